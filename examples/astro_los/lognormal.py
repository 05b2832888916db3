"""A positive 3-D prior for the standard response: a log-normal field on the Gaussian fit's statistics.

Model (nothing in it comes from a generator of synthetic skies)::

    sky[p, k] = exp(m_k + s[p, k]),   s ~ N(0, K_xy (x) C_r) + a sky-wide mode ~ N(0, C_r0),

``K_xy`` the plane-of-sky spectrum of ``field3d`` (unit variance off the zero mode), ``C_r = v R(ell_r,
q^2)`` and ``C_r0 = v0 R(ell_r)`` its radial correlations (``field3d.radial_correlation``). The
hyperparameters are ``field3d``'s, learned from the catalog by the Gaussian model's evidence
(``field3d.reconstruct``) and carried over by matching the first two moments of the density at each
bin: ``v = ln(1 + amp^2)``, ``v0 = ln(1 + amp0^2)``, ``m_k = ln mu_k - (v + v0) / 2``, so that the prior's
mean is ``mu`` and its relative sd ``amp`` (``amp0`` sky-wide) as there. Nothing is tuned on a truth,
and nothing is learned for this model itself.

The data enter through the same per-pixel statistics (``D_p``, ``t_p`` on the radial basis ``V``:
``field3d.Data``); the sky is held whole, ``n_bins x nx x ny`` (float64), and whitened, ``xi``. The map
is the posterior's mode in ``xi`` (:func:`map_estimate`: Gauss-Newton steps, each direction by CG
preconditioned by the exact inverse for the pixels' mean ``D`` at the sky's mean over pixels, with a
backtracking line search; from :func:`start` of the Gaussian prior's map where the caller has one),
reported as ``exp(m + s)`` there. Its errors: Laplace samples at the mode
(perturb and solve with the Gauss-Newton metric, :func:`laplace_deviation`), linearised,
``sky_map (1 + delta s)``: pushed through ``exp`` instead, their mean lies above the mode's columns by
``E[cosh(delta s)]`` and the columns fall outside 2 sd almost everywhere (0.9-19.5% within them on
the eight truth families; linearised: 87.8-92.3%, ``benchmarks/results/explore_lognormal_map.json``).

Against the Gaussian prior on the families' truths (``benchmarks/explore_lognormal_map.py``): the sky's
error weighted by bin length is smaller on seven of eight (the thin sheet's 0.93x the oracle's to
0.78x, the clouds' 0.69x to 0.64x), larger on the fine disc's (0.016x to 0.030x).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import field3d
import jax
import jax.numpy as jnp
import learn
import numpy as np

#: ``reconstruct.py --prior``'s choices (here, beside what they choose, for every CLI that passes them on)
PRIORS = ("auto", "gaussian", "lognormal")
#: the most cells (pixels x bins) of the whole sky this prior holds: its solves keep ~12 float64
#: copies of it (the users' 786432 x 516 would need 39 GB; the families' 64 x 48 x 96 take 28 MB)
MAX_CELLS = 1 << 24
NEWTON_STEPS = 40  # the most Gauss-Newton steps
NEWTON_NATS = 0.5  # ... stopping once a step gains less than this
NEWTON_CG = (1500, 1e-4)  # CG's most steps and relative tolerance (preconditioned norm) for a direction
NEWTON_CG_BUDGET = 30000  # ... and CG steps in all for the mode (40 capped steps took 16000 at a 400 cap)
START_SD = 1.0  # the start's pull to the Gaussian map's log (:func:`start`): an sd of one e-fold
SAMPLE_CG = (800, 1e-3)  # ... and for a sample


def unfit(grid: field3d.Grid, n_bins: int) -> str | None:
    """Why this prior cannot take ``grid`` with ``n_bins`` bins (None: it can): it holds the whole sky,
    every pixel (no blocks) and at most :data:`MAX_CELLS` cells."""
    nx, ny = grid.shape
    if grid.factor == 1 and nx * ny * n_bins <= MAX_CELLS:
        return None
    return (
        f"the log-normal prior holds the whole sky, {nx} x {ny} latent pixels x {n_bins} bins (blocks of "
        f"{grid.factor} x {grid.factor}): at most {MAX_CELLS} cells of every pixel; use the Gaussian prior"
    )


def psd_root(D: jax.Array) -> jax.Array:
    """Each ``D_p``'s symmetric square root (``(n_pix, J, J)``, float64 NumPy eigendecompositions;
    directions rounded below zero count as zero): the data's noise on the statistics, ``D_p^1/2 e``."""
    w, Q = np.linalg.eigh(np.asarray(D))
    return jnp.asarray((Q * np.sqrt(np.maximum(w, 0))[:, None, :]) @ np.swapaxes(Q, 1, 2))


def prior(theta: np.ndarray, rad: field3d.Radial, shape: tuple[int, int]) -> dict:
    """The log-normal field's prior, its moments matched to ``field3d``'s ``theta`` (see the module).

    Args:
        theta: ``field3d.NAMES``' values, as ``field3d.reconstruct`` learned them (but ``floor``: the
            Gaussian field's sky-wide sd follows the profile down to it, the log field's sd is the same
            in every bin).
        rad: the radial geometry (``field3d.Radial``).
        shape: the plane-of-sky grid, ``(nx, ny)``.

    Returns:
        ``{"m", "L", "L0", "sq", "V", "sd"}``: the log mean per bin, the radial Cholesky factors of the
        field and the sky-wide mode, the square root of the plane-of-sky power (zero at ``k = 0``), ``V``,
        and the log-density's marginal sd, ``sqrt(v + v0)``.

    Example:
        >>> import numpy as np, jax
        >>> with jax.enable_x64(True):
        ...     rad = field3d.Radial.of(np.array([40.0, 100.0, 300.0]), np.eye(2))
        ...     P = prior(np.array([0.0, 0, 0, np.log(0.5), np.log(0.5), 0, 0, 5, 0, 0]), rad, (4, 4))
        ...     var = np.diag(np.asarray(P["L"]) @ np.asarray(P["L"]).T)
        >>> P["L"].shape, bool(np.allclose(var, np.log1p(0.25)))
        ((2, 2), True)
    """
    th = jnp.asarray(theta)
    mu = field3d.profile(th, rad)
    v, v0 = jnp.log1p(jnp.exp(2 * th[3])), jnp.log1p(jnp.exp(2 * th[4]))
    n = mu.shape[0]

    def chol(C: jax.Array) -> jax.Array:
        return jnp.linalg.cholesky(C + 1e-10 * jnp.eye(n))

    return {
        "m": jnp.log(mu) - 0.5 * (v + v0),
        "L": chol(v * field3d.radial_correlation(rad.r, jnp.exp(th[7]), th[8])),
        "L0": chol(v0 * field3d.radial_correlation(rad.r, jnp.exp(th[7]))),
        "sq": field3d.sqrt_power(shape, jnp.exp(th[5]), jnp.exp(th[6]), 0.0).at[0, 0].set(0.0),
        "V": rad.V,
        "sd": jnp.sqrt(v + v0),
    }


def log_sky(P: dict, xi: jax.Array) -> jax.Array:
    """``m + s`` (``(n_bins, nx, ny)``) of the whitened field ``xi`` (the same shape): the field
    through ``L`` and the plane-of-sky filter, the sky-wide mode (``xi``'s mean) through ``L0``."""
    nx, ny = xi.shape[1:]
    s = jnp.fft.irfft2(jnp.fft.rfft2(jnp.einsum("ij,jxy->ixy", P["L"], xi)) * P["sq"], s=(nx, ny))
    c0 = P["L0"] @ (xi.sum((1, 2)) / np.sqrt(nx * ny))
    return P["m"][:, None, None] + s + c0[:, None, None]


@jax.jit
def start(P: dict, sky: jax.Array) -> jax.Array:
    """Where :func:`map_estimate` starts from a map ``sky`` (``(n_bins, nx, ny)``; the Gaussian
    prior's posterior mean, which may dip below zero): the ``xi`` most probable were ``log sky - m``
    (``sky`` floored at the prior's 2-sd low quantile, ``exp(m - 2 sd)``) a measurement of ``s`` with
    sd :data:`START_SD`. Exact and cheap: per plane-of-sky Fourier mode it is a ridge solve in the
    eigenvectors of ``L^T L`` (``L0``'s for the sky-wide mode). Only a start: the mode is the
    posterior's, found from here."""
    nb, nx, ny = sky.shape
    n, lam = nx * ny, 1.0 / START_SD**2
    y = jnp.log(jnp.maximum(sky, jnp.exp(P["m"] - 2 * P["sd"])[:, None, None])) - P["m"][:, None, None]
    yh = jnp.fft.rfft2(y)
    ell, E = jnp.linalg.eigh(P["L"].T @ P["L"])
    # off the zero mode s_k = sq_k L xi_k: xi_k = (I + lam sq_k^2 L^T L)^-1 lam sq_k L^T y_k
    b = jnp.einsum("ji,jxy->ixy", E, jnp.einsum("ji,jxy->ixy", P["L"], yh)) * (lam * P["sq"])[None]
    xh = jnp.einsum("ij,jxy->ixy", E, b / (1.0 + lam * P["sq"][None] ** 2 * ell[:, None, None]))
    # the zero mode: s_0 = sqrt(n) L0 xi_0 (unnormalised transforms)
    L0 = P["L0"]
    x0 = jnp.linalg.solve(jnp.eye(nb) + lam * n * L0.T @ L0, lam * np.sqrt(n) * L0.T @ yh[:, 0, 0])
    return jnp.fft.irfft2(xh.at[:, 0, 0].set(x0), s=(nx, ny))


def seen(P: dict, xi: jax.Array) -> jax.Array:
    """What the data see of the sky, ``u_p = V^T sky_p`` per pixel, ``(n_pix, J)``."""
    sky = jnp.exp(log_sky(P, xi))
    return (P["V"].T @ sky.reshape(sky.shape[0], -1)).T


def energy(P: dict, D: jax.Array, t: jax.Array, xi: jax.Array) -> jax.Array:
    """``-log p(xi | y)`` up to a constant: ``|xi|^2 / 2 + sum_p (u_p D_p u_p / 2 - t_p u_p)``."""
    u = seen(P, xi)
    return 0.5 * jnp.sum(xi**2) + 0.5 * jnp.einsum("pi,pij,pj->", u, D, u) - jnp.sum(t * u)


def _metric(P: dict, D: jax.Array, xi: jax.Array) -> tuple[Callable, Callable]:
    """The Gauss-Newton metric ``I + J^T D J`` at ``xi`` and ``J^T`` (``J``: :func:`seen`'s Jacobian)."""
    _, jvp = jax.linearize(lambda x: seen(P, x), xi)
    vjp = jax.linear_transpose(jvp, xi)
    return (lambda v: v + vjp(jnp.einsum("pij,pj->pi", D, jvp(v)))[0]), (lambda w: vjp(w)[0])


def _preconditioner(P: dict, D: jax.Array, xi: jax.Array) -> Callable:
    """The metric's exact inverse were every pixel's ``D`` and sky their means: diagonal in the
    plane-of-sky Fourier modes, per channel of the eigenvectors of ``L^T W mean(D) W^T L``
    (``W = diag(mean sky) V``); the sky-wide mode through ``L0``'s."""
    nx, ny = xi.shape[1:]
    W = P["V"] * jnp.exp(log_sky(P, xi)).reshape(xi.shape[0], -1).mean(1)[:, None]
    Dm = D.mean(0)

    def eig(L: jax.Array) -> tuple[jax.Array, jax.Array]:
        B = L.T @ W @ Dm @ W.T @ L
        return jnp.linalg.eigh(0.5 * (B + B.T))

    (lam, E), (lam0, E0) = eig(P["L"]), eig(P["L0"])
    f = 1.0 / (1.0 + P["sq"][None] ** 2 * jnp.maximum(lam, 0)[:, None, None])
    f0 = 1.0 / (1.0 + nx * ny * jnp.maximum(lam0, 0))

    def apply(v: jax.Array) -> jax.Array:
        vm = v.mean((1, 2))
        w = jnp.fft.irfft2(jnp.fft.rfft2(jnp.einsum("ji,jxy->ixy", E, v - vm[:, None, None])) * f, s=(nx, ny))
        return jnp.einsum("ij,jxy->ixy", E, w) + (E0 @ (f0 * (E0.T @ vm)))[:, None, None]

    return apply


@jax.jit
def newton_step(P: dict, D: jax.Array, t: jax.Array, xi: jax.Array) -> tuple:
    """One Gauss-Newton step with a backtracking line search: the new ``xi``, the energy before and
    after, CG's steps, the step's length."""
    e, g = jax.value_and_grad(lambda x: energy(P, D, t, x))(xi)
    M, _ = _metric(P, D, xi)
    d, k, _ = learn.pcg(M, _preconditioner(P, D, xi), -g, *NEWTON_CG)

    def halve(c: tuple) -> tuple:
        return c[0] * 0.5, energy(P, D, t, xi + c[0] * 0.5 * d)

    a, e_new = jax.lax.while_loop(lambda c: ~(c[1] <= e) & (c[0] > 1e-4), halve, (1.0, energy(P, D, t, xi + d)))
    return xi + a * d, e, e_new, k, a


@jax.jit
def laplace_deviation(P: dict, D: jax.Array, root: jax.Array, xi: jax.Array, key: jax.Array) -> tuple:
    """A Laplace sample's deviation from ``xi`` (the mode): the metric's inverse of ``e1 + J^T D^1/2
    e2`` (``e1, e2`` standard normal; ``root`` the ``D_p^1/2``), and CG's steps."""
    M, Jt = _metric(P, D, xi)
    k1, k2 = jax.random.split(key)
    b = jax.random.normal(k1, xi.shape) + Jt(
        jnp.einsum("pij,pj->pi", root, jax.random.normal(k2, (D.shape[0], D.shape[1])))
    )
    d, k, _ = learn.pcg(M, _preconditioner(P, D, xi), b, *SAMPLE_CG)
    return d, k


def cg_steps(path: list) -> int:
    """The CG steps :func:`map_estimate`'s record ``path`` spent, all directions together."""
    return sum(p[2] for p in path)


def settled(path: list) -> bool:
    """Whether :func:`map_estimate`'s last step (``path[-1]``: energy before, after, ...) gained less
    than :data:`NEWTON_NATS`: its stopping test, and :func:`posterior`'s ``converged``."""
    return abs(path[-1][0] - path[-1][1]) < NEWTON_NATS


def map_estimate(
    P: dict, D: jax.Array, t: jax.Array, shape: tuple[int, int], n_bins: int, xi: jax.Array | None = None
) -> tuple[jax.Array, list]:
    """The posterior's mode in ``xi`` from ``xi`` (default 0, the prior's median sky; see
    :func:`start`), by :func:`newton_step` until a step gains less than :data:`NEWTON_NATS`, or
    :data:`NEWTON_STEPS` are taken, or their CG steps reach :data:`NEWTON_CG_BUDGET`; and the steps'
    record ``(energy before, after, CG steps, step length)``."""
    xi = jnp.zeros((n_bins, *shape)) if xi is None else xi
    path: list = []
    while len(path) < NEWTON_STEPS and cg_steps(path) < NEWTON_CG_BUDGET:
        xi, e, e_new, k, a = newton_step(P, D, t, xi)
        path.append((float(e), float(e_new), int(k), float(a)))
        if settled(path):
            break
    return xi, path


def line_chi2(data: field3d.Data, V: np.ndarray, sky: np.ndarray) -> float:
    """The lines' chi2, ``sum_l (y_l - g_l . V^T sky_p(l))^2 / sigma_l^2``, of a sky ``(n_pix, n_bins)`` on
    ``data``'s grid, from its statistics: ``yy - 2 sum_p t_p u_p + sum_p u_p D_p u_p``, ``u_p = V^T sky_p``
    (float64 over ``data``'s float32 sums, which cancel: its rounding is ~1e-7 of ``yy``; the same
    compressed lines for any sky, so two maps' figures compare).

    Example:
        >>> # one pixel, one line (g = 1 on the one basis vector, sigma = 1, y = 2): D = 1, t = 2, yy = 4
        >>> data = field3d.Data(D=np.ones((1, 1, 1)), t=np.full((1, 1), 2.0), yy=np.array(4.0),
        ...                     log_norm=np.array(0.0), grid=field3d.grid_for(1, 1, 1))
        >>> line_chi2(data, np.ones((2, 1)), np.array([[0.5, 1.0]]))  # (2 - 1.5)^2
        0.25
    """
    u = np.asarray(sky, np.float64) @ np.asarray(V, np.float64)
    D, t = np.asarray(data.D, np.float64), np.asarray(data.t, np.float64)
    return float(data.yy) - 2 * float(np.sum(t * u)) + float(np.einsum("pi,pij,pj->", u, D, u))


def posterior(
    theta: np.ndarray,
    data: field3d.Data,
    rad: field3d.Radial,
    functionals: np.ndarray,
    pairs: int = 8,
    seed: int = 1,
    accept: Callable[[dict], bool] | None = None,
    start_sky: np.ndarray | None = None,
) -> dict:
    """The log-normal prior's map and linearised Laplace errors on ``data``'s grid (every pixel:
    ``data.grid.factor == 1``), in ``field3d.posterior``'s keys: ``mean`` (the mode's sky) and ``std``
    (``(n_pix, n_bins)``), ``fmean`` and ``fstd`` (``(n_pix, m)``, each row of ``functionals``, bin
    correlations included); ``converged`` (the last Gauss-Newton step gained less than
    :data:`NEWTON_NATS`), ``chi2`` (:func:`line_chi2` of the mode) and the effort. Call under
    ``jax.enable_x64``. With ``accept`` (a test of the mode's ``{"newton", "converged", "chi2"}``, the
    caller's), a mode it refuses is returned alone: ``std``, ``fmean`` and ``fstd`` None, no samples drawn.
    With ``start_sky`` (``(n_pix, n_bins)``, e.g. the Gaussian prior's posterior mean) the mode is
    sought from :func:`start` of it, else from the prior's median sky.

    ``pairs`` mirrored pairs of Laplace samples (``2 * pairs`` samples): a pair is one draw of each sd's square (its two
    deviations are +delta and -delta), so an sd has ``pairs`` degrees of freedom, and a Gaussian truth lies
    within 2 of them with probability 0.88 at 4 pairs, 0.92 at 8, 0.94 at 16, not 0.95 (Student's t).
    Until session 37 ``reconstruct.py`` capped them at 4 whatever ``--samples`` asked; the tiny catalog's
    ``1/r^2``-weighted columns within 2 sd were 53% with 4 pairs, 62% with 8, 66% with 16 (its columns 85-86%
    each).

    Raises:
        ValueError: when the grid is coarsened (blocks of pixels) or the sky has more than
            :data:`MAX_CELLS` cells; when ``start_sky`` is not a finite ``(n_pix, n_bins)`` array.
    """
    nx, ny = data.grid.shape
    n_bins = rad.r.shape[0]
    why = unfit(data.grid, n_bins)
    if why is not None:
        raise ValueError(why)
    D, t = jnp.asarray(data.D, jnp.float64), jnp.asarray(data.t, jnp.float64)
    P = prior(theta, rad, (nx, ny))
    t0 = time.perf_counter()
    xi0 = None
    if start_sky is not None:
        S = np.asarray(start_sky, np.float64)
        want = f"start_sky: expected a finite (n_pix, n_bins) = ({nx * ny}, {n_bins}) map, got shape {S.shape}"
        if S.shape != (nx * ny, n_bins):
            raise ValueError(want)
        if not np.all(np.isfinite(S)):
            raise ValueError(want + " with non-finite values")
        xi0 = start(P, jnp.asarray(S.T).reshape(n_bins, nx, ny))
    xi, path = map_estimate(P, D, t, (nx, ny), n_bins, xi0)
    t1 = time.perf_counter()
    sky = jnp.exp(log_sky(P, xi))
    mean = np.asarray(sky).reshape(n_bins, -1).T
    fit = {"newton": path, "converged": settled(path), "chi2": line_chi2(data, P["V"], mean)}
    if accept is not None and not accept(fit):
        none = {"std": None, "fmean": None, "fstd": None, "sample_cg_steps": []}
        return fit | none | {"mean": mean.astype(np.float32), "seconds": {"map_s": t1 - t0, "samples_s": 0.0}}
    root = psd_root(D)
    zero = log_sky(P, jnp.zeros_like(xi))
    C = np.asarray(functionals, np.float64)
    var = np.zeros((nx * ny, n_bins))
    fvar = np.zeros((nx * ny, C.shape[0]))
    steps = []
    for key in jax.random.split(jax.random.key(seed), pairs):
        dev, k = laplace_deviation(P, D, root, xi, key)
        steps.append(int(k))
        # the field is linear in xi: a sample's log-sky deviation, linearised through exp at the mode
        delta = np.asarray(sky * (log_sky(P, dev) - zero)).reshape(n_bins, -1).T
        var += delta**2  # (a mirrored pair's two deviations are +delta and -delta: the same squares)
        fvar += (delta @ C.T) ** 2
    return fit | {
        "mean": mean.astype(np.float32),
        "std": np.sqrt(var / pairs).astype(np.float32),
        "fmean": mean @ C.T,
        "fstd": np.sqrt(fvar / pairs),
        "sample_cg_steps": steps,
        "seconds": {"map_s": t1 - t0, "samples_s": time.perf_counter() - t1},
    }
