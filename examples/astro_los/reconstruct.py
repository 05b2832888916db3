"""Reconstruct a 3-D sky from line-of-sight integrals with a chunked implicit operator.

    python examples/astro_los/reconstruct.py [--size tiny|default|seed] [--out DIR] [--chunk C] [--iters N]
                                             [--solver channels|data|primal] [--no-fit-s] [--no-figures] [--devices N]

The forward model is the astrophysics users' LOS operator (``los.py``): sky ``(n_pix, n_bins)``,
``y_l = sum_k w_k(d_l, s_l) sky[pix_l, k]`` with ``w = -diff(exp(-(d - b) / (d s b)))``, built as
a ``chunkop.RowOperator`` (weights recomputed chunk by chunk, never stored). Steps:

1. generate a deterministic synthetic problem (structured log-normal sky, random lines, noisy
   data; no downloads) and check the operator (``chunkop.check_linear``);
2. reconstruct the sky as the posterior mean under a Gaussian prior: the sky is
   ``prior_mean * (1 + z)``. Default (``--solver channels``): ``z``'s prior is given by its
   covariance ``S``, matched to how the truth is drawn (a plane-of-sky random field constant
   along the line of sight, plus radial "cloud" modes, each with a stationary plane-of-sky
   covariance applied by FFT), and ``z = S B^T (B S B^T + sigma^2)^-1 (y - A mu)`` is found by CG
   on the whitened channels (``n_pix x 13`` unknowns, a Fourier-block preconditioner: 5 steps)
   or, ``--solver data``, by CG in data space (``n_los`` unknowns, Jacobi: converges too slowly
   beyond the tiny size). No CG step forms a sky. ``--solver primal``: the earlier prior given by
   its precision (Tikhonov + radial and plane-of-sky first differences), ``lineax.CG`` on the
   sky-sized normal equations, Jacobi-preconditioned with ``chunkop.gram_diagonal``;
3. fit a global scale ``alpha`` on the distance uncertainties (``s -> alpha * s``) by Newton
   steps built from ``jax.grad`` and a Hessian-vector product *through the operator's row data*,
   against a known calibration sky (the truth: sky amplitude and ``1/s`` are degenerate in this
   model, so ``alpha`` cannot be fitted jointly with the sky);
4. report the fit: chi2 per line, relative error of the reconstruction and of the baseline (the
   prior mean) vs the truth (also split into the pixels some line looks through and the
   others), CG's iterations and convergence, time, the compiled temp memory of the main jitted
   functions and the process's peak RSS; write PNG figures and ``results.json`` into ``--out``.

``--size seed`` runs the users' full size (786432 x 516 sky = 1.6 GB per float32 copy, 132400
lines): matvec, transpose, the gradient w.r.t. the sky and w.r.t. ``alpha``, one
Hessian-vector product and the reconstruction (about 2 minutes and 4 GiB peak RSS on 2 cores;
see README.md and ``seed_run.json``).

``--devices N`` runs the same job with the operator's rows (``pix``, ``d``, ``s``) sharded along
their leading axis over a mesh ``jax.make_mesh((N,), ("rows",))`` of the first ``N`` of
``jax.devices()``: every device computes its own lines of sight (``A x`` comes back sharded by
rows; ``A^T y`` is one all-reduce of the devices' partial skies), and the rest (CG, the s-scale
fit, the reports) runs unchanged on the replicated sky. The number of lines must be a multiple
of ``N``. On a CPU-only machine the script makes ``N`` host devices: when run as a script (not
when imported) it appends ``--xla_force_host_platform_device_count=N`` to ``XLA_FLAGS`` before
``jax`` is imported, unless ``XLA_FLAGS`` already sets a host device count or ``JAX_PLATFORMS``
names only accelerator platforms. The flag only concerns the host (CPU) platform, so on a
machine with several GPUs it changes nothing there: ``jax.devices()`` lists the GPUs and the
first ``N`` are used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def devices_from_argv(argv: Sequence[str]) -> int | None:
    """The value of ``--devices N`` / ``--devices=N`` in ``argv``, or None (absent or not an integer).

    Read before ``jax`` is imported (argparse validates it again, with its usual messages).
    """
    value = None
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--devices="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def request_host_devices(n: int) -> bool:
    """Ask XLA for ``n`` host (CPU) devices: append the flag to ``XLA_FLAGS``. Must run before ``jax``
    is imported; returns whether it changed ``XLA_FLAGS``.

    Left alone when ``XLA_FLAGS`` already sets a host device count (the user's choice wins) or
    ``JAX_PLATFORMS`` lists only non-CPU platforms (e.g. ``cuda``). The flag only concerns the host
    platform: on a GPU machine the GPUs remain ``jax.devices()``.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if n < 1 or HOST_DEVICE_FLAG in flags or (platforms and "cpu" not in platforms):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICE_FLAG}={n}".strip()
    return True


if __name__ == "__main__" and (_n_devices := devices_from_argv(sys.argv[1:])) is not None:
    request_host_devices(_n_devices)  # JAX reads XLA_FLAGS once, when its backends start

import jax  # noqa: E402  (after XLA_FLAGS is set, see above)
import jax.numpy as jnp  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import los  # noqa: E402

import chunkop  # noqa: E402

GiB, MiB = 2**30, 2**20
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


# -- the regularised normal equations -----------------------------------------------------------


def prior_scales(P: los.Problem) -> dict:
    """Prior standard deviations of ``z`` (relative deviation from the prior mean).

    ``s_z``: amplitude; ``s_r``: step between adjacent radial bins (a random walk of 0.03 per
    square root of a unit of ln r: z is nearly constant along a line of sight, which is what lets
    the data, about one well-measured combination of the radial bins per pixel, say something
    about every bin); ``s_xy``: step between adjacent pixels (a random walk of 1.5 over the grid
    width).
    """
    dlnr = float(np.log(P.edges[1] / P.edges[0]))
    return {"s_z": 0.6, "s_r": 0.03 * np.sqrt(dlnr), "s_xy": 1.5 / np.sqrt(max(P.nx, P.ny))}


def _dtd(z: jax.Array, axis: int) -> jax.Array:
    """``D^T D z`` for the first-difference operator ``D`` along ``axis`` (free ends).

    Written as ``c_i z_i - z_{i-1} - z_{i+1}`` (``c`` = number of neighbours, missing ones are
    zero) from shifted, zero-padded views: XLA fuses it into one loop, no temporaries.
    """
    n = z.shape[axis]
    if n == 1:
        return jnp.zeros_like(z)
    lo, hi = [(0, 0)] * z.ndim, [(0, 0)] * z.ndim
    lo[axis], hi[axis] = (1, 0), (0, 1)
    prev = jnp.pad(jax.lax.slice_in_dim(z, 0, n - 1, axis=axis), lo)
    nxt = jnp.pad(jax.lax.slice_in_dim(z, 1, n, axis=axis), hi)
    shape = [1] * z.ndim
    shape[axis] = n
    c = jnp.asarray(_dtd_diag(n), z.dtype).reshape(shape)
    return c * z - prev - nxt


def _dtd_diag(n: int) -> np.ndarray:
    out = np.full(n, 2.0) if n > 1 else np.zeros(n)
    if n > 1:
        out[0] = out[-1] = 1.0
    return out


def prior_apply(z: jax.Array, P: los.Problem, sc: dict) -> jax.Array:
    """The prior's precision ``R z`` (Tikhonov + radial + plane-of-sky first differences)."""
    out = z / sc["s_z"] ** 2 + _dtd(z, 1) / sc["s_r"] ** 2
    zg = z.reshape(P.nx, P.ny, -1)
    out = out + ((_dtd(zg, 0) + _dtd(zg, 1)) / sc["s_xy"] ** 2).reshape(z.shape)
    return out


def prior_diag(P: los.Problem, sc: dict) -> jax.Array:
    """``diag(R)`` (shape ``(n_pix, n_bins)``), built by broadcasting small vectors."""
    dx, dy, dr = _dtd_diag(P.nx), _dtd_diag(P.ny), _dtd_diag(P.n_bins)
    pix = ((dx[:, None] + dy[None, :]) / sc["s_xy"] ** 2).reshape(-1).astype(np.float32)
    rad = (1.0 / sc["s_z"] ** 2 + dr / sc["s_r"] ** 2).astype(np.float32)
    return jnp.asarray(pix)[:, None] + jnp.asarray(rad)[None, :]


def normal_operator(A: chunkop.RowOperator, P: los.Problem, sc: dict) -> lx.AbstractLinearOperator:
    """``H z = mu (A^T A (mu z)) / sigma^2 + R z`` as a symmetric positive definite lineax operator."""
    mu, inv_var = P.prior_mean, 1.0 / P.sigma**2

    def mv(z: jax.Array) -> jax.Array:
        return mu * A.T.mv(A.mv(mu * z)) * inv_var + prior_apply(z, P, sc)

    return lx.FunctionLinearOperator(mv, A.in_structure(), tags=(lx.symmetric_tag, lx.positive_semidefinite_tag))


def rhs(A: chunkop.RowOperator, P: los.Problem) -> jax.Array:
    """``mu A^T (y - A mu) / sigma^2`` (the normal equations' right-hand side for ``z``)."""
    mu_sky = jnp.broadcast_to(P.prior_mean, A.in_structure().shape)
    return P.prior_mean * A.T.mv(P.y - A.mv(mu_sky)) / P.sigma**2


def jacobi_preconditioner(
    A: chunkop.RowOperator, P: los.Problem, sc: dict, record: Callable | None
) -> lx.AbstractLinearOperator:
    """``kappa * diag(H)^-1``, reporting each residual it is applied to (CG applies it once per step).

    ``kappa`` only rescales CG's internal quantities (the iterates are invariant to it), but
    lineax's CG declares breakdown (returns NaN) when ``<p, H p> <= 100 * n * eps * <r, M r>``:
    a threshold that grows with the problem size ``n``, while ``<p, H p> / <r, M r>`` is a
    Rayleigh quotient of the preconditioned operator, which for smooth directions of the strong
    radial prior is ~1e-5 (the Jacobi diagonal is dominated by ``2 / s_r^2``). With
    ``kappa = 1e9 * n * eps`` the quotient stays ~100x above the threshold; ``solve`` normalises
    the right-hand side to unit norm so the (kappa-scaled) CG scalars stay far from overflow.
    """
    diag = P.prior_mean**2 * los.gram_diagonal(A, P.edges) / P.sigma**2 + prior_diag(P, sc)
    n = int(np.prod(A.in_structure().shape))
    kappa = max(1.0, 1e9 * n * float(jnp.finfo(jnp.float32).eps))
    inv = kappa / diag

    def mv(r: jax.Array) -> jax.Array:
        if record is not None:
            jax.debug.callback(record, jnp.sqrt(jnp.sum(r * r)))
        return inv * r

    return lx.FunctionLinearOperator(mv, A.in_structure(), tags=(lx.symmetric_tag, lx.positive_semidefinite_tag))


class Recorder:
    """Collects ``|r_k|`` from inside the jitted CG loop and prints progress."""

    def __init__(self, every: int):
        self.every, self.res, self.times, self.b_norm = every, [], [], None

    def __call__(self, r_norm: Any) -> None:
        self.res.append(float(r_norm))
        if self.b_norm is None:  # CG starts from 0: the first residual is b itself
            self.b_norm = self.res[0]
        self.times.append(time.perf_counter())
        k = len(self.res) - 1
        if k % self.every == 0:
            rel = self.res[-1] / self.b_norm if self.b_norm else self.res[-1]
            log(f"  CG iteration {k:4d}: |r| / |b| = {rel:.3e}")


def solve(
    A: chunkop.RowOperator,
    P: los.Problem,
    sc: dict,
    iters: int,
    rtol: float,
    recorder: Recorder | None,
    stabilise_every: int | None = 10,
):
    """Jacobi-preconditioned ``lineax.CG`` on the normal equations; returns ``(z, steps, result)``.

    With ``rtol=0`` and ``stabilise_every=None`` (the seed run: a fixed, small number of
    iterations) CG's loop carries the fewest sky-sized arrays (5 + the right-hand side).
    """
    H = normal_operator(A, P, sc)
    M = jacobi_preconditioner(A, P, sc, recorder)
    b = rhs(A, P)
    b_norm = jnp.sqrt(jnp.sum(b * b))
    solver = lx.CG(rtol=rtol, atol=0.0, max_steps=iters, stabilise_every=stabilise_every)
    sol = lx.linear_solve(H, b / b_norm, solver, options={"preconditioner": M}, throw=False)
    return sol.value * b_norm, sol.stats["num_steps"], sol.result


# -- a prior given by its covariance: the channel-space and data-space solves -------------------
#
# z (the relative deviation from the prior mean, sky = mu (1 + z)) is a sum of channels, each a
# plane-of-sky Gaussian random field (a stationary covariance on the periodic nx x ny grid, applied
# by FFT) times a fixed radial profile:
#
#     z[p, k] = sum_c zeta_c[p] U[k, c],     zeta_c ~ N(0, C_c) independent, C_c(0) = 1,
#
# so S = Cov(z) = sum_c C_c (x) U_c U_c^T. Channel 0 is constant along the line of sight (the
# truth's plane-of-sky field g); the others are the leading eigenvectors of the radial covariance
# of the truth's clouds. With B = A diag(mu), the posterior mean is
#
#     z = S B^T (B S B^T + sigma^2 I)^-1 (y - A mu)              (data space: n_los unknowns)
#       = C^1/2 xi,  (I + C^1/2 Bu^T Bu C^1/2 / sigma^2) xi = C^1/2 Bu^T (y - A mu) / sigma^2
#                                                                (whitened channels: n_pix x C)
#
# where Bu (zeta -> A (mu * zeta U^T)) is a RowOperator on A's rows whose weights are projected on
# the radial profiles ((w * mu) @ U: n_bins -> C numbers per line, recomputed chunk by chunk).
# Neither solve forms a sky: a step is one Bu.T.mv, FFTs on (n_pix, C) arrays and one Bu.mv; the
# one sky-sized array is the answer, mu (1 + zeta U^T).


def _gauss_corr(nx: int, ny: int, corr: float) -> np.ndarray:
    """Correlation function (``(nx, ny)``, periodic lags) of white noise filtered by the Gaussian
    kernel of sd ``corr`` pixels and normalised to zero mean, as ``los._smooth_field`` draws the
    truth's plane-of-sky field: its power is the kernel's squared transform, zero at ``k = 0``."""
    kx, ky = np.fft.fftfreq(nx)[:, None], np.fft.fftfreq(ny)[None, :]
    power = np.exp(-((2 * np.pi * corr) ** 2) * (kx**2 + ky**2))
    power[0, 0] = 0.0
    c = np.fft.ifft2(power).real
    return c / c[0, 0]


def _unit_power(cov: np.ndarray) -> np.ndarray:
    """The rfft2-layout power (``(nx, ny // 2 + 1)``) of a periodic stationary covariance function,
    clipped at 0 and scaled to unit variance (mean power 1)."""
    p = np.maximum(np.fft.fft2(cov).real, 0.0)
    p /= p.mean()
    return p[:, : cov.shape[1] // 2 + 1]


def covariance_prior(P: los.Problem, n_cloud_modes: int = 12) -> dict:
    """The prior covariance ``S`` of ``z``, matched to how ``los.make_problem`` draws the truth.

    The truth is ``sky = rho(r) exp(g + clouds)``, the prior mean ``mu = rho exp(g_sd^2 / 2)``:

    * ``g``: a periodic Gaussian random field of sd ``g_sd`` and correlation ``rho_g`` (white noise
      filtered by a Gaussian kernel of sd ``max(nx, ny) / 8`` pixels), constant along the line of
      sight. Its share of ``z``, ``exp(g - g_sd^2 / 2) - 1``, has covariance
      ``exp(g_sd^2 rho_g) - 1`` exactly: channel 0, radial profile 1.
    * six clouds ``a exp(-|x - x_j|^2 / 2 w^2) exp(-(ln r - l_j)^2 / 2 0.25^2)`` with
      ``a ~ U(0.4, 0.9)``, ``w ~ U(0.05, 0.12) max(nx, ny)``, ``l_j ~ U(ln 60, ln 800)``: the second
      moment of their share of ``z`` (``~ (e^a - 1) blob``), averaged over positions, is
      ``6 E[(e^a - 1)^2] E_w[blob_xy * blob_xy](delta) K_r`` with
      ``K_r[k, k'] = E_l[blob_r(k; l) blob_r(k'; l)]``; channels 1.. are ``K_r``'s leading
      ``n_cloud_modes`` eigenvectors (times the square roots of their eigenvalues), all with the
      plane-of-sky covariance ``E_w[pi w^2 exp(-|delta|^2 / 4 w^2)] / (nx ny)``.

    Returns ``U`` (``(n_bins, n_channels)`` float32) and ``power`` (``(nx, ny // 2 + 1,
    n_channels)`` float32, each channel of unit variance), and a few numbers for the report.
    The mean of the clouds and the product ``z_g z_clouds`` are left out (a Gaussian prior).
    """
    nx, ny = P.nx, P.ny
    g_sd = float(P.field["g_sd"])
    lr = np.log(P.centres)
    # channel 0: exp(g - g_sd^2/2) - 1
    cov_g = np.expm1(g_sd**2 * _gauss_corr(nx, ny, max(nx, ny) / 8.0))
    # clouds: plane-of-sky autocovariance of a blob, averaged over the widths (periodic lags)
    dx = np.minimum(np.arange(nx), nx - np.arange(nx))[:, None].astype(float)
    dy = np.minimum(np.arange(ny), ny - np.arange(ny))[None, :].astype(float)
    ws = np.linspace(0.05, 0.12, 15) * max(nx, ny)
    cov_c = np.mean([np.pi * w**2 * np.exp(-(dx**2 + dy**2) / (4 * w**2)) for w in ws], axis=0) / (nx * ny)
    a = np.linspace(0.4, 0.9, 201)
    var_c = 6 * float(np.mean(np.expm1(a) ** 2)) * min(1.0, float(cov_c[0, 0]))
    centres = np.linspace(np.log(60.0), np.log(800.0), 200)
    blob_r = np.exp(-0.5 * ((lr[None, :] - centres[:, None]) / 0.25) ** 2)  # (n_centres, n_bins)
    K_r = var_c * (blob_r.T @ blob_r) / centres.size
    lam, vec = np.linalg.eigh(K_r)
    order = np.argsort(lam)[::-1][:n_cloud_modes]
    U_cloud = vec[:, order] * np.sqrt(np.maximum(lam[order], 0.0))
    U = np.concatenate([np.full((P.n_bins, 1), np.sqrt(cov_g[0, 0])), U_cloud], axis=1)
    p_g, p_c = _unit_power(cov_g), _unit_power(cov_c)
    power = np.stack([p_g] + [p_c] * U_cloud.shape[1], axis=-1)
    return {
        "U": jnp.asarray(U, jnp.float32),
        "power": jnp.asarray(power, jnp.float32),
        "n_channels": int(U.shape[1]),
        "sd_g": float(U[0, 0]),
        "cloud_var": var_c,
        "cloud_eigenvalues": [float(v) for v in lam[order]],
        "n_cloud_modes": int(U_cloud.shape[1]),
    }


def channel_operator(A: chunkop.RowOperator, P: los.Problem, U: Any, squared: bool = False):
    """``Bu``: ``zeta (n_pix, C) -> A (mu * (zeta U^T))`` as a RowOperator on ``A``'s rows.

    Its row function is the LOS weights times the prior mean, projected on the radial profiles
    (``b_l = (w_l * mu) @ U``: ``n_bins -> C`` numbers per line, recomputed chunk by chunk),
    dotted with the ``C`` values of the line's pixel (``squared``: ``b_l**2`` instead, for
    ``diag(Bu Bu^T)``). Rows sharded over a mesh stay sharded; ``A x`` comes back replicated
    (the solvers take dot products of data-space vectors).
    """
    edges = np.asarray(P.edges, np.float64)
    muU = P.prior_mean[:, None] * jnp.asarray(U, jnp.float32)  # (n_bins, C)

    def row_fn(row, zeta):
        b = jnp.dot(los.los_weights(row["d"], row["s"], edges), muU)
        return jnp.dot(b * b if squared else b, zeta[row["pix"]])

    return chunkop.RowOperator(
        row_fn,
        A.rows,
        jax.ShapeDtypeStruct((P.n_pix, muU.shape[1]), jnp.float32),
        chunk_size=P.chunk,
        out_sharding="replicated",
    )


def data_residual_at_prior_mean(A: chunkop.RowOperator, P: los.Problem) -> jax.Array:
    """``y - A mu`` without a sky: ``A mu`` is the channel operator of the one profile ``mu``."""
    A_mu = channel_operator(A, P, np.ones((P.n_bins, 1)))
    return jax.jit(lambda op, y: y - op.mv(jnp.ones(op.in_structure().shape, jnp.float32)))(A_mu, P.y)


def apply_power(zeta: jax.Array, power: jax.Array, nx: int, ny: int) -> jax.Array:
    """Each channel of ``zeta`` (``(n_pix, C)``) filtered by its own spectrum ``power``
    (``(nx, ny // 2 + 1, C)``) on the periodic ``nx x ny`` grid (one rfft2 / irfft2 pair)."""
    f = jnp.fft.rfft2(zeta.reshape(nx, ny, -1), axes=(0, 1)) * power
    return jnp.fft.irfft2(f, s=(nx, ny), axes=(0, 1)).reshape(zeta.shape).astype(zeta.dtype)


def apply_blocks(xi: jax.Array, blocks: jax.Array, nx: int, ny: int) -> jax.Array:
    """``F^-1 blocks(k) F xi``: a ``C x C`` matrix per plane-of-sky frequency ``k``."""
    f = jnp.fft.rfft2(xi.reshape(nx, ny, -1), axes=(0, 1))
    f = jnp.einsum("xyij,xyj->xyi", blocks.astype(f.dtype), f)
    return jnp.fft.irfft2(f, s=(nx, ny), axes=(0, 1)).reshape(xi.shape).astype(xi.dtype)


def channel_gram(P: los.Problem, U: Any) -> np.ndarray:
    """``G = sum_l b_l b_l^T / (sigma^2 n_pix)`` with ``b_l = (w_l * mu) @ U``: the data's precision
    on one pixel's channels, averaged over the pixels (``(C, C)``, float64; chunk by chunk, the
    ``n_los x n_bins`` weights are never stored)."""
    muU = P.prior_mean[:, None] * jnp.asarray(U, jnp.float32)
    b_fn = jax.jit(lambda d, s: los.los_weights(d, s, P.edges) @ muU)
    d, s = np.asarray(P.d), np.asarray(P.s)
    G = np.zeros((muU.shape[1],) * 2)
    for i in range(0, d.size, P.chunk):
        b = np.asarray(b_fn(d[i : i + P.chunk], s[i : i + P.chunk]), np.float64)
        G += b.T @ b
    return G / (P.sigma**2 * P.n_pix)


def fourier_preconditioner(prior: dict, G: np.ndarray) -> jax.Array:
    """``(I + P(k)^1/2 G P(k)^1/2)^-1`` for every plane-of-sky frequency ``k`` (``(nx, ny // 2 + 1,
    C, C)`` float32).

    ``Bu^T Bu / sigma^2`` is block-diagonal over pixels (a line sees one pixel): one ``C x C``
    block per pixel. With every block replaced by their mean ``G`` (the data spread evenly over
    the sky), ``I + C^1/2 Bu^T Bu C^1/2 / sigma^2`` becomes diagonal in Fourier space, with these
    ``C x C`` blocks: its exact inverse is the preconditioner. The smooth modes the data
    constrain average the line density over many pixels, which is where this holds best.
    """
    sq = np.sqrt(np.asarray(prior["power"], np.float64))  # (nx, nyh, C)
    Hk = np.eye(G.shape[0]) + sq[..., :, None] * G * sq[..., None, :]
    return jnp.asarray(np.linalg.inv(Hk), jnp.float32)


def _pcg(H: Callable, M: Callable, b: jax.Array, iters: int, rtol: float, record: Callable | None):
    """Preconditioned CG for ``H x = b`` from ``x = 0`` (a ``lax.while_loop``).

    Stops when ``sqrt(r^T M r)`` falls below ``rtol`` times its initial value, or after ``iters``
    steps; returns ``(x, steps, sqrt(r^T M r / r0^T M r0))``. ``record(|r_k|)`` is called from
    inside the loop for ``r_0`` and once per step. A plain loop rather than ``lineax.CG``, whose
    breakdown test ``<p, H p> <= 100 n eps <r, M r>`` is calibrated for other scalings (README).
    """

    def report(r):
        if record is not None:
            jax.debug.callback(record, jnp.sqrt(jnp.sum(r * r)))

    z = M(b)
    rz0 = jnp.vdot(b, z)
    report(b)

    def cond(state):
        return (state[0] < iters) & (state[4] > rtol**2 * rz0)

    def body(state):
        k, x, r, p, rz = state
        Hp = H(p)
        alpha = rz / jnp.vdot(p, Hp)
        x, r = x + alpha * p, r - alpha * Hp
        z = M(r)
        rz_new = jnp.vdot(r, z)
        report(r)
        return k + 1, x, r, z + (rz_new / rz) * p, rz_new

    k, x, _, _, rz = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.zeros_like(b), b, z, rz0))
    return x, k, jnp.sqrt(rz / rz0)


def channel_space_solve(
    Bu: chunkop.RowOperator,
    resid0: jax.Array,
    P: los.Problem,
    prior: dict,
    precond: jax.Array,
    iters: int,
    rtol: float,
    record: Callable | None,
):
    """The posterior mean's channels ``zeta`` by CG on the whitened channels (the default solver).

    ``zeta = C^1/2 xi`` with ``xi ~ N(0, I)`` of shape ``(n_pix, C)``; solves
    ``(I + C^1/2 Bu^T Bu C^1/2 / sigma^2) xi = C^1/2 Bu^T (y - A mu) / sigma^2`` (``resid0`` is
    ``y - A mu``), preconditioned by :func:`fourier_preconditioner`. The nontrivial eigenvalues
    are those of the data-space system; a step is one ``Bu.T.mv``, one ``Bu.mv`` and three
    rfft2 / irfft2 pairs on ``(n_pix, C)``. Returns ``(zeta, steps, relative residual)``.
    """
    nx, ny, sig = P.nx, P.ny, P.sigma
    sqp = jnp.sqrt(prior["power"])
    Cs = lambda v: apply_power(v, sqp, nx, ny)  # C^1/2
    b = Cs(Bu.T.mv(resid0 / sig**2))
    b_norm = jnp.sqrt(jnp.sum(b * b))
    H = lambda xi: xi + Cs(Bu.T.mv(Bu.mv(Cs(xi)))) / sig**2
    M = lambda r: apply_blocks(r, precond, nx, ny)
    xi, k, rel = _pcg(H, M, b / b_norm, iters, rtol, record)  # unit-norm b: float32-safe scalars
    return Cs(xi) * b_norm, k, rel


def data_space_solve(
    Bu: chunkop.RowOperator,
    B2: chunkop.RowOperator,
    resid0: jax.Array,
    P: los.Problem,
    prior: dict,
    iters: int,
    rtol: float,
    record: Callable | None,
):
    """The posterior mean's channels by CG in data space (``--solver data``): ``n_los`` unknowns.

    Solves ``(B S B^T / sigma^2 + I) u = (y - A mu) / sigma`` (noise-whitened: every eigenvalue is
    >= 1), Jacobi-preconditioned by ``diag(B S B^T) / sigma^2 + 1`` (``B2``: ``Bu`` with squared
    weights, on ones; the lines' sensitivities differ ~1000-fold, as ``1/s^2``), then
    ``zeta = C Bu^T u / sigma``. Returns ``(zeta, steps, relative residual)``.
    """
    nx, ny, sig = P.nx, P.ny, P.sigma
    power = prior["power"]
    minv = 1.0 / (B2.mv(jnp.ones(B2.in_structure().shape, jnp.float32)) / sig**2 + 1.0)
    b = resid0 / sig
    b_norm = jnp.sqrt(jnp.sum(b * b))
    K = lambda u: Bu.mv(apply_power(Bu.T.mv(u), power, nx, ny)) / sig**2 + u
    u, k, rel = _pcg(K, lambda r: minv * r, b / b_norm, iters, rtol, record)
    return apply_power(Bu.T.mv(u), power, nx, ny) * (b_norm / sig), k, rel


@jax.jit
def sky_from_channels(mu: jax.Array, zeta: jax.Array, U: jax.Array) -> jax.Array:
    """``mu * (1 + zeta U^T)``: the one sky-sized array of the channel-space and data-space solves."""
    return mu * (1.0 + zeta @ U.T)


# -- the global s-scale fit ---------------------------------------------------------------------


def chi2_alpha(log_alpha: jax.Array, A: chunkop.RowOperator, sky: jax.Array, y: jax.Array, sigma: float):
    """``0.5 * |(A(s = alpha s) sky - y) / sigma|^2`` as a function of ``log alpha``."""
    A_alpha = los.with_rows(A, s=A.rows["s"] * jnp.exp(log_alpha))
    return 0.5 * jnp.sum(((A_alpha.mv(sky) - y) / sigma) ** 2)


def grad_and_curv(log_alpha, A, sky, y, sigma):
    g = lambda la: jax.grad(chi2_alpha)(la, A, sky, y, sigma)
    grad, curv = jax.jvp(g, (log_alpha,), (jnp.ones_like(log_alpha),))  # hvp on a scalar
    return chi2_alpha(log_alpha, A, sky, y, sigma), grad, curv


def fit_s_scale(A, sky, P: los.Problem, alpha0: float = 2.0, steps: int = 6, step: Callable | None = None) -> dict:
    """Newton on ``log alpha`` with exact first and second derivatives through ``A``'s rows.

    ``step``: a compiled ``grad_and_curv`` to reuse (default: ``jax.jit(grad_and_curv)``).
    """
    step = jax.jit(grad_and_curv) if step is None else step
    la = jnp.float32(np.log(alpha0))
    path = []
    for i in range(steps):
        c, g, h = step(la, A, sky, P.y, P.sigma)
        path.append({"alpha": float(jnp.exp(la)), "chi2": float(c), "grad": float(g), "curv": float(h)})
        log(f"  s-scale fit step {i}: alpha = {path[-1]['alpha']:.5f}, chi2/n = {2 * float(c) / P.n_los:.4f}")
        la = la - g / jnp.where(h > 0, h, jnp.abs(g) + 1.0)
    c, g, h = step(la, A, sky, P.y, P.sigma)
    path.append({"alpha": float(jnp.exp(la)), "chi2": float(c), "grad": float(g), "curv": float(h)})
    sd = float(jnp.exp(la)) / np.sqrt(max(float(h), 1e-30))
    log(f"  s-scale fit: alpha = {path[-1]['alpha']:.5f} +- {sd:.5f} (true 1, start {alpha0})")
    return {"alpha": path[-1]["alpha"], "alpha_sd": sd, "alpha_true": 1.0, "alpha0": alpha0, "path": path}


# -- measurement helpers ------------------------------------------------------------------------

_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def collective_counts(compiled: Any) -> dict:
    """How many collectives of each kind the compiled (optimised) HLO program runs."""
    counts: dict = {}
    for m in _COLLECTIVE.finditer(compiled.as_text()):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def compiled_memory(fn: Callable, *args) -> tuple[Any, dict]:
    """Compile ``jax.jit(fn)`` for ``args``; return the executable and its memory analysis."""
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    ma = compiled.memory_analysis()
    mem = {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "compile_s": time.perf_counter() - t,
    }
    return compiled, mem


def timed(compiled, *args, repeats: int = 1) -> tuple[Any, float]:
    ts, out = [], None
    for _ in range(repeats):
        del out
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        ts.append(time.perf_counter() - t)
    return out, float(np.median(ts))


def result_name(result) -> str:
    for name in ("successful", "max_steps_reached", "singular", "breakdown", "stagnation", "nonfinite_input"):
        item = getattr(lx.RESULTS, name, None)
        if item is not None and bool(result == item):
            return name
    return str(result)


@jax.jit
def rel_err(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum((a - b) ** 2) / jnp.sum(b**2))


@jax.jit
def rel_err_baseline(mu: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum((mu[None, :] - b) ** 2) / jnp.sum(b**2))


@jax.jit
def masked_rel_err(a: jax.Array, b: jax.Array, pixels: jax.Array) -> jax.Array:
    """``rel_err`` over the pixels (rows) where ``pixels`` is True (``a`` may broadcast over rows)."""
    m = pixels[:, None]
    return jnp.sqrt(jnp.sum(jnp.where(m, (a - b) ** 2, 0.0)) / jnp.sum(jnp.where(m, b**2, 0.0)))


@jax.jit
def sky_from_z(mu: jax.Array, z: jax.Array) -> jax.Array:
    return mu * (1.0 + z)


# -- several devices ---------------------------------------------------------------------------


def device_mesh(n: int) -> jax.sharding.Mesh:
    """The 1-D mesh ``jax.make_mesh((n,), ("rows",))`` over the first ``n`` of ``jax.devices()``.

    Raises:
        ValueError: when ``n < 1`` or JAX has fewer than ``n`` devices.
    """
    if n < 1:
        raise ValueError(f"--devices must be at least 1, got {n}")
    devices = jax.devices()
    if len(devices) < n:
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (
                f"; on a CPU the host device count must be set before jax is imported: run this file as a "
                f"script, or set XLA_FLAGS={HOST_DEVICE_FLAG}={n} (XLA_FLAGS is now "
                f"{os.environ.get('XLA_FLAGS', '')!r})"
            )
        raise ValueError(f"--devices {n}: JAX has only {len(devices)} {jax.default_backend()} device(s){hint}")
    return jax.make_mesh((n,), ("rows",), devices=devices[:n])


def sharded_operator(P: los.Problem, mesh: jax.sharding.Mesh) -> chunkop.RowOperator:
    """``P``'s LOS operator built from rows (``pix``, ``d``, ``s``) sharded along their leading axis
    over the mesh axis ``"rows"``: each device holds and computes ``n_los / n`` lines.

    Raises:
        ValueError: when the number of lines is not a multiple of the number of devices.
    """
    n = int(mesh.shape["rows"])
    if P.n_los % n:
        divisors = [k for k in range(1, min(P.n_los, 64) + 1) if P.n_los % k == 0]
        raise ValueError(
            f"--devices {n}: the {P.n_los} lines of sight (--size {P.size}) cannot be split evenly over {n} "
            f"devices (the rows are sharded in equal blocks); use --devices in {divisors}"
        )
    rows = jax.device_put({"pix": P.pix, "d": P.d, "s": P.s}, NamedSharding(mesh, PSpec("rows")))
    return los.make_los_operator(rows["pix"], rows["d"], rows["s"], n_pix=P.n_pix, edges=P.edges, chunk_size=P.chunk)


def describe_sharding(A: chunkop.RowOperator, mesh: jax.sharding.Mesh | None) -> dict:
    """How the operator's rows are laid out: mesh, each row leaf's ``PartitionSpec`` and the number
    of devices holding a shard of it, and the rows per device."""
    if mesh is None:
        return {"mesh": None, "rows_sharding": None}
    mesh_axes = getattr(A, "mesh_axes", None)  # what the operator found when it was built
    return {
        "mesh": {
            "shape": {k: int(v) for k, v in mesh.shape.items()},
            "axis_types": [str(t) for t in mesh.axis_types],
            "devices": [str(d) for d in mesh.devices.flat],
        },
        "rows_sharding": {
            k: {
                "spec": str(v.sharding.spec),
                "n_devices": len(v.sharding.device_set),
                "shard_rows": sorted({int(sh.data.shape[0]) for sh in v.addressable_shards}),
            }
            for k, v in A.rows.items()
        },
        "operator_mesh_axes": list(mesh_axes.names) if mesh_axes is not None else None,
    }


SOLVERS = ("channels", "data", "primal")

# -- the main job -------------------------------------------------------------------------------


def run(
    size: str = "default",
    out: str | None = "outputs/astro_los",
    chunk: int | None = None,
    iters: int | None = None,
    fit_s: bool = True,
    figures: bool = True,
    rtol: float = 1e-5,
    progress: bool = False,
    devices: int | None = None,
    solver: str = "channels",
) -> dict:
    """Run the example; returns the results dict (also written to ``out/results.json``).

    ``devices``: shard the operator's rows over the first ``devices`` of ``jax.devices()`` (see
    :func:`device_mesh`, :func:`sharded_operator`); the whole job then runs under
    ``jax.set_mesh`` of that mesh. None: everything on the default device, no mesh.
    """
    mesh = device_mesh(devices) if devices is not None else None
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _run(size, out, chunk, iters, fit_s, figures, rtol, progress, mesh, solver)


def _run(
    size: str,
    out: str | None,
    chunk: int | None,
    iters: int | None,
    fit_s: bool,
    figures: bool,
    rtol: float,
    progress: bool,
    mesh: jax.sharding.Mesh | None,
    solver: str = "channels",
) -> dict:
    """The body of :func:`run` (inside the mesh context when ``mesh`` is given)."""
    devices = int(mesh.size) if mesh is not None else 1
    res: dict = {"size": size, "jax": jax.__version__, "backend": jax.default_backend(), "devices": devices}
    timings, memory = {}, {}
    log(f"chunkop LOS example, size={size!r} (jax {jax.__version__}, {jax.default_backend()})")
    if mesh is not None:
        log(f"{devices} device(s), mesh {dict(mesh.shape)} over {[str(d) for d in mesh.devices.flat]}")
    else:
        log("1 device (no mesh; --devices N shards the operator's rows over N devices)")
    t = time.perf_counter()
    P = los.make_problem(size, chunk=chunk, progress=progress or None)
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if iters is None:
        iters = {"primal": P.iters, "channels": 100, "data": 3000}[solver]
    timings["make_problem_s"] = time.perf_counter() - t
    sky_bytes = P.n_pix * P.n_bins * 4
    log(
        f"problem: sky {P.n_pix} pixels ({P.nx} x {P.ny}) x {P.n_bins} radial bins "
        f"({fmt_bytes(sky_bytes)} per float32 copy), {P.n_los} lines of sight "
        f"({P.n_los / P.n_pix:.1f} per pixel), chunk {P.chunk}, noise sigma {P.sigma:.3g}; "
        f"made in {timings['make_problem_s']:.1f}s"
    )
    res["problem"] = {
        "n_pix": P.n_pix,
        "nx": P.nx,
        "ny": P.ny,
        "n_bins": P.n_bins,
        "n_los": P.n_los,
        "chunk": P.chunk,
        "sigma": P.sigma,
        "sky_bytes": sky_bytes,
        "n_los_x_n_bins_bytes": P.n_los * P.n_bins * 4,
    }
    A = P.operator() if mesh is None else sharded_operator(P, mesh)
    res.update(describe_sharding(A, mesh))
    if mesh is not None:
        log(
            f"operator rows sharded over mesh axes {res['operator_mesh_axes']}: "
            + ", ".join(f"{k} {v['spec']} on {v['n_devices']} devices" for k, v in res["rows_sharding"].items())
            + f" ({P.n_los // devices} lines per device)"
        )
    sc = prior_scales(P)
    res["prior"] = {k: float(v) for k, v in sc.items()}
    seed = size == "seed"

    if not seed:
        res["check_linear"] = chunkop.check_linear(A)
        log(f"chunkop.check_linear (relative errors): {res['check_linear']}")

    # --- the operator's building blocks, each compiled separately to report its memory ---------
    x = P.truth()
    mv, memory["matvec"] = compiled_memory(lambda A, x: A.mv(x), A, x)
    y_model, timings["matvec_s"] = timed(mv, A, x, repeats=1 if seed else 3)
    log(f"matvec A x: {timings['matvec_s']:.3f}s, temp {fmt_bytes(memory['matvec']['temp_bytes'])}")
    rmv, memory["transpose"] = compiled_memory(lambda A, y: A.T.mv(y), A, P.y)
    g, timings["transpose_s"] = timed(rmv, A, P.y, repeats=1 if seed else 3)
    del g
    log(f"transpose A^T y: {timings['transpose_s']:.3f}s, temp {fmt_bytes(memory['transpose']['temp_bytes'])}")
    if mesh is not None:  # A x stays sharded by rows; A^T y ends in one all-reduce
        res["matvec_out_spec"] = str(y_model.sharding.spec)
        res["collectives"] = {"matvec": collective_counts(mv), "transpose": collective_counts(rmv)}
        log(f"A x comes back sharded as {res['matvec_out_spec']}; compiled collectives: {res['collectives']}")

    def loss_sky(sky, A, y, sigma):
        return 0.5 * jnp.sum(((A.mv(sky) - y) / sigma) ** 2)

    gsky, memory["grad_sky"] = compiled_memory(jax.grad(loss_sky), x, A, P.y, P.sigma)
    g, timings["grad_sky_s"] = timed(gsky, x, A, P.y, P.sigma)
    del g
    log(f"grad w.r.t. sky: {timings['grad_sky_s']:.3f}s, temp {fmt_bytes(memory['grad_sky']['temp_bytes'])}")

    def hvp_sky(sky, v, A, y, sigma):
        return jax.jvp(lambda s_: jax.grad(loss_sky)(s_, A, y, sigma), (sky,), (v,))[1]

    hvp, memory["hvp_sky"] = compiled_memory(hvp_sky, x, x, A, P.y, P.sigma)
    hv, timings["hvp_sky_s"] = timed(hvp, x, x, A, P.y, P.sigma)
    del hv
    log(f"hvp w.r.t. sky: {timings['hvp_sky_s']:.3f}s, temp {fmt_bytes(memory['hvp_sky']['temp_bytes'])}")

    ga, memory["grad_hvp_alpha"] = compiled_memory(grad_and_curv, jnp.float32(0.0), A, x, P.y, P.sigma)
    (c, _gval, _hval), timings["grad_hvp_alpha_s"] = timed(ga, jnp.float32(0.0), A, x, P.y, P.sigma)
    log(
        f"chi2, grad and 2nd derivative w.r.t. log(s-scale): {timings['grad_hvp_alpha_s']:.3f}s, "
        f"temp {fmt_bytes(memory['grad_hvp_alpha']['temp_bytes'])}; chi2/n at truth = "
        f"{2 * float(c) / P.n_los:.4f}"
    )
    res["chi2_per_line_truth"] = 2 * float(c) / P.n_los

    if fit_s and not seed:
        log("fitting a global scale on s (true 1.0) with the sky fixed at the calibration (true) sky")
        t = time.perf_counter()
        res["s_fit"] = fit_s_scale(A, x, P, step=ga)
        timings["s_fit_s"] = time.perf_counter() - t
    del x, y_model

    # --- the reconstruction ---------------------------------------------------------------------
    rec = Recorder(every=1 if seed or solver == "channels" else max(1, iters // 10))
    t = time.perf_counter()
    if solver == "primal":
        if seed:  # a fixed number of iterations, fewest live sky-sized arrays
            rtol, stabilise = 0.0, None
        else:
            stabilise = 10
        solve_fn = lambda A: solve(A, P, sc, iters, rtol, rec, stabilise)
        solve_args: tuple = (A,)
        what = "Jacobi-preconditioned lineax.CG on the normal equations (405M unknowns at seed size)"
    else:
        prior = covariance_prior(P)
        Bu = channel_operator(A, P, prior["U"])
        resid0 = data_residual_at_prior_mean(A, P)
        res["covariance_prior"] = {
            k: prior[k] for k in ("n_channels", "sd_g", "cloud_var", "cloud_eigenvalues", "n_cloud_modes")
        }
        if solver == "channels":
            precond = fourier_preconditioner(prior, channel_gram(P, prior["U"]))
            solve_fn = lambda Bu, r0, pc: channel_space_solve(Bu, r0, P, prior, pc, iters, rtol, rec)
            solve_args = (Bu, resid0, precond)
            what = (
                f"CG on the whitened channels ({P.n_pix} x {prior['n_channels']} unknowns), "
                "Fourier-block preconditioner"
            )
        else:
            B2 = channel_operator(A, P, prior["U"], squared=True)
            solve_fn = lambda Bu, B2, r0: data_space_solve(Bu, B2, r0, P, prior, iters, rtol, rec)
            solve_args = (Bu, B2, resid0)
            what = f"CG in data space ({P.n_los} unknowns), Jacobi preconditioner"
        timings["prior_setup_s"] = time.perf_counter() - t
        log(
            f"covariance prior: {prior['n_channels']} channels (plane-of-sky field sd {prior['sd_g']:.3f}, "
            f"{prior['n_channels'] - 1} radial cloud modes), set up in {timings['prior_setup_s']:.1f}s"
        )
    solve_c, memory["cg_solve"] = compiled_memory(solve_fn, *solve_args)
    log(
        f"solver {solver!r}: {what}; compiled in {memory['cg_solve']['compile_s']:.1f}s "
        f"(temp {fmt_bytes(memory['cg_solve']['temp_bytes'])} = "
        f"{memory['cg_solve']['temp_bytes'] / sky_bytes:.2f} sky copies); up to {iters} iterations, rtol {rtol:g}"
    )
    t = time.perf_counter()
    sol, n_steps, rel_res = jax.block_until_ready(solve_c(*solve_args))
    timings["cg_s"] = time.perf_counter() - t
    n_steps = int(n_steps)
    if solver == "primal":
        result = result_name(rel_res)  # a lineax RESULTS
        rel_res = rec.res[-1] / rec.b_norm if rec.res else float("nan")
    else:
        rel_res = float(rel_res)
        result = "successful" if rel_res <= rtol else "max_steps_reached"
    # the recorder's first call is CG's initial residual: before it, the set-up; between its first
    # and last call, the iterations
    timings["cg_setup_s"] = rec.times[0] - t if rec.times else float("nan")
    timings["cg_per_iteration_s"] = (rec.times[-1] - rec.times[0]) / max(n_steps, 1) if rec.times else float("nan")
    log(
        f"CG: {n_steps} iterations in {timings['cg_s']:.1f}s (set-up {timings['cg_setup_s']:.1f}s, then "
        f"{timings['cg_per_iteration_s']:.3f}s per iteration), {result} (relative residual {rel_res:.2e})"
    )
    res["cg"] = {
        "solver": solver,
        "iterations": n_steps,
        "max_iterations": iters,
        "rtol": rtol,
        "result": result,
        "relative_residual": rel_res,
        "residual_norms": rec.res,
        "b_norm": rec.b_norm,
    }
    if solver == "primal":
        sky_hat = sky_from_z(P.prior_mean, sol)
    else:
        sky_hat = sky_from_channels(P.prior_mean, sol, prior["U"])
    del sol

    # --- evaluation -------------------------------------------------------------------------------
    resid_fn = jax.jit(lambda A, s, y: y - A.mv(s))
    resid_mu_fn = jax.jit(lambda A, mu, y: y - A.mv(jnp.broadcast_to(mu, A.in_structure().shape)))
    resid = np.asarray(resid_fn(A, sky_hat, P.y)) / P.sigma
    resid0 = np.asarray(resid_mu_fn(A, P.prior_mean, P.y)) / P.sigma
    finite = bool(jax.jit(lambda s: jnp.all(jnp.isfinite(s)))(sky_hat))
    x = P.truth()
    err = float(rel_err(sky_hat, x))
    err0 = float(rel_err_baseline(P.prior_mean, x))
    # the distance-integrated column sum_k sky[p, k] (b_{k+1} - b_k) per pixel
    dr = jnp.asarray(np.diff(P.edges), jnp.float32)
    col = jax.jit(lambda s: s @ dr)
    col_t, col_h = np.asarray(col(x)), np.asarray(col(sky_hat))
    col_0 = np.full_like(col_t, float(P.prior_mean @ dr))
    col_err = float(np.linalg.norm(col_h - col_t) / np.linalg.norm(col_t))
    col_err0 = float(np.linalg.norm(col_0 - col_t) / np.linalg.norm(col_t))
    # the same relative error split into the pixels some line looks through and the others
    seen = jnp.asarray(np.bincount(np.asarray(P.pix), minlength=P.n_pix) > 0)
    split = {
        f"rel_err_{part}_{name}": float(masked_rel_err(s_, x, m_)) if bool(jnp.any(m_)) else None
        for part, m_ in (("seen_pixels", seen), ("unseen_pixels", ~seen))
        for name, s_ in (("reconstruction", sky_hat), ("baseline", jnp.broadcast_to(P.prior_mean, (1, P.n_bins))))
    }
    split["fraction_of_pixels_seen"] = float(jnp.mean(seen))
    f4 = lambda v: "-" if v is None else f"{v:.4f}"
    res["metrics"] = {
        "rel_err_reconstruction": err,
        "rel_err_baseline_prior_mean": err0,
        "rel_err_column_reconstruction": col_err,
        "rel_err_column_baseline": col_err0,
        "chi2_per_line_reconstruction": float(np.mean(resid**2)),
        "chi2_per_line_baseline": float(np.mean(resid0**2)),
        "finite": finite,
        **split,
    }
    log(
        f"relative error vs truth: reconstruction {err:.4f}, baseline (prior mean) {err0:.4f}; "
        f"distance-integrated column: {col_err:.4f} vs {col_err0:.4f}"
    )
    log(
        f"  on the {100 * split['fraction_of_pixels_seen']:.1f}% of pixels some line looks through: "
        f"{f4(split['rel_err_seen_pixels_reconstruction'])} vs {f4(split['rel_err_seen_pixels_baseline'])}; "
        f"on the others: {f4(split['rel_err_unseen_pixels_reconstruction'])} vs "
        f"{f4(split['rel_err_unseen_pixels_baseline'])}"
    )
    log(
        f"data residual chi2 per line: reconstruction {res['metrics']['chi2_per_line_reconstruction']:.3f}, "
        f"baseline {res['metrics']['chi2_per_line_baseline']:.3f} (noise level = 1)"
    )

    res["timings"] = timings
    res["memory"] = memory
    res["peak_rss_bytes"] = peak_rss_bytes()
    res["wall_s"] = time.perf_counter() - T0
    log("compiled temp memory of the main jitted functions (beyond their arguments and outputs):")
    for k, m in memory.items():
        log(
            f"  {k:16s} temp {fmt_bytes(m['temp_bytes']):>10s}  args {fmt_bytes(m['argument_bytes']):>10s}  "
            f"out {fmt_bytes(m['output_bytes']):>10s}  compile {m['compile_s']:.1f}s"
        )
    log(f"peak RSS of the process: {fmt_bytes(res['peak_rss_bytes'])}")

    if out:
        os.makedirs(out, exist_ok=True)
        if figures:
            try:
                import matplotlib

                matplotlib.use("Agg")
                paths = make_figures(out, P, x, sky_hat, resid, resid0, col_t, col_h, col_0, res)
                res["figures"] = paths
            except ImportError:
                log("matplotlib not installed: no figures (pip install -e '.[examples]')")
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
        log(
            f"outputs written to {os.path.abspath(out)}/ (results.json"
            + (", " + ", ".join(os.path.basename(p) for p in res.get("figures", [])) if res.get("figures") else "")
            + ")"
        )
    log(f"done in {time.perf_counter() - T0:.1f}s")
    return res


def make_figures(out, P, x, sky_hat, resid, resid0, col_t, col_h, col_0, res) -> list:
    import matplotlib.pyplot as plt

    paths = []
    nx, ny = P.nx, P.ny
    r = P.centres
    k1, k2 = int(np.searchsorted(r, 100.0)), int(np.searchsorted(r, 400.0))
    x_np = {  # only small slices leave the device
        "truth": (col_t, np.asarray(x[:, k1]), np.asarray(x[:, k2])),
        "reconstruction": (col_h, np.asarray(sky_hat[:, k1]), np.asarray(sky_hat[:, k2])),
    }
    titles = ["distance-integrated column", f"bin at r = {r[k1]:.0f}", f"bin at r = {r[k2]:.0f}"]

    # 1. maps: truth vs reconstruction, and the relative error
    fig, axes = plt.subplots(3, 3, figsize=(13, 10), constrained_layout=True)
    for j in range(3):
        t, h = x_np["truth"][j].reshape(nx, ny), x_np["reconstruction"][j].reshape(nx, ny)
        vmin, vmax = np.percentile(t, [1, 99])
        for i, (name, im) in enumerate((("truth", t), ("reconstruction", h))):
            a = axes[i, j].imshow(im.T, origin="lower", vmin=vmin, vmax=vmax, cmap="magma")
            axes[i, j].set_title(f"{name}: {titles[j]}", fontsize=9)
            fig.colorbar(a, ax=axes[i, j], shrink=0.8)
        rel = (h - t) / t
        a = axes[2, j].imshow(rel.T, origin="lower", vmin=-0.5, vmax=0.5, cmap="RdBu_r")
        axes[2, j].set_title(f"(reconstruction - truth) / truth, rms {np.sqrt(np.mean(rel**2)):.3f}", fontsize=9)
        fig.colorbar(a, ax=axes[2, j], shrink=0.8)
    fig.suptitle(
        f"LOS sky reconstruction ({P.size}: {P.n_pix} px x {P.n_bins} bins, {P.n_los} lines); "
        f"rel. error {res['metrics']['rel_err_reconstruction']:.3f} vs prior mean "
        f"{res['metrics']['rel_err_baseline_prior_mean']:.3f}"
    )
    paths.append(os.path.join(out, "sky_maps.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    # 2. residuals: normalised data residuals, and radial profiles of a few pixels
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    bins = np.linspace(-6, 6, 121)
    axes[0].hist(
        np.clip(resid, -6, 6),
        bins=bins,
        density=True,
        alpha=0.7,
        label=f"reconstruction (rms {np.sqrt(np.mean(resid**2)):.2f})",
    )
    axes[0].plot([], [], " ", label=f"prior mean: rms {np.sqrt(np.mean(resid0**2)):.1f} (off scale)")
    g = np.linspace(-6, 6, 200)
    axes[0].plot(g, np.exp(-0.5 * g**2) / np.sqrt(2 * np.pi), "k--", label="N(0, 1)")
    axes[0].set_xlabel("(y - A sky) / sigma")
    axes[0].set_title("data residuals")
    axes[0].legend(fontsize=8)
    a = axes[1].imshow(((col_h - col_t) / col_t).reshape(nx, ny).T, origin="lower", vmin=-0.2, vmax=0.2, cmap="RdBu_r")
    axes[1].set_title("column: (reconstruction - truth) / truth")
    fig.colorbar(a, ax=axes[1], shrink=0.8)
    rng = np.random.default_rng(1)
    seen = np.flatnonzero(np.bincount(np.asarray(P.pix), minlength=P.n_pix) > 0)  # pixels with data
    for p, c in zip(rng.choice(seen, 3, replace=False), ("C0", "C1", "C2")):
        axes[2].loglog(r, np.asarray(x[p]), c + "-", label=f"truth, pixel {p}")
        axes[2].loglog(r, np.asarray(sky_hat[p]), c + "--", label="reconstruction")
    axes[2].loglog(r, np.asarray(P.prior_mean), "k:", label="prior mean")
    axes[2].set_xlabel("distance r")
    axes[2].set_title("radial profiles")
    axes[2].legend(fontsize=7)
    paths.append(os.path.join(out, "residuals.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    # 3. convergence of CG
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    rn = np.asarray(res["cg"]["residual_norms"]) / res["cg"]["b_norm"]
    ax.semilogy(np.arange(rn.size), rn, "o-" if rn.size < 30 else "-")
    ax.set_xlabel("CG iteration")
    ax.set_ylabel("|r_k| / |r_0|")
    name = {
        "primal": "Jacobi-preconditioned lineax.CG (normal equations)",
        "channels": "CG on the whitened channels (Fourier-block preconditioner)",
        "data": "CG in data space (Jacobi)",
    }[res["cg"]["solver"]]
    ax.set_title(f"{name}, {res['cg']['iterations']} iterations", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    paths.append(os.path.join(out, "convergence.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    # 4. the s-scale fit
    if "s_fit" in res:
        path = res["s_fit"]["path"]
        fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
        ax.semilogy([p["alpha"] for p in path], [2 * p["chi2"] / P.n_los for p in path], "o-")
        for i, p in enumerate(path):
            ax.annotate(str(i), (p["alpha"], 2 * p["chi2"] / P.n_los), fontsize=8)
        ax.axvline(1.0, color="k", ls=":", label="true alpha")
        ax.set_xlabel("alpha (s -> alpha * s)")
        ax.set_ylabel("chi2 per line")
        ax.set_title(
            f"Newton fit of a global s-scale: alpha = {res['s_fit']['alpha']:.4f} +- {res['s_fit']['alpha_sd']:.4f}"
        )
        ax.legend()
        paths.append(os.path.join(out, "s_fit.png"))
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="default", choices=sorted(los.SIZES), help="problem size (default: default)")
    p.add_argument("--out", default="outputs/astro_los", help="output folder (default outputs/astro_los)")
    p.add_argument("--chunk", type=int, default=None, help="lines per chunk (default: per size)")
    p.add_argument(
        "--solver",
        default="channels",
        choices=SOLVERS,
        help="channels (default): covariance prior, CG on the whitened plane-of-sky channels with a "
        "Fourier-block preconditioner; data: the same prior, CG in data space (n_los unknowns), Jacobi; "
        "primal: first-difference precision prior, lineax.CG on the normal equations (sky-sized unknowns)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="max CG iterations (default: channels 100, data 3000, primal per size)"
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="CG relative tolerance (default 1e-5)")
    p.add_argument("--no-fit-s", action="store_true", help="skip the s-scale fit")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="shard the operator's rows (lines of sight) over the first N of jax.devices(), mesh axis 'rows'; "
        f"on a CPU, N host devices are made ({HOST_DEVICE_FLAG}=N is appended to XLA_FLAGS before jax "
        "starts). The number of lines must be a multiple of N (default: one device, no mesh)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="show a progress bar of chunks for every operator kernel call (useful at --size seed)",
    )
    a = p.parse_args(argv)
    if a.devices is not None:
        n_los = los.SIZES[a.size].n_los
        if a.devices < 1:
            p.error(f"--devices must be at least 1, got {a.devices}")
        if n_los % a.devices:
            p.error(f"--devices {a.devices} does not divide the {n_los} lines of sight of --size {a.size}")
    return run(
        a.size,
        a.out,
        a.chunk,
        a.iters,
        fit_s=not a.no_fit_s,
        figures=not a.no_figures,
        rtol=a.rtol,
        progress=a.progress,
        devices=a.devices,
        solver=a.solver,
    )


if __name__ == "__main__":
    main()
