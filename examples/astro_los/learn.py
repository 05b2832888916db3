"""A reconstruction from a catalog alone: the prior's hyperparameters learned from the data.

Model (nothing in it comes from a generator of synthetic skies)::

    sky[p, k] = mu_k (1 + zeta[p]),      log mu_k = a + b t_k + c t_k^2 [+ ln ref_k] + const(b, c),
    zeta ~ N(0, amp^2 K)  (stationary on the periodic (nx, ny) grid, power (1 + (2 pi ell k)^2)^-slope),

``t_k`` the bin centre's ``ln r`` mapped linearly onto ``[-1, 1]`` over the catalog's edges (``mu`` is
normalised so that ``exp(a)`` is its ``1/r^2``-weighted mean: see :func:`profile`). The
hyperparameters ``theta = (a, b, c, ln amp, ln ell, ln slope)`` maximise the evidence (type-II maximum
likelihood, exact: dense Cholesky on a plane-of-sky grid coarsened by :func:`coarse_factor`)
times a hyperprior ``b, c ~ N(0, 1)`` (a profile that is flat in density unless the data
say otherwise; ``a``, ``amp``, ``ell``, ``slope`` have flat hyperpriors within bounds). Their uncertainty is
the Laplace approximation (the Hessian of that objective in float64, a column at a time).

Why the profile has a hyperprior: every line's weight vector has nearly the same shape
(``w_k ~ (1/b_k - 1/b_{k+1}) / s``, see ``los.py``): the singular values of the lines' weights fall
as 1, 2e-4, 3e-8, so the data measure one ``1/r^2``-weighted column per pixel and, pooled over
the sky, at most one weak contrast of the radial profile. The radial profile, and so the
distance-integrated column, is set by the hyperprior wherever the data are silent: the run
reports how much the data constrained it and warns. Knowledge from outside the catalog (a model
of the Galactic disc, an earlier map) enters as a reference profile ``ref`` (``reconstruct.py
--profile``): its shape becomes the prior's mean shape, and the data still set the level ``a``,
the field and any contrast they measure.

The lines enter through their weights projected on ``J`` radial vectors (the leading right
singular vectors of a sample of the catalog's weight vectors): ``G = W V`` (``n_los x J``),
computed once in a chunked pass (``chunkop.map``); every radial quantity of a line is then
``G (V^T f)`` (the truncation error is measured on every line and reported).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from catalog import Catalog

import chunkop

MAX_COARSE = 1024  # pixels of the grid on which the evidence is computed exactly
MAX_FINE = 16  # ... unless its pixel then spans more fine pixels than this on a side:
MAX_COARSE_FINE = 4096  # then up to this many (memory ~ pixels^2, time ~ pixels^3)
PROFILE_PRIOR_SD = 1.0  # hyperprior sd of the profile's shape coefficients b, c
REFERENCE_PRIOR_SD = 0.1  # the same, about a reference profile the user gives (--profile-sd)
NAMES = ("a", "b", "c", "log_amp", "log_ell", "log_slope")
#: L-BFGS-B's stopping rule for the hyperparameters (on the objective less its start value, in
#: coordinates scaled by the start's Hessian diagonal). SciPy's defaults (ftol 2.2e-9 of |f|,
#: gtol 1e-5) stopped `steep_profile` 0.64 nats short, with its field length off by 2x between
#: two float64 roundings of the same objective; with these both reach the same optimum (ftol
#: 1e-12 was below the objective's own roundoff: the line search then failed at the optimum).
FIT_TOLERANCES = {"maxiter": 1000, "ftol": 1e-10, "gtol": 1e-8}


# -- the lines, compressed ----------------------------------------------------------------------


def weights_np(d: np.ndarray, s: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The LOS weights in float64 numpy (the same cancellation-free form as ``los.los_weights``)."""
    d, s = np.asarray(d, np.float64)[:, None], np.asarray(s, np.float64)[:, None]
    u = (1.0 / d - 1.0 / edges[:-1]) / s
    return -np.exp(u) * np.expm1((1.0 / edges[:-1] - 1.0 / edges[1:]) / s)


def radial_basis(cat: Catalog, J: int = 3, n_sample: int = 8192, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``V`` (``(n_bins, J)``): the leading right singular vectors of (row-normalised) weight vectors
    of up to ``n_sample`` of the catalog's lines; and the singular values relative to the first."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(cat.n_los, min(n_sample, cat.n_los), replace=False)
    W = weights_np(cat.d[idx], cat.s[idx], cat.edges)
    W /= np.linalg.norm(W, axis=1, keepdims=True)
    _, sv, vt = np.linalg.svd(W, full_matrices=False)
    return vt[:J].T.copy(), sv / sv[0]


def compress_lines(cat: Catalog, V: np.ndarray, chunk: int = 8192) -> tuple[np.ndarray, float]:
    """``G = W V`` for every line (``(n_los, J)`` float64) by ``chunkop.map`` over the lines (float32
    weights, chunk by chunk: the ``n_los x n_bins`` weights are never stored), and the largest
    relative truncation error ``|w - G V^T| / |w|`` over the lines."""
    edges = cat.edges
    Vj = jnp.asarray(V, jnp.float32)
    inv_lo = jnp.asarray(1.0 / edges[:-1], jnp.float32)
    dinv = jnp.asarray(1.0 / edges[:-1] - 1.0 / edges[1:], jnp.float32)

    def one(row):
        w = -jnp.exp((1.0 / row["d"] - inv_lo) / row["s"]) * jnp.expm1(dinv / row["s"])
        g = w @ Vj
        return g, jnp.linalg.norm(w - Vj @ g) / jnp.linalg.norm(w)

    rows = {"d": jnp.asarray(cat.d), "s": jnp.asarray(cat.s)}
    g, err = jax.jit(lambda r: chunkop.map(one, r, chunk_size=min(chunk, cat.n_los)))(rows)
    return np.asarray(g, np.float64), float(jnp.max(err))


# -- the prior ---------------------------------------------------------------------------------


def profile_t(edges: np.ndarray) -> np.ndarray:
    """``t_k``: the bin centres' ``ln r`` mapped linearly onto ``[-1, 1]``."""
    lr = np.log(np.sqrt(edges[:-1] * edges[1:]))
    lo, hi = np.log(edges[0]), np.log(edges[-1])
    return (2 * lr - lo - hi) / (hi - lo)


def profile_omega(edges: np.ndarray) -> np.ndarray:
    """``omega_k``: the bins' share of the ``1/r^2``-weighted column, ``(1/b_k - 1/b_{k+1}) / (1/b_0 - 1/b_n)``."""
    w = 1.0 / edges[:-1] - 1.0 / edges[1:]
    return w / w.sum()


def profile(theta, t, omega, xp: Any = jnp, reference: Any = None) -> Any:
    """``mu_k = exp(a + s_k) / sum_j omega_j exp(s_j)``, ``s_k = b t_k + c t_k^2 (+ ln ref_k)``:
    ``exp(a)`` is the profile's ``1/r^2``-weighted mean density (what the data measure), ``b``, ``c``
    its shape, relative to the user's ``reference`` profile (``(n_bins,)``, positive) when one is
    given (then ``b = c = 0`` is the reference's shape at the learned level).
    ``theta`` of shape ``(6,)`` or ``(S, 6)`` (then ``(S, n_bins)``); differentiable (jnp)."""
    theta = xp.asarray(theta)
    a, b, c = theta[..., 0:1], theta[..., 1:2], theta[..., 2:3]
    shape = b * t + c * t**2
    if reference is not None:
        shape = shape + xp.log(xp.asarray(reference))
    return xp.exp(a + shape - xp.log(xp.sum(omega * xp.exp(shape), axis=-1, keepdims=True)))


def check_reference(reference: Any, n_bins: int) -> np.ndarray:
    """A user's reference profile as float64: one finite, positive density per radial bin."""
    ref = np.asarray(reference, np.float64)
    if ref.shape != (n_bins,) or not np.all(np.isfinite(ref)) or not np.all(ref > 0):
        raise ValueError(
            f"the reference profile must hold one finite, positive density per radial bin, shape ({n_bins},); "
            f"got shape {ref.shape}" + ("" if ref.shape != (n_bins,) else f", min {ref.min():.3g}")
        )
    return ref


def field_power(nx: int, ny: int, ell: Any, slope: Any, full: bool = False, sqrt: bool = False) -> Any:
    """Power spectrum ``(1 + (2 pi ell k)^2)^-slope`` of a unit-variance stationary field on the
    periodic ``nx x ny`` grid (a Matern field of smoothness ``slope - 1``: ``slope`` 2.5 is
    Matern-3/2; large ``slope`` approaches a squared-exponential), ``ell`` in pixels; zero at
    ``k = 0`` (a field of zero mean over the grid: the level is the profile's ``a``), mean power 1;
    rfft2 layout (``full``: fft2 layout); ``sqrt``: its square root. Differentiable in ``ell`` and
    ``slope`` (the zero mode is masked, not square-rooted)."""
    k2 = np.fft.fftfreq(nx)[:, None] ** 2 + np.fft.fftfreq(ny)[None, :] ** 2
    mask = jnp.asarray(k2 > 0)
    raw = jnp.exp(-slope * jnp.log1p((2 * np.pi * ell) ** 2 * jnp.asarray(k2)))
    norm = jnp.mean(jnp.where(mask, raw, 0.0))
    p = jnp.where(mask, jnp.sqrt(raw / norm), 0.0) if sqrt else jnp.where(mask, raw / norm, 0.0)
    return p if full else p[:, : ny // 2 + 1]


# -- the evidence on a coarse grid ----------------------------------------------------------------


def coarse_factor(nx: int, ny: int, max_pixels: int | None = None) -> int:
    """The coarsening factor of the evidence's grid: the smallest ``f`` whose grid of ``ceil(nx/f) x
    ceil(ny/f)`` pixels holds at most ``max_pixels``. None: at most ``MAX_COARSE`` pixels, unless a
    coarse pixel would then span more than ``MAX_FINE`` fine ones on a side (the field below it is
    treated crudely: measured at seed size, ``README.md``); then ``MAX_FINE`` (or the smallest factor
    that keeps the grid within ``MAX_COARSE_FINE`` pixels, if larger)."""

    def smallest(limit: int) -> int:
        f = 1
        while -(-nx // f) * -(-ny // f) > limit:
            f += 1
        return f

    if max_pixels is not None:
        return smallest(max_pixels)
    f = smallest(MAX_COARSE)
    return f if f <= MAX_FINE else max(MAX_FINE, smallest(MAX_COARSE_FINE))


def _coarse(cat: Catalog, f: int) -> tuple[int, int, np.ndarray]:
    nxc, nyc = -(-cat.nx // f), -(-cat.ny // f)
    ix, iy = cat.pix // cat.ny, cat.pix % cat.ny
    return nxc, nyc, (ix // f) * nyc + iy // f


def _coarse_of_pixel(nx: int, ny: int, f: int) -> np.ndarray:
    """The coarse pixel of every fine pixel ``ix * ny + iy``."""
    ix, iy = np.divmod(np.arange(nx * ny), ny)
    return (ix // f) * (-(-ny // f)) + iy // f


def _box_gain2(k: np.ndarray, f: int) -> np.ndarray:
    """``|mean_{j<f} exp(2 pi i k j)|^2``: the power transfer of averaging ``f`` neighbours."""
    if f == 1:
        return np.ones_like(k)
    num, den = np.sin(np.pi * f * k), f * np.sin(np.pi * k)
    return np.where(np.abs(den) < 1e-12, 1.0, (num / np.where(den == 0, 1.0, den)) ** 2)


def _dense_sqrt_cov(nx: int, ny: int, ell, slope) -> Any:
    """``K^1/2`` as a dense ``(nx ny) x (nx ny)`` matrix: the circulant of the square root of the
    unit-variance power on the periodic grid (``K^1/2 K^1/2 = K``, ``K`` of unit diagonal)."""
    c = jnp.fft.ifft2(field_power(nx, ny, ell, slope, full=True, sqrt=True)).real
    ix, iy = np.divmod(np.arange(nx * ny), ny)
    return c[(ix[:, None] - ix[None, :]) % nx, (iy[:, None] - iy[None, :]) % ny]


def _sqrt_cov_apply(nx: int, ny: int, ell, slope, X: Any) -> Any:
    """``K^1/2 x`` for every row ``x`` of ``X`` (``(..., nx * ny)``): the matrix of
    :func:`_dense_sqrt_cov` applied by FFT, ``O(nx ny log(nx ny))`` a row instead of ``(nx ny)^2``."""
    g = X.reshape(*X.shape[:-1], nx, ny)
    p = field_power(nx, ny, ell, slope, sqrt=True)
    return jnp.fft.irfft2(jnp.fft.rfft2(g) * p, s=(nx, ny)).reshape(X.shape)


def make_objective(
    cat: Catalog,
    G: np.ndarray,
    V: np.ndarray,
    f: int,
    reference: np.ndarray | None = None,
    shape_sd: float = PROFILE_PRIOR_SD,
) -> tuple[Callable, dict]:
    """``-log evidence - log hyperprior`` of ``theta`` (float64 jnp; call under ``jax.enable_x64``).

    With ``r = y - A mu``, ``m = A mu`` line by line, ``D``, ``t`` the coarse pixels' sums of
    ``m^2 / sigma^2`` and ``m r / sigma^2``, ``H = I + K^1/2 D K^1/2``: the quadratic form
    ``r^T (N + M K M^T)^-1 r`` is evaluated as the posterior mean's ``chi2 + |xi|^2``
    (``xi = H^-1 K^1/2 t``, ``zeta = K^1/2 xi``), free of the cancellation of ``r^T N^-1 r - ...``;
    ``log det = log |N| + log |H|`` (Cholesky). The field below the coarse pixel (its variance
    ``amp^2 (1 - mean_k P(k) |box(k)|^2)`` from the fine-grid spectrum) is integrated out per fine
    pixel as an independent deviation shared by that pixel's lines (exact per pixel; the
    correlation between the fine pixels of one coarse pixel is neglected); the coarse field keeps
    the rest of the variance.
    """
    nxc, nyc, cpix = _coarse(cat, f)
    n_c = nxc * nyc
    t, om = jnp.asarray(profile_t(cat.edges)), jnp.asarray(profile_omega(cat.edges))
    Gj, Vj = jnp.asarray(G), jnp.asarray(V)
    y, var = jnp.asarray(cat.y, jnp.float64), jnp.asarray(cat.sigma.astype(np.float64) ** 2)
    cp = jnp.asarray(cpix)

    fine = jnp.asarray(cat.pix)
    fine_to_coarse = jnp.asarray(_coarse_of_pixel(cat.nx, cat.ny, f))
    kx, ky = np.fft.fftfreq(cat.nx)[:, None], np.fft.fftfreq(cat.ny)[None, :]
    box2 = jnp.asarray(_box_gain2(kx, f) * _box_gain2(ky, f))  # |block-average transfer|^2

    def objective(theta):
        m = Gj @ (Vj.T @ profile(theta, t, om, reference=reference))  # A mu, line by line
        r = y - m
        iv = 1.0 / var
        log_norm = jnp.sum(jnp.log(2 * np.pi * var))
        ell, slope = jnp.exp(theta[4]), jnp.exp(theta[5])
        # the field's share below the coarse pixel: variance w2 per fine pixel (independent),
        # integrated out pixel by pixel (a rank-1 term of the lines' covariance per fine pixel)
        pf = field_power(cat.nx, cat.ny, ell * f, slope, full=True)
        w2 = jnp.exp(2 * theta[3]) * (1.0 - jnp.mean(pf * box2))
        Dp = jax.ops.segment_sum(m * m * iv, fine, cat.n_pix)
        tp_ = jax.ops.segment_sum(m * r * iv, fine, cat.n_pix)
        shrink = 1.0 / (1.0 + w2 * Dp)
        D = jax.ops.segment_sum(Dp * shrink, fine_to_coarse, n_c)
        tp = jax.ops.segment_sum(tp_ * shrink, fine_to_coarse, n_c)
        C = _dense_sqrt_cov(nxc, nyc, ell, slope)
        amp_c = jnp.exp(theta[3]) * jnp.sqrt(1.0 - w2 * jnp.exp(-2 * theta[3]))
        Ks = amp_c * C
        # K^1/2 D K^1/2 (symmetric) as K^1/2 applied to the rows of K^1/2 D by FFT: n^2 log n, where
        # the dense product cost 2 n^3 (five times the Cholesky's n^3 / 3, with its gradient)
        H = jnp.eye(n_c) + amp_c**2 * _sqrt_cov_apply(nxc, nyc, ell, slope, C * D[None, :])
        L = jnp.linalg.cholesky(H)
        xi = jax.scipy.linalg.cho_solve((L, True), Ks @ tp)
        zeta = Ks @ xi
        res = r - m * zeta[cp]
        common = tp_ - Dp * zeta[fine_to_coarse]  # m^T N^-1 (r - m zeta) per fine pixel
        quad = jnp.sum(res * res * iv) - jnp.sum(w2 * common**2 * shrink) + xi @ xi
        logdet = 2 * jnp.sum(jnp.log(jnp.diag(L))) - jnp.sum(jnp.log(shrink))
        nll = 0.5 * (quad + logdet + log_norm)
        return nll + 0.5 * (theta[1] ** 2 + theta[2] ** 2) / shape_sd**2

    info = {"coarse_factor": f, "coarse_grid": [nxc, nyc]}
    return objective, info


def learn_hyperparameters(
    cat: Catalog,
    G: np.ndarray,
    V: np.ndarray,
    log: Callable = print,
    reference: np.ndarray | None = None,
    shape_sd: float | None = None,
    max_pixels: int | None = None,
) -> dict:
    """Type-II MAP of ``theta`` and its Laplace covariance; returns a dict (see :func:`report`).

    ``reference``: the user's reference radial profile (see :func:`profile`), or None (flat).
    ``shape_sd``: the hyperprior sd of the shape ``b``, ``c`` about it; by default
    ``PROFILE_PRIOR_SD`` (1: a flat profile unless the data say otherwise) without a reference and
    ``REFERENCE_PRIOR_SD`` (0.1: the reference trusted to about 10% in log density at the ends of
    the distance range) with one. The data constrain the shape only weakly and through the model's
    assumptions (a field ``1 + zeta`` the same at every distance), so a loose hyperprior about a
    good reference lets those assumptions, not the data, move it.
    ``max_pixels``: the most pixels of the coarse grid the evidence is computed on (its dense
    matrices are ``max_pixels^2`` float64; its cost grows as ``max_pixels^3``); None: the rule of
    :func:`coarse_factor`. Where a coarse pixel holds many fine ones, the field below it is treated
    crudely (independent fine pixels): a finer grid learns the small scales better.
    The Hessian (Laplace, and the optimizer's scaling) is computed a column at a time
    (``chunkop.jacfwd`` of the gradient with ``chunk_size=1``): one tangent's intermediates alive,
    not six."""
    if max_pixels is not None and not (isinstance(max_pixels, int) and max_pixels >= 1):
        raise ValueError(f"max_pixels (the evidence's coarse grid) must be a positive int, got {max_pixels!r}")
    if shape_sd is None:
        shape_sd = PROFILE_PRIOR_SD if reference is None else REFERENCE_PRIOR_SD
    if not shape_sd > 0:
        raise ValueError(f"the profile shape's hyperprior sd must be positive, got {shape_sd}")
    f = coarse_factor(cat.nx, cat.ny, max_pixels)
    t0 = time.perf_counter()
    with jax.enable_x64(True):
        objective, info = make_objective(cat, G, V, f, reference, shape_sd)
        nxc, nyc = info["coarse_grid"]
        vg = jax.jit(jax.value_and_grad(objective))
        # the level a by least squares at the reference (flat) profile; then a log-spaced grid of lengths
        m0 = G @ (V.T @ np.asarray(profile(np.zeros(6), profile_t(cat.edges), profile_omega(cat.edges), np, reference)))
        iv = 1.0 / cat.sigma.astype(np.float64) ** 2
        a0 = float(np.log(max(np.sum(cat.y * m0 * iv) / np.sum(m0 * m0 * iv), 1e-30)))
        lo_ell, hi_ell = np.log(0.5), np.log(float(max(nxc, nyc)))
        bounds = [
            (a0 - 20, a0 + 20),
            (-6.0, 6.0),
            (-6.0, 6.0),
            (np.log(1e-3), np.log(10.0)),
            (lo_ell, hi_ell),
            (np.log(1.2), np.log(50.0)),
        ]
        starts = [
            np.array([a0, 0.0, 0.0, np.log(0.3), le, np.log(sl)])
            for le in np.linspace(lo_ell + 0.5, hi_ell - 0.5, 4)
            for sl in (2.5, 10.0)
        ]
        vals = [float(vg(jnp.asarray(s0))[0]) for s0 in starts]
        x0 = starts[int(np.argmin(vals))]

        # L-BFGS-B on coordinates scaled by the Hessian's diagonal at the start (the level a is
        # ~1e4x more sharply determined than the rest, which otherwise sends the first steps astray)
        hess = jax.jit(chunkop.jacfwd(jax.grad(objective), chunk_size=1))
        d0 = np.abs(np.diag(np.asarray(hess(jnp.asarray(x0)), np.float64)))
        scale = 1.0 / np.sqrt(np.maximum(d0, 1e-6 * d0.max()))

        # the objective less its value at the start: L-BFGS-B's stopping test is relative to |f|,
        # and |f| (~1e6, mostly the constant log |2 pi N|) let it stop ~1e-3 short in the flat valley
        # of the profile's shape, where float64 roundoff then moved the optimum (FIT_TOLERANCES)
        f0 = min(vals)

        def fun(u):
            v, g = vg(jnp.asarray(x0 + scale * u))
            return float(v) - f0, scale * np.asarray(g, np.float64)

        ub = [((lo - x) / sc_, (hi - x) / sc_) for (lo, hi), x, sc_ in zip(bounds, x0, scale)]
        opt = scipy.optimize.minimize(
            fun, np.zeros(len(NAMES)), jac=True, method="L-BFGS-B", bounds=ub, options=FIT_TOLERANCES
        )
        theta = x0 + scale * opt.x
        H = np.asarray(hess(jnp.asarray(theta)), np.float64)
    H = 0.5 * (H + H.T)
    w, vec = np.linalg.eigh(H)
    cov = (vec / np.maximum(w, 1e-12)) @ vec.T  # Laplace; flat directions capped (reported)
    at_bound = [NAMES[i] for i, (lo, hi) in enumerate(bounds) if min(theta[i] - lo, hi - theta[i]) < 1e-3 * (hi - lo)]
    sd = np.sqrt(np.diag(cov))
    # how much the data constrained the profile's shape (b, c): posterior sd / hyperprior sd
    shape_ratio = [float(sd[1] / shape_sd), float(sd[2] / shape_sd)]
    out = {
        "theta": theta.tolist(),
        "theta_sd": sd.tolist(),
        "theta_cov": cov.tolist(),
        "names": list(NAMES),
        "bounds": [list(b) for b in bounds],
        "at_bound": at_bound,
        "amp": float(np.exp(theta[3])),
        "ell_pixels": float(np.exp(theta[4]) * f),
        "slope": float(np.exp(theta[5])),
        "neg_log_posterior": float(opt.fun) + f0,
        "optimizer": {"success": bool(opt.success), "iterations": int(opt.nit), "message": str(opt.message)},
        "neg_log_posterior_start": float(f0),
        "profile_shape_sd_over_prior_sd": shape_ratio,
        "profile_prior_sd": shape_sd,
        "reference_profile": None if reference is None else np.asarray(reference, np.float64).tolist(),
        "seconds": time.perf_counter() - t0,
        **info,
    }
    log(
        f"learned: level a = {theta[0]:.4f} +- {sd[0]:.4f}, profile shape b = {theta[1]:+.3f} +- {sd[1]:.3f}, "
        f"c = {theta[2]:+.3f} +- {sd[2]:.3f} (hyperprior sd {shape_sd:g}), field sd {out['amp']:.3f} "
        f"(x/ {np.exp(sd[3]):.3f}), correlation length {out['ell_pixels']:.2f} px (x/ {np.exp(sd[4]):.3f}), "
        f"spectral slope {out['slope']:.2f} (x/ {np.exp(sd[5]):.3f}); "
        f"coarse grid {nxc} x {nyc} (factor {f}), {opt.nit} L-BFGS-B iterations"
    )
    return out


# -- the posterior at full resolution -------------------------------------------------------------


def pcg(H: Callable, M: Callable, b: jax.Array, iters: int, rtol: float):
    """Preconditioned CG for ``H x = b`` from 0 (a ``lax.while_loop``); returns (x, steps, rel. residual)."""
    z = M(b)
    rz0 = jnp.vdot(b, z)

    def cond(st):
        return (st[0] < iters) & (st[4] > rtol**2 * rz0)

    def body(st):
        k, x, r, p, rz = st
        Hp = H(p)
        alpha = rz / jnp.vdot(p, Hp)
        x, r = x + alpha * p, r - alpha * Hp
        z = M(r)
        rz_new = jnp.vdot(r, z)
        return k + 1, x, r, z + (rz_new / rz) * p, rz_new

    k, x, _, _, rz = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.zeros_like(b), b, z, rz0))
    return x, k, jnp.sqrt(rz / rz0)


def posterior(
    cat: Catalog,
    G: np.ndarray,
    V: np.ndarray,
    hyper: dict,
    n_samples: int = 32,
    iters: int = 200,
    rtol: float = 1e-5,
    seed: int = 0,
) -> dict:
    """The posterior of ``zeta`` given the learned ``theta`` at full resolution, and samples.

    Whitened: ``zeta = C^1/2 xi``, ``(I + C^1/2 D C^1/2) xi = C^1/2 t`` (``D``, ``t``: per-pixel sums
    of ``m^2 / sigma^2`` and ``m (y - m) / sigma^2`` over the pixel's lines), CG preconditioned by the
    exact inverse for the mean ``D`` (diagonal in Fourier space). A sample (perturb and solve):
    ``xi_s = H^-1 (C^1/2 t + e1 + C^1/2 D^1/2 e2)``, ``e ~ N(0, I)``; samples of ``theta`` from the
    Laplace approximation give the profile's share of the spread.
    """
    nx, ny = cat.nx, cat.ny
    theta = np.asarray(hyper["theta"])
    t = profile_t(cat.edges)
    om = profile_omega(cat.edges)
    ref = hyper.get("reference_profile")
    mu = np.asarray(profile(theta, t, om, np, ref))
    m = G @ (V.T @ mu)
    iv = 1.0 / cat.sigma.astype(np.float64) ** 2
    D = np.bincount(cat.pix, m * m * iv, cat.n_pix)
    tp = np.bincount(cat.pix, m * (cat.y - m) * iv, cat.n_pix)
    power = hyper["amp"] ** 2 * np.asarray(field_power(nx, ny, hyper["ell_pixels"], hyper["slope"]), np.float64)
    sq = jnp.asarray(np.sqrt(power), jnp.float32)
    Dj = jnp.asarray(D, jnp.float32)
    pre = jnp.asarray(1.0 / (1.0 + power * D.mean()), jnp.float32)

    def filt(v, p):  # v (..., n_pix) -> the field filtered by the power p (rfft2 layout)
        f = jnp.fft.rfft2(v.reshape(*v.shape[:-1], nx, ny)) * p
        return jnp.fft.irfft2(f, s=(nx, ny)).reshape(v.shape).astype(v.dtype)

    def solve(rhs):
        scale = jnp.sqrt(jnp.sum(rhs * rhs))
        H = lambda xi: xi + filt(Dj * filt(xi, sq), sq)
        xi, k, rel = pcg(H, lambda r: filt(r, pre), rhs / scale, iters, rtol)
        return filt(xi, sq) * scale, k, rel

    b = filt(jnp.asarray(tp, jnp.float32), sq)
    zeta, k, rel = jax.jit(solve)(b)
    out = {"zeta": np.asarray(zeta, np.float64), "mu": mu, "cg_iterations": int(k), "cg_relative_residual": float(rel)}
    if n_samples > 0:
        key = jax.random.key(seed)
        e1 = jax.random.normal(key, (n_samples, cat.n_pix))
        e2 = jax.random.normal(jax.random.fold_in(key, 1), (n_samples, cat.n_pix))
        rhs = b[None] + e1 + filt(jnp.sqrt(Dj) * e2, sq)
        zs, ks, _ = jax.jit(jax.vmap(solve))(rhs)
        rng = np.random.default_rng(seed)
        ths = rng.multivariate_normal(theta, np.asarray(hyper["theta_cov"]), n_samples)
        out["zeta_samples"] = np.asarray(zs, np.float64)
        out["mu_samples"] = np.asarray(profile(ths, t, om, np, ref))
        out["sample_cg_iterations_max"] = int(jnp.max(ks))
    return out


def sky_summaries(cat: Catalog, post: dict) -> dict:
    """The posterior mean sky given the learned hyperparameters (``(n_pix, n_bins)`` float32), its std
    over the samples (profile uncertainty included), and per pixel the two columns with their std:
    ``column`` = ``sum_k sky_k (b_{k+1} - b_k)`` (pc x density) and ``wcolumn`` = ``sum_k sky_k
    (1/b_k - 1/b_{k+1})`` (the ``1/r^2``-weighted column each line measures, up to its ``1/s``)."""
    db = np.diff(cat.edges)
    dib = 1.0 / cat.edges[:-1] - 1.0 / cat.edges[1:]
    mu, zeta = post["mu"], post["zeta"]
    mean = mu.astype(np.float32)[None, :] * (1.0 + zeta.astype(np.float32))[:, None]
    out = {"mean": mean, "column": (1 + zeta) * (mu @ db), "wcolumn": (1 + zeta) * (mu @ dib)}
    if "zeta_samples" in post:
        Z, M = 1.0 + post["zeta_samples"], post["mu_samples"]
        S = Z.shape[0]
        std = np.empty(mean.shape, np.float32)
        for i in range(0, Z.shape[1], 65536):  # pixel blocks: no sky-sized float64 temporaries
            z = Z[:, i : i + 65536]
            e1 = (z.T @ M) / S
            std[i : i + 65536] = np.sqrt(np.maximum(((z * z).T @ (M * M)) / S - e1 * e1, 0.0))
        out["std"] = std
        out["column_std"] = np.std(Z * (M @ db)[:, None], axis=0)
        out["wcolumn_std"] = np.std(Z * (M @ dib)[:, None], axis=0)
    return out
