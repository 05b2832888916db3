"""Variational inference of a 3-D sky with NIFTy.re, the response a chunked ``chunkop.RowOperator``.

    python examples/astro_los/nifty_vi.py [--size tiny|small] [--out DIR] [--iters N] [--samples N]
                                          [--chunk C] [--no-figures]

The model (``pip install -e ".[nifty]"``, NIFTy.re is ``import nifty.re as jft``):

* **sky**: ``sky = rho(r) * exp(s)`` on ``(n_pix, n_bins)`` (``n_pix = nx * ny`` plane-of-sky
  pixels, radial bins ``geomspace(40, 1700, n_bins + 1)``), where ``rho(r) = 1 / (1 + (r/400)^2)``
  is a fixed radial profile and ``s`` a **correlated field** (``jft.CorrelatedFieldMaker``) on the
  ``(nx, ny, n_bins)`` grid whose power spectrum is a product of a plane-of-sky and a radial
  (log-distance) spectrum, both inferred (fluctuation amplitude, slope, flexibility, asperity);
* **response**: the users' line-of-sight operator ``y_l = sum_k w_k(d_l, s_l) sky[pix_l, k]``
  from ``los.py``, a ``chunkop.RowOperator``: the ``n_los x n_bins`` weights are recomputed chunk
  by chunk, never stored, in the forward model, its jvp/vjp (MGVI's metric) and under the
  ``jax.vmap`` over samples that ``jft.optimize_kl`` applies;
* **likelihood**: ``jft.Gaussian(y, noise_cov_inv).amend(response)``;
* **inference**: ``jft.optimize_kl`` (MGVI: linear samples, mirrored, and a KL minimisation by
  Newton-CG per iteration).

The truth is a draw from the prior (fixed seed) and the lines are the users' random lines
(``los.draw_lines``); data get Gaussian noise of 2% of the rms signal. The script prints the
relative errors of the posterior mean vs the truth (the sky and its distance-integrated column)
and the fraction of pixels where the truth lies within two posterior standard deviations, and
writes ``posterior.png`` (truth vs posterior mean and std) and ``results.json`` into ``--out``
(default ``outputs/astro_los_nifty/``).

The data constrain about one radial combination per pixel (``examples/astro_los/README.md``,
"One number per pixel"): the column is well measured, the radial structure mostly comes from
the prior, and the posterior standard deviation says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import los

import chunkop

try:
    import nifty.re as jft
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError('nifty_vi.py needs NIFTy.re: pip install -e ".[nifty]"') from err


@dataclasses.dataclass(frozen=True)
class Size:
    nx: int
    ny: int
    n_bins: int
    n_los: int
    chunk: int  # lines per chunk of the RowOperator
    iters: int  # optimize_kl iterations
    samples: int  # MGVI samples per iteration (mirrored: twice as many are used)
    cg_iters: int  # cap on the CG iterations that draw a sample
    kl_iters: int  # cap on the Newton-CG steps of each KL minimisation


SIZES = {
    "tiny": Size(nx=8, ny=6, n_bins=12, n_los=1500, chunk=500, iters=2, samples=2, cg_iters=20, kl_iters=3),
    "small": Size(nx=32, ny=24, n_bins=24, n_los=24_000, chunk=4096, iters=12, samples=4, cg_iters=60, kl_iters=8),
}


def radial_profile(edges: np.ndarray) -> np.ndarray:
    """The fixed radial density profile ``rho(r) = 1 / (1 + (r / 400)^2)`` at the bin centres."""
    r = np.sqrt(edges[:-1] * edges[1:])
    return 1.0 / (1.0 + (r / 400.0) ** 2)


def correlated_field(nx: int, ny: int, edges: np.ndarray) -> jft.Model:
    """The log-density prior: a correlated field on ``(nx, ny, n_bins)`` (pixels of unit size,
    radial bins uniform in ``ln r``) with a product of a plane-of-sky and a radial power spectrum."""
    cfm = jft.CorrelatedFieldMaker("sky ")
    cfm.set_amplitude_total_offset(offset_mean=0.0, offset_std=(0.3, 0.1))
    cfm.add_fluctuations(
        (nx, ny),
        distances=1.0,
        fluctuations=(0.6, 0.2),
        loglogavgslope=(-3.0, 0.5),
        flexibility=(0.5, 0.2),
        asperity=None,
        prefix="xy ",
        non_parametric_kind="power",
    )
    dlnr = float(np.log(edges[1] / edges[0]))
    cfm.add_fluctuations(
        edges.size - 1,
        distances=dlnr,
        fluctuations=(0.6, 0.2),
        loglogavgslope=(-4.0, 0.5),
        flexibility=None,
        asperity=None,
        prefix="r ",
        non_parametric_kind="power",
    )
    return cfm.finalize()


class Sky(jft.Model):
    """``sky = rho(r) * exp(field)``, shape ``(n_pix, n_bins)``."""

    field: jft.Model = dataclasses.field(metadata=dict(static=False))
    log_rho: jax.Array = dataclasses.field(metadata=dict(static=False))

    def __init__(self, field: jft.Model, log_rho: jax.Array):
        self.field = field
        self.log_rho = log_rho
        super().__init__(init=field.init)

    def __call__(self, xi: Any) -> jax.Array:
        s = self.field(xi)  # (nx, ny, n_bins)
        return jnp.exp(self.log_rho + s).reshape(-1, s.shape[-1])


class Response(jft.Model):
    """The data model ``xi -> A @ sky(xi)``; ``A`` is any linear map of the sky (e.g. a
    ``chunkop.RowOperator``), or a plain function of the sky (``apply``)."""

    sky: Sky = dataclasses.field(metadata=dict(static=False))
    A: Any = dataclasses.field(metadata=dict(static=False))

    def __init__(self, sky: Sky, A: Any):
        self.sky = sky
        self.A = A
        super().__init__(init=sky.init)

    def __call__(self, xi: Any) -> jax.Array:
        sky = self.sky(xi)
        return self.A.mv(sky) if isinstance(self.A, chunkop.RowOperator) else self.A(sky)


@dataclasses.dataclass
class Setup:
    size: Size
    edges: np.ndarray
    sky: Sky
    A: chunkop.RowOperator
    pix: jax.Array
    d: jax.Array
    s: jax.Array
    xi_true: Any
    sky_true: jax.Array
    y: jax.Array
    sigma: float

    def likelihood(self, response: str = "chunkop") -> jft.Likelihood:
        """``jft.Gaussian(y, 1/sigma^2).amend(Response)``, with the chunked ``RowOperator`` response
        (``"chunkop"``) or the unchunked ``jax.vmap`` reference ``los.los_vmap`` (``"vmap"``)."""
        if response == "chunkop":
            A: Any = self.A
        elif response == "vmap":
            pix, d, s, edges = self.pix, self.d, self.s, self.edges
            A = jax.tree_util.Partial(lambda sky: los.los_vmap(pix, d, s, sky, edges))
        else:
            raise ValueError(f"response must be 'chunkop' or 'vmap', got {response!r}")
        inv_std = 1.0 / self.sigma
        gaussian = jft.Gaussian(self.y, noise_cov_inv=lambda r: inv_std**2 * r, noise_std_inv=lambda r: inv_std * r)
        return gaussian.amend(Response(self.sky, A))


@jax.jit
def _truth_and_data(sky: Sky, A: chunkop.RowOperator, xi: Any) -> tuple[jax.Array, jax.Array]:
    truth = sky(xi)
    return truth, A.mv(truth)


@jax.jit
def _posterior_summary(sky: Sky, A: chunkop.RowOperator, samples: Any) -> tuple[jax.Array, jax.Array]:
    """The sky of every sample, and the mean of their data predictions (``A`` is linear: ``A`` of the mean sky)."""
    skies = jax.vmap(sky)(samples)
    return skies, A.mv(skies.mean(0))


def make_setup(size: str = "small", *, seed: int = 0, noise: float = 0.02, chunk: int | None = None) -> Setup:
    """A synthetic problem: a prior draw as the truth, the users' random lines, noisy data."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    cfg = SIZES[size]
    edges = los.bin_edges(cfg.n_bins)
    field = correlated_field(cfg.nx, cfg.ny, edges)
    sky = Sky(field, jnp.asarray(np.log(radial_profile(edges)), jnp.float32))
    rng = np.random.default_rng(seed)
    pix, d, s = los.draw_lines(cfg.n_los, cfg.nx * cfg.ny, rng)
    A = los.make_los_operator(pix, d, s, n_pix=cfg.nx * cfg.ny, edges=edges, chunk_size=chunk or cfg.chunk)
    xi_true = jft.Vector(sky.init(jax.random.key(seed + 1)))
    sky_true, y_clean = _truth_and_data(sky, A, xi_true)
    sigma = float(noise * jnp.sqrt(jnp.mean(y_clean**2)))
    y = y_clean + sigma * jnp.asarray(rng.standard_normal(cfg.n_los), jnp.float32)
    return Setup(cfg, edges, sky, A, A.rows["pix"], A.rows["d"], A.rows["s"], xi_true, sky_true, y, sigma)


def rel_err(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run(
    size: str = "small",
    out: str | None = "outputs/astro_los_nifty",
    *,
    iters: int | None = None,
    samples: int | None = None,
    chunk: int | None = None,
    seed: int = 0,
    figures: bool = True,
) -> dict:
    """Run MGVI on the problem of ``size``; returns the results (also written to ``out``)."""
    t0 = time.perf_counter()
    S = make_setup(size, seed=seed, chunk=chunk)
    cfg = S.size
    lh = S.likelihood("chunkop")
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(S.xi_true))
    print(
        f"{size}: sky {cfg.nx}x{cfg.ny} pixels x {cfg.n_bins} bins, {cfg.n_los} lines "
        f"(chunk {S.A.chunk_size}), {n_params} latent parameters",
        flush=True,
    )

    key, k_init = jax.random.split(jax.random.key(seed + 2))
    xi0 = jft.Vector(lh.init(k_init))
    xi0 = jax.tree_util.tree_map(lambda x: 0.1 * x, xi0)  # start near the prior median
    samples_out, state = jft.optimize_kl(
        lh,
        xi0,
        n_total_iterations=iters or cfg.iters,
        n_samples=samples or cfg.samples,
        key=key,
        draw_linear_kwargs=dict(cg_name="SL", cg_kwargs=dict(absdelta=1e-4 * n_params, maxiter=cfg.cg_iters)),
        nonlinearly_update_kwargs=dict(
            minimize_kwargs=dict(name="SN", xtol=1e-4, cg_kwargs=dict(name=None), maxiter=3)
        ),
        kl_kwargs=dict(minimize_kwargs=dict(name="M", xtol=1e-4, cg_kwargs=dict(name=None), maxiter=cfg.kl_iters)),
        sample_mode="linear_resample",
        odir=None,
    )
    skies, y_pred = _posterior_summary(S.sky, S.A, samples_out.samples)  # skies: (n_samples, n_pix, n_bins)
    mean, std = jnp.mean(skies, 0), jnp.std(skies, 0, ddof=1)
    columns = skies.sum(-1)
    col_mean, col_std = columns.mean(0), columns.std(0, ddof=1)
    col_true = S.sky_true.sum(-1)
    prior_sky = jnp.broadcast_to(jnp.exp(S.sky.log_rho), S.sky_true.shape)  # the prior median
    chi2 = float(jnp.mean(((y_pred - S.y) / S.sigma) ** 2))
    results = {
        "size": size,
        "n_pix": cfg.nx * cfg.ny,
        "n_bins": cfg.n_bins,
        "n_los": cfg.n_los,
        "n_latent": int(n_params),
        "chunk_size": int(S.A.chunk_size),
        "n_samples": len(samples_out),
        "iterations": int(state.nit),
        "rel_err_sky": rel_err(mean, S.sky_true),
        "rel_err_sky_prior": rel_err(prior_sky, S.sky_true),
        "rel_err_column": rel_err(col_mean, col_true),
        "rel_err_column_prior": rel_err(prior_sky.sum(-1), col_true),
        "column_within_2std": float(jnp.mean(jnp.abs(col_mean - col_true) < 2 * col_std)),
        "sky_within_2std": float(jnp.mean(jnp.abs(mean - S.sky_true) < 2 * std)),
        "chi2_per_line": chi2,
        "seconds": time.perf_counter() - t0,
    }
    for k, v in results.items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        if figures:
            plot(S, mean, std, col_mean, col_std, os.path.join(out, "posterior.png"))
        print(f"wrote {os.path.abspath(out)}", flush=True)
    return results


def plot(S: Setup, mean, std, col_mean, col_std, path: str) -> None:
    """Truth, posterior mean and posterior std of the column and of one distance slice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = S.size
    k = cfg.n_bins // 3
    r_k = float(np.sqrt(S.edges[k] * S.edges[k + 1]))
    grid = lambda a: np.asarray(a).reshape(cfg.nx, cfg.ny).T
    rows = [
        ("distance-integrated column", S.sky_true.sum(-1), col_mean, col_std),
        (f"slice r = {r_k:.0f}", S.sky_true[:, k], mean[:, k], std[:, k]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), constrained_layout=True)
    for ax_row, (name, truth, m, sd) in zip(axes, rows):
        lo, hi = float(np.min(truth)), float(np.max(truth))
        for ax, img, title, kw in (
            (ax_row[0], truth, f"truth: {name}", dict(vmin=lo, vmax=hi)),
            (ax_row[1], m, "posterior mean", dict(vmin=lo, vmax=hi)),
            (ax_row[2], sd, "posterior std", dict(cmap="magma")),
        ):
            im = ax.imshow(grid(img), origin="lower", **kw)
            ax.set_title(title)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"NIFTy.re MGVI with a chunkop.RowOperator response ({cfg.n_los} lines)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--out", default="outputs/astro_los_nifty")
    p.add_argument("--iters", type=int, default=None, help="optimize_kl iterations")
    p.add_argument("--samples", type=int, default=None, help="MGVI samples (x2, mirrored)")
    p.add_argument("--chunk", type=int, default=None, help="lines per chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-figures", action="store_true")
    a = p.parse_args(argv)
    run(a.size, a.out, iters=a.iters, samples=a.samples, chunk=a.chunk, seed=a.seed, figures=not a.no_figures)


if __name__ == "__main__":
    main()
