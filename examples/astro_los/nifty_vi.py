"""Variational inference of a 3-D sky with NIFTy.re, the response a chunked ``chunkop.RowOperator``.

    python examples/astro_los/nifty_vi.py [--size tiny|small] [--out DIR] [--seed S] [--noise F]
                                          [--prior default|inferred|wide] [--iters N] [--samples N]
                                          [--final-samples N] [--chunk C] [--r-pad P] [--xy-pad P]
                                          [--kl-iters N] [--geovi] [--nl-iters N]
                                          [--fix-hyperparameters] [--vi-seed S] [--no-figures]

The model (``pip install -e ".[nifty]"``, NIFTy.re is ``import nifty.re as jft``):

* **sky**: ``sky = rho(r) * exp(s)`` on ``(n_pix, n_bins)`` (``n_pix = nx * ny`` plane-of-sky
  pixels, radial bins ``geomspace(40, 1700, n_bins + 1)``), where ``rho(r) = 1 / (1 + (r/400)^2)``
  is a fixed radial profile and ``s`` a **correlated field** (``jft.CorrelatedFieldMaker``) on the
  ``(nx, ny, n_bins)`` grid whose power spectrum is a product of a plane-of-sky and a radial
  (log-distance) spectrum. ``--prior`` (``PRIORS``): ``default`` holds the spectrum fixed (a known
  spectrum; log-sky prior std 0.32-0.36 per voxel, 0.3 of it the overall level); ``inferred``
  infers the same spectrum's amplitudes and slopes; ``wide`` is the first version of this example
  (a dust-like sky, log-sky prior std 1.4-1.95 per voxel, spectrum inferred);
* **response**: the users' line-of-sight operator ``y_l = sum_k w_k(d_l, s_l) sky[pix_l, k]``
  from ``los.py``, a ``chunkop.RowOperator``: the ``n_los x n_bins`` weights are recomputed chunk
  by chunk, never stored, in the forward model, its jvp/vjp (MGVI's metric) and under the
  ``jax.vmap`` over samples that ``jft.optimize_kl`` applies;
* **likelihood**: ``jft.Gaussian(y, noise_cov_inv).amend(response)``;
* **inference**: ``jft.optimize_kl`` (MGVI: linear samples, mirrored, and a KL minimisation by
  Newton-CG per iteration; 4 sample pairs per iteration, 16 in the last, whose samples are the
  reported posterior).

The truth is a draw from the model's own prior (every latent the model uses; fixed seed) and the
lines are the users' random lines (``los.draw_lines``); data get Gaussian noise of 10% of the rms
signal (``--noise``). The sample-drawing CG runs to convergence (cap 300; the metric applications
are counted and reported), NIFTy's ``minisanity`` is logged every iteration (reduced chi^2 of the
data and of every latent excitation), and the script reports the KL energy trajectory, the chi^2
per line of the posterior mean, z-scores and 2-sigma coverage of the log-sky (per voxel and per
distance bin), of the column (sum over the bins) and of the combination the lines measure, and
the truth's z-score for each inferred hyperparameter. It writes ``posterior.png`` and
``results.json`` into ``--out`` (default ``outputs/astro_los_nifty/``). ``--geovi`` switches to
geoVI; ``--fix-hyperparameters`` holds inferred hyperparameters at their truth (a diagnostic);
``--vi-seed S`` draws another starting point and other samples for the same truth and data.
``--r-pad P`` / ``--xy-pad P`` build the (periodic) correlated field on ``P`` times the radial /
plane-of-sky extent and crop it, so the nearest and the farthest bin are no longer neighbours.

Units: distances in pc; the sky in the model's arbitrary density units (prior median
``rho(r)``, 1 at r = 0); the column is the sum over the radial bins (uniform in ``ln r``) in the
same units.

The data constrain about one radial combination per pixel (``examples/astro_los/README.md``,
"One number per pixel"): every line through a pixel measures ``sum_k v_k sky_k`` with
``v ~ diff(-1/b)`` up to a factor ``1/s``. MGVI approximates the posterior by a Gaussian in the
latent space; ``nifty_reference.py`` computes the exact posterior of the linearised problem, the
Laplace posterior and an HMC reference, and ``docs/nifty.md`` has the measured numbers
(``nifty_tiny_results.json``): with the ``wide`` prior and 2% noise the posterior is far from
Gaussian and MGVI is over-confident; with the default it is nearly Gaussian and MGVI nearly
calibrated: ``nifty_calibration.py`` runs many truths; over 60, MGVI covers 94.5% of the columns
within 2 sigma and the exact posterior 96.3% (``nifty_calibration.json``).
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
    final_samples: int  # samples of the last iteration, the posterior that is reported (mirrored: x2)
    cg_iters: int  # cap on the CG iterations that draw a sample (they stop earlier when converged)
    kl_iters: int  # cap on the Newton-CG steps of each KL minimisation
    r_pad: int = 1  # the correlated field lives on r_pad * n_bins radial bins (cropped): no wrap-around
    xy_pad: int = 1  # the same for both plane-of-sky axes


SIZES = {
    "tiny": Size(
        nx=8, ny=6, n_bins=12, n_los=1500, chunk=500, iters=6, samples=4, final_samples=16, cg_iters=300, kl_iters=10
    ),
    "small": Size(
        nx=32,
        ny=24,
        n_bins=24,
        n_los=24_000,
        chunk=4096,
        iters=12,
        samples=4,
        final_samples=16,
        cg_iters=300,
        kl_iters=10,
    ),
}


def _size(size: str | Size) -> Size:
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return SIZES[size] if isinstance(size, str) else size


Hyper = tuple[float, float] | float


@dataclasses.dataclass(frozen=True)
class Prior:
    """The hyperparameters of the correlated field: a number is held fixed (a known power
    spectrum), ``(mean, std)`` is inferred with NIFTy's prior for it, as ``jft.CorrelatedFieldMaker``
    takes them (``None``: that part of the spectrum is left out)."""

    offset_std: Hyper = 0.3
    xy_fluctuations: Hyper = 0.1
    xy_slope: Hyper = -3.0
    xy_flexibility: Hyper | None = None
    r_fluctuations: Hyper = 0.1
    r_slope: Hyper = -4.0

    def fixed(self) -> tuple[str, ...]:
        """The latent names (``"sky ..."``) of the hyperparameters held fixed: their excitations are
        in the latent vector but unused (posterior = prior), so they are left out of the statistics."""
        names = {
            "offset_std": "sky zeromode",
            "xy_fluctuations": "sky xy fluctuations",
            "xy_slope": "sky xy loglogavgslope",
            "xy_flexibility": "sky xy flexibility",
            "r_fluctuations": "sky r fluctuations",
            "r_slope": "sky r loglogavgslope",
        }
        return tuple(
            n for f, n in names.items() if getattr(self, f) is not None and not isinstance(getattr(self, f), tuple)
        )


PRIORS = {
    # a known spectrum, log-sky prior std 0.32-0.36 per voxel (0.3 of it the overall level)
    "default": Prior(),
    # the same spectrum inferred: MGVI collapses the radial amplitude the data do not measure
    "inferred": Prior(
        offset_std=(0.3, 0.1),
        xy_fluctuations=(0.1, 0.03),
        xy_slope=(-3.0, 0.5),
        r_fluctuations=(0.1, 0.03),
        r_slope=(-4.0, 0.5),
    ),
    # the first version: a dust-like sky (log-sky prior std 1.4-1.95 per voxel), spectrum inferred
    "wide": Prior(
        offset_std=(0.3, 0.1),
        xy_fluctuations=(0.6, 0.2),
        xy_slope=(-3.0, 0.5),
        xy_flexibility=(0.5, 0.2),
        r_fluctuations=(0.6, 0.2),
        r_slope=(-4.0, 0.5),
    ),
}


def radial_profile(edges: np.ndarray) -> np.ndarray:
    """The fixed radial density profile ``rho(r) = 1 / (1 + (r / 400)^2)`` at the bin centres."""
    r = np.sqrt(edges[:-1] * edges[1:])
    return 1.0 / (1.0 + (r / 400.0) ** 2)


def _hyper(p: Hyper | None):
    """A hyperparameter prior as ``jft.CorrelatedFieldMaker`` takes it: ``(mean, std)`` is inferred
    (NIFTy's default prior), a plain number is held fixed (its latent is kept, but unused)."""
    if p is None or isinstance(p, tuple):
        return p
    value = float(p)
    return lambda xi: jnp.full(jnp.shape(xi), value, jnp.result_type(xi))


def correlated_field(
    nx: int, ny: int, edges: np.ndarray, prior: Prior = Prior(), *, r_pad: int = 1, xy_pad: int = 1
) -> jft.Model:
    """The log-density prior: a correlated field on ``(nx, ny, n_bins)`` (pixels of unit size,
    radial bins uniform in ``ln r``) with a product of a plane-of-sky and a radial power spectrum.

    The field is periodic (FFT-based): built on ``(xy_pad * nx, xy_pad * ny, r_pad * n_bins)``
    and cropped by ``Sky`` to the first ``(nx, ny, n_bins)``, the nearest and the farthest bin
    (and opposite plane-of-sky edges) are no longer neighbours."""
    nx, ny = xy_pad * nx, xy_pad * ny
    cfm = jft.CorrelatedFieldMaker("sky ")
    cfm.set_amplitude_total_offset(offset_mean=0.0, offset_std=_hyper(prior.offset_std))
    cfm.add_fluctuations(
        (nx, ny),
        distances=1.0,
        fluctuations=_hyper(prior.xy_fluctuations),
        loglogavgslope=_hyper(prior.xy_slope),
        flexibility=_hyper(prior.xy_flexibility),
        asperity=None,
        prefix="xy ",
        non_parametric_kind="power",
    )
    dlnr = float(np.log(edges[1] / edges[0]))
    cfm.add_fluctuations(
        r_pad * (edges.size - 1),
        distances=dlnr,
        fluctuations=_hyper(prior.r_fluctuations),
        loglogavgslope=_hyper(prior.r_slope),
        flexibility=None,
        asperity=None,
        prefix="r ",
        non_parametric_kind="power",
    )
    return cfm.finalize()


class Sky(jft.Model):
    """``sky = rho(r) * exp(field)``, shape ``(n_pix, n_bins)``; the field (possibly padded) is
    cropped to its first ``shape = (nx, ny, n_bins)``."""

    field: jft.Model = dataclasses.field(metadata=dict(static=False))
    log_rho: jax.Array = dataclasses.field(metadata=dict(static=False))
    shape: tuple[int, int, int]

    def __init__(self, field: jft.Model, log_rho: jax.Array, shape: tuple[int, int, int]):
        self.field = field
        self.log_rho = log_rho
        self.shape = tuple(int(n) for n in shape)
        super().__init__(init=field.init)

    def __call__(self, xi: Any) -> jax.Array:
        nx, ny, nb = self.shape
        s = self.field(xi)[:nx, :ny, :nb]
        return jnp.exp(self.log_rho + s).reshape(-1, nb)


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


def make_setup(
    size: str | Size = "small",
    *,
    seed: int = 0,
    noise: float = 0.1,
    chunk: int | None = None,
    prior: str | Prior = "default",
) -> Setup:
    """A synthetic problem: a draw from the model's own prior (hyperparameters included) as the
    truth, the users' random lines, noisy data."""
    cfg = _size(size)
    prior = PRIORS[prior] if isinstance(prior, str) else prior
    edges = los.bin_edges(cfg.n_bins)
    field = correlated_field(cfg.nx, cfg.ny, edges, prior, r_pad=cfg.r_pad, xy_pad=cfg.xy_pad)
    sky = Sky(field, jnp.asarray(np.log(radial_profile(edges)), jnp.float32), (cfg.nx, cfg.ny, cfg.n_bins))
    rng = np.random.default_rng(seed)
    pix, d, s = los.draw_lines(cfg.n_los, cfg.nx * cfg.ny, rng)
    A = los.make_los_operator(pix, d, s, n_pix=cfg.nx * cfg.ny, edges=edges, chunk_size=chunk or cfg.chunk)
    xi_true = jft.Vector(sky.init(jax.random.key(seed + 1)))  # every latent, hyperparameters too
    sky_true, y_clean = _truth_and_data(sky, A, xi_true)
    sigma = float(noise * jnp.sqrt(jnp.mean(y_clean**2)))
    y = y_clean + sigma * jnp.asarray(rng.standard_normal(cfg.n_los), jnp.float32)
    return Setup(cfg, edges, sky, A, A.rows["pix"], A.rows["d"], A.rows["s"], xi_true, sky_true, y, sigma)


def rel_err(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


class CountingCG:
    """``jft.conjugate_gradient.cg`` that records, per solve, how many times it applied the
    metric (CG iterations + 1 for the start residual + 1 per restart every 20 iterations) and
    whether it converged (NIFTy's ``info == 0``) rather than stopping at ``maxiter``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, mat, j, x0=None, **kwargs):
        n = [0]

        def counted(x):
            n[0] += 1
            return mat(x)

        x, info = jft.conjugate_gradient.cg(counted, j, x0, **kwargs)
        self.calls.append((n[0], int(info) == 0))
        return x, info


def _latent_stats(samples: Any, truth: Any, unused: tuple[str, ...] = ()) -> dict:
    """Per latent leaf (``unused`` ones left out): NIFTy's reduced chi^2 of the excitations
    (``jft.reduced_residual_stats``: mean over samples of ``|xi|^2 / n``; about 1 under the prior)
    and, for the scalar hyperparameters, the truth's z-score under the posterior samples."""
    stats = jft.reduced_residual_stats(samples)
    out = {}
    for k, st in stats.tree.items():
        if k in unused:
            continue
        entry = {"reduced_chi2": float(st.reduced_chisq[0]), "ndof": int(st.ndof)}
        if samples.samples.tree[k].ndim == 1:  # a scalar latent: (n_samples,)
            s = samples.samples.tree[k]
            entry["posterior_mean"] = float(s.mean())
            entry["posterior_std"] = float(s.std(ddof=1))
            entry["truth"] = float(truth.tree[k])
            entry["truth_z"] = float((truth.tree[k] - s.mean()) / s.std(ddof=1))
        out[k] = entry
    return out


@jax.jit
def _prior_log_sky_std(sky: Sky, key: jax.Array) -> jax.Array:
    """The prior standard deviation of ``log sky`` per voxel, from 256 prior draws."""
    keys = jax.random.split(key, 256)
    logs = jax.vmap(lambda k: jnp.log(sky(jft.Vector(sky.init(k)))))(keys)
    return logs.std(0)


def measured_weights(edges: np.ndarray) -> np.ndarray:
    """What one line measures, normalised: ``w_k ~ (1/b_k - 1/b_{k+1}) / s`` within ~1% for all
    distances (``los.py``), so every line through a pixel sees nearly the same combination
    ``sum_k v_k sky_k``, ``v = diff(-1/b) / sum``."""
    v = 1.0 / edges[:-1] - 1.0 / edges[1:]
    return v / v.sum()


def posterior_stats(S: Setup, skies: jax.Array) -> dict:
    """Accuracy and calibration of the posterior samples ``skies`` (n_samples, n_pix, n_bins)
    against the truth: z-scores ``(truth - mean) / std`` and 2-sigma coverage of the log-sky per
    voxel and per distance bin, of the column (sum over the bins) and of the data-weighted
    combination the lines measure."""
    truth = S.sky_true
    logs = jnp.log(skies)
    z_log = (jnp.log(truth) - logs.mean(0)) / logs.std(0, ddof=1)
    v = jnp.asarray(measured_weights(S.edges), skies.dtype)
    out = {"log_sky_z": z_log}
    for name, q, q_true in (
        ("column", skies.sum(-1), truth.sum(-1)),
        ("measured", skies @ v, truth @ v),
    ):
        out[f"{name}_z"] = (q_true - q.mean(0)) / q.std(0, ddof=1)
        out[f"{name}_mean"], out[f"{name}_std"] = q.mean(0), q.std(0, ddof=1)
    return out


def column_coverage(st: dict) -> dict:
    """From :func:`posterior_stats`: the share of the truth's columns within 2 and 1 posterior
    std and of its measured combinations within 2, the columns' median ``|z|`` and their
    z-scores (one per pixel), as ``run`` and ``nifty_reference.py`` report them."""
    within = lambda z, k: float(jnp.mean(jnp.abs(z) < k))
    return {
        "column_within_2std": within(st["column_z"], 2),
        "column_within_1std": within(st["column_z"], 1),
        "measured_within_2std": within(st["measured_z"], 2),
        "median_abs_z_column": float(jnp.median(jnp.abs(st["column_z"]))),
        "column_z": [round(float(z), 3) for z in st["column_z"]],  # per pixel: (truth - mean) / std
    }


def optimize_kl_settings(cfg: Size, n_params: int, cg: Any = None, *, nl_iters: int = 10) -> dict:
    """The ``jft.optimize_kl`` settings of the example (also used by ``nifty_reference.py``):
    ``cfg.iters`` iterations of ``cfg.samples`` mirrored sample pairs, ``cfg.final_samples`` in the
    last one (the reported posterior); sample CG to convergence (``cg``: e.g. a ``CountingCG``);
    at most ``cfg.kl_iters`` Newton-CG steps per KL minimisation."""
    cg = jft.conjugate_gradient.cg if cg is None else cg

    def n_samples(i: int) -> int:
        return cfg.final_samples if i >= cfg.iters - 1 else cfg.samples

    return dict(
        n_total_iterations=cfg.iters,
        n_samples=n_samples,
        draw_linear_kwargs=dict(
            cg=cg, cg_name=None, cg_kwargs=dict(absdelta=1e-4 * n_params / 10, maxiter=cfg.cg_iters)
        ),
        nonlinearly_update_kwargs=dict(
            minimize_kwargs=dict(name=None, xtol=1e-4, cg_kwargs=dict(name=None), maxiter=nl_iters)
        ),
        kl_kwargs=dict(
            minimize_kwargs=dict(
                name=None, xtol=1e-4, absdelta=1e-3 * n_params / 10, cg_kwargs=dict(name=None), maxiter=cfg.kl_iters
            )
        ),
    )


def run(
    size: str | Size = "small",
    out: str | None = "outputs/astro_los_nifty",
    *,
    iters: int | None = None,
    samples: int | None = None,
    final_samples: int | None = None,
    chunk: int | None = None,
    seed: int = 0,
    noise: float = 0.1,
    prior: str | Prior = "default",
    sample_mode: str = "linear_resample",
    fix_hyperparameters: bool = False,
    r_pad: int | None = None,
    xy_pad: int | None = None,
    kl_iters: int | None = None,
    nl_iters: int = 10,
    vi_seed: int | None = None,
    figures: bool = True,
    verbose: bool = True,
) -> dict:
    """Run MGVI (or geoVI: ``sample_mode="nonlinear_resample"``) on the problem of ``size``;
    returns the results (also written to ``out``). ``samples`` pairs of mirrored samples per
    iteration, ``final_samples`` pairs in the last one (the reported posterior).
    ``fix_hyperparameters``: a diagnostic run with the spectrum's inferred hyperparameters held
    at their true values. ``vi_seed`` seeds the initial position and the samples (default
    ``seed + 2``) without changing the truth, lines or data of ``seed``: how much of a coverage
    figure is the draw of the samples."""
    t0 = time.perf_counter()
    overrides = dict(r_pad=r_pad, xy_pad=xy_pad, kl_iters=kl_iters, iters=iters, samples=samples)
    overrides["final_samples"] = final_samples
    cfg = dataclasses.replace(_size(size), **{k: v for k, v in overrides.items() if v is not None})
    prior = PRIORS[prior] if isinstance(prior, str) else prior
    S = make_setup(cfg, seed=seed, noise=noise, chunk=chunk, prior=prior)
    lh = S.likelihood("chunkop")
    unused = prior.fixed()  # excitations of fixed hyperparameters: in the latent vector, unused
    n_params = sum(v.size for k, v in S.xi_true.tree.items() if k not in unused)
    size_name = size if isinstance(size, str) else "custom"
    print(
        f"{size_name}: sky {cfg.nx}x{cfg.ny} pixels x {cfg.n_bins} bins, {cfg.n_los} lines "
        f"(chunk {S.A.chunk_size}), {n_params} latent parameters, field padded x{cfg.xy_pad} "
        f"(plane of sky) x{cfg.r_pad} (radial)",
        flush=True,
    )

    key, k_init = jax.random.split(jax.random.key(seed + 2 if vi_seed is None else vi_seed))
    xi0 = jft.Vector(lh.init(k_init))
    xi0 = jax.tree_util.tree_map(lambda x: 0.1 * x, xi0)  # start near the prior median
    hyper = tuple(k for k in S.xi_true.tree if k != "sky xi" and k not in unused)
    fixed: tuple[str, ...] = ()
    if fix_hyperparameters:
        fixed = hyper
        xi0 = jft.Vector({k: (S.xi_true.tree[k] if k in fixed else v) for k, v in xi0.tree.items()})

    cg = CountingCG()
    history: list[dict] = []

    def callback(smpls: jft.Samples, state: Any) -> None:
        ms = state.minimization_state
        resid = jft.reduced_residual_stats(smpls, lh.normalized_residual)
        entry = {
            "iteration": int(state.nit),
            "kl_energy": float(ms.fun),
            "kl_newton_steps": int(ms.nit),
            "kl_converged": int(ms.status) == 0,
            "reduced_chi2_data": float(resid.reduced_chisq[0]),
        }
        ss = state.sample_state
        if ss is not None and hasattr(ss, "nit"):  # geoVI: the nonlinear sample updates
            entry["nonlinear_update_steps"] = [int(n) for n in np.atleast_1d(ss.nit)]
            entry["nonlinear_update_converged"] = [int(st) == 0 for st in np.atleast_1d(ss.status)]
        history.append(entry)
        if verbose:
            _, msg = jft.minisanity(smpls)
            print(
                f"  it {entry['iteration']:2d}: KL energy {entry['kl_energy']:.6g}, "
                f"{entry['kl_newton_steps']} Newton steps (converged: {entry['kl_converged']}), "
                f"data reduced chi2 {entry['reduced_chi2_data']:.3f}, "
                f"sample CG metric applications {[c[0] for c in cg.calls[-n_samples(state.nit - 1) :]]}"
                + (
                    f", nonlinear update steps {entry['nonlinear_update_steps']} "
                    f"(converged {entry['nonlinear_update_converged']})"
                    if "nonlinear_update_steps" in entry
                    else ""
                ),
                flush=True,
            )
            if entry["iteration"] == cfg.iters:
                print("  NIFTy minisanity of the latent excitations:\n" + msg, flush=True)

    n_samples = optimize_kl_settings(cfg, n_params, cg, nl_iters=nl_iters)["n_samples"]
    samples_out, state = jft.optimize_kl(
        lh,
        xi0,
        key=key,
        point_estimates=fixed,
        constants=fixed,
        sample_mode=sample_mode,
        callback=callback,
        odir=None,
        **optimize_kl_settings(cfg, n_params, cg, nl_iters=nl_iters),
    )
    skies, y_pred = _posterior_summary(S.sky, S.A, samples_out.samples)  # skies: (n_samples, n_pix, n_bins)
    st = posterior_stats(S, skies)
    z_log = st["log_sky_z"]
    prior_std = _prior_log_sky_std(S.sky, jax.random.key(seed + 4))
    post_std = jnp.log(skies).std(0, ddof=1)
    mean = jnp.mean(skies, 0)
    col_true = S.sky_true.sum(-1)
    prior_sky = jnp.broadcast_to(jnp.exp(S.sky.log_rho), S.sky_true.shape)  # the prior median
    chi2 = float(jnp.mean(((y_pred - S.y) / S.sigma) ** 2))
    cover = lambda z: float(jnp.mean(jnp.abs(z) < 2))
    r_mid = np.sqrt(S.edges[:-1] * S.edges[1:])
    cg_n = np.array([c[0] for c in cg.calls]) if cg.calls else np.zeros(1, int)
    results = {
        "size": size_name,
        "n_pix": cfg.nx * cfg.ny,
        "n_bins": cfg.n_bins,
        "n_los": cfg.n_los,
        "n_latent": int(n_params),
        "r_pad": cfg.r_pad,
        "xy_pad": cfg.xy_pad,
        "kl_iters_cap": cfg.kl_iters,
        "seed": seed,
        "vi_seed": seed + 2 if vi_seed is None else vi_seed,
        "chunk_size": int(S.A.chunk_size),
        "sample_mode": sample_mode,
        "prior": {k: v for k, v in dataclasses.asdict(prior).items()},
        "spectrum_fixed": list(unused),
        "hyperparameters_fixed_at_truth": bool(fix_hyperparameters),
        "noise": noise,
        "samples_per_iteration": 2 * cfg.samples,
        "n_samples": len(samples_out),
        "iterations": int(state.nit),
        "noise_sigma": S.sigma,
        "chi2_per_line": chi2,
        "reduced_chi2_data": history[-1]["reduced_chi2_data"],
        "rel_err_sky": rel_err(mean, S.sky_true),
        "rel_err_sky_prior": rel_err(prior_sky, S.sky_true),
        "rel_err_column": rel_err(st["column_mean"], col_true),
        "rel_err_column_prior": rel_err(prior_sky.sum(-1), col_true),
        **column_coverage(st),
        "log_sky_within_2std": cover(z_log),
        "sky_within_2std": cover(z_log),
        "median_abs_z_log_sky": float(jnp.median(jnp.abs(z_log))),
        "mean_z_column": float(jnp.mean(st["column_z"])),
        "mean_z_log_sky": float(jnp.mean(z_log)),
        "per_bin": {
            "r_pc": [float(r) for r in r_mid],
            "log_sky_within_2std": [float(c) for c in jnp.mean(jnp.abs(z_log) < 2, 0)],
            "median_abs_z": [float(c) for c in jnp.median(jnp.abs(z_log), 0)],
            "mean_z": [float(c) for c in jnp.mean(z_log, 0)],
            "posterior_over_prior_std": [float(c) for c in jnp.mean(post_std / prior_std, 0)],
        },
        "sample_cg": {
            "solves": len(cg.calls),
            "converged": int(sum(c[1] for c in cg.calls)),
            "cap": cfg.cg_iters,
            "metric_applications_median": float(np.median(cg_n)),
            "metric_applications_max": int(cg_n.max()),
        },
        "kl_history": history,
        "latents": _latent_stats(samples_out, S.xi_true, unused),
        "seconds": time.perf_counter() - t0,
    }
    if verbose:
        for k, v in results.items():
            if k in ("kl_history", "latents", "per_bin", "column_z"):
                continue
            print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
        print("  per distance bin (r pc: 2-sigma coverage of log sky, posterior/prior std):")
        pb = results["per_bin"]
        for r, c, q, mz in zip(pb["r_pc"], pb["log_sky_within_2std"], pb["posterior_over_prior_std"], pb["mean_z"]):
            print(f"    {r:7.0f}: {c:.2f}  {q:.2f}  mean z {mz:+.2f}")
        print("  hyperparameters (latent): truth z under the posterior, reduced chi2 of the excitations")
        for k, e in results["latents"].items():
            print(
                f"    {k:24s} chi2 {e['reduced_chi2']:.2f}"
                + (f"  truth_z {e['truth_z']:+.2f}" if "truth_z" in e else "")
            )
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        if figures:
            plot(S, skies, st, results, os.path.join(out, "posterior.png"))
        print(f"wrote {os.path.abspath(out)}", flush=True)
    return results


def plot(S: Setup, skies: jax.Array, st: dict, results: dict, path: str) -> None:
    """Truth, posterior mean, posterior std and z-score of the column and of one distance slice,
    and the 2-sigma coverage of the log-sky per distance bin.

    Units: distances in pc; the sky in the model's arbitrary density units (its prior median is
    ``rho(r) = 1 / (1 + (r / 400 pc)^2)``, 1 at r = 0); the column is the sum over the radial
    bins (bins uniform in ``ln r``: ``(1 / dln r) * integral sky d ln r``), in the same units.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = S.size
    k = cfg.n_bins // 3
    r_k = float(np.sqrt(S.edges[k] * S.edges[k + 1]))
    grid = lambda a: np.asarray(a).reshape(cfg.nx, cfg.ny).T
    mean, std = skies.mean(0), skies.std(0, ddof=1)
    rows = [
        ("column (sum over bins)", S.sky_true.sum(-1), st["column_mean"], st["column_std"], st["column_z"]),
        (f"sky at r = {r_k:.0f} pc", S.sky_true[:, k], mean[:, k], std[:, k], st["log_sky_z"][:, k]),
    ]
    fig = plt.figure(figsize=(15, 8.5), constrained_layout=True)
    gs = fig.add_gridspec(3, 4, height_ratios=[1, 1, 0.9])
    for i, (name, truth, m, sd, z) in enumerate(rows):
        lo, hi = float(min(np.min(truth), np.min(m))), float(max(np.max(truth), np.max(m)))  # one scale
        zc = float(np.mean(np.abs(np.asarray(z)) < 2))
        for j, (img, title, kw, unit) in enumerate(
            (
                (truth, f"truth: {name}", dict(vmin=lo, vmax=hi), "density units"),
                (m, "posterior mean", dict(vmin=lo, vmax=hi), "density units"),
                (sd, "posterior std", dict(cmap="magma"), "density units"),
                (
                    z,
                    f"z of {'log sky' if i else 'column'}: (truth - mean) / std\n|z| < 2 for {zc:.0%} of pixels",
                    dict(cmap="RdBu_r", vmin=-4, vmax=4),
                    "z",
                ),
            )
        ):
            ax = fig.add_subplot(gs[i, j])
            im = ax.imshow(grid(img), origin="lower", **kw)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("pixel x")
            ax.set_ylabel("pixel y")
            fig.colorbar(im, ax=ax, shrink=0.85, label=unit)
    pb = results["per_bin"]
    ax = fig.add_subplot(gs[2, :2])
    ax.semilogx(pb["r_pc"], pb["log_sky_within_2std"], "o-", label="log sky: |z| < 2 (fraction of pixels)")
    ax.semilogx(pb["r_pc"], pb["posterior_over_prior_std"], "s--", label="posterior / prior std of log sky")
    ax.axhline(0.954, color="gray", lw=0.8, ls=":", label="0.954 (calibrated Gaussian)")
    ax.set_xlabel("distance r [pc]")
    ax.set_ylim(0, max(1.3, max(pb["posterior_over_prior_std"]) + 0.1))
    ax.legend(fontsize=8)
    ax.set_title("per distance bin", fontsize=10)
    ax = fig.add_subplot(gs[2, 2:])
    ax.axis("off")
    sc = results["sample_cg"]
    h = results["kl_history"]
    lines = [
        f"{results['n_pix']} pixels x {results['n_bins']} bins, {results['n_los']} lines, "
        f"{results['n_latent']} latent parameters",
        f"{results['sample_mode']}, {results['iterations']} iterations, {results['samples_per_iteration']} samples "
        f"per iteration, {results['n_samples']} in the last (mirrored)",
        f"noise {results['noise']:.0%} of the rms signal; spectrum "
        + ("fixed (known)" if results["spectrum_fixed"] else "inferred"),
        f"data: chi2 per line of the mean {results['chi2_per_line']:.2f}, "
        f"reduced chi2 over samples {results['reduced_chi2_data']:.2f}",
        "2-sigma coverage (fraction of truth values within):",
        f"   measured combination sum_k v_k sky_k: {results['measured_within_2std']:.0%}",
        f"   column: {results['column_within_2std']:.0%}    log sky voxels: {results['log_sky_within_2std']:.0%}",
        f"   median |z|: column {results['median_abs_z_column']:.2f}, log sky {results['median_abs_z_log_sky']:.2f} "
        "(0.67 if calibrated)",
        f"sample CG: {sc['converged']}/{sc['solves']} converged, metric applications "
        f"median {sc['metric_applications_median']:.0f}, max {sc['metric_applications_max']} (cap {sc['cap']})",
        "KL energy by iteration: " + ", ".join(f"{e['kl_energy']:.0f}" for e in h[-6:]),
    ]
    ax.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8.5, transform=ax.transAxes)
    fig.suptitle(
        "NIFTy.re MGVI with a chunkop.RowOperator response: sky in arbitrary density units "
        "(prior median 1 / (1 + (r / 400 pc)^2)), distances in pc"
    )
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--out", default="outputs/astro_los_nifty")
    p.add_argument("--iters", type=int, default=None, help="optimize_kl iterations")
    p.add_argument("--samples", type=int, default=None, help="MGVI samples per iteration (x2, mirrored)")
    p.add_argument("--final-samples", type=int, default=None, help="MGVI samples of the last iteration (x2)")
    p.add_argument("--prior", default="default", choices=sorted(PRIORS), help="hyperparameter preset (PRIORS)")
    p.add_argument("--chunk", type=int, default=None, help="lines per chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vi-seed", type=int, default=None, help="seed of the samples (default: seed + 2), data unchanged")
    p.add_argument("--noise", type=float, default=0.1, help="noise std as a fraction of the rms signal")
    p.add_argument("--geovi", action="store_true", help="geoVI (nonlinear sample updates) instead of MGVI")
    p.add_argument("--fix-hyperparameters", action="store_true", help="diagnostic: spectrum held at its truth")
    p.add_argument("--r-pad", type=int, default=None, help="radial padding factor of the field (no wrap-around)")
    p.add_argument("--xy-pad", type=int, default=None, help="plane-of-sky padding factor of the field")
    p.add_argument("--kl-iters", type=int, default=None, help="cap on the Newton-CG steps per KL minimisation")
    p.add_argument(
        "--nl-iters", type=int, default=10, help="geoVI: cap on the Newton steps of each nonlinear sample update"
    )
    p.add_argument("--no-figures", action="store_true")
    a = p.parse_args(argv)
    run(
        a.size,
        a.out,
        iters=a.iters,
        samples=a.samples,
        final_samples=a.final_samples,
        chunk=a.chunk,
        seed=a.seed,
        noise=a.noise,
        prior=a.prior,
        sample_mode="nonlinear_resample" if a.geovi else "linear_resample",
        fix_hyperparameters=a.fix_hyperparameters,
        r_pad=a.r_pad,
        xy_pad=a.xy_pad,
        kl_iters=a.kl_iters,
        nl_iters=a.nl_iters,
        vi_seed=a.vi_seed,
        figures=not a.no_figures,
    )


if __name__ == "__main__":
    main()
