"""The line-of-sight (LOS) operator of the astrophysics users, and a synthetic problem to invert.

The sky is an array of shape ``(n_pix, n_bins)``: plane-of-sky pixels x radial (distance)
bins with edges ``b`` (``b = geomspace(40, 1700, n_bins + 1)`` by default). A line of sight ``l``
looks through pixel ``pix[l]`` at a star at distance ``d[l]`` with distance uncertainty ``s[l]``
and measures ``y_l = sum_k w_k(d_l, s_l) * sky[pix_l, k]``, with one of two responses:

* ``"standard"`` (the published 3-D dust maps'): the extinction to a star is the density
  integrated up to the star, averaged over the star's distance uncertainty (a lognormal of
  median ``d`` and log-sd ``s / d``; ``s`` is the distance's standard deviation in pc)::

      w_k = (b_{k+1} - b_k) * S(sqrt(b_k b_{k+1})),   S(r) = erfc((ln r - ln d) / (sqrt(2) s / d)) / 2;

* ``"seed"`` (the users' first formula, literally; the benchmark kernel)::

      w = -diff(exp(-(d - b) / (d * s * b))).

  With the users' ``s = 0.1 d`` every line's weight vector has the same shape (``los_weights``):
  such lines measure one ``1/r^2``-weighted column per pixel.

``make_los_operator`` builds either as a :class:`chunkop.RowOperator` whose rows are
``{"pix", "d", "s"}`` and whose ``row_fn`` reads ``sky[row["pix"]]`` (so the row layout can be
windowed): the ``n_los x n_bins`` weights are recomputed chunk by chunk and never stored, and
``d`` / ``s`` are differentiable.

Numerics of the seed formula: ``exp(-(d - b) / (d s b))`` is within about 1% of 1 over the whole
range, so the literal ``-diff(exp(...))`` in float32 loses a median 0.5% of each weight to
cancellation at 516 bins (18% at the 99th percentile; the far, small bins can be off by 2x). The
seed weights here use the algebraically identical

    w_k = -exp(u_k) * expm1((1/b_k - 1/b_{k+1}) / s),   u_k = (1/d - 1/b_k) / s,

with ``1/b_k - 1/b_{k+1}`` precomputed in float64: full float32 accuracy
(``los_weights_naive`` keeps the literal form for comparison).

``make_problem(size)`` generates a deterministic synthetic problem, no downloads: a smooth
log-normal sky on an ``nx x ny`` plane-of-sky grid (a radial density profile, times a smooth
2-D Gaussian random field, times a few compact "clouds" at given distances), lines of sight and
noisy data. With the standard response the stars are those of a magnitude-limited catalog
(counts growing as ``d^2`` out to the edge, ``draw_stars``); with the seed response, the users'
toy lines (``draw_lines``). Sizes: ``tiny`` (tests), ``default`` (the README's main job, about half a
minute) and ``seed`` (the users' size: 786432 x 516 sky, 132400 lines).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import chunkop

R_MIN, R_MAX = 40.0, 1700.0
#: the two responses (module docstring): ``"standard"`` (the published maps'), ``"seed"`` (the users'
#: literal first formula, the benchmark kernel and :func:`make_los_operator`'s default)
RESPONSES = ("standard", "seed")

__all__ = [
    "RESPONSES",
    "SIZES",
    "Problem",
    "bin_edges",
    "standard_weights",
    "response_weights",
    "los_weights",
    "los_weights_naive",
    "make_los_operator",
    "gram_diagonal",
    "with_rows",
    "los_vmap",
    "draw_lines",
    "draw_stars",
    "make_problem",
    "true_sky",
]


# -- the operator -------------------------------------------------------------------------------


def bin_edges(n_bins: int = 516, bounds: tuple[float, float] = (R_MIN, R_MAX)) -> np.ndarray:
    """The radial bin edges ``geomspace(lo, hi, n_bins + 1)`` (float64)."""
    return np.geomspace(bounds[0], bounds[1], n_bins + 1)


def standard_weights(d: jax.Array, s: jax.Array, edges: np.ndarray) -> jax.Array:
    """The standard response for one line: ``w_k = (b_{k+1} - b_k) S(sqrt(b_k b_{k+1}))``, ``S`` the
    survival function of a lognormal distance of median ``d`` and log-sd ``s / d``,
    ``S(r) = erfc((ln r - ln d) / (sqrt(2) s / d)) / 2``.

    ``sum_k w_k sky_k`` is then the density integrated from the first edge up to the star, averaged
    over the star's distance uncertainty (bin by bin, at the bin's geometric centre). The bin
    centres' logarithms and the widths are float64 constants. Broadcasts like :func:`los_weights`.

    Args:
        d: the star's distance (pc), any shape ``S``.
        s: the sd of that distance (pc), shape ``S``.
        edges: the ``n_bins + 1`` bin edges (pc).

    Returns:
        The weights, shape ``S + (n_bins,)``, in the dtype of ``d`` and ``s``.
    """
    edges = np.asarray(edges, np.float64)
    dtype = jnp.result_type(d, s)
    log_r = jnp.asarray(0.5 * (np.log(edges[:-1]) + np.log(edges[1:])), dtype)
    width = jnp.asarray(np.diff(edges), dtype)
    d, s = jnp.asarray(d)[..., None], jnp.asarray(s)[..., None]
    z = (log_r - jnp.log(d)) * (d / (np.sqrt(2.0) * s))
    return width * (0.5 * jax.scipy.special.erfc(z))


def response_weights(d: jax.Array, s: jax.Array, edges: np.ndarray, response: str = "standard") -> jax.Array:
    """The weights of ``response`` (``"standard"``: :func:`standard_weights`; ``"seed"``: :func:`los_weights`)."""
    if response == "standard":
        return standard_weights(d, s, edges)
    if response == "seed":
        return los_weights(d, s, edges)
    raise ValueError(f"response must be one of {RESPONSES}, got {response!r}")


def los_weights(d: jax.Array, s: jax.Array, edges: np.ndarray) -> jax.Array:
    """The seed response ``w = -diff(exp(-(d - b) / (d s b)))`` for one line (scalars ``d``, ``s``),
    cancellation-free.

    Uses ``-(f_{k+1} - f_k) = -f_k * expm1(u_{k+1} - u_k)`` with ``f = exp(u)``,
    ``u = (1/d - 1/b) / s``; the bin-width term ``1/b_k - 1/b_{k+1}`` is a float64 constant.
    Broadcasts: ``d`` and ``s`` of shape ``S`` give weights of shape ``S + (n_bins,)``.
    """
    edges = np.asarray(edges, np.float64)
    dtype = jnp.result_type(d, s)
    inv_lo = jnp.asarray(1.0 / edges[:-1], dtype)
    dinv = jnp.asarray(1.0 / edges[:-1] - 1.0 / edges[1:], dtype)  # > 0
    d, s = jnp.asarray(d)[..., None], jnp.asarray(s)[..., None]
    u = (1.0 / d - inv_lo) / s
    return -jnp.exp(u) * jnp.expm1(dinv / s)


def los_weights_naive(d: jax.Array, s: jax.Array, edges: np.ndarray) -> jax.Array:
    """The users' literal formula ``-diff(exp(-(d - b) / (d * s * b)))`` (loses precision in float32)."""
    d, s = jnp.asarray(d)[..., None], jnp.asarray(s)[..., None]
    b = jnp.asarray(edges, jnp.result_type(d, s))
    return -jnp.diff(jnp.exp(-(d - b) / (d * s * b)), axis=-1)


def _row_fns(edges: np.ndarray, response: str = "seed"):
    """``(row_fn, squared_row_fn)`` of ``response`` for these edges.

    No cache is needed: ``RowOperator`` traces ``row_fn`` when it is built, and the arrays it
    derives from ``edges`` become the operator's ``consts``; operators with the same number of
    bins trace to the same jaxpr and share compiled kernels (and jitted functions taking them as
    arguments do not retrace).
    """
    edges = np.asarray(edges, np.float64)
    if response not in RESPONSES:
        raise ValueError(f"response must be one of {RESPONSES}, got {response!r}")

    def row_fn(row: dict, sky: jax.Array) -> jax.Array:
        return jnp.dot(response_weights(row["d"], row["s"], edges, response), sky[row["pix"]])

    def squared_row_fn(row: dict, sky: jax.Array) -> jax.Array:
        return jnp.dot(response_weights(row["d"], row["s"], edges, response) ** 2, sky[row["pix"]])

    return row_fn, squared_row_fn


def make_los_operator(
    idx: Any,
    d: Any,
    s: Any,
    *,
    n_pix: int,
    n_bins: int | None = None,
    bounds: tuple[float, float] = (R_MIN, R_MAX),
    edges: np.ndarray | None = None,
    chunk_size: int = 4096,
    dtype: Any = jnp.float32,
    progress: Any = None,
    response: str = "seed",
    layout: str = "auto",
) -> chunkop.RowOperator:
    """The LOS operator ``sky (n_pix, n_bins) -> y (n_los,)`` as a :class:`chunkop.RowOperator`.

    Args:
        idx: ``(n_los,)`` int pixel index of every line.
        d, s: ``(n_los,)`` distance and distance uncertainty of every line (differentiable).
        response: ``"standard"`` or ``"seed"`` (the module docstring); ``"seed"``, the users' literal
            weights, is the default here because it is the benchmark kernel (``benchmarks/``); the
            example's CLI defaults to ``"standard"``.
        n_pix: number of plane-of-sky pixels (the sky's first axis).
        n_bins, bounds: radial bins ``geomspace(*bounds, n_bins + 1)``; or give ``edges``.
        chunk_size: lines computed at once (memory ~ ``chunk_size * n_bins`` floats per array).
        progress: ``progress=`` of :class:`chunkop.RowOperator` (True: a bar per kernel call).
        layout: ``layout=`` of :class:`chunkop.RowOperator`: ``"auto"`` sorts the lines and keeps the
            windowed layout where this platform's measurements say it wins; ``"plain"`` skips that
            sort (once per operator), which a one-shot run over many lines may not repay
            (``reconstruct.py --layout``); ``"windowed"`` forces the windows.

    Operators with the same number of bins share compiled kernels (the edges are array leaves of
    the operator, so jitted functions taking them as arguments compile once).
    ``gram_diagonal(A, edges)`` gives the Jacobi preconditioner.
    """
    if edges is None:
        edges = bin_edges(516 if n_bins is None else n_bins, bounds)
    edges = np.asarray(edges, np.float64)
    if n_bins is not None and n_bins != edges.size - 1:
        raise ValueError(f"n_bins={n_bins} does not match {edges.size} edges")
    row_fn, _ = _row_fns(edges, response)
    rows = {"pix": jnp.asarray(idx, jnp.int32), "d": jnp.asarray(d, dtype), "s": jnp.asarray(s, dtype)}
    return chunkop.RowOperator(
        row_fn,
        rows,
        jax.ShapeDtypeStruct((n_pix, edges.size - 1), dtype),
        chunk_size=chunk_size,
        progress=progress,
        layout=layout,
    )


def gram_diagonal(A: chunkop.RowOperator, edges: np.ndarray, response: str = "seed") -> jax.Array:
    """``diag(A^T A)`` of a LOS operator of ``response``: one chunked transposed matvec of the squared weights."""
    _, squared_row_fn = _row_fns(edges, response)
    return chunkop.gram_diagonal(A, squared_row_fn=squared_row_fn)


def with_rows(A: chunkop.RowOperator, **rows: Any) -> chunkop.RowOperator:
    """``A`` with some row leaves replaced (e.g. ``s=alpha * s``): the same operator with new
    ``rows`` leaves (``RowOperator.with_rows``: no new trace of ``row_fn``, no new sort of the
    lines; differentiable in the new leaves)."""
    return A.with_rows({**A.rows, **rows})


def los_vmap(
    idx: jax.Array, d: jax.Array, s: jax.Array, sky: jax.Array, edges: np.ndarray, response: str = "seed"
) -> jax.Array:
    """The unchunked reference: ``jax.vmap`` over all lines (materialises ``n_los x n_bins``)."""
    w = response_weights(d, s, edges, response)  # (n_los, n_bins)
    return jnp.sum(w * sky[idx], axis=-1)


# -- the synthetic problem ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
    nx: int  # plane-of-sky grid: n_pix = nx * ny
    ny: int
    n_bins: int
    n_los: int
    chunk: int
    iters: int  # CG iterations (cap)


SIZES = {
    "tiny": Size(nx=12, ny=8, n_bins=24, n_los=6_000, chunk=1024, iters=80),
    "default": Size(nx=64, ny=48, n_bins=96, n_los=131_072, chunk=8192, iters=150),
    # the users' size: 786432 = 1024 * 768 pixels, 516 bins, 132400 lines
    "seed": Size(nx=1024, ny=768, n_bins=516, n_los=132_400, chunk=8192, iters=5),
}


@dataclasses.dataclass
class Problem:
    size: str
    nx: int
    ny: int
    edges: np.ndarray  # (n_bins + 1,) float64
    pix: jax.Array  # (n_los,) int32
    d: jax.Array  # (n_los,) float32
    s: jax.Array  # (n_los,) float32
    y: jax.Array  # (n_los,) noisy data
    sigma: float  # noise standard deviation
    prior_mean: jax.Array  # (n_bins,): the sky's prior mean, per radial bin
    field: dict  # parameters of the true sky (see true_sky)
    chunk: int
    iters: int
    response: str = "standard"

    @property
    def n_pix(self) -> int:
        return self.nx * self.ny

    @property
    def n_bins(self) -> int:
        return self.edges.size - 1

    @property
    def n_los(self) -> int:
        return int(self.pix.shape[0])

    @property
    def centres(self) -> np.ndarray:
        return np.sqrt(self.edges[:-1] * self.edges[1:])

    def operator(self, chunk_size: int | None = None, layout: str = "auto") -> chunkop.RowOperator:
        return make_los_operator(
            self.pix,
            self.d,
            self.s,
            n_pix=self.n_pix,
            edges=self.edges,
            chunk_size=chunk_size or self.chunk,
            response=self.response,
            layout=layout,
        )

    def truth(self) -> jax.Array:
        """The true sky, ``(n_pix, n_bins)`` float32 (recomputed on each call: 1.6 GB at seed size)."""
        return true_sky(self.field)


def draw_lines(n_los: int, n_pix: int, rng: np.random.Generator, d_sigma: float = 1.0, s_frac: float = 0.1):
    """The users' lines: uniform random pixels; ``d`` log-normal around ``sqrt(1700)`` (log-sd
    ``d_sigma``) clipped to [40, 1700]; ``s = s_frac * d``."""
    pix = rng.integers(0, n_pix, n_los).astype(np.int32)
    d = np.clip(np.exp(rng.normal(np.log(np.sqrt(R_MAX)), d_sigma, n_los)), R_MIN, R_MAX)
    return pix, d.astype(np.float32), (s_frac * d).astype(np.float32)


def draw_stars(
    n_los: int,
    n_pix: int,
    rng: np.random.Generator,
    bounds: tuple[float, float] = (R_MIN, R_MAX),
    plx_sd_mas: tuple[float, float] = (0.02, 0.1),
    floor: float = 0.03,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stars of a magnitude-limited catalog: uniform random pixels; distances with counts
    growing as ``d^2`` (a uniform density of stars in the volume) out to the far edge;
    ``s`` the distance's sd in pc, ``s / d = hypot(floor, d[kpc] * plx_sd)`` with each star's
    parallax sd ``plx_sd`` (mas) uniform in ``plx_sd_mas`` (a parallax-like error growing with
    distance, above a photometric floor).

    Returns:
        ``(pix, d, s)``: int32 pixels, float32 distances and distance sd (pc), each ``(n_los,)``.
    """
    pix = rng.integers(0, n_pix, n_los).astype(np.int32)
    lo3, hi3 = bounds[0] ** 3, bounds[1] ** 3
    d = (lo3 + rng.uniform(0.0, 1.0, n_los) * (hi3 - lo3)) ** (1.0 / 3.0)
    frac = np.hypot(floor, d / 1000.0 * rng.uniform(*plx_sd_mas, n_los))
    return pix, d.astype(np.float32), (frac * d).astype(np.float32)


def _smooth_field(rng: np.random.Generator, nx: int, ny: int, corr: float) -> np.ndarray:
    """A unit-variance Gaussian random field on an ``nx x ny`` grid, Gaussian-filtered (FFT)."""
    white = rng.standard_normal((nx, ny))
    kx = np.fft.fftfreq(nx)[:, None]
    ky = np.fft.rfftfreq(ny)[None, :]
    filt = np.exp(-0.5 * (2 * np.pi * corr) ** 2 * (kx**2 + ky**2))
    f = np.fft.irfft2(np.fft.rfft2(white) * filt, s=(nx, ny))
    return (f - f.mean()) / f.std()


def _make_field(nx: int, ny: int, edges: np.ndarray, rng: np.random.Generator) -> dict:
    """Parameters of a structured log-normal sky (small arrays only; ``true_sky`` assembles it).

    ``log sky[p, k] = log rho(r_k) + g_sd * g[p] + sum_j a_j * blob_xy_j[p] * blob_r_j[k]``:
    a radial density profile ``rho``, a smooth 2-D field ``g`` (correlation length ~1/8 of the
    grid) and a few clouds, each compact on the sky and in log-distance.
    """
    r = np.sqrt(edges[:-1] * edges[1:])
    rho = 1.0 / (1.0 + (r / 400.0) ** 2)  # a disc-like density falling with distance
    g_sd = 0.5
    g = _smooth_field(rng, nx, ny, corr=max(nx, ny) / 8.0)
    n_clouds = 6
    xs, ys = np.meshgrid(np.arange(nx), np.arange(ny), indexing="ij")
    blob_xy, blob_r, amp = [], [], []
    for _ in range(n_clouds):
        cx, cy = rng.uniform(0, nx), rng.uniform(0, ny)
        w = rng.uniform(0.05, 0.12) * max(nx, ny)
        blob_xy.append(np.exp(-0.5 * ((xs - cx) ** 2 + (ys - cy) ** 2) / w**2).reshape(-1))
        lr = rng.uniform(np.log(60.0), np.log(800.0))
        blob_r.append(np.exp(-0.5 * ((np.log(r) - lr) / 0.25) ** 2))
        amp.append(rng.uniform(0.4, 0.9))
    return {
        "log_rho": np.log(rho).astype(np.float32),
        "g": (g_sd * g).reshape(-1).astype(np.float32),
        "blob_xy": np.stack(blob_xy, 1).astype(np.float32),  # (n_pix, n_clouds)
        "blob_r": (np.array(amp)[:, None] * np.stack(blob_r, 0)).astype(np.float32),  # (n_clouds, n_bins)
        "g_sd": g_sd,
    }


@jax.jit
def _assemble(log_rho, g, blob_xy, blob_r):
    return jnp.exp(log_rho[None, :] + g[:, None] + blob_xy @ blob_r)


def true_sky(field: dict) -> jax.Array:
    """Assemble the true sky from :func:`_make_field`'s parameters (one fused jitted kernel)."""
    return _assemble(field["log_rho"], field["g"], field["blob_xy"], field["blob_r"])


def make_problem(
    size: str = "default",
    *,
    seed: int = 0,
    noise: float = 0.02,
    chunk: int | None = None,
    progress: Any = None,
    response: str = "standard",
    n_los: int | None = None,
    layout: str = "auto",
) -> Problem:
    """A deterministic synthetic LOS problem: true sky, lines of sight, noisy data.

    ``response="standard"``: the stars of a magnitude-limited catalog (:func:`draw_stars`) seen
    through the standard response; ``"seed"``: the users' toy lines (:func:`draw_lines`) through
    their literal weights (the same data as before the standard response was added).
    ``noise`` is the noise standard deviation relative to the rms of the noise-free data.
    ``n_los``: the number of lines (default: the size's); the sky is the size's either way.
    ``layout``: the generating operator's ``layout=`` (:func:`make_los_operator`).
    The prior mean is the sky's mean given only the radial profile: ``rho(r) * E[exp(g)]``.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    cfg = SIZES[size]
    if n_los is not None:
        if int(n_los) < 1:
            raise ValueError(f"n_los must be a positive number of lines, got {n_los!r}")
        cfg = dataclasses.replace(cfg, n_los=int(n_los), chunk=min(cfg.chunk, int(n_los)))
    rng = np.random.default_rng(seed)
    edges = bin_edges(cfg.n_bins)
    field = _make_field(cfg.nx, cfg.ny, edges, rng)
    if response not in RESPONSES:
        raise ValueError(f"response must be one of {RESPONSES}, got {response!r}")
    draw = draw_stars if response == "standard" else draw_lines
    pix, d, s = draw(cfg.n_los, cfg.nx * cfg.ny, rng)
    chunk = chunk or cfg.chunk
    A = make_los_operator(
        pix,
        d,
        s,
        n_pix=cfg.nx * cfg.ny,
        edges=edges,
        chunk_size=chunk,
        progress=progress,
        response=response,
        layout=layout,
    )
    y_clean = jax.jit(lambda op, f: op.mv(true_sky(f)))(A, field)
    sigma = float(noise * jnp.sqrt(jnp.mean(y_clean**2)))
    eps = rng.standard_normal(cfg.n_los).astype(np.float32)
    y = y_clean + sigma * jnp.asarray(eps)
    prior_mean = jnp.asarray(np.exp(field["log_rho"] + 0.5 * field["g_sd"] ** 2), jnp.float32)
    return Problem(
        size=size,
        nx=cfg.nx,
        ny=cfg.ny,
        edges=edges,
        pix=A.rows["pix"],
        d=A.rows["d"],
        s=A.rows["s"],
        y=y,
        sigma=sigma,
        prior_mean=prior_mean,
        field=field,
        chunk=chunk,
        iters=cfg.iters,
        response=response,
    )
