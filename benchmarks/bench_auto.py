"""``chunk_size="auto"`` against a sweep of fixed chunks (issue #24, finding 6): auto / best fixed.

Usage::

    python benchmarks/bench_auto.py              # full sizes (about 10-15 minutes on a 2-core CPU)
    python benchmarks/bench_auto.py --quick      # tiny sizes: checks that everything runs (about 2 minutes)
    python benchmarks/bench_auto.py --rounds 9   # more interleaved rounds
    python benchmarks/bench_auto.py --out DIR    # write auto.json and auto.md under DIR (default benchmarks/results)

Four workloads, each run with ``chunk_size="auto"`` (the default budget: on CPU the 16 MiB
throughput cap and the per-chunk overhead floor, ``chunkop._search``) and with every chunk of a
fixed sweep:

* ``LOS``: the line-of-sight ``RowOperator`` of ``examples/astro_los/los.py`` (sky of pixels x
  radial bins, the expm1 weights): ``A.mv`` and ``A.T.mv``;
* ``CT``: a parallel-beam CT projector as a ``RowOperator``: one row per ray (angle, detector
  offset), bilinear interpolation of an ``n x n`` image at ``ceil(1.4142 n)`` samples per ray
  (the shape of the case in the issue: 92160 rays x 1449 samples of a 1024 x 1024 image, where
  "auto" had picked chunk 24): ``A.mv`` and ``A.T.mv``;
* ``MLP``: ``jax.grad`` of ``chunkop.sum`` of a per-example cross-entropy, 64 -> 256 -> 256 ->
  256 -> 10 tanh (the workload of ``bench_vmap.py``);
* ``NeRF``: ``jax.grad`` of the full-image loss of ``examples/nerf/nerf.py`` (``chunkop.sum``
  over rays, an MLP at every sample of a ray).

Every program is compiled first; then all of them, of every workload, run round-robin in ONE
interleaved loop (order reversed every other round), so load from other processes hits them
alike. Reported per (workload, operation): the median time of each fixed chunk and of "auto",
the chunk "auto" chose (and its plan's overhead floor), and **auto / best fixed** (target:
<= 1.1). The load average (``os.getloadavg``, as ``uptime`` prints it) is recorded before and
after; on a loaded machine differences below about 10-20% are noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import chunkop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "astro_los"))
sys.path.insert(0, str(ROOT / "examples" / "nerf"))
import los  # noqa: E402
import nerf  # noqa: E402

MiB = 2**20

#: Sizes of each workload, full and --quick.
SIZES = {
    "full": {
        "LOS": {"n_pix": 20000, "n_bins": 256, "n_los": 131072, "chunks": (256, 1024, 4096, 16384)},
        "CT": {"n": 1024, "angles": 360, "detectors": 256, "chunks": (24, 64, 256, 1024, 4096)},
        "MLP": {"n": 65536, "width": 256, "chunks": (64, 256, 1024, 4096, 16384)},
        "NeRF": {"rays": 16384, "samples": 64, "width": 128, "depth": 4, "chunks": (16, 64, 256, 1024, 4096)},
    },
    "quick": {
        "LOS": {"n_pix": 1000, "n_bins": 32, "n_los": 4096, "chunks": (64, 512)},
        "CT": {"n": 64, "angles": 45, "detectors": 32, "chunks": (16, 128)},
        "MLP": {"n": 2048, "width": 32, "chunks": (64, 512)},
        "NeRF": {"rays": 512, "samples": 8, "width": 16, "depth": 2, "chunks": (16, 128)},
    },
}


def log(msg: str) -> None:
    print(msg, flush=True)


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    return [round(x, 2) for x in os.getloadavg()]


# -- the workloads: each returns {operation: {label: (fn, args)}} and the chunk "auto" chose ----


def ct_row_fn(n: int, samples: int) -> Callable:
    """One ray of a parallel-beam projector on an ``n x n`` image (pixel units, centred)."""
    half = (n - 1) / 2
    ts = np.linspace(-1.4142 * half, 1.4142 * half, samples).astype(np.float32)
    dt = float(ts[1] - ts[0])

    def row_fn(ray: dict, image: jax.Array) -> jax.Array:
        c, s = jnp.cos(ray["angle"]), jnp.sin(ray["angle"])
        px = ray["offset"] * c - ts * s + half
        py = ray["offset"] * s + ts * c + half
        x0, y0 = jnp.floor(px), jnp.floor(py)
        fx, fy = px - x0, py - y0
        i0, j0 = x0.astype(jnp.int32), y0.astype(jnp.int32)

        def tap(i: jax.Array, j: jax.Array, w: jax.Array) -> jax.Array:
            inside = (i >= 0) & (i < n) & (j >= 0) & (j < n)
            return jnp.where(inside, w, 0.0) * image[jnp.clip(i, 0, n - 1), jnp.clip(j, 0, n - 1)]

        total = (
            tap(i0, j0, (1 - fx) * (1 - fy))
            + tap(i0 + 1, j0, fx * (1 - fy))
            + tap(i0, j0 + 1, (1 - fx) * fy)
            + tap(i0 + 1, j0 + 1, fx * fy)
        )
        return jnp.sum(total) * dt

    return row_fn


def ct_rays(n: int, angles: int, detectors: int) -> dict:
    """Every (angle, detector offset) pair: ``angles * detectors`` rays."""
    a = np.repeat(np.linspace(0.0, np.pi, angles, endpoint=False), detectors)
    o = np.tile(np.linspace(-(n - 1) / 2, (n - 1) / 2, detectors), angles)
    return {"angle": jnp.asarray(a, jnp.float32), "offset": jnp.asarray(o, jnp.float32)}


def operator_cells(make: Callable[[Any], chunkop.RowOperator], chunks: tuple, x: jax.Array) -> tuple[dict, Any]:
    """``mv`` and ``T.mv`` of the operator ``make(chunk)`` for each fixed chunk and for "auto"."""
    mv = jax.jit(lambda A, v: A.mv(v))
    tmv = jax.jit(lambda A, v: A.T.mv(v))
    cells: dict = {"mv": {}, "T.mv": {}}
    plan = None
    for chunk in (*chunks, "auto"):
        A = make(chunk)
        if chunk == "auto":
            plan = A.budget_plan
        y = jnp.ones(jax.eval_shape(A.mv, x).shape, x.dtype)
        label = "auto" if chunk == "auto" else str(A.chunk_size)
        cells["mv"][label] = (mv, (A, x))
        cells["T.mv"][label] = (tmv, (A, y))
    return cells, plan


def los_workload(n_pix: int, n_bins: int, n_los: int, chunks: tuple) -> tuple[dict, Any]:
    pix, d, s = los.draw_lines(n_los, n_pix, np.random.default_rng(0))
    edges = los.bin_edges(n_bins)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(n_pix, n_bins)), jnp.float32)
    make = lambda chunk: los.make_los_operator(pix, d, s, n_pix=n_pix, edges=edges, chunk_size=chunk)
    return operator_cells(make, chunks, x)


def ct_workload(n: int, angles: int, detectors: int, chunks: tuple) -> tuple[dict, Any]:
    rays = ct_rays(n, angles, detectors)
    row_fn = ct_row_fn(n, math.ceil(1.4142 * n))
    image = jax.ShapeDtypeStruct((n, n), jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).uniform(size=(n, n)), jnp.float32)
    make = lambda chunk: chunkop.RowOperator(row_fn, rays, image, chunk_size=chunk)
    return operator_cells(make, chunks, x)


def mlp_workload(n: int, width: int, chunks: tuple) -> tuple[dict, Any]:
    rng = np.random.default_rng(3)
    sizes = [64, width, width, width, 10]
    params = [jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32) for a, b in zip(sizes[:-1], sizes[1:])]
    xs = jnp.asarray(rng.normal(size=(n, 64)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, 10, n), jnp.int32)

    def loss(p: list, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x
        for w in p[:-1]:
            h = jnp.tanh(h @ w)
        logits = h @ p[-1]
        return jax.nn.logsumexp(logits) - logits[y]

    cells: dict = {"grad": {}}
    for chunk in (*chunks, "auto"):
        total = chunkop.sum(loss, (None, 0, 0), chunk_size=chunk)
        cells["grad"][str(chunk)] = (jax.jit(jax.grad(lambda p, x, y, f=total: f(p, x, y))), (params, xs, ys))
    plan = chunkop.plan(chunkop.sum(loss, (None, 0, 0), chunk_size="auto"), params, xs, ys)
    return cells, plan


def nerf_workload(rays: int, samples: int, width: int, depth: int, chunks: tuple) -> tuple[dict, Any]:
    base = nerf.Config(samples=samples, width=width, depth=depth)
    params = nerf.init_mlp(jax.random.key(0), base)
    rng = np.random.default_rng(4)
    origins = jnp.asarray(rng.normal(size=(rays, 3)) * 0.1 + np.array([0.0, -4.0, 1.0]), jnp.float32)
    dirs = jnp.asarray(rng.normal(size=(rays, 3)) * 0.1 + np.array([0.0, 1.0, -0.2]), jnp.float32)
    dirs = dirs / jnp.linalg.norm(dirs, axis=-1, keepdims=True)
    target = jnp.asarray(rng.uniform(size=(rays, 3)), jnp.float32)
    key = jax.random.key(5)
    cells: dict = {"grad": {}}
    plan = None
    for chunk in (*chunks, "auto"):
        cfg = nerf.Config(samples=samples, width=width, depth=depth, chunk=chunk)
        fn = jax.jit(jax.grad(lambda p, o, d, t, k, cfg=cfg: nerf.image_loss(p, o, d, t, k, cfg)))
        cells["grad"][str(chunk)] = (fn, (params, origins, dirs, target, key))
    # the plan "auto" makes there: the same chunkop.sum as image_loss's, planned on its arguments
    cfg = nerf.Config(samples=samples, width=width, depth=depth, chunk="auto")

    def sq_err(p: Any, o: jax.Array, d: jax.Array, t: jax.Array, i: jax.Array) -> jax.Array:
        rgb = nerf.render_ray(p, o, d, nerf.ray_offsets(key, i, cfg), cfg)
        return jnp.sum((rgb - t) ** 2)

    f = chunkop.sum(sq_err, in_axes=(None, 0, 0, 0, 0), chunk_size="auto")
    plan = chunkop.plan(f, params, origins, dirs, target, jnp.arange(rays))
    return cells, plan


WORKLOADS = {"LOS": los_workload, "CT": ct_workload, "MLP": mlp_workload, "NeRF": nerf_workload}


# -- the run ---------------------------------------------------------------------------------------


def run(sizes: dict, rounds: int, only: list[str]) -> dict:
    """Compile every cell, then time all of them round-robin; returns the results."""
    cells: list[tuple[str, str, str, Callable, tuple]] = []
    plans: dict = {}
    compile_s: dict = {}
    for name in only:
        t0 = time.perf_counter()
        workload, plan = WORKLOADS[name](**sizes[name])
        plans[name] = plan
        for op, by_label in workload.items():
            for label, (fn, args) in by_label.items():
                t1 = time.perf_counter()
                jax.block_until_ready(fn(*args))  # compile and warm up
                compile_s[f"{name}/{op}/{label}"] = round(time.perf_counter() - t1, 2)
                cells.append((name, op, label, fn, args))
        log(f"{name}: built and compiled in {time.perf_counter() - t0:.1f} s; auto plan: {plan}")
    times: dict = {(w, o, lab): [] for w, o, lab, _, _ in cells}
    load_before = load()
    t_start = time.perf_counter()
    for r in range(rounds):
        order = cells if r % 2 == 0 else cells[::-1]
        for w, o, lab, fn, args in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[(w, o, lab)].append(time.perf_counter() - t0)
        log(f"round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s), load {load()}")
    load_after = load()
    results: dict = {}
    for (w, o, lab), ts in times.items():
        entry = results.setdefault(w, {}).setdefault(o, {"chunks": {}, "auto": None})
        stats = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "samples_ms": [1e3 * t for t in ts]}
        if lab == "auto":
            entry["auto"] = stats
        else:
            entry["chunks"][lab] = stats
    for w, ops in results.items():
        plan = plans[w]
        for entry in ops.values():
            best_label = min(entry["chunks"], key=lambda k: entry["chunks"][k]["median_ms"])
            best = entry["chunks"][best_label]["median_ms"]
            entry.update(
                best_chunk=int(best_label),
                best_ms=best,
                auto_chunk=None if plan is None else plan.chunk,
                auto_floor=None if plan is None else plan.floor,
                ratio=entry["auto"]["median_ms"] / best,
            )
    return {
        "results": results,
        "plans": {w: repr(p) for w, p in plans.items()},
        "compile_s": compile_s,
        "load_before": load_before,
        "load_after": load_after,
        "rounds": rounds,
        "sizes": sizes,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__},
        "backend": jax.default_backend(),
    }


def markdown(report: dict) -> str:
    lines = [
        f'`chunk_size="auto"` against fixed chunks: median of {report["rounds"]} interleaved rounds; '
        f"load {report['load_before']} -> {report['load_after']} ({report['machine']['cpus']} CPUs, "
        f"{report['backend']}). Target: auto / best <= 1.1.",
        "",
        "| workload | op | fixed chunks: median ms | auto chunk (floor) | auto ms | best fixed | auto / best |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for w, ops in report["results"].items():
        for o, e in ops.items():
            sweep = ", ".join(
                f"{c}: {v['median_ms']:.1f}" for c, v in sorted(e["chunks"].items(), key=lambda kv: int(kv[0]))
            )
            auto = "whole axis" if e["auto_chunk"] is None else str(e["auto_chunk"])
            lines.append(
                f"| {w} | {o} | {sweep} | {auto} ({e['auto_floor']}) | {e['auto']['median_ms']:.1f} | "
                f"{e['best_chunk']}: {e['best_ms']:.1f} | {e['ratio']:.2f} |"
            )
    lines += ["", "Plans:", ""] + [f"- {w}: `{p}`" for w, p in report["plans"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "full"]
    rounds = args.rounds or (3 if args.quick else 7)
    log(f"load before: {load()}")
    report = run(sizes, rounds, args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (args.out / "auto.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
