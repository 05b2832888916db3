"""NIFTy.re's log-normal correlated field with MGVI on a catalog (standard response), measured like ``field3d.py``.

    python examples/astro_los/nifty_families.py --data CATALOG.npz [--truth TRUTH.npz] [--out DIR]
        [--results JSON] [--key NAME] [--map-iters N] [--map-newton N] [--iters N] [--samples N]
        [--final-samples N] [--cg-iters N] [--kl-iters N] [--final-kl-iters N] [--kl-cg-iters N]
        [--r-pad P] [--chunk C] [--seed S] [--point-hyper 0|1] [--geovi 0|1] [--nl-iters N]
    python examples/astro_los/nifty_families.py --families DIR [--family NAME ...] [--results JSON] ...

Issue #41 asks to measure NIFTy.re's correlated-field model with MGVI (the field's standard) against
the hand-written Gaussian process of ``field3d.py`` before choosing. This script is that measurement:
the same catalogs (``families.py --size tiny|default --out DIR`` writes them, ``DIR/NAME.npz`` and
``DIR/NAME.truth.npz``), the same response operator, the same metrics (``reconstruct.evaluate``).

The model (nothing in it is read from a truth):

* **sky** ``= exp(s)`` on ``(nx * ny, n_bins)``, ``s[x, y, k] = offset + b P1(t_k) + c P2(t_k) + f[x, y, k]``:
  ``t_k`` the bin centre's distance mapped onto ``[-1, 1]`` (``P1``, ``P2``: Legendre polynomials),
  ``b, c ~ N(0, TREND_SD^2)`` (a smooth mean radial profile, learned), and ``offset + f`` a
  ``jft.CorrelatedFieldMaker`` field on the ``(nx, ny, r_pad * n_bins)`` grid (plane-of-sky pixels of
  unit size; radial bins uniform in ``ln r``, cropped to the first ``n_bins`` so the nearest and
  the farthest bin are not neighbours), its spectrum the product of a plane-of-sky and a radial
  power spectrum whose fluctuations, slopes (and the plane-of-sky flexibility) are inferred; the
  zero mode of either spectrum lets ``f`` carry a sky-wide radial profile and a distance-independent
  plane-of-sky pattern. The offset's prior mean is the log density of the constant sky that fits
  the data best (the data set the units); ``b, c`` start at the best-fitting smooth profile
  ``exp(offset + b P1 + c P2)`` (a 3-parameter least-squares fit to the data). Priors: ``PRIOR``.
* **response**: ``los.make_los_operator(cat.pix, cat.d, cat.s, edges=cat.edges, response="standard")``,
  the chunked ``chunkop.RowOperator`` (as ``reconstruct.fit_check`` builds it from a catalog).
* **likelihood**: ``jft.Gaussian(y, 1 / sigma^2)`` with the catalog's per-line noise sd.
* **inference**: ``jft.optimize_kl``: ``--map-iters`` iterations without samples (MAP, ``--map-newton``
  Newton-CG steps each: the starting point), then ``--iters`` iterations of MGVI
  (``sample_mode="linear_resample"``; ``--geovi 1``: geoVI) with ``--samples`` mirrored sample pairs,
  ``--final-samples`` pairs in the last one (the reported posterior: ``2 * final_samples`` samples).
  The spectrum's hyperparameters are point estimates (``--point-hyper 1``, the default; ``field3d.py``
  learns its own by type-II maximum likelihood): sampled, they made MGVI oscillate on the tiny
  catalogs. ``--iters 0``: the MAP alone (no sd, so no coverage).

Outputs (``--out DIR``, default ``outputs/nifty_families/NAME``): ``posterior_mean.npy``,
``posterior_std.npy`` (``(nx * ny, n_bins)`` float32, over the samples), ``column_std.npy``
(``(nx * ny,)``: the sd over the samples of each pixel's column ``sum_k sky_k (b_{k+1} - b_k)``) and
``summary.json``; with ``--truth``, the metrics of ``reconstruct.evaluate`` (chi2 per line, the sky's
error weighted by bin length against the oracle radial profile's, the column's, coverage within 2
sd of the column and the ``1/r^2``-weighted column). ``--results JSON`` adds the run's summary to a
results file under ``--key`` (default: the catalog's name). ``--families DIR`` runs every
``DIR/NAME.npz`` of ``--family`` (default: the four families of ``families.py``) in turn.

The recorded comparison with ``field3d.py`` (``nifty_families_results.json``) is in ``README.md``,
"NIFTy.re's correlated field with MGVI against field3d.py".
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
import reconstruct
from catalog import Catalog, load_catalog

import chunkop

try:
    import nifty.re as jft
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError('nifty_families.py needs NIFTy.re: pip install -e ".[nifty]"') from err

FAMILIES = ("steep_profile", "compact_clouds", "sheet_edge", "steep_disc_fine")
TREND_SD = 3.0  # prior sd of the smooth radial profile's Legendre coefficients b, c (log density)


@dataclasses.dataclass(frozen=True)
class Prior:
    """The correlated field's hyperpriors, ``(mean, std)`` of NIFTy's defaults (log-normal for the
    offset sd, fluctuations and flexibility; normal for the slopes); ``None``: left out.

    In NIFTy's product spectrum the modes that vary along both the plane of sky and the radius
    (clouds, sheets) have amplitude ``xy_fluctuations * r_fluctuations / offset_std`` (the zero
    mode's sd), while the sky-wide radial profile and the distance-independent plane-of-sky pattern
    have ``r_fluctuations`` and ``xy_fluctuations``: the offset sd's prior is wide (median 0.22),
    since it sets the ratio of the two kinds of structure. (The first tiny run, with ``(1, 0.5)``,
    pulled it to 0.12, 4.5 prior sd below its mean; held at 1, the mixed modes were too weak to fit
    the data, chi2 2.0 per line.)"""

    offset_std: tuple[float, float] = (0.5, 1.0)
    xy_fluctuations: tuple[float, float] = (0.5, 0.3)
    xy_slope: tuple[float, float] = (-3.0, 1.0)
    xy_flexibility: tuple[float, float] | None = (0.5, 0.3)
    r_fluctuations: tuple[float, float] = (0.5, 0.3)
    r_slope: tuple[float, float] = (-3.0, 1.0)


PRIOR = Prior()


@dataclasses.dataclass(frozen=True)
class Settings:
    map_iters: int = 3  # first iterations without samples: MAP (a starting point for MGVI)
    map_newton: int = 20  # Newton-CG steps of each MAP iteration
    iters: int = 6  # MGVI iterations after those (the last one with final_samples)
    samples: int = 2  # mirrored sample pairs per MGVI iteration
    final_samples: int = 16  # pairs in the last iteration (the reported posterior: twice as many samples)
    cg_iters: int = 150  # cap on the CG steps drawing a sample
    kl_iters: int = 8  # cap on the Newton-CG steps of an MGVI iteration's KL minimisation
    final_kl_iters: int = 4  # ... of the last iteration's
    kl_cg_iters: int = 40  # cap on the CG steps of one Newton step
    r_pad: int = 2  # the field lives on r_pad * n_bins radial bins, cropped
    chunk: int = 8192  # lines per chunk of the RowOperator
    seed: int = 0
    point_hyper: int = 1  # 1: the spectrum's hyperparameters are point estimates (their samples do not vary)
    geovi: int = 0  # 1: geoVI (samples updated nonlinearly) instead of MGVI
    nl_iters: int = 5  # geoVI: cap on the nonlinear update steps of a sample


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def radial_trend_basis(edges: np.ndarray) -> np.ndarray:
    """``(2, n_bins)``: ``P1(t), P2(t)`` with ``t`` the bin centre's distance mapped onto ``[-1, 1]``."""
    r = np.sqrt(edges[:-1] * edges[1:])
    t = 2.0 * (r - edges[0]) / (edges[-1] - edges[0]) - 1.0
    return np.stack([t, 1.5 * t**2 - 0.5])


def correlated_field(nx: int, ny: int, edges: np.ndarray, offset_mean: float, prior: Prior, r_pad: int) -> jft.Model:
    """``offset + f`` on ``(nx, ny, r_pad * n_bins)``: plane-of-sky x radial (``ln r``) power spectra."""
    cfm = jft.CorrelatedFieldMaker("sky ")
    cfm.set_amplitude_total_offset(offset_mean=offset_mean, offset_std=prior.offset_std)
    cfm.add_fluctuations(
        (nx, ny),
        distances=1.0,
        fluctuations=prior.xy_fluctuations,
        loglogavgslope=prior.xy_slope,
        flexibility=prior.xy_flexibility,
        asperity=None,
        prefix="xy ",
        non_parametric_kind="power",
    )
    cfm.add_fluctuations(
        r_pad * (edges.size - 1),
        distances=float(np.log(edges[1] / edges[0])),
        fluctuations=prior.r_fluctuations,
        loglogavgslope=prior.r_slope,
        flexibility=None,
        asperity=None,
        prefix="r ",
        non_parametric_kind="power",
    )
    return cfm.finalize()


class LogNormalSky(jft.Model):
    """``xi -> exp(field[:nx, :ny, :n_bins] + TREND_SD * xi["trend"] @ basis)``, shape ``(nx * ny, n_bins)``."""

    field: jft.Model = dataclasses.field(metadata=dict(static=False))
    basis: jax.Array = dataclasses.field(metadata=dict(static=False))
    shape: tuple[int, int, int]

    def __init__(self, field: jft.Model, basis: np.ndarray, shape: tuple[int, int, int]):
        self.field = field
        self.basis = jnp.asarray(basis, jnp.float32)
        self.shape = tuple(int(n) for n in shape)
        domain = {**field.domain, "trend": jft.ShapeWithDtype((basis.shape[0],), jnp.float32)}
        super().__init__(domain=domain, white_init=True)

    def log_sky(self, xi: Any) -> jax.Array:
        nx, ny, nb = self.shape
        s = self.field(xi)[:nx, :ny, :nb] + TREND_SD * (xi["trend"] @ self.basis)
        return s.reshape(nx * ny, nb)

    def __call__(self, xi: Any) -> jax.Array:
        return jnp.exp(self.log_sky(xi))


class Response(jft.Model):
    """``xi -> A @ sky(xi)`` with ``A`` a ``chunkop.RowOperator``."""

    sky: LogNormalSky = dataclasses.field(metadata=dict(static=False))
    A: chunkop.RowOperator = dataclasses.field(metadata=dict(static=False))

    def __init__(self, sky: LogNormalSky, A: chunkop.RowOperator):
        self.sky = sky
        self.A = A
        super().__init__(domain=sky.domain, init=sky.init)

    def __call__(self, xi: Any) -> jax.Array:
        return self.A.mv(self.sky(xi))


def operator(cat: Catalog, chunk: int) -> chunkop.RowOperator:
    """The catalog's standard-response operator, built as ``reconstruct.fit_check`` builds it."""
    return los.make_los_operator(
        cat.pix, cat.d, cat.s, n_pix=cat.n_pix, edges=cat.edges, chunk_size=min(chunk, cat.n_los), response="standard"
    )


def smooth_profile_fit(cat: Catalog, A: chunkop.RowOperator, basis: np.ndarray) -> np.ndarray:
    """``(a, b, c)``: the sky ``exp(a + b P1 + c P2)``, the same at every pixel, that fits the data
    best (weighted least squares, Gauss-Newton from the best constant sky). Data only."""
    y, w = jnp.asarray(cat.y), jnp.asarray(1.0 / cat.sigma)
    ones = jnp.ones((cat.n_pix, cat.n_bins), jnp.float32)
    m1 = np.asarray(jax.jit(lambda A: A.mv(ones))(A), np.float64)
    yw, m1w = np.asarray(cat.y, np.float64) / cat.sigma, m1 / cat.sigma
    level = max(float(yw @ m1w / (m1w @ m1w)), 1e-30)  # best constant sky
    B = jnp.asarray(np.vstack([np.ones(cat.n_bins), basis]), jnp.float32)

    @jax.jit
    def resid(p, A):
        sky = jnp.broadcast_to(jnp.exp(p @ B), (cat.n_pix, cat.n_bins))
        return (A.mv(sky) - y) * w

    jac = jax.jit(jax.jacfwd(resid))
    p = np.array([np.log(level), 0.0, 0.0])
    cost = float(jnp.sum(resid(jnp.asarray(p, jnp.float32), A) ** 2))
    lam = 1e-3
    for _ in range(30):  # Levenberg-Marquardt on 3 parameters
        r = np.asarray(resid(jnp.asarray(p, jnp.float32), A), np.float64)
        J = np.asarray(jac(jnp.asarray(p, jnp.float32), A), np.float64)
        H, g = J.T @ J, J.T @ r
        step = -np.linalg.solve(H + lam * np.diag(np.diag(H)), g)
        new = p + np.clip(step, -2.0, 2.0)
        new_cost = float(jnp.sum(resid(jnp.asarray(new, jnp.float32), A) ** 2))
        if new_cost < cost:
            converged = cost - new_cost < 1e-6 * cost
            p, cost, lam = new, new_cost, lam / 3
            if converged:
                break
        else:
            lam *= 10
    return p


def kl_settings(st: Settings, n_params: int) -> dict:
    """The ``jft.optimize_kl`` keyword arguments of ``st``: ``map_iters`` iterations without samples
    (MAP), then ``iters`` of MGVI (``sample_mode="linear_resample"``), the last with ``final_samples``."""
    total = st.map_iters + st.iters

    def n_samples(i: int) -> int:
        return 0 if i < st.map_iters or st.iters == 0 else st.final_samples if i >= total - 1 else st.samples

    def kl_kwargs(i: int) -> dict:
        n = st.map_newton if i < st.map_iters else st.final_kl_iters if i >= total - 1 else st.kl_iters
        minimize = dict(
            name=os.environ.get("NF_KL_NAME"),
            xtol=1e-9,  # (scaled by the number of latents; the Newton steps' cap decides)
            absdelta=1e-3 * n_params / 10,
            cg_kwargs=dict(name=None, maxiter=st.kl_cg_iters),
            maxiter=n,
        )
        return dict(minimize_kwargs=minimize)

    return dict(
        n_total_iterations=total,
        n_samples=n_samples,
        sample_mode="nonlinear_resample" if st.geovi else "linear_resample",
        draw_linear_kwargs=dict(cg_name=None, cg_kwargs=dict(absdelta=1e-4 * n_params / 10, maxiter=st.cg_iters)),
        nonlinearly_update_kwargs=dict(
            minimize_kwargs=dict(
                name=None, xtol=1e-9, cg_kwargs=dict(name=None, maxiter=st.kl_cg_iters), maxiter=st.nl_iters
            )
        ),
        kl_kwargs=kl_kwargs,
    )


def _hyper_values(prior: Prior) -> dict:
    """Transforms latent -> value of the inferred hyperparameters (NIFTy's priors, as the maker uses them)."""
    out = {
        "sky zeromode": ("offset_std", jft.lognormal_prior(*prior.offset_std)),
        "sky xy fluctuations": ("xy_fluctuations", jft.lognormal_prior(*prior.xy_fluctuations)),
        "sky xy loglogavgslope": ("xy_slope", jft.normal_prior(*prior.xy_slope)),
        "sky r fluctuations": ("r_fluctuations", jft.lognormal_prior(*prior.r_fluctuations)),
        "sky r loglogavgslope": ("r_slope", jft.normal_prior(*prior.r_slope)),
    }
    if prior.xy_flexibility is not None:
        out["sky xy flexibility"] = ("xy_flexibility", jft.lognormal_prior(*prior.xy_flexibility))
    return out


@jax.jit
def _sample_skies(sky: LogNormalSky, samples: Any, db: jax.Array, dib: jax.Array) -> dict:
    """Mean, sd of the sky and mean, sd of the column and the ``1/r^2``-weighted column over the samples."""

    def one(xi):
        x = sky(xi)
        return x, x @ db, x @ dib

    skies, cols, wcols = jax.vmap(one)(samples)
    sd = lambda v: jnp.std(v, axis=0, ddof=1)
    return {
        "mean": skies.mean(0),
        "std": sd(skies),
        "column": cols.mean(0),
        "column_std": sd(cols),
        "wcolumn": wcols.mean(0),
        "wcolumn_std": sd(wcols),
    }


def reconstruct_nifty(cat: Catalog, st: Settings = Settings(), prior: Prior = PRIOR, *, verbose: bool = True) -> dict:
    """MGVI of the log-normal correlated-field model on ``cat`` (standard response).

    Returns ``{"summary", "mean", "std", "column", "column_std", "wcolumn", "wcolumn_std", "resid"}``
    (the keys ``reconstruct.evaluate`` reads)."""
    if (cat.response or "standard") != "standard":
        raise ValueError(f"the catalog's response is {cat.response!r}; this model is for the standard response")
    t0 = time.perf_counter()
    A = operator(cat, st.chunk)
    basis = radial_trend_basis(cat.edges)
    a, b, c = smooth_profile_fit(cat, A, basis)
    t_fit = time.perf_counter() - t0
    log(f"smooth profile fit: log level {a:.3f}, b {b:.3f}, c {c:.3f} ({t_fit:.1f} s)")
    field = correlated_field(cat.nx, cat.ny, cat.edges, float(a), prior, st.r_pad)
    sky = LogNormalSky(field, basis, (cat.nx, cat.ny, cat.n_bins))
    inv_sd = jnp.asarray(1.0 / cat.sigma, jnp.float32)
    lh = jft.Gaussian(
        jnp.asarray(cat.y, jnp.float32), noise_cov_inv=lambda r: inv_sd**2 * r, noise_std_inv=lambda r: inv_sd * r
    ).amend(Response(sky, A))
    key, k_init = jax.random.split(jax.random.key(st.seed))
    xi0 = jax.tree_util.tree_map(lambda x: 0.1 * x, jft.Vector(lh.init(k_init)))  # near the prior median
    tree = dict(xi0.tree)
    tree["trend"] = jnp.asarray([b / TREND_SD, c / TREND_SD], jnp.float32)  # the smooth fit's profile
    xi0 = jft.Vector(tree)
    n_params = int(sum(np.size(v) for v in tree.values()))
    log(
        f"{cat.name or 'catalog'}: {cat.nx} x {cat.ny} pixels x {cat.n_bins} bins (field on {st.r_pad * cat.n_bins} "
        f"radial bins), {cat.n_los} lines, {n_params} latent parameters; {st.map_iters} MAP iterations, then MGVI "
        f"{st.iters} iterations, {st.samples} sample pairs ({st.final_samples} in the last)"
    )
    history: list[dict] = []
    t_iter = [time.perf_counter()]

    def callback(smpls: jft.Samples, state: Any) -> None:
        ms = state.minimization_state
        resid = jft.reduced_residual_stats(smpls, lh.normalized_residual)
        now = time.perf_counter()
        entry = {
            "iteration": int(state.nit),
            "kl_energy": float(ms.fun),
            "kl_newton_steps": int(ms.nit),
            "reduced_chi2_data": float(resid.reduced_chisq[0]),
            "seconds": now - t_iter[0],
        }
        t_iter[0] = now
        history.append(entry)
        if verbose:
            log(
                f"  it {entry['iteration']}: KL {entry['kl_energy']:.6g}, {entry['kl_newton_steps']} Newton steps, "
                f"data reduced chi2 {entry['reduced_chi2_data']:.3f} ({entry['seconds']:.0f} s)"
            )

    t1 = time.perf_counter()
    point = tuple(k for k in tree if k not in ("sky xi", "trend")) if st.point_hyper else ()
    samples, _ = jft.optimize_kl(
        lh, xi0, key=key, callback=callback, odir=None, point_estimates=point, **kl_settings(st, n_params)
    )
    t_vi = time.perf_counter() - t1
    db = jnp.asarray(np.diff(cat.edges), jnp.float32)
    dib = jnp.asarray(1.0 / cat.edges[:-1] - 1.0 / cat.edges[1:], jnp.float32)
    if len(samples) > 1:
        post = samples.samples
    else:  # --iters 0: the MAP alone (no sd: coverage is not defined)
        post = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), samples.pos)
    sm = {k: np.asarray(v) for k, v in _sample_skies(sky, post, db, dib).items()}
    if len(samples) <= 1:
        sm.update({k: np.full_like(sm[k], np.nan) for k in ("std", "column_std", "wcolumn_std")})
    resid = reconstruct.fit_check(cat, sm["mean"], "standard", st.chunk)
    hyper = {}
    for name, (label, fn) in _hyper_values(prior).items():
        vals = np.asarray(jax.vmap(lambda xi, fn=fn, name=name: fn(xi[name]))(post))
        hyper[label] = {"mean": float(vals.mean()), "sd": float(vals.std(ddof=1))}
    trend = np.asarray(post.tree["trend"]) * TREND_SD
    hyper["trend_b"] = {"mean": float(trend[:, 0].mean()), "sd": float(trend[:, 0].std(ddof=1))}
    hyper["trend_c"] = {"mean": float(trend[:, 1].mean()), "sd": float(trend[:, 1].std(ddof=1))}
    summ = {
        "catalog": {"name": cat.name, "n_los": cat.n_los, "nx": cat.nx, "ny": cat.ny, "n_bins": cat.n_bins},
        "model": "sky = exp(offset + b P1(t) + c P2(t) + f), f: jft.CorrelatedFieldMaker (xy x ln r spectra)",
        "prior": dataclasses.asdict(prior),
        "trend_sd": TREND_SD,
        "settings": dataclasses.asdict(st),
        "n_latent": n_params,
        "n_samples": len(samples),
        "smooth_profile_fit": {"a": float(a), "b": float(b), "c": float(c)},
        "hyperparameters": hyper,
        "history": history,
        "chi2_per_line": float(np.mean(resid**2)),
        "residual_fraction_beyond_3": float(np.mean(np.abs(resid) > 3)),
        "column_rel_std_median": float(np.median(sm["column_std"] / np.abs(sm["column"])))
        if len(samples) > 1
        else None,
        "seconds_profile_fit": t_fit,
        "seconds_vi": t_vi,
        "seconds": time.perf_counter() - t0,
        "device": str(jax.devices()[0].platform),
    }
    log(
        f"fit: chi2 per line {summ['chi2_per_line']:.3f}; {summ['seconds']:.0f} s ({t_vi:.0f} s MGVI); "
        "hyperparameters " + ", ".join(f"{k} {v['mean']:.3g}" for k, v in hyper.items())
    )
    return {"summary": summ, "resid": resid, **sm}


def write_outputs(out: str, rec: dict) -> None:
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "posterior_mean.npy"), rec["mean"].astype(np.float32))
    np.save(os.path.join(out, "posterior_std.npy"), rec["std"].astype(np.float32))
    np.save(os.path.join(out, "column_std.npy"), rec["column_std"].astype(np.float32))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rec["summary"], f, indent=1, default=float)
    log(f"wrote {os.path.abspath(out)}/: posterior_mean.npy, posterior_std.npy, column_std.npy, summary.json")


def run_one(data: str, truth: str | None, out: str | None, st: Settings, results: str | None, key: str | None) -> dict:
    """Reconstruct one catalog file, evaluate against ``truth`` if given, write ``out`` and ``results``."""
    cat = load_catalog(data)
    rec = reconstruct_nifty(cat, st)
    summ = rec["summary"]
    if truth:
        ev = reconstruct.evaluate(cat, rec, reconstruct.load_truth(truth))
        summ["truth"] = ev["metrics"]
        if st.iters == 0:  # the MAP alone: no sd, no coverage
            for k in ("column_within_2sd", "column_z_mean", "wcolumn_within_2sd", "wcolumn_z_mean"):
                summ["truth"][k] = None
    name = key or cat.name or os.path.splitext(os.path.basename(data))[0]
    write_outputs(out or os.path.join("outputs", "nifty_families", name), rec)
    if results:
        old = {}
        if os.path.exists(results):
            with open(results) as f:
                old = json.load(f)
        old.setdefault("runs", {})[name] = summ
        with open(results, "w") as f:
            json.dump(old, f, indent=1, default=float)
        log(f"recorded {name!r} in {results}")
    return summ


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--data", help="a catalog npz (standard response)")
    g.add_argument("--families", metavar="DIR", help="run DIR/NAME.npz (+ DIR/NAME.truth.npz) for each --family")
    p.add_argument("--truth", help="the true sky (npz with 'sky'), for the metrics")
    p.add_argument("--family", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--out", help="output directory (with --families: one subdirectory per family)")
    p.add_argument("--results", help="add the summaries to this JSON file (under 'runs')")
    p.add_argument("--key", help="the name to record a --data run under (default: the catalog's name)")
    d = Settings()
    for f in dataclasses.fields(Settings):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=getattr(d, f.name))
    a = p.parse_args(argv)
    st = Settings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Settings)})
    if a.data:
        return run_one(a.data, a.truth, a.out, st, a.results, a.key)
    out = {}
    for name in a.family:
        base = os.path.join(a.families, name)
        o = os.path.join(a.out, name) if a.out else None
        out[name] = run_one(base + ".npz", base + ".truth.npz", o, st, a.results, a.key and f"{a.key}{name}")
    return out


if __name__ == "__main__":
    main()
