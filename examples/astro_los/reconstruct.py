"""Reconstruct a 3-D sky from line-of-sight integrals with a chunked implicit operator.

    python examples/astro_los/reconstruct.py [--size tiny|default|seed] [--out DIR] [--samples N]
    python examples/astro_los/reconstruct.py --data CATALOG.npz [--truth TRUTH.npz] --out DIR [--response R]
    python examples/astro_los/reconstruct.py --size tiny --write-catalog PATH

The forward model is the astrophysics users' LOS operator (``los.py``): sky ``(n_pix, n_bins)``,
``y_l = sum_k w_k(d_l, s_l) sky[pix_l, k]``, built as a ``chunkop.RowOperator`` (weights recomputed
chunk by chunk, never stored), with the response ``--response``: ``standard`` (the default: the
density integrated up to the star, averaged over its lognormal distance,
``w_k = (b_{k+1} - b_k) erfc((ln sqrt(b_k b_{k+1}) - ln d) / (sqrt(2) s / d)) / 2``) or ``seed`` (the
users' literal ``w = -diff(exp(-(d - b) / (d s b)))``).

``--data``: a catalog (``catalog.py``: ``pix``, ``d``, ``s``, ``y``, ``sigma`` per line; ``nx``,
``ny``, ``edges``) is validated and reconstructed by :func:`reconstruct_catalog`, which sees
nothing else. Standard response: a 3-D Gaussian-field prior whose hyperparameters are learned from
the catalog by the evidence (``field3d.py``, :func:`reconstruct_standard`), then, where the whole sky
fits (``--prior auto``, the default; ``lognormal.MAX_CELLS``), a positive field on those
hyperparameters (``lognormal.py``): its mode is the map, with linearised Laplace errors, where that
mode is reached and fits the lines no worse than the Gaussian field's map (:func:`_with_prior`); a
Gaussian map kept there is made a density (``field3d.nonnegative``, :func:`_as_density`). Seed response: the
radial-shape prior's hyperparameters (radial profile level and shape, plane-of-sky field sd,
correlation length and spectral slope) are learned by type-II maximum likelihood (``learn.py``).
The posterior mean (the log-normal prior's: its mode) and samples are solved, and
``posterior_mean.npy``, ``posterior_std.npy``, ``column_std.npy``, ``summary.json`` and figures are
written to ``--out``. ``--truth`` adds the
comparison with a known sky (:func:`evaluate`).

Without ``--data`` (the synthetic job): ``--size``'s built-in data are written as a catalog
(``OUT/catalog.npz``), the operator is measured (``chunkop.check_linear``; matvec, transpose,
gradient and hvp in the sky, chi2 and its derivatives in the row data; compiled temp memory), a
global scale on ``s`` is fitted against the known sky (a calibration demo of derivatives through
the row data, not part of the reconstruction), and the sky is reconstructed from the catalog
file through the same :func:`reconstruct_catalog`, then compared with the truth.

With the seed response the data measure one ``1/r^2``-weighted column per pixel and almost nothing
of the radial profile: the run warns that the distance-integrated column comes from the profile's
hyperprior (README.md, "What these data can and cannot tell"). With the standard response the run
warns where the data do not constrain what it reports (columns, distance ranges).

``--devices N`` runs the same job with the operator's rows (``pix``, ``d``, ``s``) sharded along
their leading axis over a mesh ``jax.make_mesh((N,), ("rows",))`` of the first ``N`` of
``jax.devices()``: every device computes its own lines of sight (``A x`` comes back sharded by
rows; ``A^T y`` is one all-reduce of the devices' partial skies): the operator's measurements,
the s-scale demo and the reconstruction's fit check; the hyperparameters and the posterior are
computed from the catalog's compressed lines without a mesh. The number of lines must be a multiple
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
import tempfile
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
import field3d  # noqa: E402
import learn  # noqa: E402
import lognormal  # noqa: E402
import los  # noqa: E402
from catalog import Catalog, CatalogError, load_catalog, write_catalog  # noqa: E402

import chunkop  # noqa: E402

GiB, MiB = 2**30, 2**20
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


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


# -- the reconstruction from a catalog -----------------------------------------------------------


def _catalog_summary(cat: Catalog, response: str) -> dict:
    """The run summary's start (the catalog's size, grid, bins and ``response``), logged."""
    log(
        f"catalog {cat.name!r} ({response} response): {cat.n_los} lines on a {cat.nx} x {cat.ny} grid, "
        f"{cat.n_bins} radial bins {cat.edges[0]:.0f}-{cat.edges[-1]:.0f} pc "
        f"({cat.n_los / cat.n_pix:.2f} lines per pixel)"
    )
    catalog = {"name": cat.name, "n_los": cat.n_los, "nx": cat.nx, "ny": cat.ny, "n_bins": cat.n_bins}
    catalog["edges_pc"] = [float(cat.edges[0]), float(cat.edges[-1])]
    return {"catalog": catalog, "response": response}


def reconstruct_catalog(
    cat: Catalog,
    out: str | None = None,
    *,
    samples: int = 32,
    rtol: float = 1e-5,
    iters: int = 200,
    chunk: int = 8192,
    figures: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    reference: np.ndarray | None = None,
    profile_sd: float | None = None,
    evidence_pixels: int | None = None,
    response: str | None = None,
    layout: str = "auto",
    prior: str = "auto",
) -> dict:
    """Reconstruct the sky from a :class:`catalog.Catalog` alone (the only data it is given), and
    from a reference radial profile (``(n_bins,)`` densities: the prior's mean shape) if one is given.

    Learns the prior's hyperparameters (``learn.learn_hyperparameters``: evidence, type-II MAP, Laplace),
    solves for the posterior at full resolution, draws ``samples`` posterior samples (the posterior
    std, hyperparameter uncertainty included; 0: no std), checks the fit with the full chunked
    operator and returns ``{"summary": dict, "mean": (n_pix, n_bins) float32, "std": ... or None,
    "column"/"wcolumn" (+ "_std"): (n_pix,)}``. With ``out``, writes ``posterior_mean.npy``,
    ``posterior_std.npy`` (when ``samples > 0``), ``summary.json`` and the figures there.
    ``evidence_pixels``: the most pixels of the coarse grid the hyperparameters' evidence is computed
    on (``learn.learn_hyperparameters``'s ``max_pixels``; None: ``learn.coarse_factor``'s rule).
    ``response``: the response the lines were measured through (:func:`resolve_response`; None: the
    catalog's, else ``"standard"``). ``"standard"`` is reconstructed with the 3-D prior
    (:func:`reconstruct_standard`, ``field3d.py``); ``"seed"`` with the radial-shape prior described above.
    ``layout``: ``layout=`` of every operator over the lines (``chunkop.RowOperator``; ``--layout``).
    ``prior``: the standard response's prior (:func:`reconstruct_standard`; ``--prior``).
    """
    response = resolve_response(cat, response)
    if response == "standard":
        if reference is not None or profile_sd is not None:
            raise ValueError(
                "--profile / --profile-sd apply to --response seed only (the 3-D prior learns its profile)"
            )
        return reconstruct_standard(
            cat, out, samples=samples, chunk=chunk, figures=figures, mesh=mesh, layout=layout, prior=prior
        )
    t0 = time.perf_counter()
    summ = _catalog_summary(cat, "seed")
    V, sv = learn.radial_basis(cat)
    G, trunc = learn.compress_lines(cat, V, chunk)
    summ["radial_basis"] = {"singular_values_rel": [float(v) for v in sv[:5]], "max_truncation_error": trunc}
    log(
        f"the lines' weight vectors: singular values {', '.join(f'{v:.1e}' for v in sv[:4])} (relative): "
        f"each line measures ~one radial combination; kept {V.shape[1]} (largest truncation error {trunc:.1e})"
    )
    if reference is not None:
        reference = learn.check_reference(reference, cat.n_bins)
        summ["reference_profile"] = True
        log("the prior's radial profile: the reference given (--profile), its level and contrasts learned")
    hyper = learn.learn_hyperparameters(
        cat, G, V, log=log, reference=reference, shape_sd=profile_sd, max_pixels=evidence_pixels
    )
    summ["hyperparameters"] = {k: v for k, v in hyper.items() if k != "theta_cov"}
    post = learn.posterior(cat, G, V, hyper, n_samples=samples, iters=iters, rtol=rtol)
    log(
        f"posterior: CG {post['cg_iterations']} steps to relative residual {post['cg_relative_residual']:.1e}"
        + (f"; {samples} samples (CG <= {post['sample_cg_iterations_max']} steps each)" if samples else "")
    )
    summ["posterior"] = {k: post[k] for k in ("cg_iterations", "cg_relative_residual") if k in post}
    summ["posterior"]["samples"] = samples
    sm = learn.sky_summaries(cat, post)
    # the fit, with the full chunked operator (checks the compression too)
    resid = fit_check(cat, sm["mean"], "seed", chunk, mesh, layout)
    chi2 = float(np.mean(resid**2))
    summ["chi2_per_line"] = chi2
    summ["residual_fraction_beyond_3"] = float(np.mean(np.abs(resid) > 3))
    rel_std = (sm["column_std"] / np.abs(sm["column"])) if "column_std" in sm else None
    rel_wstd = (sm["wcolumn_std"] / np.abs(sm["wcolumn"])) if "wcolumn_std" in sm else None
    summ["column_rel_std_median"] = float(np.median(rel_std)) if rel_std is not None else None
    summ["wcolumn_rel_std_median"] = float(np.median(rel_wstd)) if rel_wstd is not None else None
    log(f"fit: chi2 per line {chi2:.3f} (noise = 1), {100 * summ['residual_fraction_beyond_3']:.2f}% beyond 3 sigma")
    summ["warnings"] = warnings_for(summ, hyper, cat)
    for w in summ["warnings"]:
        log(f"WARNING: {w}")
    summ["seconds"] = time.perf_counter() - t0
    rec = {"summary": summ, "mean": sm["mean"], "std": sm.get("std"), "resid": resid, "post": post, "hyper": hyper}
    rec.update({k: sm[k] for k in ("column", "wcolumn", "column_std", "wcolumn_std") if k in sm})
    if out:
        write_outputs(out, cat, rec, figures=figures)
    return rec


def resolve_response(cat: Catalog, response: str | None) -> str:
    """The response to reconstruct ``cat`` with: ``response`` if given, else the catalog's own
    ``response`` entry, else ``"standard"``.

    Raises:
        ValueError: ``response`` is not one of ``los.RESPONSES``, or differs from the catalog's entry.
    """
    if response is not None and response not in los.RESPONSES:
        raise ValueError(f"response must be one of {los.RESPONSES}, got {response!r}")
    if response is not None and cat.response is not None and response != cat.response:
        raise ValueError(f"--response {response}: the catalog says its lines were measured with {cat.response!r}")
    return response or cat.response or "standard"


def fit_check(
    cat: Catalog, sky: np.ndarray, response: str, chunk: int, mesh: Any = None, layout: str = "auto"
) -> np.ndarray:
    """The normalised residuals ``(y - A sky) / sigma`` with the full chunked operator of ``response``
    (rows sharded over ``mesh`` if given; ``layout``: its ``layout=``)."""
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        sky, y = jnp.asarray(sky), jnp.asarray(cat.y)
        if mesh is None:
            A = los.make_los_operator(
                cat.pix,
                cat.d,
                cat.s,
                n_pix=cat.n_pix,
                edges=cat.edges,
                chunk_size=min(chunk, cat.n_los),
                response=response,
                layout=layout,
            )
        else:
            A = sharded_los_operator(cat, mesh, chunk, response, layout)
            sky, y = jax.device_put((sky, y), NamedSharding(mesh, PSpec()))  # replicated on the mesh
        resid = np.asarray(jax.jit(lambda A, s_, y: y - A.mv(s_))(A, sky, y))
    return resid / cat.sigma


def reconstruct_standard(
    cat: Catalog,
    out: str | None = None,
    *,
    samples: int = 32,
    chunk: int = 8192,
    figures: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    layout: str = "auto",
    prior: str = "auto",
) -> dict:
    """The standard response's reconstruction with the 3-D prior (``field3d.reconstruct``): the same
    outputs as :func:`reconstruct_catalog`'s, with ``column_std`` from posterior samples (bin
    correlations included) and warnings where the data do not constrain what is reported.

    ``prior``: ``"gaussian"``, the Gaussian field (``field3d``); ``"lognormal"``, the positive field
    of ``lognormal.py`` on the same learned hyperparameters and statistics (its mode, with linearised
    Laplace errors), which holds the whole sky (every pixel, at most ``lognormal.MAX_CELLS`` cells);
    ``"auto"``: the log-normal one where it fits, its mode is reached and it fits the lines no worse
    than the Gaussian map (:func:`_with_prior`), else the Gaussian one, its map made a density where the
    whole sky is held (:func:`_as_density`)."""
    if prior not in PRIORS:
        raise ValueError(f"prior must be one of {PRIORS}, got {prior!r}")
    t0 = time.perf_counter()
    summ = _catalog_summary(cat, "standard")
    kept: dict = {}
    r = field3d.reconstruct(cat, "standard", samples=max(samples, 2), chunk=chunk, layout=layout, log=log, keep=kept)
    r = _with_prior(r, kept, prior, samples, cat.n_los)
    if r["prior"]["name"] == "gaussian":
        r = _as_density(r, kept)
    summ["prior"] = r["prior"]
    summ["radial_basis"] = r["basis"]
    summ["hyperparameters"] = r["hyper"]
    summ["posterior"] = r["posterior"]
    summ["timings"] = dict(r["timings"])
    t1 = time.perf_counter()
    resid = fit_check(cat, r["mean"], "standard", chunk, mesh, layout)
    summ["timings"]["fit_check_s"] = time.perf_counter() - t1
    summ["chi2_per_line"] = float(np.mean(resid**2))
    summ["residual_fraction_beyond_3"] = float(np.mean(np.abs(resid) > 3))
    summ["column_rel_std_median"] = float(np.median(r["column_std"] / np.abs(r["column"])))
    summ["wcolumn_rel_std_median"] = float(np.median(r["wcolumn_std"] / np.abs(r["wcolumn"])))
    summ["negative_density"] = negative_density(r["mean"], r["std"], np.diff(cat.edges))
    log(
        f"fit: chi2 per line {summ['chi2_per_line']:.3f} (noise = 1), "
        f"{100 * summ['residual_fraction_beyond_3']:.2f}% beyond 3 sigma"
    )
    summ["warnings"] = warnings_standard(summ, r, cat)
    for w in summ["warnings"]:
        log(f"WARNING: {w}")
    summ["seconds"] = time.perf_counter() - t0
    rec = {"summary": summ, "resid": resid, "post": {"mu": r["mu"]}, "hyper": r["hyper"]}
    rec.update({k: r[k] for k in ("mean", "std", "column", "wcolumn", "column_std", "wcolumn_std")})
    rec["constrained"] = r["column_std"] * field3d.CONSTRAINED <= r["column_prior_sd"]
    if out:
        write_outputs(out, cat, rec, figures=figures)
    return rec


PRIORS = lognormal.PRIORS


def _as_density(r: dict, kept: dict) -> dict:
    """The Gaussian field's result ``r`` with its map made a density (``field3d.nonnegative``: in each
    pixel where the posterior mean dips below zero, the non-negative sky nearest to it in the pixel's
    posterior metric) and its columns those of that map, where the whole sky is held
    (``lognormal.unfit``: every pixel, at most ``lognormal.MAX_CELLS`` cells); beyond, ``r`` as it is
    (``summary.json``'s ``negative_density`` and its warning say how negative). ``r["prior"]["nonnegative"]``
    records which."""
    data, rad = kept["data"], kept["rad"]
    if lognormal.unfit(data.grid, rad.r.shape[0]) is not None:
        why = (
            "the posterior mean as it is: made a density only where every pixel and at most "
            f"{lognormal.MAX_CELLS} cells are held"
        )
        return r | {"prior": r["prior"] | {"nonnegative": why}}
    sky, info = field3d.nonnegative(r["mean"], kept["theta"], data, rad)
    if info["pixels"]:
        log(
            f"the map made a density: {info['cells']} negative cells in {info['pixels']} pixels, each pixel the "
            f"non-negative sky nearest the posterior mean in its posterior metric ({info['seconds']:.1f}s)"
        )
    cols = np.asarray(sky, np.float64) @ np.asarray(kept["functionals"], np.float64).T
    return r | {"mean": sky, "column": cols[:, 0], "wcolumn": cols[:, 1], "prior": r["prior"] | {"nonnegative": info}}


def _with_prior(r: dict, kept: dict, prior: str, samples: int, n_los: int) -> dict:
    """``field3d.reconstruct``'s result ``r``, or with ``prior`` ``"lognormal"`` the log-normal prior's map
    and errors in its place (``lognormal.posterior`` on what ``r``'s posterior was solved from, ``kept``).
    ``"auto"`` takes the log-normal field where it fits (``lognormal.unfit``), its mode was reached and
    it fits the ``n_los`` lines no worse than the Gaussian posterior mean (``lognormal.line_chi2``,
    within :data:`CHI2_SD` sd of a chi2's noise, ``sqrt(2 n_los)``); else it keeps ``r``. ``r["prior"]``
    says which, and why."""
    data, V = kept["data"], kept["rad"].V
    unfit = lognormal.unfit(data.grid, kept["rad"].r.shape[0])
    if prior == "gaussian" or (prior == "auto" and unfit is not None):
        return r | {"prior": {"name": "gaussian", "why": "asked" if prior == "gaussian" else unfit}}
    t0 = time.perf_counter()
    gauss_chi2 = lognormal.line_chi2(data, V, r["mean"])
    bound = gauss_chi2 + CHI2_SD * np.sqrt(2.0 * n_los)

    def poor(fit: dict) -> list:  # why a mode is not taken (none: it is)
        steps, cg = len(fit["newton"]), lognormal.cg_steps(fit["newton"])
        why = [] if fit["converged"] else [f"its mode was not reached in {steps} Gauss-Newton steps ({cg} CG steps)"]
        if fit["chi2"] > bound:
            why.append(
                f"it fits the lines worse (chi2 per line {fit['chi2'] / n_los:.3f}, "
                f"the Gaussian's {gauss_chi2 / n_los:.3f})"
            )
        return why

    # on the host, beside the Gaussian model's latent algebra (field3d.host: an accelerator emulates float64)
    with jax.enable_x64(True), jax.default_device(field3d.host()):
        post = lognormal.posterior(
            kept["theta"],
            data,
            kept["rad"],
            kept["functionals"],
            pairs=max(1, -(-samples // 2)),  # (--samples, an odd count rounded up to a pair)
            accept=(lambda fit: not poor(fit)) if prior == "auto" else None,
            start_sky=r["mean"],
        )
    seconds = time.perf_counter() - t0
    fit = {
        "newton_steps": len(post["newton"]),
        "newton_cg_steps": lognormal.cg_steps(post["newton"]),
        "newton_energy": post["newton"][-1][1],
        "converged": bool(post["converged"]),
        "chi2_per_line": post["chi2"] / n_los,
        "gaussian_chi2_per_line": gauss_chi2 / n_los,
    }
    reasons = poor(post)
    if post["std"] is None:  # "auto", and the mode is poor: the Gaussian field's map and errors stay
        why = "the log-normal prior was tried: " + "; ".join(reasons)
        log(f"{why} ({seconds:.1f}s): the Gaussian prior's map and errors are kept")
        return r | {"prior": {"name": "gaussian", "why": why, "lognormal": fit}}
    log(
        f"log-normal prior: the mode in {len(post['newton'])} Gauss-Newton steps ({post['seconds']['map_s']:.1f}s), "
        f"{2 * len(post['sample_cg_steps'])} linearised Laplace samples (CG <= {max(post['sample_cg_steps'])} steps, "
        f"{post['seconds']['samples_s']:.1f}s)"
    )
    out = dict(r)
    out.update(
        mean=post["mean"],
        std=post["std"],
        column=post["fmean"][:, 0],
        column_std=post["fstd"][:, 0],
        wcolumn=post["fmean"][:, 1],
        wcolumn_std=post["fstd"][:, 1],
    )
    out["timings"] = dict(r["timings"], lognormal_s=seconds)
    out["prior"] = {
        "name": "lognormal",
        **fit,
        "sample_cg_steps": post["sample_cg_steps"],
        "seconds": post["seconds"],
        **({"warning": "the log-normal prior was asked for, but " + "; ".join(reasons)} if reasons else {}),
    }
    return out


#: how far (in sd of a chi2's noise, sqrt(2 n_los)) the log-normal mode's chi2 may lie above the Gaussian
#: posterior mean's for ``--prior auto`` to take it
CHI2_SD = 3.0


#: a radial bin is reported as unconstrained when its median posterior sd exceeds this fraction of the prior's
UNCONSTRAINED_BIN = 0.8

#: the map is reported as partly negative when its negative cells hold more than this share of its mass
NEGATIVE_MASS = 0.01


def negative_density(mean: np.ndarray, std: np.ndarray, db: np.ndarray) -> dict:
    """Where a map ``(n_pix, n_bins)`` is negative (the Gaussian field allows it; the log-normal one
    cannot): the share of its cells below zero, their mass against the positive cells' (both weighted
    by the bin lengths ``db``), and the share of cells more than 2 posterior sd (``std``) below zero.
    In blocks of pixels: no sky-sized temporaries at the users' size.

    Example:
        >>> m = np.array([[1.0, -0.5], [2.0, 0.5]])
        >>> nd = negative_density(m, np.full_like(m, 0.1), np.array([1.0, 2.0]))
        >>> nd["cells"], nd["mass"], nd["beyond_2sd"]
        (0.25, 0.25, 0.25)
    """
    db = np.asarray(db, np.float64)
    n = pos = neg = beyond = 0.0
    for sl in field3d.blocks(mean.shape[0], 1 << 16):
        m = np.asarray(mean[sl], np.float64)
        n += float(np.sum(m < 0))
        pos += float(np.sum(np.maximum(m, 0) @ db))
        neg -= float(np.sum(np.minimum(m, 0) @ db))
        beyond += float(np.sum(m + 2 * np.asarray(std[sl], np.float64) < 0))
    cells = mean.shape[0] * mean.shape[1]
    return {"cells": n / cells, "mass": neg / max(pos, 1e-300), "beyond_2sd": beyond / cells}


def negative_warnings(nd: dict) -> list:
    """The warning on :func:`negative_density`'s figures ``nd`` when the negative cells hold more than
    :data:`NEGATIVE_MASS` of the map's mass (none below)."""
    if nd["mass"] <= NEGATIVE_MASS:
        return []
    return [
        f"the map's density is negative in {100 * nd['cells']:.1f}% of its cells, {100 * nd['mass']:.1f}% of its "
        f"mass (weighted by bin length; {100 * nd['beyond_2sd']:.2f}% of the cells more than 2 posterior sd below "
        "zero): the Gaussian field allows it; read those cells as consistent with zero where their sd reaches it"
    ]


def s_warnings(cat: Catalog) -> list:
    """Warnings on the catalog's ``s`` under the standard response, where ``s`` is the sd of the star's
    distance in pc (log-sd ``s / d``): a median ``s / d`` below 0.005 looks like ``s`` given as a
    fraction of ``d`` (or in kpc), one above 1 like ``s`` in the wrong unit (or distances no better
    than a factor e)."""
    frac = float(np.median(cat.s / cat.d))
    if frac < 0.005:
        return [
            f"the catalog's s is a median {frac:.2g} of d: under the standard response s is the sd of the "
            "star's distance in pc (a 10% distance error is s = 0.1 d); was a fraction of d given?"
        ]
    if frac > 1.0:
        return [
            f"the catalog's s is a median {frac:.2g} of d: under the standard response s is the sd of the "
            "star's distance in pc, the log-sd of a lognormal being s / d; is s in the right unit?"
        ]
    return []


def _fit_warnings(hyper: dict, chi2: float, cat: Catalog, example: str) -> list:
    """Both priors' warnings on the fit: hyperparameters at a bound, and a chi2 per line beyond
    what the noise allows (``example``: what the prior cannot represent, after the general words)."""
    w = [
        f"hyperparameter {name} = {hyper['theta'][hyper['names'].index(name)]:.3g} sits at its bound"
        for name in hyper["at_bound"]
    ]
    if chi2 > 1 + max(0.1, 5 * np.sqrt(2 / cat.n_los)):
        w.append(
            f"chi2 per line {chi2:.2f}: the data are not fitted to their noise (structure the prior cannot "
            f"represent{example}, or misstated sigma)"
        )
    return w


def warnings_standard(summ: dict, r: dict, cat: Catalog) -> list:
    """The 3-D prior's warnings, from the catalog's run alone: ``s`` in a suspicious unit
    (:func:`s_warnings`), pixels whose column the data barely constrain, distances no star
    constrains, a map negative in more than :data:`NEGATIVE_MASS` of its mass, hyperparameters at a
    bound, a poor fit, unconverged CG, a poor log-normal mode."""
    w = s_warnings(cat) + ([r["prior"]["warning"]] if "warning" in r.get("prior", {}) else [])
    loose = r["column_std"] * field3d.CONSTRAINED > r["column_prior_sd"]
    if np.any(loose):
        w.append(
            f"{int(loose.sum())} of {cat.n_pix} pixels' distance-integrated columns are barely constrained by the "
            f"data (posterior sd more than 1/{field3d.CONSTRAINED:g} of the prior's): there the column is the "
            "prior's guess (too few lines in or near the pixel); see column_std.npy"
        )
    # the bins whose density the data barely constrain: the posterior sd at most pixels still
    # above UNCONSTRAINED_BIN of the prior's (no star near that distance on most lines)
    ratio = np.median(r["std"], axis=0) / r["prior_sd"]
    loose_bins = ratio > UNCONSTRAINED_BIN
    if np.any(loose_bins):
        runs, k = [], 0
        while k < cat.n_bins:
            if loose_bins[k]:
                j = k
                while j + 1 < cat.n_bins and loose_bins[j + 1]:
                    j += 1
                runs.append(f"{cat.edges[k]:.0f}-{cat.edges[j + 1]:.0f} pc")
                k = j + 1
            else:
                k += 1
        w.append(
            f"the density at {', '.join(runs)} is mostly the prior's (posterior sd above {UNCONSTRAINED_BIN:g} of the "
            f"prior's at most pixels; {100 * np.mean(cat.d < cat.edges[np.argmax(~loose_bins)]):.1f}% of the stars "
            "are nearer than the first constrained bin): where along the line the dust lies there is not measured, "
            "only its sum with the rest of the column; see posterior_std.npy"
        )
    w += negative_warnings(summ["negative_density"])
    w += _fit_warnings(r["hyper"], summ["chi2_per_line"], cat, "")
    if r["posterior"]["cg_error_sd"] > 0.05:
        w.append(f"CG stopped {r['posterior']['cg_error_sd']:.2g} posterior sd from the solution")
    return w


def warnings_for(summ: dict, hyper: dict, cat: Catalog) -> list:
    """What the user must be told even when the data are fitted: from the catalog's run alone."""
    w = []
    ratio = hyper["profile_shape_sd_over_prior_sd"]
    if max(ratio) > 0.5:
        col = summ.get("column_rel_std_median")
        given = hyper.get("reference_profile") is not None
        w.append(
            "the radial profile is set mostly by its hyperprior, not by the data (posterior/prior sd of its "
            f"shape b, c: {ratio[0]:.2f}, {ratio[1]:.2f}): the lines measure one 1/r^2-weighted column per pixel"
            + (f" (+-{100 * summ['wcolumn_rel_std_median']:.1f}%)" if summ.get("wcolumn_rel_std_median") else "")
            + "; the distance-integrated column and every distance bin depend on "
            + ("the reference profile given (--profile), as right as it is" if given else "the assumed profile")
            + (f" (+-{100 * col:.0f}% per pixel, 1 sd, median)" if col is not None else "")
            + ("" if given else "; give a reference radial profile from outside the catalog with --profile")
        )
    f = hyper.get("coarse_factor", 1)
    if f > learn.MAX_FINE:
        w.append(
            f"the hyperparameters' evidence was computed on a coarse grid whose pixel spans {f} x {f} fine ones: "
            "the field below it is treated crudely, so the learned small scales and the posterior sd may be off; "
            "a finer grid (--evidence-pixels, memory ~ N^2, time ~ N^3) learns them better"
        )
    w += _fit_warnings(hyper, summ["chi2_per_line"], cat, ", e.g. compact clouds below the learned correlation length")
    if summ["posterior"]["cg_relative_residual"] > 1e-3:
        w.append(f"CG did not converge (relative residual {summ['posterior']['cg_relative_residual']:.1e})")
    return w


def write_outputs(out: str, cat: Catalog, rec: dict, truth: dict | None = None, figures: bool = True) -> None:
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "posterior_mean.npy"), rec["mean"])
    if rec.get("std") is not None:
        np.save(os.path.join(out, "posterior_std.npy"), rec["std"])
    if rec.get("column_std") is not None:
        np.save(os.path.join(out, "column_std.npy"), np.asarray(rec["column_std"], np.float32))
    summ = rec["summary"]
    if figures:
        try:
            import matplotlib

            matplotlib.use("Agg")
            summ["figures"] = make_figures(out, cat, rec, truth)
        except ImportError:
            log("matplotlib not installed: no figures (pip install -e '.[examples]')")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summ, f, indent=1, default=float)
    log(
        f"wrote {os.path.abspath(out)}/: posterior_mean.npy, "
        + ("posterior_std.npy, " if rec.get("std") is not None else "")
        + ("column_std.npy, " if rec.get("column_std") is not None else "")
        + "summary.json"
    )


def oracle_profile(truth_sky: Any) -> np.ndarray:
    """The oracle baseline's radial profile: the true sky's mean over pixels, per bin (float64)."""
    return np.asarray(truth_sky).mean(axis=0, dtype=np.float64)


#: the distances (pc) at which :func:`evaluate` splits the sky's error by range
DISTANCE_RANGES = (100.0, 200.0, 400.0, 800.0)

#: :func:`evaluate`'s near-column reference: in front of this distance (pc) a catalog whose star counts
#: grow as ``d^2`` out to 1700 pc has 0.16% of its stars (0.07 a pixel at the default size), so the lines
#: measure that stretch's column (every farther star sees it) but hardly where along it the dust lies
NEAR_PC = 200.0


def evaluate(cat: Catalog, rec: dict, truth_sky: Any) -> dict:
    """Figures against a known truth (``(n_pix, n_bins)``): relative errors of the sky, the
    distance-integrated column and the ``1/r^2``-weighted column, those of the oracle radial-profile
    baseline (the truth's mean over pixels per bin, the same at every pixel), and the fraction of
    columns within 2 posterior sd. Also the bin-length-weighted sky error of the near-column reference
    (``rel_err_sky_db_near_column``: exact beyond :data:`NEAR_PC`, the oracle's profile scaled to each
    pixel's true column in front of it), per distance range too: where a reconstruction's near ranges
    err as much as it, the catalog's columns were used and what is left needs stars that are not there.
    Never used by the reconstruction."""
    x = np.asarray(truth_sky, np.float32)
    db = np.diff(cat.edges)
    dib = 1.0 / cat.edges[:-1] - 1.0 / cat.edges[1:]
    oracle = oracle_profile(x)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    # the sky's squared errors per bin, summed over pixels in blocks (no sky-sized temporaries at the
    # users' size): the reconstruction's, the oracle's, and the truth's own squares
    # ... and the near-column reference's: the truth itself beyond NEAR_PC, and in front of it the oracle's
    # profile scaled per pixel to the truth's column there (what knowing that column exactly gives when
    # nothing says where along the stretch the dust lies)
    near = cat.centres < NEAR_PC
    o_near = np.asarray(oracle, np.float64)[near]
    o_col = max(float(o_near @ db[near]), 1e-300)  # the oracle's column in front of NEAR_PC
    e2, o2, x2, n2 = (np.zeros(cat.n_bins) for _ in range(4))
    for sl in field3d.blocks(x.shape[0], 1 << 16):
        xb = x[sl].astype(np.float64)
        e2 += np.sum((rec["mean"][sl] - xb) ** 2, 0)
        o2 += np.sum((oracle - xb) ** 2, 0)
        x2 += np.sum(xb**2, 0)
        if np.any(near):
            scale = (xb[:, near] @ db[near]) / o_col
            n2[near] += np.sum((scale[:, None] * o_near[None, :] - xb[:, near]) ** 2, 0)
    sq = [np.sum(e2), np.sum(o2), np.sum(x2)]
    sqw = [e2 @ db, o2 @ db, x2 @ db]  # weighted by the bin lengths (|(rec - sky) sqrt(db)|)
    col_t, wcol_t = x @ db.astype(np.float32), x @ dib.astype(np.float32)
    m = {
        "rel_err_sky": float(np.sqrt(sq[0] / sq[2])),
        "rel_err_sky_oracle": float(np.sqrt(sq[1] / sq[2])),
        "rel_err_sky_db": float(np.sqrt(sqw[0] / sqw[2])),
        "rel_err_sky_db_oracle": float(np.sqrt(sqw[1] / sqw[2])),
        "rel_err_sky_db_near_column": float(np.sqrt((n2 @ db) / sqw[2])),
        "rel_err_column": rel(rec["column"], col_t),
        "rel_err_column_oracle": rel(np.full_like(col_t, oracle @ db), col_t),
        "rel_err_wcolumn": rel(rec["wcolumn"], wcol_t),
        "rel_err_wcolumn_oracle": rel(np.full_like(wcol_t, oracle @ dib), wcol_t),
        "chi2_per_line": rec["summary"]["chi2_per_line"],
    }
    # ... and by distance range (where along the line the error lies): error (oracle's), share of the total
    r = cat.centres
    cuts = [c for c in DISTANCE_RANGES if cat.edges[0] < c < cat.edges[-1]]
    bounds = [float(cat.edges[0]), *cuts, float(cat.edges[-1])]
    by_range = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        k = (r >= lo) & (r < hi)
        if np.any(k):
            num, den = float(e2[k] @ db[k]), float(x2[k] @ db[k])
            by_range.append(
                {
                    "range_pc": [lo, hi],
                    "rel_err": float(np.sqrt(num / den)),
                    "rel_err_oracle": float(np.sqrt((o2[k] @ db[k]) / den)),
                    "rel_err_near_column": float(np.sqrt((n2[k] @ db[k]) / den)),
                    "share_of_error": num / float(e2 @ db),
                }
            )
    m["sky_db_by_distance"] = by_range
    if "column_std" in rec:
        z = (rec["column"] - col_t) / rec["column_std"]
        zw = (rec["wcolumn"] - wcol_t) / rec["wcolumn_std"]
        m.update(
            {
                "column_within_2sd": float(np.mean(np.abs(z) < 2)),
                "column_z_mean": float(np.mean(z)),
                "wcolumn_within_2sd": float(np.mean(np.abs(zw) < 2)),
                "wcolumn_z_mean": float(np.mean(zw)),
            }
        )
    log(
        f"vs truth: sky {m['rel_err_sky']:.4f} (oracle profile {m['rel_err_sky_oracle']:.4f}), weighted by bin "
        f"length {m['rel_err_sky_db']:.4f} ({m['rel_err_sky_db_oracle']:.4f}; near-column reference "
        f"{m['rel_err_sky_db_near_column']:.4f}); column "
        f"{m['rel_err_column']:.4f} ({m['rel_err_column_oracle']:.4f}); 1/r^2-weighted column "
        f"{m['rel_err_wcolumn']:.4f} ({m['rel_err_wcolumn_oracle']:.4f})"
        + (
            f"; within 2 sd: column {100 * m['column_within_2sd']:.1f}%, weighted {100 * m['wcolumn_within_2sd']:.1f}%"
            if "column_within_2sd" in m
            else ""
        )
    )
    return {"metrics": m, "truth_column": col_t, "truth_wcolumn": wcol_t, "oracle_profile": oracle}


def sharded_los_operator(
    lines: Any, mesh: jax.sharding.Mesh, chunk: int, response: str = "seed", layout: str = "auto"
) -> chunkop.RowOperator:
    """The LOS operator of ``lines`` (a :class:`catalog.Catalog` or a ``los.Problem``: its ``pix``,
    ``d``, ``s``, ``n_pix``, ``edges``) with those rows sharded along their leading axis over the mesh
    axis ``"rows"``: each device holds and computes ``n_los / n`` lines.

    Raises:
        ValueError: when the number of lines is not a multiple of the number of devices.
    """
    n, n_los = int(mesh.shape["rows"]), len(lines.pix)
    if n_los % n:
        divisors = [k for k in range(1, min(n_los, 64) + 1) if n_los % k == 0]
        raise ValueError(
            f"--devices {n}: the {n_los} lines of sight cannot be split evenly over {n} devices (the rows "
            f"are sharded in equal blocks); use --devices in {divisors}"
        )
    rows = jax.device_put(
        {"pix": jnp.asarray(lines.pix), "d": jnp.asarray(lines.d), "s": jnp.asarray(lines.s)},
        NamedSharding(mesh, PSpec("rows")),
    )
    return los.make_los_operator(
        rows["pix"],
        rows["d"],
        rows["s"],
        n_pix=lines.n_pix,
        edges=lines.edges,
        chunk_size=min(chunk, n_los),
        response=response,
        layout=layout,
    )


def load_truth(path: str) -> np.ndarray:
    with np.load(path) as f:
        return f["sky"]


def write_synthetic_catalog(
    size: str,
    path: str,
    progress: bool = False,
    response: str = "standard",
    n_los: int | None = None,
    layout: str = "auto",
) -> tuple[los.Problem, Catalog]:
    """The built-in synthetic data of ``size`` seen through ``response`` (``los.make_problem``; ``n_los``
    lines, default the size's; ``layout``: the generating operator's) as a catalog file (with its
    ``response`` entry); its true sky beside it (``PATH`` with ``.truth.npz``) when smaller than 64 MiB."""
    P = los.make_problem(size, progress=progress or None, response=response, n_los=n_los, layout=layout)
    cat = write_catalog(
        path,
        pix=P.pix,
        d=P.d,
        s=P.s,
        y=P.y,
        sigma=P.sigma,
        nx=P.nx,
        ny=P.ny,
        edges=P.edges,
        name=f"synthetic-{size}"
        + ("" if n_los is None else f"-{P.n_los}")
        + ("" if response == "standard" else f"-{response}"),
        response=response,
    )
    if P.n_pix * P.n_bins * 4 <= 64 * MiB:
        np.savez(truth_path(path), sky=np.asarray(P.truth()))
    return P, cat


def truth_path(catalog_path: str) -> str:
    return re.sub(r"\.npz$", "", catalog_path) + ".truth.npz"


# -- the main job -------------------------------------------------------------------------------


def run(
    size: str = "default",
    out: str | None = "outputs/astro_los",
    chunk: int | None = None,
    fit_s: bool = True,
    figures: bool = True,
    rtol: float = 1e-5,
    progress: bool = False,
    devices: int | None = None,
    samples: int | None = None,
    evidence_pixels: int | None = None,
    response: str = "standard",
    n_los: int | None = None,
    layout: str = "auto",
    demos: bool = True,
    prior: str = "auto",
) -> dict:
    """The built-in synthetic job: writes ``--size``'s catalog (``out/catalog.npz``), measures the
    operator, reconstructs the sky from the catalog file alone (:func:`reconstruct_catalog`) and
    compares it with the truth. Returns the results dict (also ``out/results.json``).

    ``devices``: shard the operator's rows over the first ``devices`` of ``jax.devices()`` (see
    :func:`device_mesh`); the job runs under ``jax.set_mesh`` of that mesh. ``n_los``: the number of
    lines (default: the size's; the sky is the size's either way). ``layout``: ``layout=`` of every
    operator over the lines (``--layout``). ``demos=False`` (``--no-demos``): skip the operator's
    measurements (its calls' seconds and compiled memory, ``check_linear``, the s-scale demo).
    ``prior``: the standard response's prior (:func:`reconstruct_standard`; ``--prior``).
    """
    mesh = device_mesh(devices) if devices is not None else None
    tmp = None if out else tempfile.TemporaryDirectory()
    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            res, P, cat_path, chunk, timings = _operator_demos(
                size, out or tmp.name, chunk, fit_s, progress, mesh, response, n_los, layout, demos
            )
        # the reconstruction (outside the mesh: only its final fit check uses the sharded operator)
        return _reconstruct_synthetic(
            res, P, cat_path, chunk, timings, out, figures, rtol, mesh, samples, evidence_pixels, layout, prior
        )
    finally:
        if tmp is not None:
            tmp.cleanup()


def _operator_demos(
    size, out, chunk, fit_s, progress, mesh, response="standard", n_los=None, layout="auto", demos=True
):
    """Write the synthetic catalog; measure the operator; the s-scale demo (inside the mesh)."""
    devices = int(mesh.size) if mesh is not None else 1
    res: dict = {"size": size, "jax": jax.__version__, "backend": jax.default_backend(), "devices": devices}
    res["response"] = response
    res["layout"] = layout
    timings, memory = {}, {}
    log(f"chunkop LOS example, size={size!r}, response={response!r} (jax {jax.__version__}, {jax.default_backend()})")
    if mesh is not None:
        log(f"{devices} device(s), mesh {dict(mesh.shape)} over {[str(d) for d in mesh.devices.flat]}")
    else:
        log("1 device (no mesh; --devices N shards the operator's rows over N devices)")
    cat_path = os.path.join(out, "catalog.npz")
    t = time.perf_counter()
    P, _ = write_synthetic_catalog(size, cat_path, progress, response, n_los, layout)
    chunk = chunk or P.chunk
    timings["make_problem_s"] = time.perf_counter() - t
    sky_bytes = P.n_pix * P.n_bins * 4
    log(
        f"synthetic data ({size}): sky {P.n_pix} pixels ({P.nx} x {P.ny}) x {P.n_bins} radial bins "
        f"({fmt_bytes(sky_bytes)} per float32 copy), {P.n_los} lines, written to {cat_path} in "
        f"{timings['make_problem_s']:.1f}s"
    )
    res["problem"] = {"n_pix": P.n_pix, "nx": P.nx, "ny": P.ny, "n_bins": P.n_bins, "n_los": P.n_los, "chunk": chunk}
    res["problem"].update({"sigma": P.sigma, "sky_bytes": sky_bytes, "n_los_x_n_bins_bytes": P.n_los * P.n_bins * 4})
    A = P.operator(chunk, layout) if mesh is None else sharded_los_operator(P, mesh, P.chunk, P.response, layout)
    res.update(describe_sharding(A, mesh))
    if mesh is not None:
        log(
            f"operator rows sharded over mesh axes {res['operator_mesh_axes']}: "
            + ", ".join(f"{k} {v['spec']} on {v['n_devices']} devices" for k, v in res["rows_sharding"].items())
        )
    seed = size == "seed"
    if not demos:
        res["memory"] = {}
        return res, P, cat_path, chunk, timings
    if not seed:
        res["check_linear"] = chunkop.check_linear(A)
        log(f"chunkop.check_linear (relative errors): {res['check_linear']}")

    # --- the operator's building blocks (on the true sky as a test vector), each compiled alone ----
    x = P.truth()
    mv, memory["matvec"] = compiled_memory(lambda A, x: A.mv(x), A, x)
    y_model, timings["matvec_s"] = timed(mv, A, x, repeats=1 if seed else 3)
    log(f"matvec A x: {timings['matvec_s']:.3f}s, temp {fmt_bytes(memory['matvec']['temp_bytes'])}")
    rmv, memory["transpose"] = compiled_memory(lambda A, y: A.T.mv(y), A, P.y)
    g, timings["transpose_s"] = timed(rmv, A, P.y, repeats=1 if seed else 3)
    del g
    log(f"transpose A^T y: {timings['transpose_s']:.3f}s, temp {fmt_bytes(memory['transpose']['temp_bytes'])}")
    if mesh is not None:
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
        f"temp {fmt_bytes(memory['grad_hvp_alpha']['temp_bytes'])}; chi2/n at truth = {2 * float(c) / P.n_los:.4f}"
    )
    res["chi2_per_line_truth"] = 2 * float(c) / P.n_los
    if fit_s and not seed:
        log("calibration demo (not part of the reconstruction): a global scale on s fitted against the known sky")
        t = time.perf_counter()
        res["s_fit"] = fit_s_scale(A, x, P, step=ga)
        timings["s_fit_s"] = time.perf_counter() - t
    del x, y_model, A
    res["memory"] = memory
    return res, P, cat_path, chunk, timings


def _reconstruct_synthetic(
    res, P, cat_path, chunk, timings, out, figures, rtol, mesh, samples, evidence_pixels, layout="auto", prior="auto"
) -> dict:
    """The reconstruction from the catalog file alone, then the comparison with the truth."""
    seed = P.size == "seed"
    cat = load_catalog(cat_path)
    if samples is None:
        samples = 8 if seed else 32
    t = time.perf_counter()
    rec = reconstruct_catalog(
        cat,
        None,
        samples=samples,
        rtol=rtol,
        chunk=chunk,
        mesh=mesh,
        evidence_pixels=evidence_pixels,
        response=P.response,
        layout=layout,
        prior=prior,
    )
    timings["reconstruction_s"] = time.perf_counter() - t
    ev = evaluate(cat, rec, P.truth())
    rec["summary"]["evaluation"] = ev["metrics"]
    res["summary"] = rec["summary"]
    res["metrics"] = ev["metrics"]
    res["timings"] = timings
    res["peak_rss_bytes"] = peak_rss_bytes()
    if res["memory"]:
        log("compiled temp memory of the operator's jitted functions (beyond their arguments and outputs):")
    for k, m in res["memory"].items():
        log(f"  {k:16s} temp {fmt_bytes(m['temp_bytes']):>10s}  args {fmt_bytes(m['argument_bytes']):>10s}")
    log(f"peak RSS of the process: {fmt_bytes(res['peak_rss_bytes'])}")
    if out:
        write_outputs(out, cat, rec, truth=ev, figures=figures)
        if figures and "s_fit" in res:
            with contextlib.suppress(ImportError):
                s_fit_figure(out, res, P.n_los)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
    res["wall_s"] = time.perf_counter() - T0
    log(f"done in {res['wall_s']:.1f}s")
    return res


def _grid_ax(ax, fig, im, title, label):
    a = ax.imshow(im.T, origin="lower", cmap="magma" if "error" not in title else "RdBu_r")
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("x (pixel)")
    ax.set_ylabel("y (pixel)")
    fig.colorbar(a, ax=ax, shrink=0.8, label=label)
    return a


def _error_by_distance(ax, m: dict) -> None:
    """The sky's error weighted by bin length per distance range (:func:`evaluate`'s ``sky_db_by_distance``):
    the reconstruction's, the oracle profile's and the near-column reference's, side by side."""
    ranges = m["sky_db_by_distance"]
    x = np.arange(len(ranges))
    top = 0.0
    for i, (key, name) in enumerate(
        [
            ("rel_err", "reconstruction"),
            ("rel_err_oracle", "oracle profile"),
            ("rel_err_near_column", "near-column reference"),
        ]
    ):
        ax.bar(x + (i - 1) * 0.27, [b[key] for b in ranges], 0.27, label=name)
        top = max(top, *(b[key] for b in ranges))
    ax.set_ylim(0, 1.7 * top)  # (room for the legend above the bars)
    ax.set_xticks(x, [f"{b['range_pc'][0]:.0f}-{b['range_pc'][1]:.0f}" for b in ranges], fontsize=7)
    ax.set_xlabel("distance range (pc)")
    ax.set_ylabel("sky error / |truth| in the range")
    ax.set_title(
        f"sky error by distance, weighted by bin length\n(the near-column reference is exact beyond {NEAR_PC:.0f} pc)",
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="upper right")


def make_figures(out: str, cat: Catalog, rec: dict, truth: dict | None) -> list:
    """``sky_maps.png``, ``profile.png``, ``residuals.png``; every number shown is taken from the
    run's ``summary`` / evaluation metrics."""
    import matplotlib.pyplot as plt

    paths = []
    nx, ny, r = cat.nx, cat.ny, cat.centres
    k1 = int(np.clip(np.searchsorted(r, 100.0), 0, r.size - 1))
    db_label = "sum_k sky_k (b_k+1 - b_k)  [density x pc]"
    wb_label = "sum_k sky_k (1/b_k - 1/b_k+1)  [density / pc]"
    maps = [
        # (what the seed response's lines measure; the standard response's measure the density up to each star)
        (
            "1/r^2-weighted column"
            + ("\n(what the lines measure)" if rec["summary"].get("response") == "seed" else ""),
            rec["wcolumn"],
            wb_label,
        ),
        ("distance-integrated column", rec["column"], db_label),
        (f"density in the bin at r = {r[k1]:.0f} pc", rec["mean"][:, k1], "density"),
    ]
    rows = 3 if truth is not None else 2
    fig, axes = plt.subplots(rows, 3, figsize=(14, 3.6 * rows), constrained_layout=True)
    for j, (name, im, lab) in enumerate(maps):
        _grid_ax(axes[0, j], fig, im.reshape(nx, ny), f"reconstruction: {name}", lab)
    if truth is None:
        std = [rec.get("wcolumn_std"), rec.get("column_std"), None if rec.get("std") is None else rec["std"][:, k1]]
        for j, s_ in enumerate(std):
            if s_ is None:
                axes[1, j].axis("off")
                continue
            _grid_ax(axes[1, j], fig, (s_ / np.abs(maps[j][1])).reshape(nx, ny), "posterior sd / mean", "relative sd")
    else:
        m = truth["metrics"]
        tmaps = [truth["truth_wcolumn"], truth["truth_column"], None]
        errs = [
            f"1/r^2-weighted column: error |rec - truth| / |truth|\n= {m['rel_err_wcolumn']:.4f} "
            f"(oracle profile {m['rel_err_wcolumn_oracle']:.4f})",
            f"distance-integrated column: error |rec - truth| / |truth|\n= {m['rel_err_column']:.4f} "
            f"(oracle profile {m['rel_err_column_oracle']:.4f})",
            None,
        ]
        for j in range(2):
            _grid_ax(axes[1, j], fig, tmaps[j].reshape(nx, ny), f"truth: {maps[j][0]}", maps[j][2])
            err = (maps[j][1] - tmaps[j]) / tmaps[j]
            lim = max(0.005, float(np.percentile(np.abs(err), 99)))  # each panel on its own scale
            a = axes[2, j].imshow(err.reshape(nx, ny).T, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim)
            axes[2, j].set_title(errs[j], fontsize=8)
            axes[2, j].set_xlabel("x (pixel)")
            axes[2, j].set_ylabel("y (pixel)")
            fig.colorbar(a, ax=axes[2, j], shrink=0.8, label="(reconstruction - truth) / truth")
        axes[1, 2].axis("off")
        _error_by_distance(axes[2, 2], m)
        axes[1, 2].text(
            0.0,
            0.5,
            f"sky, weighted by bin length: error {m['rel_err_sky_db']:.4f}\n"
            f"  oracle radial profile {m['rel_err_sky_db_oracle']:.4f} "
            f"({m['rel_err_sky_db'] / max(m['rel_err_sky_db_oracle'], 1e-300):.2f}x)\n"
            f"sky, every bin alike: error {m['rel_err_sky']:.4f}\n"
            f"  oracle radial profile {m['rel_err_sky_oracle']:.4f}\n"
            f"chi2 per line {m['chi2_per_line']:.3f}"
            + (
                f"\ncolumns within 2 sd: {100 * m['column_within_2sd']:.1f}%\n"
                f"weighted columns within 2 sd: {100 * m['wcolumn_within_2sd']:.1f}%"
                if "column_within_2sd" in m
                else ""
            ),
            fontsize=10,
        )
    fig.suptitle(
        f"{cat.name or 'catalog'}: {cat.n_los} lines, {nx} x {ny} pixels x {cat.n_bins} bins "
        f"({cat.edges[0]:.0f}-{cat.edges[-1]:.0f} pc)"
    )
    paths.append(os.path.join(out, "sky_maps.png"))
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    # the radial profile: learned (+- 2 sd over the Laplace samples), the map's mean over pixels, and
    # the truth's mean if known
    fig, ax = plt.subplots(figsize=(6.5, 4.5), constrained_layout=True)
    post = rec["post"]
    ax.loglog(r, post["mu"], "C0-", label="learned mean profile mu(r) (a hyperparameter)")
    if "mu_samples" in post:
        lo, hi = np.percentile(post["mu_samples"], [2.5, 97.5], axis=0)
        ax.fill_between(r, lo, hi, color="C0", alpha=0.25, label="95% (hyperparameter posterior)")
    if rec["hyper"].get("reference_profile") is not None:
        level = np.array(rec["hyper"]["theta"])
        level[1:3] = 0.0  # the reference's own shape, at the learned level
        ref = learn.profile(
            level, learn.profile_t(cat.edges), learn.profile_omega(cat.edges), np, rec["hyper"]["reference_profile"]
        )
        ax.loglog(r, ref, color="C1", ls=(0, (4, 3)), lw=2, label="reference given (--profile), at the learned level")
    prior = rec["summary"].get("prior", {}).get("name")
    which = {"lognormal": "the log-normal mode", "gaussian": "the posterior mean"}.get(prior, "the posterior mean")
    ax.loglog(r, rec["mean"].mean(0), "C2-", lw=2, label=f"map ({which}): mean over pixels")
    if truth is not None:
        ax.loglog(r, truth["oracle_profile"], "k--", label="truth: mean over pixels (the oracle)")
    ax.set_xlabel("distance r (pc)")
    ax.set_ylabel("density (sky units)")
    h = rec["hyper"]
    along = (
        f"\nalong the line {h['ell_r_pc']:.0f} pc and {field3d.SHORT_PC:.0f} pc with q {h['q']:.2f}; "
        f"sky-wide sd {h['amp0']:.2f} x (mean + {h['floor']:.2f} x its average)"
        if "ell_r_pc" in h  # (the 3-D prior's: the standard response)
        else ""
    )
    ax.set_title(
        f"learned: field sd {h['amp']:.3f} x mean; correlation on the sky {h['ell_pixels']:.1f} px "
        f"(slope {h['slope']:.2f}){along}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    paths.append(os.path.join(out, "profile.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5), constrained_layout=True)
    resid = rec["resid"]
    ax.hist(np.clip(resid, -6, 6), bins=np.linspace(-6, 6, 121), density=True, alpha=0.7, label="lines")
    g = np.linspace(-6, 6, 200)
    ax.plot(g, np.exp(-0.5 * g**2) / np.sqrt(2 * np.pi), "k--", label="N(0, 1)")
    ax.set_xlabel("normalised residual (y - A sky) / sigma")
    ax.set_ylabel("density of lines")
    ax.set_title(f"chi2 per line = {rec['summary']['chi2_per_line']:.3f}")
    ax.legend(fontsize=8)
    paths.append(os.path.join(out, "residuals.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def s_fit_figure(out: str, res: dict, n_los: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = res["s_fit"]["path"]
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.semilogy([p["alpha"] for p in path], [2 * p["chi2"] / n_los for p in path], "o-")
    for i, p in enumerate(path):
        ax.annotate(str(i), (p["alpha"], 2 * p["chi2"] / n_los), fontsize=8)
    ax.axvline(1.0, color="k", ls=":", label="true alpha")
    ax.set_xlabel("alpha (every line's s -> alpha s; s: the distance uncertainty of the weights)")
    ax.set_ylabel("chi2 per line (sky fixed at the truth)")
    ax.set_title(f"Newton steps on log alpha: alpha = {res['s_fit']['alpha']:.4f} +- {res['s_fit']['alpha_sd']:.4f}")
    ax.legend()
    fig.savefig(os.path.join(out, "s_fit.png"), dpi=90)
    plt.close(fig)
    res.setdefault("summary", {}).setdefault("figures", []).append(os.path.join(out, "s_fit.png"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, metavar="CATALOG.npz", help="reconstruct this catalog (catalog.py format)")
    p.add_argument("--truth", default=None, metavar="TRUTH.npz", help="with --data: compare with this true sky ('sky')")
    p.add_argument(
        "--write-catalog", default=None, metavar="PATH", help="write --size's synthetic catalog (and truth) and exit"
    )
    p.add_argument("--size", default="default", choices=sorted(los.SIZES), help="synthetic size (default: default)")
    p.add_argument("--out", default="outputs/astro_los", help="output folder (default outputs/astro_los)")
    p.add_argument(
        "--n-los",
        type=int,
        default=None,
        metavar="N",
        help="the synthetic run's number of lines (default: --size's; the sky's grid stays --size's)",
    )
    p.add_argument("--chunk", type=int, default=None, help="lines per chunk (default: per size, 8192 with --data)")
    p.add_argument("--samples", type=int, default=None, help="posterior samples for the std (default 32; seed 8)")
    p.add_argument("--rtol", type=float, default=1e-5, help="CG relative tolerance (default 1e-5; seed response)")
    p.add_argument("--no-fit-s", action="store_true", help="skip the s-scale calibration demo")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument(
        "--no-demos",
        action="store_true",
        help="synthetic run: skip the operator's measurements (seconds and compiled memory of its calls, "
        "check_linear, the s-scale demo) and go from the catalog to the reconstruction",
    )
    p.add_argument(
        "--evidence-pixels",
        type=int,
        default=None,
        metavar="N",
        help=f"seed response: the most pixels of the coarse grid the prior's evidence is computed on "
        f"(default: {learn.MAX_COARSE}, "
        f"or up to {learn.MAX_COARSE_FINE} where a coarse pixel would span more than {learn.MAX_FINE} fine ones "
        "on a side; memory ~ N^2, time ~ N^3: see the example's README, seed size)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="shard the operator's rows (lines of sight) over the first N of jax.devices(), mesh axis 'rows'; "
        f"on a CPU, N host devices are made ({HOST_DEVICE_FLAG}=N is appended to XLA_FLAGS before jax "
        "starts). The number of lines must be a multiple of N (default: one device, no mesh)",
    )
    p.add_argument("--progress", action="store_true", help="a progress bar of chunks per operator call")
    p.add_argument(
        "--layout",
        default="auto",
        choices=("auto", "windowed", "plain"),
        help="the rows' layout of every operator over the lines (chunkop.RowOperator's layout=): 'auto' "
        "(default) sorts the lines and keeps windows where this platform's measurements say they win; 'plain' "
        "skips that sort (once per operator)",
    )
    p.add_argument(
        "--response",
        default=None,
        choices=los.RESPONSES,
        help="the lines' response (los.py): 'standard' (the published maps': the density integrated up to the "
        "star, averaged over its lognormal distance; reconstructed with the 3-D prior, field3d.py) or 'seed' "
        "(the users' literal first weights, the benchmark kernel; the radial-shape prior, learn.py). Default: "
        "the catalog's 'response' entry with --data, else standard",
    )
    p.add_argument(
        "--prior",
        default="auto",
        choices=PRIORS,
        help="the standard response's prior: 'gaussian' (a Gaussian 3-D field about a learned mean profile, "
        "field3d.py), 'lognormal' (a positive field on the same learned hyperparameters, lognormal.py: its mode "
        "and linearised errors; every pixel, at most lognormal.MAX_CELLS cells), or 'auto' (default): the "
        "log-normal one where it fits, its mode is reached and it fits the lines no worse than the Gaussian map",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PROFILE.npy",
        help="with --data: a reference radial profile, one positive density per radial bin (n_bins,), from "
        "outside the catalog (a model of the disc, an earlier map): the prior's mean shape. The lines measure "
        "one 1/r^2-weighted column per pixel; the distance-integrated column follows this profile",
    )
    p.add_argument(
        "--profile-sd",
        type=float,
        default=None,
        metavar="SD",
        help="the hyperprior sd of the profile's shape (log density, at the ends of the distance range) about "
        f"the reference (default {learn.REFERENCE_PRIOR_SD} with --profile, {learn.PROFILE_PRIOR_SD} without)",
    )
    a = p.parse_args(argv)
    if (a.profile is not None or a.profile_sd is not None) and a.data is None:
        p.error("--profile and --profile-sd need --data (the built-in synthetic run learns its profile)")
    if a.profile_sd is not None and not a.profile_sd > 0:
        p.error(f"--profile-sd must be positive, got {a.profile_sd}")
    if a.n_los is not None and a.data is not None:
        p.error("--n-los applies to the synthetic run (the catalog given with --data has its own lines)")
    if a.n_los is not None and a.n_los < 1:
        p.error(f"--n-los must be at least 1, got {a.n_los}")
    if a.evidence_pixels is not None and a.evidence_pixels < 1:
        p.error(f"--evidence-pixels must be at least 1, got {a.evidence_pixels}")
    if a.devices is not None:
        if a.devices < 1:
            p.error(f"--devices must be at least 1, got {a.devices}")
        n_los = a.n_los or los.SIZES[a.size].n_los
        if a.data is None and n_los % a.devices:
            p.error(f"--devices {a.devices} does not divide the {n_los} lines of the synthetic run")
    if a.write_catalog:
        _, cat = write_synthetic_catalog(
            a.size, a.write_catalog, a.progress, a.response or "standard", a.n_los, a.layout
        )
        log(f"wrote {a.write_catalog} ({cat.n_los} lines, {cat.nx} x {cat.ny} x {cat.n_bins})")
        return {"catalog": a.write_catalog}
    if a.data is None:
        return run(
            a.size,
            a.out,
            a.chunk,
            fit_s=not a.no_fit_s,
            figures=not a.no_figures,
            rtol=a.rtol,
            progress=a.progress,
            devices=a.devices,
            samples=a.samples,
            evidence_pixels=a.evidence_pixels,
            response=a.response or "standard",
            n_los=a.n_los,
            layout=a.layout,
            demos=not a.no_demos,
            prior=a.prior,
        )
    try:
        cat = load_catalog(a.data)
        response = resolve_response(cat, a.response)
    except (CatalogError, ValueError) as e:
        p.error(f"{a.data}: {e}")
    if (a.profile is not None or a.profile_sd is not None) and response != "seed":
        p.error("--profile and --profile-sd need the seed response (the 3-D prior learns its profile)")
    reference = None
    if a.profile is not None:
        try:
            reference = learn.check_reference(np.load(a.profile), cat.n_bins)
        except (OSError, ValueError) as e:
            p.error(f"--profile {a.profile}: {e}")
    mesh = device_mesh(a.devices) if a.devices is not None else None
    rec = reconstruct_catalog(
        cat,
        None,
        samples=32 if a.samples is None else a.samples,
        rtol=a.rtol,
        chunk=a.chunk or 8192,
        mesh=mesh,
        reference=reference,
        profile_sd=a.profile_sd,
        evidence_pixels=a.evidence_pixels,
        response=response,
        layout=a.layout,
        prior=a.prior,
    )
    ev = None
    if a.truth:
        ev = evaluate(cat, rec, load_truth(a.truth))
        rec["summary"]["evaluation"] = ev["metrics"]
    write_outputs(a.out, cat, rec, truth=ev, figures=not a.no_figures)
    log(f"done in {time.perf_counter() - T0:.1f}s")
    return rec["summary"]


if __name__ == "__main__":
    main()
