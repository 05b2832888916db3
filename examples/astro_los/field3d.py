"""A 3-D prior for the standard response: dust anywhere along a line, hyperparameters from the catalog.

Model (nothing in it comes from a generator of synthetic skies)::

    sky[p, k] = mu_k + f[p, k],      f ~ N(0, K_xy (x) Sigma_r),      Sigma_r = diag(sigma) C_r diag(sigma),
    log mu_k = a + b t_k + c t_k^2 + const(b, c),      sigma_k = amp mu_k,

* ``C_r``: exponential (Matern-1/2, Ornstein-Uhlenbeck) correlations in *physical* distance along
  the line between the bins' geometric centres, a long one and a short one,
  ``(exp(-|r_k - r_k'| / ell_r) + q^2 exp(-|r_k - r_k'| / 50 pc)) / (1 + q^2)`` (:func:`radial_correlation`;
  a Matern-3/2, smoother, tied the near bins, which few stars constrain, to the well-measured
  farther ones: on the test families its posterior was overconfident there, 9-18% of the
  1/r^2-weighted columns within 2 sd against 58-93% with this one, and its errors were no smaller;
  the short component, its weight ``q^2`` learned, loosens that tie where the evidence asks for it);
* ``K_xy``: a stationary correlation on the periodic plane-of-sky grid, power
  ``(1 + (2 pi ell_xy k)^2)^-slope`` (unit variance), plus its zero mode (the field's mean over the
  sky, the same at every pixel): the mean radial profile is ``mu_k + amp0 (mu_k + floor exp(a)) zeta_0k``,
  ``zeta_0`` a Gaussian process along the line (the long correlation alone), learned with the rest. The
  floor lets the profile be flat where the log-quadratic falls away: with the sd proportional to ``mu``
  alone, a far dense layer (``outside_skies.py``'s ``far_ring``) pulled the learned profile to a peak
  that left the near bins 90x below the truth with an sd that small, and none of the ``1/r^2``-weighted
  columns within 2 sd; the evidence learns ``floor`` (0: the sd proportional to the profile);
* ``t_k`` the bin centre's distance ``r`` (pc, not ``ln r``: where no star constrains the profile, near
  the observer, it stays nearly flat rather than following a parabola in ``ln r``) mapped onto
  ``[-1, 1]``; ``exp(a)`` the density's mean over distance (``sum_k mu_k db_k / sum_k db_k``).

``theta = (a, b, c, ln amp, ln amp0, ln ell_xy, ln slope, ln ell_r, q^2, floor)`` maximises the evidence
``p(y | theta)`` (type-II maximum likelihood) times a hyperprior ``b, c ~ N(0, 1)`` (flat within
bounds for the rest), in two stages (:func:`reconstruct`): first ``b, c, amp, amp0, ell_r, q, floor`` by the
exact evidence of the model without plane-of-sky correlation (:func:`pixelwise_evidence`, Newton
steps), ``a`` held at the lines' best log-quadratic profile (:func:`start_and_bounds`; see
:data:`PIXEL_FREE`); then all but ``a`` and ``floor`` by the full model's evidence (:func:`fit_hyperparameters`,
quasi-Newton; ``b, c`` too since session 32: the model without plane-of-sky correlation chose a mean
profile that left a far dense layer 1.93x the oracle's error, the full model's 0.70x,
``outside_skies.py``), whose gradient is the posterior mean of the gradient of ``log p(y | field, theta)``
over the whitened field (Fisher's identity), estimated with exact posterior samples (perturb and
solve, mirrored), the same random numbers at every step, each solve started from the last one's.

The lines enter through ``J`` radial vectors ``V`` (``n_bins x J``, the leading right singular
vectors of a sample of the catalog's weight vectors; enough of them for every line's weights to
within ``TRUNCATION`` noise sd on a rough sky, :func:`truncate`): ``g_l = V^T w_l``, computed once
by ``chunkop.map`` over the lines, and per latent pixel ``D_p = sum_l g_l g_l^T / sigma_l^2``, ``t_p = sum_l g_l
y_l / sigma_l^2`` (the transpose of a ``chunkop.RowOperator`` on the latent field). The data see
the sky only through ``u_p = V^T f_p``, whose prior is ``K_xy (x) C`` with ``C = V^T Sigma_r V``
on the non-zero plane-of-sky modes and ``C0 = V^T Sigma_r0 V`` on the sky-wide one (``Sigma_r0``:
the long radial correlation alone); the posterior of ``u`` is solved exactly (CG on the whitened
field ``u = (K_xy^1/2 (x) L) z``, ``L L^T = C``, the zero mode through ``L0``, ``L0 L0^T = C0``,
preconditioned by the exact inverse for the mean ``D``: diagonal in Fourier space) and the sky
follows per component as ``Sigma_r V C^-1 u`` (``Sigma_r0 V C0^-1 u`` for the sky-wide one) plus
the prior's variance left unseen, ``diag(Sigma_r - Sigma_r V C^-1 V^T Sigma_r)`` and its sky-wide
twin, added to every sample's spread.

The posterior mean is a Gaussian field's and may dip below zero (behind a dense layer, in front of
it where the density is small). Where the whole sky is held, the map reported is made a density
(:func:`nonnegative`): per pixel, the non-negative sky nearest the mean in that pixel's posterior
metric, which moves mass along the line where the lines do not see it and keeps their fit.

The latent plane-of-sky grid is the catalog's, coarsened (blocks of ``factor x factor`` pixels
sharing one value) only where the posterior's solves would need more than ``POSTERIOR_BYTES``
(:func:`posterior_bytes`) and the hyperparameters' fit more than ``MAX_LEARN`` pixels (the users'
1024 x 768 grid: the posterior on every pixel up to J = 28 radial vectors with 8 samples, its
solves all at once up to J = 22 and one at a time beyond, :func:`solve_batch`; the hyperparameters
on 147 x 110). Blocks cannot follow the sky inside them: with a few lines per pixel their errors stop
covering the truth (3M lines, 4 x 4 blocks: 41.5% of the columns within 2 sd, every pixel: 99.0%;
54M lines, 2 x 2 blocks: 33.7%, every pixel: 92.5%).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import los
import numpy as np
from catalog import Catalog

import chunkop

NAMES = ("a", "b", "c", "log_amp", "log_amp0", "log_ell_xy", "log_slope", "log_ell_r", "q2", "floor")
SHORT_PC = 50.0  # the short radial component's correlation length (pc; radial_correlation)
SHAPE_PRIOR_SD = 1.0  # hyperprior sd of the mean profile's shape b, c (flat in density unless the data say otherwise)
TRUNCATION = 1.0  # the radial basis moves no line by more than this many noise sd (truncate)
POSTERIOR_BYTES = 6 << 30  # the posterior's solves, at most (coarser latent blocks beyond; posterior_bytes)
MAX_LEARN = 16384  # ... and of the hyperparameters' fit
MAX_BASIS = 32  # radial vectors computed per line when all of them would exceed COMPRESS_BYTES
COMPRESS_BYTES = 1 << 30  # (n_lines x n_bins float32 at the seed's size: 0.27 GB; at 54M lines: 111 GB)
PROFILE_VECTORS = 6  # radial vectors added for the mean profile's family (with_profile_vectors)
EXACT_PROFILE_LINES = 1 << 20  # the mean profile's start from each line's prediction up to here, then from sums
LEARN = {
    "steps": 20,
    "max_gradients": 30,
    "pairs": 2,
    "fd_step": 0.03,
    "max_step": 1.0,
    "gain": 0.5,
    "cg_iters": 1000,
    "tol": 0.003,
    # the level (the sky-wide mode moves it as ``a`` does; see PIXEL_FREE) and the sky-wide sd's floor,
    # the pixel-by-pixel evidence's (exact): where the sky-wide mode is nearly off (amp0 ~ 1e-3 on the tiny
    # catalog) the floor moves nothing, and the full fit's sampled gradient let it and amp wander (floor
    # 0.25, the columns within 2 sd 86% -> 76%); held, a floor of 0 leaves the fit as it was
    "fixed": ("a", "floor"),
}


# -- the lines, compressed ------------------------------------------------------------------------


def weights_np(d: np.ndarray, s: np.ndarray, edges: np.ndarray, response: str) -> np.ndarray:
    """The response's weights in float64 NumPy (``(n, n_bins)``)."""
    return np.asarray(los.response_weights(np.asarray(d, np.float64), np.asarray(s, np.float64), edges, response))


def host() -> jax.Device:
    """The host's CPU device, where the example's float64 algebra runs: an accelerator emulates
    float64 (on a TPU v5e the mean profile's start, the statistics and the pixel-by-pixel evidence
    took 329 s at 13.24M lines; the 2-core CPU, 38 s at 3M)."""
    return jax.devices("cpu")[0]


def _stratified_sample(d: np.ndarray, n_sample: int, rng: np.random.Generator, strata: int = 64) -> np.ndarray:
    """Up to ``n_sample`` line indices spread evenly over ``ln d`` (a magnitude-limited catalog holds
    few near stars, whose weights a uniform sample would miss)."""
    ld = np.log(d)
    which = np.digitize(ld, np.linspace(ld.min(), ld.max(), strata + 1)[1:-1])
    per = max(1, n_sample // strata)
    idx = [rng.choice(m, min(m.size, per), replace=False) for m in (np.flatnonzero(which == k) for k in range(strata))]
    return np.concatenate(idx)


def radial_basis(cat: Catalog, response: str, n_sample: int = 8192, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The right singular vectors of (row-normalised) weight vectors of up to ``n_sample`` lines spread
    over ``ln d`` (all ``n_bins`` of them, leading first; :func:`truncate` keeps the fewest that do),
    and the singular values relative to the first."""
    idx = _stratified_sample(cat.d, n_sample, np.random.default_rng(seed))
    with jax.enable_x64(True), jax.default_device(host()):
        W = weights_np(cat.d[idx], cat.s[idx], cat.edges, response)
    _, sv, vt = np.linalg.svd(W / np.linalg.norm(W, axis=1, keepdims=True), full_matrices=False)
    return vt.T.copy(), sv / sv[0]


def basis_kept(n_lines: int, n_bins: int) -> int:
    """How many leading radial vectors :func:`compress_lines` computes per line: all ``n_bins`` while
    ``n_lines x n_bins`` float32 fit in ``COMPRESS_BYTES``, else ``MAX_BASIS`` (:func:`truncate` keeps
    fewer: 7 at the seed's size)."""
    return n_bins if n_lines * n_bins * 4 <= COMPRESS_BYTES else min(n_bins, MAX_BASIS)


def blocks(n: int, block: int, multiple: int = 1) -> Iterator[slice]:
    """The slices of ``range(n)`` that every pass over the lines (or the pixels) takes a block at a time:
    ``block`` items each, rounded down to a multiple of ``multiple`` (a chunk, so that no block but the
    last is padded) and at least ``multiple``; the last one shorter.

    Example:
        >>> [(b.start, b.stop) for b in blocks(10, 7, multiple=3)]
        [(0, 6), (6, 10)]
    """
    step = max(multiple, block // multiple * multiple)
    for lo in range(0, n, step):
        yield slice(lo, min(n, lo + step))


def compress_lines(
    cat: Catalog, V: np.ndarray, response: str, chunk: int = 8192, seconds: dict | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``g = W V`` for every line (``(n_lines, K)`` float32 for ``V``'s ``K`` orthonormal columns;
    ``chunkop.map`` over the lines, the weights recomputed chunk by chunk, never stored), ``w . 1``
    (``(n_lines,)`` float64: the line's prediction for a density of 1 everywhere), and the
    truncation's measurements on the way (``(2, K)`` float64, for :func:`truncate`): with
    ``e_lJ = |w_l - V_J g_lJ| / sigma_l`` the error of keeping ``V``'s first ``J`` columns, row 0 holds
    ``max_l e_lJ`` and row 1 ``sum_l e_lJ^2`` for ``J = 1 .. K``.

    ``|w - V_J g_J|^2`` is summed from what is dropped (``sum_{j > J} g_j^2``, plus ``|w - V g|^2``
    beyond ``V``'s columns, computed from the residual itself), never as ``|w|^2 - |g_J|^2``, whose
    float32 cancellation would exceed the small errors that decide the truncation; and it is reduced
    over the lines on the device, so no pass over ``g`` is left for the host (the float64 NumPy
    pass took 37 s at 13.24M lines on the TPU machine's host). ``seconds``, when given, gains the
    time spent computing (``"device"``, compiles included) and copying the results into host
    arrays (``"copy"``)."""
    run = jax.jit(_compress_pass(cat.edges, V, response, chunk))
    # blocks of lines, each block's g copied out before the next (27.6 GB of padded (n, K) at 54M lines)
    g = np.empty((cat.n_los, V.shape[1]), np.float32)
    w1, stats = np.empty(cat.n_los), np.zeros((2, V.shape[1]))
    spent = {"device": 0.0, "copy": 0.0}
    for sl in blocks(cat.n_los, COMPRESS_BYTES // (128 * 4), chunk):
        t0 = time.perf_counter()
        rows = {k: jnp.asarray(getattr(cat, k)[sl], jnp.float32) for k in ("d", "s", "sigma")}
        out = jax.block_until_ready(run(rows))
        t1 = time.perf_counter()
        gt, w1[sl], st = (np.asarray(o) for o in out)
        g[sl] = gt.T
        stats = np.stack([np.maximum(stats[0], st[0]), stats[1] + st[1]])
        spent["device"] += t1 - t0
        spent["copy"] += time.perf_counter() - t1
    if seconds is not None:
        for k, v in spent.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return g, w1, stats


def _compress_pass(edges: np.ndarray, V: np.ndarray, response: str, chunk: int) -> Callable:
    """:func:`compress_lines`' pass over a block of lines, ``{"d", "s", "sigma"} (n,) ->`` ``g^T``
    ``(K, n)``, ``w . 1`` ``(n,)`` and the block's truncation measurements ``(2, K)``, at float32
    matmul precision (a TPU's default is one bfloat16 pass, about 3 significant digits)."""
    Vj = jnp.asarray(V, jnp.float32)
    complete = V.shape[1] >= V.shape[0]  # (every direction kept: nothing beyond V)
    # sum_{j >= J} g_j^2 for every J as one product with a triangle of ones: a cumsum there took the
    # pass's compile on a TPU v5e from 1.7 s (g alone) to 15.3 s at K = 96 (5.1 s at 32;
    # benchmarks/explore_small_catalog.py --variants)
    tail = jnp.asarray(np.tril(np.ones((V.shape[1], V.shape[1]))), jnp.float32)

    def one(row):
        # the barrier keeps the weights out of the matmul's fusion: on a TPU v5e, XLA compiled that
        # fusion for 32 s a call, 4.3 s with the barrier (benchmarks/RESULTS.md)
        w = jax.lax.optimization_barrier(los.response_weights(row["d"], row["s"], edges, response))
        g = w @ Vj
        beyond = 0.0 if complete else jnp.sum(jnp.square(w - Vj @ g))
        dropped = jnp.square(g) @ tail  # sum_{j >= J}, J = 0 .. K - 1
        e = jnp.sqrt(jnp.append(dropped[1:], 0.0) + beyond) / row["sigma"]
        return g, jnp.sum(w), e

    def run(r: dict) -> tuple:
        with jax.default_matmul_precision("float32"):
            g, w1, e = chunkop.map(one, r, chunk_size=min(chunk, len(r["d"])))
        # (K, n): on a TPU an (n, K) array's minor axis is padded to 128 lanes
        return g.T, w1, jnp.stack([jnp.max(e, 0), jnp.sum(jnp.square(e), 0)])

    return run


def truncate(stats: np.ndarray, n_lines: int, level: float) -> tuple[int, dict]:
    """The fewest leading radial vectors ``J`` for which dropping the rest moves no line by more than
    ``TRUNCATION`` noise sd on a rough sky, one of independent fluctuations of the mean density
    ``level`` in every bin (``level |w - V_J g_J| / sigma``; a smooth sky moves far less), from
    :func:`compress_lines`' measurements ``stats`` over ``n_lines`` lines. Returns ``J`` and the
    measured errors (that bound's largest and rms values)."""
    worst, sq = level * stats[0], level**2 * stats[1]
    ok = np.flatnonzero(worst <= TRUNCATION)
    J = int(ok[0]) + 1 if ok.size else stats.shape[1]
    return J, {"J": J, "max_sigma": float(worst[J - 1]), "rms_sigma": float(np.sqrt(sq[J - 1] / n_lines))}


# -- the latent grid and the data's sufficient statistics -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
    """The latent plane-of-sky grid: blocks of ``factor x factor`` catalog pixels."""

    nx: int
    ny: int
    factor: int

    @property
    def shape(self) -> tuple[int, int]:
        return -(-self.nx // self.factor), -(-self.ny // self.factor)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def of_pixel(self, pix: np.ndarray) -> np.ndarray:
        """The latent pixel of each catalog pixel ``ix * ny + iy``."""
        ix, iy = np.divmod(np.asarray(pix), self.ny)
        return ((ix // self.factor) * self.shape[1] + iy // self.factor).astype(np.int32)


def grid_for(nx: int, ny: int, max_pixels: int) -> Grid:
    """The finest blocking of the ``nx x ny`` grid with at most ``max_pixels`` latent pixels."""
    f = 1
    while -(-nx // f) * -(-ny // f) > max_pixels:
        f += 1
    return Grid(nx, ny, f)


def posterior_bytes(n_lat: int, J: int, pairs: int, batched: bool = False) -> int:
    """A bound on the memory of :func:`solve_all` on ``n_lat`` latent pixels with ``J`` radial vectors
    and ``pairs`` mirrored sample pairs: ``n_lat (4 J^2 + 60 J + 28 pairs J)`` bytes with the solves
    one at a time (a pair adds only its right-hand sides and solutions), ``28 n_lat pairs J`` more with
    all ``1 + pairs`` at once (``batched``). XLA's compiled arguments, temporaries and outputs measured
    ``n_lat (4 J^2 + 75 J + 24 pairs J)`` one at a time and ``n_lat (4 J^2 + 48 J + 48 pairs J)`` all
    at once on 40 x 30 pixels, a little less on 256 x 192 (``J = 19``, 4 pairs: 4058 and 5843 bytes a
    pixel; with the products ``L^T D_p L`` held beside ``D_p``, before the sky-wide mode had its own
    radial correlation, 7696 one at a time); tests/test_example_field3d.py checks the bound."""
    return n_lat * (4 * J * J + 60 * J + 28 * pairs * J + (28 * pairs * J if batched else 0))


def solve_batch(n_lat: int, J: int, pairs: int) -> int:
    """How many of the ``1 + pairs`` posterior solves :func:`solve_all` runs at once: all of them
    where they fit ``POSTERIOR_BYTES`` together (a CG step on a batch reads each pixel's ``J x J``
    matrix once for all of it: five solves on 512 x 384 pixels at ``J = 19`` took 4.8 s at once and
    6.7 s one at a time on a 2-core CPU), else one."""
    return 1 + pairs if posterior_bytes(n_lat, J, pairs, batched=True) <= POSTERIOR_BYTES else 1


def posterior_grid(nx: int, ny: int, J: int, pairs: int) -> Grid:
    """The finest latent grid whose posterior solves, one at a time, fit in ``POSTERIOR_BYTES``
    (:func:`posterior_bytes`)."""
    per = posterior_bytes(1, J, pairs)
    return grid_for(nx, ny, max(1, POSTERIOR_BYTES // per))


class Data(eqx.Module):
    """The catalog as the prior sees it on a latent grid: per latent pixel ``D_p = sum g g^T / sigma^2``
    (``(n_lat, J, J)``) and ``t_p = sum g y / sigma^2`` (``(n_lat, J)``), float32; ``yy = sum y^2 /
    sigma^2`` and ``log_norm = sum log(2 pi sigma^2)`` (float64)."""

    D: jax.Array
    t: jax.Array
    yy: jax.Array
    log_norm: jax.Array
    grid: Grid = eqx.field(static=True)


def latent_operator(
    g: np.ndarray, cpix: np.ndarray, n_lat: int, chunk: int = 8192, rows: dict | None = None, layout: str = "auto"
) -> chunkop.RowOperator:
    """The response on the latent grid, ``u (n_lat, J) -> y_l = g_l . u[cpix_l]``, a ``chunkop.RowOperator``
    whose ``row_fn`` reads ``u[row["pix"]]`` (``rows``: :func:`_rows` of ``g, cpix``, made if not given;
    ``layout``: the operator's ``layout=``)."""
    struct = jax.ShapeDtypeStruct((n_lat, g.shape[1]), jnp.float32)
    rows = _rows(g, cpix) if rows is None else rows
    return chunkop.RowOperator(_response_row, rows, struct, chunk_size=min(chunk, len(g)), layout=layout)


def _response_row(row: dict, u: jax.Array) -> jax.Array:
    """One line of :func:`latent_operator`: ``g_l . u[cpix_l]``."""
    return _g(row) @ u[row["pix"]]


def _outer_row(row: dict, M: jax.Array) -> jax.Array:
    """One line of :func:`data_on`'s outer-product operator: ``g_l . M[cpix_l] g_l``."""
    return _g(row) @ M[row["pix"]] @ _g(row)


def _rows(g: np.ndarray, cpix: np.ndarray) -> dict:
    """The latent operators' rows: the latent pixel and ``g``'s columns as separate ``(n_lines,)``
    arrays (an ``(n_lines, J)`` array would take ``n_lines x 128`` floats on a TPU)."""
    return {"pix": jnp.asarray(cpix), "g": tuple(jnp.asarray(g[:, j], jnp.float32) for j in range(g.shape[1]))}


def _g(row: dict) -> jax.Array:
    """One line's ``g`` (``(J,)``) from its row (:func:`_rows`)."""
    return jnp.stack(row["g"])


#: the most lines a latent pixel receives, on average, in one of :func:`data_on`'s passes: float32 sums
#: within a pass, float64 across. With 4310 lines a latent pixel in one float32 pass (13.24M lines on
#: the CPU, the hyperparameters' grid at 64 x 48), the rounding of the running sums left ``D_p``
#: indefinite (smallest eigenvalue -2e-6 of the largest entry): the directions few lines measure, the
#: near bins', are lost at that level (54M lines on a TPU: ~4400 a pixel)
LINES_PER_PASS = 256


def data_on(cat: Catalog, g: np.ndarray, grid: Grid, chunk: int = 8192, layout: str = "auto") -> Data:
    """:class:`Data` on ``grid``: ``t = A^T (y / sigma^2)`` and ``D = B^T (1 / sigma^2)`` with ``A`` the
    latent response (:func:`latent_operator`) and ``B`` its outer-product twin (``row_fn`` reads one
    latent pixel's ``J x J`` block), both chunked transposes; over blocks of lines that give a latent
    pixel :data:`LINES_PER_PASS` lines on average, each summed in float32 on the device, the blocks
    added in float64 (one block where the lines are fewer)."""
    cpix = grid.of_pixel(cat.pix)
    iv = 1.0 / cat.sigma.astype(np.float64) ** 2
    n, J = g.shape
    passes = list(blocks(n, LINES_PER_PASS * grid.size, chunk))
    for sl in passes:
        rows = _rows(g[sl], cpix[sl])  # on the device once, for both operators
        A = latent_operator(g[sl], cpix[sl], grid.size, chunk, rows, layout)
        B = chunkop.RowOperator(
            _outer_row,
            rows,
            jax.ShapeDtypeStruct((grid.size, J, J), jnp.float32),
            chunk_size=min(chunk, sl.stop - sl.start),
            layout=layout,
        )
        ivj = jnp.asarray(iv[sl], jnp.float32)
        tb = jax.jit(_transposed)(A, ivj * jnp.asarray(cat.y[sl], jnp.float32))
        Db = jax.jit(_transposed)(B, ivj)
        if len(passes) == 1:  # (one block: the device's arrays as they are)
            t, D = tb, Db
        elif sl.start == 0:  # (several: their float64 sums)
            t, D = np.asarray(tb, np.float64), np.asarray(Db, np.float64)
        else:
            t += np.asarray(tb, np.float64)
            D += np.asarray(Db, np.float64)
    if len(passes) > 1:
        t, D = jnp.asarray(t, jnp.float32), jnp.asarray(D, jnp.float32)
    yy = float(np.sum(cat.y.astype(np.float64) ** 2 * iv))
    log_norm = float(np.sum(np.log(2 * np.pi / iv)))
    return Data(D=D, t=t, yy=jnp.asarray(yy), log_norm=jnp.asarray(log_norm), grid=grid)


def _transposed(op: chunkop.RowOperator, v: jax.Array) -> jax.Array:
    """``op^T v`` at float32 matmul precision (a TPU's default is one bfloat16 pass)."""
    with jax.default_matmul_precision("float32"):
        return op.T.mv(v)


#: :func:`nearest_psd` leaves a ``D_p`` as it is unless its smallest eigenvalue is below ``-INDEFINITE``
#: times its largest: the float32 rounding of exact sums reaches ~1e-6 (J eps), which every CPU run
#: kept; beyond it a sum has lost what it measured (one float32 pass over ~4400 lines a pixel: -2e-6
#: of the largest entry, and the evidence NaN)
INDEFINITE = 1e-5


def nearest_psd(D: jax.Array, block: int = 1 << 16) -> tuple[jax.Array, int]:
    """``D`` (``(n, J, J)``) with each matrix indefinite beyond rounding (smallest eigenvalue below
    ``-INDEFINITE`` times the largest) replaced by the nearest (Frobenius) positive semi-definite
    matrix to its symmetric part, computed in float64 and returned in ``D``'s dtype; every other matrix
    is returned bitwise. ``block`` matrices at a time. Returns the matrices and how many were replaced.

    Only those: a projection of every ``D_p`` in float32 (what the accelerator's path did until session
    28) errs by ~1e-7 of each one's largest eigenvalue in every direction, more than the directions
    few lines measure (the near bins') hold. 27M lines on the CPU with it gave the sky 0.121x the
    oracle's error and 14.6% of the ``1/r^2``-weighted columns within 2 sd, against 0.066x and 88.4%
    without (``benchmarks/RESULTS.md``, "The 54M loss found")."""
    out, replaced = [], 0
    with jax.enable_x64(True):  # (each block back in D's dtype before the next: no float64 copy of D)
        for sl in blocks(D.shape[0], block):
            M, bad = _psd_block(jnp.asarray(D[sl], jnp.float64), INDEFINITE)
            out.append(jnp.where(bad[:, None, None], M.astype(D.dtype), D[sl]))
            replaced += int(jnp.sum(bad))
    return jnp.concatenate(out), replaced


@jax.jit
def _psd_block(M: jax.Array, tol: float) -> tuple[jax.Array, jax.Array]:
    """:func:`nearest_psd` of one block of matrices: the projections, and which are indefinite beyond ``tol``."""
    w, Q = jnp.linalg.eigh(0.5 * (M + jnp.swapaxes(M, -1, -2)))
    bad = w[..., 0] < -tol * jnp.maximum(w[..., -1], jnp.finfo(w.dtype).tiny)
    return (Q * jnp.maximum(w, 0)[..., None, :]) @ jnp.swapaxes(Q, -1, -2), bad


# -- the prior ------------------------------------------------------------------------------------


class Radial(eqx.Module):
    """The radial geometry (float64): bin centres ``r``, widths ``db``, ``t`` (``r`` on [-1, 1]),
    the basis ``V`` (``n_bins x J``). Build it under ``jax.enable_x64``."""

    r: jax.Array
    db: jax.Array
    t: jax.Array
    V: jax.Array

    @classmethod
    def of(cls, edges: np.ndarray, V: np.ndarray) -> Radial:
        r = np.sqrt(edges[:-1] * edges[1:])
        lo, hi = edges[0], edges[-1]
        t = (2 * r - lo - hi) / (hi - lo)
        return cls(*(jnp.asarray(a, jnp.float64) for a in (r, np.diff(edges), t, V)))


def profile(theta: Any, rad: Radial) -> jax.Array:
    """``mu_k = exp(a + b t_k + c t_k^2) / <exp(b t + c t^2)>_db``: ``exp(a)`` is its mean over distance."""
    shape = theta[1] * rad.t + theta[2] * rad.t**2
    w = rad.db / rad.db.sum()
    return jnp.exp(theta[0] + shape - jnp.log(jnp.sum(w * jnp.exp(shape))))


def radial_correlation(r: jax.Array, ell_r: Any, q2: Any = 0.0) -> jax.Array:
    """The bins' correlation: an exponential (Matern-1/2) of length ``ell_r`` plus a short one of
    length :data:`SHORT_PC` with ``q^2`` its variance, ``(exp(-|dr| / ell_r) + q^2 exp(-|dr| /
    SHORT_PC)) / (1 + q^2)`` (unit diagonal).

    Alone, the long component ties the near bins, which few stars constrain, to the well-measured
    farther ones, and their posterior is overconfident (at 54M lines 9% of the ``1/r^2``-weighted
    columns within 2 sd). The evidence chooses ``q^2`` (:data:`PIXEL_FREE`; linear, not ``ln q``: where
    the evidence wants no short component, ``ln q`` would crawl towards its bound on a surface that
    flattens as ``q^2``): near zero where the density is smooth along the line (a fixed ``q = 1``
    doubled a steep profile's error), larger for shells, sheets and clouds.

    Args:
        r: the bin centres (pc), ``(n_bins,)``.
        ell_r: the long component's correlation length (pc).
        q2: ``q^2``, the short component's variance relative to the long one's.

    Returns:
        ``(n_bins, n_bins)`` correlation matrix.

    Example:
        >>> C = radial_correlation(jnp.array([50.0, 100.0]), 200.0, q2=1.0)
        >>> round(float(C[0, 1]), 4)  # (exp(-1/4) + exp(-1)) / 2
        0.5733
    """
    dr = jnp.abs(r[:, None] - r[None, :])
    return (jnp.exp(-dr / ell_r) + q2 * jnp.exp(-dr / SHORT_PC)) / (1.0 + q2)


def sqrt_power(shape: tuple[int, int], ell: Any, slope: Any, zero_ratio: Any) -> jax.Array:
    """Square root of the plane-of-sky power on the periodic latent grid (rfft2 layout): ``(1 + (2 pi
    ell k)^2)^-slope`` scaled to unit pointwise variance over the non-zero modes, and ``n zero_ratio^2``
    at ``k = 0`` (the sky-wide mean's variance ``zero_ratio^2``). ``ell`` in latent pixels."""
    nx, ny = shape
    k2 = np.fft.fftfreq(nx)[:, None] ** 2 + np.fft.rfftfreq(ny)[None, :] ** 2
    mult = np.full(k2.shape, 2.0)  # rfft2 layout: the modes counted twice (their conjugates) ...
    mult[:, 0] = 1.0  # ... except the ky = 0 column and, for even ny, the Nyquist column
    if ny % 2 == 0:
        mult[:, -1] = 1.0
    raw = jnp.exp(-slope * jnp.log1p((2 * np.pi * ell) ** 2 * jnp.asarray(k2)))
    nonzero = jnp.asarray(k2 > 0)
    norm = jnp.sum(jnp.where(nonzero, raw * mult, 0.0)) / (nx * ny)
    power = jnp.where(nonzero, raw / norm, nx * ny * zero_ratio**2)
    return jnp.sqrt(power)


@dataclasses.dataclass(frozen=True)
class Prior:
    """``theta``'s prior on the latent grid: ``mu`` (``n_bins``), the per-pixel field's ``Sigma_r``
    (``n_bins x n_bins``) and ``L`` (``J x J``, ``L L^T = V^T Sigma_r V``), the sky-wide mode's
    ``Sigma_r0`` and ``L0`` (the long radial correlation alone: the short one is a pixel's own, not
    the sky's; its sd ``amp (mu + floor exp(a))``, scaled by ``amp0 / amp`` in ``sq``), and the square
    root of the plane-of-sky power (its zero mode: the sky-wide mode's)."""

    mu: jax.Array
    sigma_r: jax.Array
    L: jax.Array
    sigma_r0: jax.Array
    L0: jax.Array
    sq: jax.Array
    k0: jax.Array  # 1 + (amp0 / amp)^2

    @property
    def variance(self) -> jax.Array:
        """The prior covariance of one pixel's bins (``n_bins x n_bins``): the field's plus the sky-wide mode's."""
        return self.sigma_r + (self.k0 - 1.0) * self.sigma_r0


def prior_of(theta: Any, rad: Radial, grid: Grid) -> Prior:
    """:class:`Prior` of ``theta`` (float64; differentiable)."""
    mu = profile(theta, rad)
    amp, amp0 = jnp.exp(theta[3]), jnp.exp(theta[4])
    sig = amp * mu
    sigma_r = sig[:, None] * radial_correlation(rad.r, jnp.exp(theta[7]), theta[8]) * sig[None, :]
    # the sky-wide mode's sd follows the profile down to a floor, floor x exp(a), in every bin (:data:`NAMES`)
    # (at q2 = 0 and floor = 0 the two are equal, and both are still factored: the pixel-by-pixel fit asks
    # at those bounds whether to leave them, and the evidence's derivative in q2 there flows through L alone)
    sig0 = amp * (mu + theta[9] * jnp.exp(theta[0]))
    sigma_r0 = sig0[:, None] * radial_correlation(rad.r, jnp.exp(theta[7])) * sig0[None, :]

    def chol(S: jax.Array) -> jax.Array:
        C = rad.V.T @ S @ rad.V
        return jnp.linalg.cholesky(C + 1e-9 * jnp.trace(C) / C.shape[0] * jnp.eye(C.shape[0]))

    zero_ratio = amp0 / amp
    sq = sqrt_power(grid.shape, jnp.exp(theta[5]) / grid.factor, jnp.exp(theta[6]), zero_ratio)
    return Prior(
        mu=mu, sigma_r=sigma_r, L=chol(sigma_r), sigma_r0=sigma_r0, L0=chol(sigma_r0), sq=sq, k0=1.0 + zero_ratio**2
    )


def hyperprior(theta: Any) -> jax.Array:
    """``log`` hyperprior density (up to a constant): ``b, c ~ N(0, SHAPE_PRIOR_SD^2)``, flat otherwise."""
    return -0.5 * (theta[1] ** 2 + theta[2] ** 2) / SHAPE_PRIOR_SD**2


# -- the posterior on the latent grid -------------------------------------------------------------


def _mix(M: jax.Array, z: jax.Array) -> jax.Array:
    """``M`` (``J' x J``) applied to the channels of ``z`` (``(..., J, nx, ny)``)."""
    return jnp.einsum("ij,...jxy->...ixy", M.astype(z.real.dtype), z)


def _dmul(D: jax.Array, u: jax.Array) -> jax.Array:
    """``D_p u_p`` per latent pixel for ``u`` of shape ``(J, nx, ny)``."""
    J, nx, ny = u.shape
    return jnp.einsum("pij,pj->pi", D, u.reshape(J, -1).T).T.reshape(J, nx, ny)


def _multiplicity(shape: tuple[int, int]) -> np.ndarray:
    """How many Fourier modes each rfft2 coefficient of an ``nx x ny`` real field stands for (1 or 2:
    itself and its conjugate)."""
    nx, ny = shape
    mult = np.full((nx, ny // 2 + 1), 2.0)
    mult[:, 0] = 1.0
    if ny % 2 == 0:
        mult[:, -1] = 1.0
    return mult


def rotation_of(prior: Prior, data: Data) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """``((lambda, E), (lambda0, E0))``: the eigen-decompositions of ``L^T mean(D) L`` and ``L0^T
    mean(D) L0``; ``E`` are the channels :class:`System` solves the non-zero plane-of-sky modes in,
    ``E0`` the sky-wide mode's. Computed once per solve and handed on (:func:`solve_all` returns
    ``(E, E0)``): where eigenvalues are (nearly) degenerate, two ``eigh`` calls may return different bases."""
    Dm = jnp.mean(data.D, axis=0).astype(prior.L.dtype)

    def eig(L: jax.Array) -> tuple[jax.Array, jax.Array]:
        M = L.T @ Dm @ L
        return jnp.linalg.eigh(0.5 * (M + M.T))

    return eig(prior.L), eig(prior.L0)


def _split_modes(zh: jax.Array, sq: jax.Array, shape: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """``K^1/2 z`` of whitened rfft2 coefficients ``zh`` (``(..., J, nx, ny // 2 + 1)``) in two parts:
    the non-zero plane-of-sky modes as a field (``(..., J, nx, ny)``) and the zero mode's coefficient
    (``(..., J)``; its field, the same at every pixel, is that over ``nx ny``)."""
    x = jnp.fft.irfft2((zh * sq).at[..., 0, 0].set(0.0), s=shape)
    return x, zh[..., 0, 0].real * sq[0, 0]


def _to_u(L: jax.Array, L0: jax.Array, sq: jax.Array, zh: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``u = V^T f`` per latent pixel (``(..., J, nx, ny)``) of whitened rfft2 coefficients ``zh``: the
    non-zero modes through ``L``, the zero mode (the sky-wide field, the same at every pixel) through ``L0``."""
    x, c0 = _split_modes(zh, sq, shape)
    return _mix(L, x) + (jnp.einsum("ij,...j->...i", L0, c0) / (shape[0] * shape[1]))[..., None, None]


class System:
    """The whitened normal equations ``H z = rhs``, ``H = I + (K^1/2 (x) L^T) D (K^1/2 (x) L)``, solved
    for the rfft2 coefficients of ``z`` (``(J, nx, ny // 2 + 1)`` complex64; ``dot`` is the real
    fields' dot product) in the channels that diagonalise the mean ``D`` (``L E``, ``E`` the
    eigenvectors of ``L^T mean(D) L``; the zero mode in ``L0 E0``, :func:`rotation_of`): ``K^1/2`` is
    then diagonal, each product with ``H`` one pair of FFTs, one ``J x J`` product ``D_p`` per pixel
    and two with the shared ``L E`` (no ``L^T D_p L`` held: half the memory), and the preconditioner
    (the exact ``H^-1`` for the mean ``D``, ``1 / (1 + P(k) lambda_j)``) a diagonal."""

    def __init__(self, data: Data, prior: Prior, rad: Radial, rotation: tuple):
        self.data, self.shape = data, data.grid.shape
        (lam, E), (lam0, E0) = rotation
        self.L = jnp.asarray(prior.L @ E, jnp.float32)  # u = L E z (the non-zero modes)
        self.L0 = jnp.asarray(prior.L0 @ E0, jnp.float32)  # ... and L0 E0 z_0 (the sky-wide mode)
        self.sq = jnp.asarray(prior.sq, jnp.float32)
        self.mu_v = jnp.asarray(rad.V.T @ prior.mu, jnp.float32)  # V^T mu
        inv = 1.0 / (1.0 + self.sq[None] ** 2 * jnp.maximum(lam, 0.0)[:, None, None])
        inv0 = 1.0 / (1.0 + self.sq[0, 0] ** 2 * jnp.maximum(lam0, 0.0))
        self.inv = jnp.asarray(inv.at[:, 0, 0].set(inv0), jnp.float32)
        self.w = jnp.asarray(_multiplicity(self.shape) / (self.shape[0] * self.shape[1]), jnp.float32)

    def dot(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(self.w * (a.real * b.real + a.imag * b.imag))

    def to_u(self, zh: jax.Array) -> jax.Array:
        """``u = (K^1/2 (x) L E) z`` (the zero mode through ``L0 E0``): the data-seen field ``V^T f`` per
        latent pixel, ``(J, nx, ny)`` real."""
        return _to_u(self.L, self.L0, self.sq, zh, self.shape)

    def from_u(self, v: jax.Array) -> jax.Array:
        """The transpose of :meth:`to_u` (rfft2 coefficients)."""
        out = jnp.fft.rfft2(_mix(self.L.T, v)) * self.sq
        return out.at[:, 0, 0].set(self.sq[0, 0] * (self.L0.T @ jnp.sum(v, (1, 2))))

    def H(self, zh: jax.Array) -> jax.Array:
        return zh + self.from_u(_dmul(self.data.D, self.to_u(zh)))

    def M(self, zh: jax.Array) -> jax.Array:
        return self.inv * zh

    def rhs(self) -> jax.Array:
        """``A^T N^-1 (y - A mu)`` whitened: ``from_u(t - D V^T mu)``."""
        nx, ny = self.shape
        J = self.L.shape[0]
        t = self.data.t.T.reshape(J, nx, ny)
        return self.from_u(t - _dmul(self.data.D, jnp.broadcast_to(self.mu_v[:, None, None], t.shape)))

    def perturbation(self, noise: tuple[jax.Array, jax.Array]) -> jax.Array:
        """``e1 + A^T N^-1 e2`` (``e1 ~ N(0, I)``, ``e2 ~ N(0, N)``): ``H^-1`` of it is a posterior sample
        less the mean. ``noise = (e1, D^1/2 e)`` from :func:`draw_noise` (``A^T N^-1 e2`` before
        whitening, per latent pixel, is ``D_p^1/2 e`` in law, ``e ~ N(0, I_J)``; ``e1``'s law is the
        same in any orthonormal channels)."""
        return jnp.fft.rfft2(noise[0]) + self.from_u(noise[1])


def draw_noise(data: Data, key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``n`` draws of the two noises of :meth:`System.perturbation` (independent of ``theta``: the same
    draws serve every step of the hyperparameters' fit), ``(n, J, nx, ny)`` float32 each."""
    k1, k2 = jax.random.split(key)
    nx, ny = data.grid.shape
    J = data.t.shape[-1]
    w, Q = jnp.linalg.eigh(data.D)
    root = (Q * jnp.sqrt(jnp.maximum(w, 0.0))[:, None, :]) @ jnp.swapaxes(Q, 1, 2)
    e = jax.random.normal(k2, (n, nx * ny, J), jnp.float32)
    e2 = jnp.swapaxes(jnp.einsum("pij,npj->npi", root, e), 1, 2).reshape(n, J, nx, ny)
    return jax.random.normal(k1, (n, J, nx, ny), jnp.float32), e2


def pcg(H: Callable, M: Callable, dot: Callable, b: jax.Array, x0: jax.Array, iters: int, tol: float):
    """Preconditioned CG for ``H x = b`` from ``x0`` (a ``lax.while_loop``; ``dot`` the inner product).
    ``H`` is the posterior precision in whitened coordinates, so the error's ``H``-norm counts
    posterior sd: it stops when ``r^T M r`` (``M ~ H^-1``: that norm, squared) is at most ``tol^2``
    times the dimension ``n`` (an error of about ``tol`` posterior sd per degree of freedom).
    Returns ``(x, steps, sqrt(r^T M r / n))``."""
    n = dot(jnp.ones_like(b), jnp.ones_like(b)) * b.shape[-2] * b.shape[-1]  # the real fields' dimension
    r = b - H(x0)
    z = M(r)
    rz0 = dot(r, z)

    def cond(st):
        return (st[0] < iters) & (st[4] > tol**2 * n)

    def body(st):
        k, x, r, p, rz = st
        Hp = H(p)
        alpha = rz / dot(p, Hp)
        x, r = x + alpha * p, r - alpha * Hp
        z = M(r)
        rz_new = dot(r, z)
        return k + 1, x, r, z + (rz_new / rz) * p, rz_new

    k, x, _, _, rz = jax.lax.while_loop(cond, body, (jnp.int32(0), x0, r, z, rz0))
    return x, k, jnp.sqrt(jnp.maximum(rz, 0.0) / n)


@functools.partial(jax.jit, static_argnames=("iters", "tol", "batch"))
def solve_all(theta, data: Data, rad: Radial, noise, z0, iters: int, tol: float, batch: int = 1):
    """The posterior mean (whitened, rfft2 coefficients) and one perturbation per draw of ``noise``, each
    by PCG from ``z0`` (``(1 + n, J, nx, ny // 2 + 1)`` complex64), ``batch`` solves at a time
    (:func:`solve_batch`; a batch takes as many steps as its slowest solve); returns ``(z, steps,
    error estimates, (E, E0))``, the channels the ``z`` are in (:func:`rotation_of`). Call under
    ``jax.enable_x64`` (``theta`` float64)."""
    prior = prior_of(theta, rad, data.grid)
    rotation = rotation_of(prior, data)
    S = System(data, prior, rad, rotation)
    solve = lambda b, x0: pcg(S.H, S.M, S.dot, b, x0, iters, tol)
    b = jnp.concatenate([S.rhs()[None], jax.vmap(S.perturbation)(noise)])
    # batch=1: each solve stops at its own tolerance and the memory holds one solve's vectors
    # beside the right-hand sides (posterior_bytes)
    return (*chunkop.vmap(solve, chunk_size=batch)(b, z0), (rotation[0][1], rotation[1][1]))


def zeros(data: Data, n: int) -> jax.Array:
    """``n`` whitened fields of zeros, as :func:`solve_all` holds them."""
    nx, ny = data.grid.shape
    return jnp.zeros((n, data.t.shape[-1], nx, ny // 2 + 1), jnp.complex64)


def log_likelihood(theta: Any, data: Data, rad: Radial, zs: jax.Array, rotation: tuple) -> jax.Array:
    """``mean_s log p(y | z_s, theta)`` up to a constant, for whitened fields ``zs`` (rfft2 coefficients,
    ``(S, J, nx, ny // 2 + 1)``), from the per-pixel statistics: ``-1/2 sum_p (v_p^T D_p v_p - 2 t_p .
    v_p)``, ``v_p = V^T mu + u_p``, ``u = (K^1/2 (x) L E) z`` (the zero mode through ``L0 E0``) with
    ``(E, E0) = rotation`` held fixed (the channels the samples were solved in, returned by
    :func:`solve_all`)."""
    prior = prior_of(theta, rad, data.grid)
    mu_v = rad.V.T @ prior.mu
    E, E0 = (jax.lax.stop_gradient(e) for e in rotation)
    L, L0 = (prior.L @ E).astype(jnp.float32), (prior.L0 @ E0).astype(jnp.float32)
    sq = prior.sq.astype(jnp.float32)
    J = L.shape[0]

    def one(z):
        v = _to_u(L, L0, sq, z, data.grid.shape).reshape(J, -1).T + mu_v.astype(jnp.float32)
        Dv = jnp.einsum("pij,pj->pi", data.D, v)
        return -0.5 * (jnp.sum(v * Dv) - 2.0 * jnp.sum(data.t * v))

    return chunkop.mean(one, in_axes=0, chunk_size=2)(zs)


@jax.jit
def hyper_grad(theta, data: Data, rad: Radial, zs: jax.Array, rotation: tuple):
    """``log p(y | z_s, theta) + log hyperprior`` averaged over the samples ``zs``, and its gradient in
    ``theta``: the log evidence's gradient when ``zs`` are posterior samples (Fisher's identity; the
    samples' channels ``rotation = (E, E0)``, those :func:`solve_all` solved them in at ``theta``, held fixed)."""
    return jax.value_and_grad(lambda th: log_likelihood(th, data, rad, zs, rotation) + hyperprior(th))(theta)


# -- the hyperparameters ------------------------------------------------------------------------------


def pixelwise_evidence(theta: Any, data: Data, rad: Radial) -> jax.Array:
    """``log p(y | theta)`` (exact, float64) of the model with the plane-of-sky correlation dropped:
    every latent pixel's field independent, ``u_p = L z_p + (amp0 / amp) L0 z_0`` with the sky-wide
    zero mode ``z_0`` kept (the joint precision is block-arrow: per-pixel ``B_p = I + L^T D_p L``, the
    couplings ``(amp0 / amp) L^T D_p L0 = (amp0 / amp) W_p M``, ``W_p = L^T D_p L``, ``M = L^-1 L0``,
    then the ``J x J`` Schur complement of ``z_0``). Its maximum is a composite-likelihood estimate of
    the radial hyperparameters (each pixel's marginal is the full model's): the full fit's start."""
    prior = prior_of(theta, rad, data.grid)
    L, ratio = prior.L, prior.k0 - 1.0
    # M = L^-1 L0 is bounded: at floor 0, M M^T <= (1 + q2) I, as Sigma_r >= Sigma_r0 / (1 + q2); a floor
    # multiplies that bound by up to (1 + floor max_k exp(a) / mu_k)^2 (~1e6 where a profile peaked far
    # away leaves the near bins at 1e-3 exp(a): float64 holds it)
    M = jax.scipy.linalg.solve_triangular(L, prior.L0, lower=True)
    D, t = data.D.astype(L.dtype), data.t.astype(L.dtype)
    mu_v = rad.V.T @ prior.mu
    W = jnp.einsum("ji,pjk,kl->pil", L, D, L)
    b = (t - D @ mu_v) @ L
    B = jnp.eye(L.shape[0]) + W
    cB = jnp.linalg.cholesky(B)
    Bb = jax.scipy.linalg.cho_solve((cB, True), b[..., None])[..., 0]  # B_p^-1 b_p
    # The Schur complement: I + ratio M^T sum_p (L^T D_p L - W_p B_p^-1 W_p) M, and W - W B^-1 W = I - B^-1;
    # B_p^-1 = (cB_p^-1)^T cB_p^-1 (a batched triangular solve of the identity: the gradient of jax's
    # batched cho_solve with a matrix right-hand side hangs on some CPUs, jax 0.10)
    J = L.shape[0]
    Li = jax.scipy.linalg.solve_triangular(cB, jnp.broadcast_to(jnp.eye(J), cB.shape), lower=True)
    S = jnp.eye(J) + ratio * M.T @ (W.shape[0] * jnp.eye(J) - jnp.sum(jnp.swapaxes(Li, 1, 2) @ Li, 0)) @ M
    s_ = jnp.sqrt(ratio) * M.T @ jnp.sum(Bb, 0)  # ratio^1/2 (L0^T sum_p e_p - M^T sum_p W_p B_p^-1 b_p)
    cS = jnp.linalg.cholesky(0.5 * (S + S.T))
    quad = jnp.sum(b * Bb) + s_ @ jax.scipy.linalg.cho_solve((cS, True), s_)
    rr = data.yy - 2 * jnp.sum(t @ mu_v) + jnp.einsum("i,pij,j->", mu_v, D, mu_v)
    logdet = 2 * jnp.sum(jnp.log(jnp.diagonal(cB, axis1=1, axis2=2))) + 2 * jnp.sum(jnp.log(jnp.diag(cS)))
    return -0.5 * (rr - quad + logdet + data.log_norm) + hyperprior(theta)


def mean_profile_fit(cat: Catalog, g: np.ndarray, rad: Radial) -> np.ndarray:
    """``(a, b, c)`` of the log-quadratic profile whose predictions ``w_l . mu`` fit the lines best
    (Gauss-Newton on ``sum_l ((y_l - w_l . mu) / sigma_l)^2``, from the flat profile at the
    least-squares level): the starting mean profile of the hyperparameters' fit.

    Up to ``EXACT_PROFILE_LINES`` lines each step forms every line's prediction ``(g_l V^T) v`` (the
    products every recorded figure came from: the hyperparameters' fit follows its start at the
    rounding level, examples/astro_los/README.md, "Things worth knowing"); beyond, the same steps from
    the catalog's sums ``sum_l g_l g_l^T / sigma_l^2`` and ``sum_l y_l g_l / sigma_l^2`` (``J x J``: a
    step costs nothing per line, where the products cost minutes a step at 54M lines)."""
    Vt = np.asarray(rad.V).T  # w_l = V g_l, as the basis keeps it
    iv = 1.0 / cat.sigma.astype(np.float64) ** 2
    y = cat.y.astype(np.float64)
    if len(g) <= EXACT_PROFILE_LINES:
        g64 = np.asarray(g, np.float64)
        block = max(1, COMPRESS_BYTES // (8 * Vt.shape[1]))

        def G(v: np.ndarray) -> np.ndarray:
            """``(w_l . v)_l`` (``v``: ``(n_bins,)`` or ``(n_bins, k)``), ``w_l`` made for a block of lines
            at a time: never the whole ``(n_lines, n_bins)`` matrix (223 GB at 54M lines)."""
            return np.concatenate([(g64[sl] @ Vt) @ v for sl in blocks(len(g64), block)])

        def level(v: np.ndarray) -> float:
            m = G(v)
            return np.sum(y * m * iv) / np.sum(m * m * iv)

        def step(mu: np.ndarray, X: np.ndarray) -> np.ndarray:
            Jm, r = G(X), y - G(mu)
            return np.linalg.lstsq(Jm * np.sqrt(iv)[:, None], r * np.sqrt(iv), rcond=None)[0]

    else:
        M, m = _line_sums(g, iv, y)

        def level(v: np.ndarray) -> float:
            a = Vt @ v
            return (m @ a) / (a @ M @ a)

        def step(mu: np.ndarray, X: np.ndarray) -> np.ndarray:
            P = Vt @ X
            return np.linalg.lstsq(P.T @ M @ P, P.T @ (m - M @ (Vt @ mu)), rcond=None)[0]

    flat = np.asarray(profile(jnp.zeros(3), rad))
    p = np.array([np.log(max(level(flat), 1e-30)), 0.0, 0.0])
    basis = np.stack([np.ones_like(np.asarray(rad.t)), np.asarray(rad.t), np.asarray(rad.t) ** 2], 1)
    db = np.asarray(rad.db)
    for _ in range(30):
        mu = np.asarray(profile(jnp.asarray(p), rad))
        d = step(mu, mu[:, None] * (basis - (db * mu) @ basis / (db @ mu) * [0, 1, 1]))
        p = p + np.clip(d, -1.0, 1.0)
        if np.max(np.abs(d)) < 1e-6:
            break
    return p


def with_profile_vectors(
    cat: Catalog, V: np.ndarray, g: np.ndarray, response: str, chunk: int = 8192, seconds: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``V`` and ``g`` with ``PROFILE_VECTORS`` more radial vectors: ``mu0 t^i`` (``i < PROFILE_VECTORS``)
    made orthogonal to ``V`` and to each other, ``mu0`` the best-fitting mean profile on ``V``
    (:func:`mean_profile_fit`), and every line's coefficients on them (:func:`compress_lines`).

    The truncation's tolerance is per line (:func:`truncate`), but the mean profile is shared by every
    line of the catalog: what the basis drops of it adds up over the lines into a bias. At the
    default size the true mean profile's dropped part moved the data by 28 noise sd in all (the norm of
    ``(w_l - V V^T w_l) . mu / sigma_l`` over the lines) with the 16 vectors the truncation keeps,
    0.06 sd with three added; but that grows with the stars: with 8M stars on the default grid three
    left the sky 0.21 in error in front of 100 pc (oracle 0.45) and 35% of the ``1/r^2``-weighted
    columns within 2 sd, six 0.067 and 51% (six more basis vectors instead: no better; 54M on a TPU
    with three: 2.6%; ``benchmarks/RESULTS.md``). ``seconds``: as :func:`compress_lines`'."""
    if PROFILE_VECTORS == 0:
        return V, g
    with jax.enable_x64(True), jax.default_device(host()):
        rad = Radial.of(cat.edges, V)
        mu0 = np.asarray(profile(jnp.asarray(mean_profile_fit(cat, g, rad)), rad))
        t = np.asarray(rad.t)
    X = np.stack([mu0 * t**i for i in range(PROFILE_VECTORS)], 1)
    for _ in range(2):  # twice: orthogonal to V to rounding
        X = X - V @ (V.T @ X)
    Q, R = np.linalg.qr(X)
    Q = Q[:, np.abs(np.diag(R)) > 1e-8 * np.linalg.norm(mu0)]  # what V already holds, once
    if Q.shape[1] == 0:  # (every vector kept: V holds the family already)
        return V, g
    gq, _, _ = compress_lines(cat, Q, response, chunk, seconds)
    return np.concatenate([V, Q], 1), np.ascontiguousarray(np.concatenate([g, gq], 1))


def _line_sums(g: np.ndarray, iv: np.ndarray, y: np.ndarray, block: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """``sum_l iv_l g_l g_l^T`` and ``sum_l iv_l y_l g_l`` in float64, a block of lines at a time."""
    J = g.shape[1]
    M, m = np.zeros((J, J)), np.zeros(J)
    for sl in blocks(len(g), block):
        gb = g[sl].astype(np.float64)
        M += gb.T @ (gb * iv[sl, None])
        m += gb.T @ (iv[sl] * y[sl])
    return M, m


def start_and_bounds(cat: Catalog, g: np.ndarray, rad: Radial) -> tuple[np.ndarray, list]:
    """Generic starting values (the best-fitting log-quadratic mean profile, field sd 0.5, a tenth of
    the grid across, 1/20 of the distance range along the line, ``q^2`` 0.1, the sky-wide mode's sd
    floor 0.1 x the mean density; from 0, the model without it, the Newton steps left that bound slowly:
    19 steps to far_ring's 0.49, 9 from 0.1) and bounds for ``theta``."""
    abc = mean_profile_fit(cat, g, rad)
    span = float(cat.edges[-1] - cat.edges[0])
    n = max(cat.nx, cat.ny)
    theta0 = np.array([*abc, np.log(0.5), np.log(0.5), np.log(n / 10.0), np.log(2.0), np.log(span / 20.0), 0.1, 0.1])
    bounds = [
        (abc[0] - 20.0, abc[0] + 20.0),
        (-6.0, 6.0),
        (-6.0, 6.0),
        (np.log(1e-3), np.log(10.0)),
        (np.log(1e-3), np.log(10.0)),
        (np.log(0.3), np.log(float(n))),
        (np.log(1.05), np.log(50.0)),
        (np.log(float(np.min(np.diff(cat.edges)))), np.log(10.0 * span)),
        (0.0, 10.0),
        (0.0, 10.0),
    ]
    theta0[1:3] = np.clip(theta0[1:3], -6.0, 6.0)
    return theta0, bounds


def _gradient(theta: np.ndarray, data: Data, rad: Radial, noise: tuple, z: jax.Array, o: dict) -> tuple:
    """The log evidence's gradient at ``theta`` estimated with the posterior samples ``mean +- H^-1 noise``
    (:func:`hyper_grad`), the solves started from ``z``; returns ``(gradient, z, CG steps)``."""
    th = jnp.asarray(theta, jnp.float64)
    batch = solve_batch(data.grid.size, data.t.shape[-1], noise[0].shape[0])
    z, k, _, E = solve_all(th, data, rad, noise, z, o["cg_iters"], o["tol"], batch)
    _, grad = hyper_grad(th, data, rad, jnp.concatenate([z[0] + z[1:], z[0] - z[1:]]), E)
    return np.asarray(grad, np.float64), z, int(jnp.max(k))


def _line_search(theta, g, step, lo, hi, gradient: Callable, z, probes: int = 2):
    """Along ``step`` (an ascent direction), the point where the directional derivative has fallen to
    at most half its start value (a curvature condition), by secant steps on it: extrapolating while
    it stays large (at most 4x a time), interpolating once it changes sign. Returns the point, its
    gradient, the solves' end state and their CG steps."""
    d0 = float(g @ step)
    a_lo, d_lo, a_hi, d_hi = 0.0, d0, None, None
    a, out, cg = 1.0, None, []
    for _ in range(probes):
        new = np.clip(theta + a * step, lo, hi)
        g_new, z_new, k = gradient(new, z)
        cg.append(k)
        out = (new, g_new, z_new)
        d = float(g_new @ step)
        if abs(d) <= 0.5 * abs(d0) or np.allclose(new, np.clip(theta + 4 * a * step, lo, hi)):
            break
        if d > 0:
            a_lo, d_lo = a, d
            a = a * min(4.0, max(1.5, d_lo / max(d0 - d, 1e-30))) if a_hi is None else a
        else:
            a_hi, d_hi = a, d
        if a_hi is not None:
            a = a_lo + (a_hi - a_lo) * d_lo / (d_lo - d_hi)  # secant root of the directional derivative
    return (*out, cg)


def _negative_definite(H: np.ndarray, floor: float = 1e-3) -> np.ndarray:
    """``H`` symmetrised, its eigenvalues made at most ``-floor`` times the largest magnitude."""
    w, Q = np.linalg.eigh(0.5 * (H + H.T))
    cap = floor * np.max(np.abs(w))
    return (Q * np.minimum(w, -cap)) @ Q.T


def _projected_step(H: np.ndarray, g: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`_bounded_newton_step` on the coordinates free to move: those on a bound whose gradient
    points out of the box are held (step 0) and left out of the Newton system. Clipping the full
    step instead spoils its direction in the others: with ``q2`` on its bound 0 the pixel-by-pixel
    evidence stopped 23 nats below the same model's optimum (steep_profile, default size)."""
    held = ((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0))
    step = np.zeros_like(g)
    free = ~held
    if np.any(free):
        step[free] = _bounded_newton_step(H[np.ix_(free, free)], g[free])
    return step


def _bounded_newton_step(H: np.ndarray, g: np.ndarray, bound: float = 1.0) -> np.ndarray:
    """An ascent step for a maximisation with gradient ``g`` and Hessian ``H``: Newton's step on
    ``H``'s eigenvalues' magnitudes (``Q diag(1 / |w|) Q^T g``: up where the function is concave,
    also up where it is not), or, where that moves a coordinate by more than ``bound``, the
    Levenberg-Marquardt step ``Q diag(1 / (|w| + mu)) Q^T g`` with ``mu > 0`` found by bisection
    to keep every coordinate within ``bound`` (its largest coordinate on the bound, where that
    falls steadily with ``mu``).

    Flooring the curvatures at 1e-3 of the largest and shrinking the step as a whole (the rule
    before) made the flat directions crawl: the pixel-by-pixel evidence of 13.24M lines took 40
    steps (its cap, 533 gradients) and stopped short; with this rule, 9 steps (130 gradients) to an
    evidence 0.15 nats higher."""
    w, Q = np.linalg.eigh(0.5 * (H + H.T))
    w = np.maximum(np.abs(w), 1e-12 * np.max(np.abs(w)))
    c = Q.T @ g

    def of(mu: float) -> np.ndarray:
        return Q @ (c / (w + mu))

    if np.max(np.abs(of(0.0))) <= bound:
        return of(0.0)
    lo, hi = 0.0, float(np.max(w))
    while np.max(np.abs(of(hi))) > bound:
        hi *= 4.0
    for _ in range(60):  # bisection on mu: the step shrinks as mu grows
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.max(np.abs(of(mid))) > bound else (lo, mid)
    return of(hi)


def fit_hyperparameters(
    data: Data, rad: Radial, theta0: np.ndarray, bounds: list, log: Callable = print, seed: int = 0, **opts: Any
) -> dict:
    """Type-II MAP of ``theta``: the root of the log evidence's gradient (plus the hyperprior's), the
    gradient estimated with ``pairs`` mirrored posterior samples whose random numbers are drawn once
    (a sample-average approximation: a smooth, deterministic function of ``theta``). Quasi-Newton:
    the Hessian by forward differences at the start (``fd_step``), then BFGS updates, each step at
    most ``max_step`` in every coordinate; stops when the predicted gain ``g^T (-H)^-1 g / 2`` is
    below ``gain`` nats, or after ``steps``. ``opts`` override :data:`LEARN`. Returns ``theta``, the
    Hessian (its inverse's diagonal: the Laplace sd), the path and the effort. Call under
    ``jax.enable_x64``."""
    o = {**LEARN, **opts}
    lo, hi = np.array([b[0] for b in bounds]), np.array([b[1] for b in bounds])
    noise = draw_noise(data, jax.random.key(seed), o["pairs"])
    z = zeros(data, 1 + o["pairs"])
    t0 = time.perf_counter()
    theta = np.clip(np.asarray(theta0, np.float64), lo, hi)
    moving = np.array([n not in o["fixed"] for n in NAMES])
    g, z, k = _gradient(theta, data, rad, noise, z, o)
    cg = [k]
    H = -np.eye(theta.size)
    for i in np.flatnonzero(moving):  # forward differences, each solve started from the base point's
        e = np.zeros_like(theta)
        e[i] = o["fd_step"] if theta[i] + o["fd_step"] <= hi[i] else -o["fd_step"]
        gi, _, k = _gradient(theta + e, data, rad, noise, z, o)
        H[moving, i] = (gi - g)[moving] / e[i]
        cg.append(k)
    H = _negative_definite(H)
    path, gains = [theta.tolist()], []
    for it in range(o["steps"]):
        # coordinates at a bound whose gradient points out of the box stay there (an active set)
        free = moving & ~(((theta <= lo + 1e-9) & (g < 0)) | ((theta >= hi - 1e-9) & (g > 0)))
        step = np.zeros_like(theta)
        step[free] = -np.linalg.solve(H[np.ix_(free, free)], g[free])
        gains.append(float(0.5 * g @ step))
        log(
            f"  hyperparameters {it}: "
            + ", ".join(f"{n}={x:.3g}" for n, x in zip(NAMES, theta))
            + f"; predicted gain {gains[-1]:.3g} nats (CG {cg[-1]} steps, <= {max(cg)}; {len(cg)} gradients; "
            f"{time.perf_counter() - t0:.1f}s)"
        )
        if gains[-1] < o["gain"] or len(cg) >= o["max_gradients"]:
            break
        step *= min(1.0, o["max_step"] / np.max(np.abs(step)))
        new, g_new, z, probes = _line_search(
            theta, g, step, lo, hi, lambda t, z: _gradient(t, data, rad, noise, z, o), z
        )
        cg.extend(probes)
        s_, y_ = (new - theta) * moving, -(g_new - g) * moving  # BFGS on B = -H (positive definite)
        B = -H
        if s_ @ y_ > 1e-12 * np.linalg.norm(s_) * np.linalg.norm(y_):
            Bs = B @ s_
            B = B - np.outer(Bs, Bs) / (s_ @ Bs) + np.outer(y_, y_) / (s_ @ y_)
        H = _negative_definite(-B)
        theta, g = new, g_new
        path.append(theta.tolist())
    cov = np.zeros_like(H)
    cov[np.ix_(moving, moving)] = np.linalg.inv(-H[np.ix_(moving, moving)])  # Laplace, the fixed ones exact
    return {
        "theta": theta.tolist(),
        "theta_sd": np.sqrt(np.diag(cov)).tolist(),
        "theta_cov": cov.tolist(),
        "gradient": g.tolist(),
        "predicted_gain": gains[-1],
        "names": list(NAMES),
        "bounds": [list(b) for b in bounds],
        "at_bound": [
            NAMES[i] for i in range(len(NAMES)) if min(theta[i] - lo[i], hi[i] - theta[i]) < 1e-3 * (hi[i] - lo[i])
        ],
        "path": path,
        "cg_steps": cg,
        "gradient_evaluations": len(cg),
        "seconds": time.perf_counter() - t0,
        "options": o,
    }


# -- the posterior sky -----------------------------------------------------------------------------


def posterior(
    theta: Any,
    data: Data,
    rad: Radial,
    functionals: np.ndarray,
    pairs: int = 16,
    seed: int = 1,
    iters: int = 1000,
    tol: float = 0.01,
) -> dict:
    """The posterior given ``theta`` on the latent grid, from ``pairs`` mirrored exact samples (the
    prior's variance unseen by the data added analytically): per latent pixel the mean sky and its sd
    (``mean``, ``std``: ``(n_lat, n_bins)`` float32), and for each row ``c`` of ``functionals``
    (``(m, n_bins)``, e.g. the bin widths: the distance-integrated column) the posterior mean of
    ``c . sky_p`` and its sd (correlations between bins included): ``fmean``, ``fstd`` (``(n_lat, m)``),
    with their prior sd ``fprior_sd`` (``(m,)``); ``prior_sd`` per bin, the profile ``mu``, CG effort,
    ``seconds`` (the solves' compile, their run, the run per CG step).
    Call under ``jax.enable_x64``."""
    th = jnp.asarray(theta, jnp.float64)
    prior = prior_of(th, rad, data.grid)
    noise = draw_noise(data, jax.random.key(seed), pairs)
    z0 = zeros(data, 1 + pairs)
    jax.block_until_ready((data, noise, z0))  # (so the clocks below time the solves' compile and run alone)
    t0 = time.perf_counter()
    batch = solve_batch(data.grid.size, data.t.shape[-1], pairs)
    solve = solve_all.lower(th, data, rad, noise, z0, iters=iters, tol=tol, batch=batch).compile()
    t1 = time.perf_counter()
    z, k, rel, rot = jax.block_until_ready(solve(th, data, rad, noise, z0))
    seconds = {"compile_s": t1 - t0, "solve_s": time.perf_counter() - t1}
    # a batch takes as many steps as its slowest solve
    steps = int(jnp.max(k)) if batch > 1 else int(jnp.sum(k))
    seconds["per_cg_step_s"] = seconds["solve_s"] / max(1, steps)
    zt, c0 = _split_modes(z, prior.sq.astype(jnp.float32), data.grid.shape)
    zt = jnp.swapaxes(zt.reshape(1 + pairs, -1, data.grid.size), 1, 2)
    c = c0 / data.grid.size  # the sky-wide mode's field (1 + pairs, J)
    C = jnp.asarray(functionals, jnp.float64)
    ratio2 = prior.k0 - 1.0

    def recovery(L: jax.Array, S: jax.Array, E: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``S V L^-T E`` (the bins' mean given the channels), and the variance it leaves unseen per bin
        and per functional."""
        G = jax.scipy.linalg.solve_triangular(L, (S @ rad.V).T, lower=True).T
        unseen = jnp.clip(jnp.diag(S) - jnp.sum(G * G, 1), 0.0)
        unseen_f = jnp.maximum(jnp.einsum("mi,ij,mj->m", C, S, C) - jnp.sum((C @ G) ** 2, 1), 0.0)
        return G @ E, unseen, unseen_f

    G, cond, cond_f = recovery(prior.L, prior.sigma_r, rot[0])
    G0, cond0, cond0_f = recovery(prior.L0, prior.sigma_r0, rot[1])
    cond, cond_f = cond + ratio2 * cond0, cond_f + ratio2 * cond0_f
    G32, G032, mu32 = G.astype(jnp.float32), G0.astype(jnp.float32), prior.mu.astype(jnp.float32)
    mean = mu32 + zt[0] @ G32.T + G032 @ c[0]
    var = jnp.zeros_like(mean)
    for s in range(pairs):  # one sample at a time: no (pairs, n_lat, n_bins) array
        var = var + (zt[1 + s] @ G32.T + G032 @ c[1 + s]) ** 2
    var = var / pairs + cond.astype(jnp.float32)
    CG, CG0 = (C @ G).astype(jnp.float32), (C @ G0).astype(jnp.float32)
    f_dev = np.asarray(zt[1:] @ CG.T + (c[1:] @ CG0.T)[:, None, :], np.float64)  # (pairs, n_lat, m)
    return {
        "mean": np.asarray(mean),
        "std": np.asarray(jnp.sqrt(var)),
        "fmean": _rows_times(mean, np.asarray(functionals, np.float64).T),
        "fstd": np.sqrt(np.mean(f_dev**2, 0) + np.asarray(cond_f)[None, :]),
        "fprior_sd": np.sqrt(np.asarray(jnp.einsum("mi,ij,mj->m", C, prior.variance, C))),
        "prior_sd": np.sqrt(np.asarray(jnp.diag(prior.variance))),
        "mu": np.asarray(prior.mu),
        "cg_iterations": int(jnp.max(k)),
        "cg_steps": int(jnp.sum(k)),
        "cg_error_sd": float(jnp.max(rel)),
        "solve_batch": batch,
        "seconds": seconds,
    }


def nonnegative(mean: np.ndarray, theta: Any, data: Data, rad: Radial) -> tuple[np.ndarray, dict]:
    """The posterior mean made a density: in every latent pixel where ``mean`` dips below zero, the
    non-negative sky nearest to it in that pixel's posterior metric,
    ``argmin_{x >= 0} (x - m_p)^T Q_p (x - m_p)``, ``Q_p = Sigma^-1 + V D_p V^T`` (``Sigma``: the prior's
    covariance of a pixel's bins, :attr:`Prior.variance`; ``V D_p V^T``: what the pixel's lines measure).

    It is the mode of the Gaussian posterior restricted to densities, pixel by pixel (the plane-of-sky
    coupling left out of the metric): mass moves along the line where the data do not see it (what
    ``Q_p`` weighs least) and stays where they do, so the lines' fit and the columns hardly move.
    Clipping the mean at zero instead moved what the lines measure (``far_ring``, ``outside_skies.py``:
    chi2 per line 0.923 -> 21.3); this, 0.923 -> 0.925, and the sky's error 0.61x -> 0.45x the oracle's.
    Where the mean dips below zero near the observer, in front of most stars, the density raises what
    little is there (``families.py``'s ``local_bubble``, the Gaussian map: 0.83x -> 0.85x).
    Each pixel is a non-negative least-squares problem (``scipy.optimize.nnls`` on ``Q_p``'s Cholesky
    factor, Lawson-Hanson: exact). Pixels already non-negative are returned as they are.

    Args:
        mean: the posterior mean, ``(n_lat, n_bins)`` on ``data``'s latent grid, which must hold every
            pixel (``data.grid.factor == 1``).
        theta: the hyperparameters (:data:`NAMES`).
        data: the per-pixel statistics (``D``: ``(n_lat, J, J)``).
        rad: the radial geometry (``V``: ``(n_bins, J)``).

    Returns:
        ``(sky, info)``: the non-negative sky (``mean``'s shape and dtype) and ``{"pixels": the pixels
        moved, "cells": the cells below zero before, "seconds"}``.

    Raises:
        ValueError: when the latent grid is coarsened, or ``mean`` is not ``(n_lat, n_bins)``.

    Example:
        >>> with jax.enable_x64(True):
        ...     rad = Radial.of(np.array([40.0, 100.0, 300.0]), np.eye(2))  # two bins, each seen alone
        >>> data = Data(D=np.zeros((1, 2, 2)), t=np.zeros((1, 2)), yy=np.array(0.0),
        ...             log_norm=np.array(0.0), grid=grid_for(1, 1, 1))
        >>> theta = np.array([0.0, 0, 0, 0, -5, 0, 0, np.log(1e-3), 0, 0])  # bins nearly independent
        >>> sky, info = nonnegative(np.array([[1.0, -0.5]]), theta, data, rad)
        >>> np.round(sky, 6), info["cells"]  # no data: the prior's metric, nearly diagonal
        (array([[1., 0.]]), 1)
    """
    from scipy.optimize import nnls

    t0 = time.perf_counter()
    n_lat, n_bins = data.grid.size, rad.V.shape[0]
    if data.grid.factor != 1:
        raise ValueError(f"nonnegative holds every pixel: the latent grid is coarsened {data.grid.factor}-fold")
    if mean.shape != (n_lat, n_bins):
        raise ValueError(f"mean: expected the latent grid's (n_lat, n_bins) = ({n_lat}, {n_bins}), got {mean.shape}")
    with jax.enable_x64(True), jax.default_device(host()):
        S = np.asarray(prior_of(jnp.asarray(theta, jnp.float64), rad, data.grid).variance)
    w, E = np.linalg.eigh(0.5 * (S + S.T))
    S_inv = (E / np.maximum(w, 1e-12 * w.max())) @ E.T  # (a direction the prior rounds to zero: pinned)
    V = np.asarray(rad.V, np.float64)
    out = np.array(mean, copy=True)
    below = mean < 0
    moved = np.flatnonzero(np.any(below, axis=1))
    D = np.asarray(jnp.asarray(data.D)[moved], np.float64)  # (one gather: the statistics may sit on a device)
    for p, Dp in zip(moved, D):
        Q = S_inv + V @ Dp @ V.T
        R = np.linalg.cholesky(0.5 * (Q + Q.T)).T
        m = np.asarray(mean[p], np.float64)
        out[p] = nnls(R, R @ m, maxiter=50 * n_bins)[0]
    return out, {"pixels": int(moved.size), "cells": int(np.sum(below)), "seconds": time.perf_counter() - t0}


# -- the whole reconstruction ---------------------------------------------------------------------


def _pixel_evidence_fit(
    data: Data, rad: Radial, theta0: np.ndarray, bounds: list, free: tuple, steps: int = 40, log: Callable = print
) -> np.ndarray:
    """Maximise :func:`pixelwise_evidence` over the hyperparameters named in ``free``, the others held
    at ``theta0``: :func:`_bounded_newton_step` on the Hessian (central differences of the exact
    gradient), at most 1 in every coordinate, halved until the evidence rises; the step count,
    gradients and seconds are logged. Call under ``jax.enable_x64``."""
    idx = np.array([NAMES.index(n) for n in free])
    lo, hi = np.array([bounds[i][0] for i in idx]), np.array([bounds[i][1] for i in idx])
    base = jnp.asarray(theta0, jnp.float64)

    def f(x):
        return pixelwise_evidence(base.at[idx].set(x), data, rad)

    fj = jax.jit(f)
    fg = jax.jit(jax.value_and_grad(f))
    count = {"steps": 0, "gradients": 0, "values": 0}
    t0 = time.perf_counter()

    def grad(x: np.ndarray) -> np.ndarray:
        count["gradients"] += 1
        return np.asarray(jax.block_until_ready(fg(jnp.asarray(x)))[1], np.float64)

    def fgh(x: np.ndarray) -> tuple:
        """The value, gradient and Hessian (central differences of the exact gradient, step 1e-4)."""
        count["gradients"] += 1
        v, g = jax.block_until_ready(fg(jnp.asarray(x)))
        H = np.stack([(grad(x + e) - grad(x - e)) / 2e-4 for e in 1e-4 * np.eye(x.size)])
        return float(v), np.asarray(g, np.float64), 0.5 * (H + H.T)

    x = np.clip(np.asarray(theta0, np.float64)[idx], lo, hi)
    v, g, H = fgh(x)
    if not (np.isfinite(v) and np.all(np.isfinite(g)) and np.all(np.isfinite(H))):
        D = np.asarray(data.D, np.float64)
        low = np.linalg.eigvalsh(0.5 * (D + np.swapaxes(D, 1, 2))).min(1) / np.abs(D).max((1, 2)).clip(1e-300)
        raise FloatingPointError(
            f"the pixel-by-pixel evidence is not finite at its start ({dict(zip(free, x.round(3)))}: value {v}, "
            f"gradient {g}); the data's D_p: smallest eigenvalue relative to the largest entry {low.min():.3g}"
        )
    for _ in range(steps):
        step = _projected_step(H, g, x, lo, hi)
        for _ in range(30):
            new = np.clip(x + step, lo, hi)
            count["values"] += 1
            v_new = float(fj(jnp.asarray(new)))
            if np.isfinite(v_new) and v_new >= v:
                break
            step = step / 2
        else:
            break
        gain, x = v_new - v, new
        count["steps"] += 1
        v, g, H = fgh(x)
        if gain < 1e-3:
            break
    log(
        f"  pixel-by-pixel evidence {v:.1f}: "
        + ", ".join(f"{n}={t:.3g}" for n, t in zip(free, x))
        + f" ({count['steps']} Newton steps, {count['gradients']} gradients, {count['values']} values; "
        f"{time.perf_counter() - t0:.1f}s)"
    )
    out = np.array(theta0, np.float64)
    out[idx] = x
    return out


#: the hyperparameters the pixel-by-pixel evidence learns (:func:`reconstruct`'s first stage). Not ``a``:
#: the zero mode (a Gaussian process along the line with ``ell_r`` of several kpc, nearly a constant
#: there) moves the mean profile's level as ``a`` does, and the field's sd is ``amp mu``, so the
#: evidence is nearly flat along ``a`` up, ``amp`` down. With ``a`` free the fit ran along that
#: ridge at 54M lines (40 Newton steps, its cap: ``a`` 2.65 from -1.06, ``amp`` 0.01, the mean 47x
#: the lines' and the zero mode cancelling it), and the full fit's CG then took 1000 steps. Held at
#: the lines' best log-quadratic profile, the same statistics take 9 steps to ``amp`` 0.43, and the
#: default catalog's and 13.24M lines' evidence is as high as with ``a`` free (0.3 nats higher at
#: the default size, where the free fit stopped on the ridge).
PIXEL_FREE = ("b", "c", "log_amp", "log_amp0", "log_ell_r", "q2", "floor")

#: the bounds that are an answer, not the edge of a search range, by name: (lower, upper) with True for
#: an answer; :func:`at_bounds` warns of the others. ``q2 = 0`` is the model without the short radial
#: component (the two smooth-profile truths learn it); ``floor = 0`` the sky-wide mode's sd proportional
#: to the profile
ANSWER_BOUNDS = {"q2": (True, False), "floor": (True, False)}

#: what the posterior's summaries may be trusted for: a pixel's column is "constrained" when the data
#: cut its prior sd by at least this factor
CONSTRAINED = 2.0


def at_bounds(theta: np.ndarray, bounds: list) -> list:
    """The hyperparameters within 1e-3 of their range of a bound, for the fit's warnings; not at a bound
    that :data:`ANSWER_BOUNDS` names (``q2 = 0``, the model without the short radial component, and
    ``floor = 0``)

    Example:
        >>> at_bounds(np.zeros(len(NAMES)), [(0.0, 1.0)] * len(NAMES))
        ['a', 'b', 'c', 'log_amp', 'log_amp0', 'log_ell_xy', 'log_slope', 'log_ell_r']
    """
    near = []
    for n, t, (a, b) in zip(NAMES, theta, bounds):
        answer_lo, answer_hi = ANSWER_BOUNDS.get(n, (False, False))
        if (not answer_lo and t - a < 1e-3 * (b - a)) or (not answer_hi and b - t < 1e-3 * (b - a)):
            near.append(n)
    return near


def reconstruct(
    cat: Catalog,
    response: str = "standard",
    *,
    samples: int = 32,
    chunk: int = 8192,
    learn_gradients: int = LEARN["max_gradients"],
    layout: str = "auto",
    log: Callable = print,
    keep: dict | None = None,
) -> dict:
    """The 3-D prior's reconstruction of ``cat`` seen through ``response``, from the catalog alone.

    Compresses the lines onto the radial basis (:func:`radial_basis`, :func:`truncate`), learns
    ``theta``: first the radial hyperparameters but ``a`` (:data:`PIXEL_FREE`) by the exact pixel-by-pixel evidence
    (:func:`pixelwise_evidence`), then all but the mean profile's by the full model's evidence
    (:func:`fit_hyperparameters`, at most ``learn_gradients`` stochastic gradients; 0: skip), and
    solves the posterior with ``samples`` samples (rounded up to pairs; at least 2).

    Args:
        cat: the catalog (``catalog.Catalog``).
        response: ``"standard"`` or ``"seed"`` (``los.RESPONSES``).
        samples: posterior samples (mirrored pairs) for the sd.
        chunk: lines per chunk of the chunked passes over the lines.
        learn_gradients: the most stochastic gradients of the full evidence (0: the pixel-by-pixel fit only).
        layout: ``layout=`` of the latent operators over the lines (``chunkop.RowOperator``).
        log: where progress lines go.
        keep: when given, gains what the posterior was solved from, for more solves at other
            ``theta`` (:func:`posterior`; ``examples/astro_los/hyper_oracle.py``): ``"data"``, ``"rad"``,
            ``"functionals"`` (the column's and the weighted column's bin weights), ``"theta"``, ``"bounds"``.

    Returns:
        ``{"mean", "std"}`` (``(n_pix, n_bins)`` float32), ``column``, ``column_std``, ``wcolumn``,
        ``wcolumn_std`` (``(n_pix,)``: the distance-integrated and ``1/r^2``-weighted columns, sd from
        the samples, bin correlations included), ``column_prior_sd`` (``(n_pix,)``), ``prior_sd`` and
        ``mu`` (``(n_bins,)``), ``hyper`` (the learned ``theta`` and the fit's record), ``basis``
        (the radial basis' record), ``posterior`` (CG effort) and ``timings`` (seconds of the stages:
        the lines' compression and truncation, the mean profile's start, the sufficient statistics,
        the hyperparameters, the posterior; and per iteration, compiles included: per stochastic
        gradient of the evidence, per CG step of the posterior's solves).
    """
    t0 = time.perf_counter()
    V, sv = radial_basis(cat, response)
    V = V[:, : basis_kept(cat.n_los, cat.n_bins)]
    timing = {"radial_basis_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    passes: dict = {}
    g, w1, stats = compress_lines(cat, V, response, chunk, passes)
    timing["compress_lines_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    J, trunc = truncate(stats, cat.n_los, _level(cat, w1))
    V, g = V[:, :J], np.ascontiguousarray(g[:, :J])
    timing["truncate_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    V, g = with_profile_vectors(cat, V, g, response, chunk, passes)
    timing["profile_vectors_s"] = time.perf_counter() - t1
    timing.update({f"line_passes_{k}_s": v for k, v in passes.items()})
    log(
        f"radial basis: {J} of {cat.n_bins} vectors and {V.shape[1] - J} for the mean profile "
        f"(singular values {', '.join(f'{v:.2g}' for v in sv[:4])}, ...; "
        f"truncation moves a line by <= {trunc['max_sigma']:.2f} noise sd on a rough sky, "
        f"rms {trunc['rms_sigma']:.2f}; " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in timing.items()) + ")"
    )
    # the passes over the lines run on the default device (an accelerator's, where there is one), the
    # latent grid's float64 algebra on the host (:func:`host`)
    lines_device, latent = jax.devices()[0], host()

    def data_on_latent(grid: Grid) -> Data:
        with jax.default_device(lines_device):
            data = jax.device_put(data_on(cat, g, grid, chunk, layout), latent)
        # every platform alike: D_p indefinite beyond rounding made semi-definite (nearest_psd; data_on's
        # float64-added blocks leave them semi-definite to rounding). Until session 28 an accelerator's
        # were all projected in float32, which was itself the 54M run's loss (benchmarks/RESULTS.md)
        D, replaced = nearest_psd(data.D)
        if replaced:
            log(f"  {replaced} latent pixels' D_p indefinite beyond rounding: made semi-definite (nearest_psd)")
        return eqx.tree_at(lambda d: d.D, data, D)

    with jax.enable_x64(True), jax.default_device(latent):
        rad = Radial.of(cat.edges, V)
        t1 = time.perf_counter()
        theta0, bounds = start_and_bounds(cat, g, rad)
        timing["mean_profile_s"] = time.perf_counter() - t1
        learn_grid = grid_for(cat.nx, cat.ny, MAX_LEARN)
        t1 = time.perf_counter()
        data = data_on_latent(learn_grid)
        timing["data_on_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        theta = _pixel_evidence_fit(data, rad, theta0, bounds, PIXEL_FREE, log=log)
        fit = {"pixelwise_theta": theta.tolist()}
        timing["pixel_evidence_s"] = time.perf_counter() - t1
        if learn_gradients > 0:
            fit.update(fit_hyperparameters(data, rad, theta, bounds, log=log, max_gradients=learn_gradients))
            theta = np.asarray(fit["theta"])
            timing["per_hyper_gradient_s"] = fit["seconds"] / fit["gradient_evaluations"]
        timing["hyperparameters_s"] = time.perf_counter() - t1
        pairs = max(1, -(-samples // 2))
        post_grid = posterior_grid(cat.nx, cat.ny, V.shape[1], pairs)  # (the profile's vectors included)
        if post_grid != learn_grid:
            t1 = time.perf_counter()
            data = data_on_latent(post_grid)
            timing["data_on_s"] += time.perf_counter() - t1
        db = np.diff(cat.edges)
        dib = 1.0 / cat.edges[:-1] - 1.0 / cat.edges[1:]
        t1 = time.perf_counter()
        functionals = np.stack([db, dib])
        post = posterior(theta, data, rad, functionals, pairs=pairs)
        if keep is not None:
            keep.update(data=data, rad=rad, functionals=functionals, theta=theta, bounds=bounds)
        timing["posterior_s"] = time.perf_counter() - t1
        timing.update({f"posterior_{k}": v for k, v in post["seconds"].items()})
    blocks = "every pixel" if post_grid.factor == 1 else f"blocks of {post_grid.factor} x {post_grid.factor} pixels"
    how = "at once" if post["solve_batch"] > 1 else "one at a time"
    log(
        f"posterior on {post_grid.shape[0]} x {post_grid.shape[1]} latent pixels ({blocks}): {1 + pairs} solves "
        f"{how}, CG <= {post['cg_iterations']} steps each"
    )
    lat = post_grid.of_pixel(np.arange(cat.n_pix)) if post_grid.factor > 1 else slice(None)  # (no copy)
    at_bound = at_bounds(theta, bounds)
    hyper = {
        "names": list(NAMES),
        "theta": [float(t) for t in theta],
        "bounds": [list(map(float, b)) for b in bounds],
        "at_bound": at_bound,
        "amp": float(np.exp(theta[3])),
        "amp0": float(np.exp(theta[4])),
        "ell_pixels": float(np.exp(theta[5])),
        "slope": float(np.exp(theta[6])),
        "ell_r_pc": float(np.exp(theta[7])),
        "q": float(np.sqrt(theta[8])),
        "floor": float(theta[9]),
        "latent_factor": post_grid.factor,
        "learn_factor": learn_grid.factor,
        "fit": {k: v for k, v in fit.items() if k not in ("theta_cov", "options")},
    }
    log("stages: " + ", ".join(f"{k[:-2]} {v:.3g}s" for k, v in timing.items()))
    log(
        "learned: "
        + ", ".join(f"{n}={t:.3g}" for n, t in zip(NAMES, theta))
        + f" (field sd {hyper['amp']:.2f} x mean, along the line {hyper['ell_r_pc']:.0f} pc and {SHORT_PC:.0f} pc "
        f"with q {hyper['q']:.2f}, on the sky "
        f"{hyper['ell_pixels']:.1f} px; the sky-wide mode's sd floor {hyper['floor']:.2f} x mean; "
        f"{time.perf_counter() - t0:.1f}s)"
    )
    return {
        "mean": post["mean"][lat],
        "std": post["std"][lat],
        "column": post["fmean"][lat, 0],
        "column_std": post["fstd"][lat, 0],
        "wcolumn": post["fmean"][lat, 1],
        "wcolumn_std": post["fstd"][lat, 1],
        "column_prior_sd": np.full(cat.n_pix, post["fprior_sd"][0]),
        "prior_sd": post["prior_sd"],
        "mu": post["mu"],
        "hyper": hyper,
        "basis": {
            "J": J,
            "profile_vectors": V.shape[1] - J,
            "singular_values_rel": [float(v) for v in sv[:8]],
            **trunc,
        },
        "posterior": {k: post[k] for k in ("cg_iterations", "cg_steps", "cg_error_sd", "solve_batch")}
        | {"samples": samples},
        "timings": timing,
    }


def _rows_times(a: jax.Array, b: np.ndarray, block: int = 1 << 16) -> np.ndarray:
    """``a @ b`` in float64, a block of ``a``'s rows at a time (no float64 copy of all of ``a``: 3.2 GB
    for the users' 786432 x 516 sky)."""
    return np.concatenate([np.asarray(a[sl], np.float64) @ b for sl in blocks(a.shape[0], block)])


def _level(cat: Catalog, m: np.ndarray) -> float:
    """A rough mean density: the least-squares level of a flat sky, ``sum y m / sum m^2`` with ``m_l`` the
    line's prediction for a density of 1 everywhere (``w_l . 1``, from :func:`compress_lines`)."""
    iv = 1.0 / cat.sigma.astype(np.float64) ** 2
    return float(max(np.sum(cat.y * m * iv) / np.sum(m * m * iv), 1e-30))
