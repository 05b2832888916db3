"""Benchmark ``chunkop.vmap`` against ``jax.vmap``, ``jax.lax.map(batch_size)`` and a Python-loop batchify.

Usage::

    python benchmarks/bench_vmap.py            # full run (a few minutes on a small CPU box)
    python benchmarks/bench_vmap.py --quick    # smoke run (well under a minute)
    python benchmarks/bench_vmap.py --out DIR  # write vmap.json / vmap_memory.png under DIR

Workload: the summed per-example loss of a 4-layer MLP (64 -> 256 -> 256 -> 256 -> 10, tanh,
softmax cross-entropy); the parameters are unmapped, ``x`` and ``y`` are mapped over axis 0.
Two modes are measured: ``fwd`` (the summed loss) and ``grad`` (its gradient w.r.t. the params).

For every (method, mode, N) it records

* the compiled temp memory, ``jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes``
  (what XLA allocates beyond arguments and outputs: the activations/residuals);
* the compile time, seconds for ``lower`` + ``compile`` of a freshly built function (median of
  ``--compile-repeats``), which should not grow with N for a scan-based method;
* the run time, median over repeats of the compiled executable, after a warm-up call, each call
  ended by ``block_until_ready``. All competitors of one comparison are timed round-robin
  (interleaved) in the same loop, so drift and load from other processes hit them alike.

Stages:

1. chunk-size sweep at the largest N (chunkop remat=True/False and lax.map at every chunk size,
   jax.vmap as baseline); the "good" chunk size is the one maximising the geometric mean of
   chunkop(remat=True)'s forward and grad throughput relative to jax.vmap;
2. N sweep at that chunk size for all five methods, plus compile-only (memory and compile time)
   points at larger N;
3. a report: markdown tables, throughput ratios against the targets, JSON and a PNG.

Targets (from the issue): forward >= 0.95x and grad >= 0.8x jax.vmap throughput at a good chunk
size; never slower than lax.map(batch_size) beyond noise; compile time flat in N.
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

import jax
import jax.numpy as jnp
import numpy as np

import chunkop

SIZES = (64, 256, 256, 256, 10)
METHODS = ("jax.vmap", "lax.map", "batchify", "chunkop", "chunkop(remat=False)")
MODES = ("fwd", "grad")
MiB = 2**20

# Targets of the issue.
FWD_TARGET = 0.95
GRAD_TARGET = 0.80
COMPILE_FLAT_TOL = 1.5  # compile(N_max) / compile(smallest chunked N) must stay below this


# ------------------------------------------------------------------------------------------------
# Workload.


def init_params(key: jax.Array, sizes=SIZES) -> list:
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a), jnp.zeros((b,), jnp.float32)))
    return params


def example_loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of one example: ``x`` of shape (64,), integer label ``y``."""
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    logits = h @ w + b
    return jax.nn.logsumexp(logits) - logits[y]


def make_method(name: str, chunk: int) -> Callable:
    """A freshly built ``f(params, x, y) -> summed loss`` (fresh closures: no tracing cache hits)."""
    loss = lambda p, x, y: example_loss(p, x, y)  # noqa: E731  (new identity every time)

    if name == "jax.vmap":
        def f(p, x, y):
            return jax.vmap(loss, in_axes=(None, 0, 0))(p, x, y).sum()
    elif name == "lax.map":
        def f(p, x, y):
            return jax.lax.map(lambda xy: loss(p, *xy), (x, y), batch_size=chunk).sum()
    elif name == "batchify":
        def f(p, x, y):
            v = jax.vmap(loss, in_axes=(None, 0, 0))
            n = x.shape[0]
            return jnp.concatenate([v(p, x[i : i + chunk], y[i : i + chunk]) for i in range(0, n, chunk)]).sum()
    elif name == "chunkop":
        def f(p, x, y):
            return chunkop.vmap(loss, in_axes=(None, 0, 0), chunk_size=chunk)(p, x, y).sum()
    elif name == "chunkop(remat=False)":
        def f(p, x, y):
            return chunkop.vmap(loss, in_axes=(None, 0, 0), chunk_size=chunk, remat=False)(p, x, y).sum()
    else:  # pragma: no cover
        raise ValueError(name)
    return f


def make_args(n: int, concrete: bool):
    params = init_params(jax.random.key(0))
    if not concrete:
        sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
        return (jax.tree_util.tree_map(sds, params), jax.ShapeDtypeStruct((n, SIZES[0]), jnp.float32),
                jax.ShapeDtypeStruct((n,), jnp.int32))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n, SIZES[0]), jnp.float32)
    y = jax.random.randint(ky, (n,), 0, SIZES[-1], jnp.int32)
    return params, x, y


# ------------------------------------------------------------------------------------------------
# Measurement.


def compile_one(name: str, mode: str, chunk: int, args, repeats: int) -> tuple:
    """(compiled, median compile seconds, temp bytes) for ``name`` in ``mode``."""
    times, compiled = [], None
    for _ in range(repeats):
        f = make_method(name, chunk)
        g = f if mode == "fwd" else jax.grad(f)
        t0 = time.perf_counter()
        compiled = jax.jit(g).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes) if mem is not None else -1
    return compiled, statistics.median(times), temp


def time_round_robin(execs: dict, args, min_repeats: int, max_repeats: int, budget_s: float) -> dict:
    """Median seconds per call of every compiled executable, timed interleaved (round-robin)."""
    for c in execs.values():  # warm-up (first call may allocate / page in)
        jax.block_until_ready(c(*args))
    one = {}
    for k, c in execs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        one[k] = time.perf_counter() - t0
    per_round = sum(one.values())
    reps = int(min(max_repeats, max(min_repeats, budget_s // max(per_round, 1e-9))))
    samples: dict = {k: [] for k in execs}
    for r in range(reps):
        keys = list(execs)
        if r % 2:
            keys.reverse()  # alternate order so no method always runs right after the same one
        for k in keys:
            t0 = time.perf_counter()
            jax.block_until_ready(execs[k](*args))
            samples[k].append(time.perf_counter() - t0)
    out = {}
    for k, s in samples.items():
        med = statistics.median(s)
        mad = statistics.median([abs(v - med) for v in s])
        out[k] = {"median_s": med, "mad_s": mad, "min_s": min(s), "repeats": len(s)}
    return out


def slower_beyond_noise(t_a: dict, t_b: dict) -> tuple[bool, float, float]:
    """Is ``a`` slower than ``b`` beyond noise? Returns (flag, ratio a/b, tolerance)."""
    ratio = t_a["median_s"] / t_b["median_s"]
    rel = 2.0 * (t_a["mad_s"] / t_a["median_s"] + t_b["mad_s"] / t_b["median_s"])
    tol = max(0.05, rel)
    return ratio > 1.0 + tol, ratio, tol


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Stages.


def chunk_sweep(n: int, chunks: list, cfg: argparse.Namespace) -> dict:
    log(f"\n## chunk-size sweep at N={n}")
    args_c = make_args(n, concrete=True)
    args_s = make_args(n, concrete=False)
    res: dict = {"n": n, "chunks": chunks, "fwd": {}, "grad": {}}
    for mode in MODES:
        execs, meta = {}, {}
        c, tc, mem = compile_one("jax.vmap", mode, n, args_s, 1)
        execs[("jax.vmap", 0)] = c
        meta[("jax.vmap", 0)] = (tc, mem)
        for chunk in chunks:
            for name in ("chunkop", "chunkop(remat=False)", "lax.map"):
                c, tc, mem = compile_one(name, mode, chunk, args_s, 1)
                execs[(name, chunk)] = c
                meta[(name, chunk)] = (tc, mem)
        t0 = time.perf_counter()
        times = time_round_robin(execs, args_c, cfg.min_repeats, cfg.max_repeats, cfg.budget_s)
        log(f"  {mode}: timed {len(execs)} executables in {time.perf_counter() - t0:.1f}s")
        base = times[("jax.vmap", 0)]["median_s"]
        rows = []
        for (name, chunk), t in times.items():
            rows.append({
                "method": name, "chunk": chunk, **t,
                "throughput_vs_vmap": base / t["median_s"],
                "compile_s": meta[(name, chunk)][0], "temp_bytes": meta[(name, chunk)][1],
            })
        res[mode] = rows
    return res


def pick_chunk(sweep: dict) -> tuple[int, dict]:
    def ratio(mode, chunk, name="chunkop"):
        return next(r["throughput_vs_vmap"] for r in sweep[mode] if r["method"] == name and r["chunk"] == chunk)

    score = {c: math.sqrt(ratio("fwd", c) * ratio("grad", c)) for c in sweep["chunks"]}
    best = max(score, key=score.get)
    return best, {
        "geomean_score": score,
        "best_fwd_chunk": max(sweep["chunks"], key=lambda c: ratio("fwd", c)),
        "best_grad_chunk": max(sweep["chunks"], key=lambda c: ratio("grad", c)),
    }


def n_sweep(ns: list, mem_only_ns: list, chunk: int, cfg: argparse.Namespace) -> list:
    log(f"\n## N sweep at chunk_size={chunk}")
    rows = []
    for n in ns + mem_only_ns:
        timed = n in ns
        args_s = make_args(n, concrete=False)
        args_c = make_args(n, concrete=True) if timed else None
        for mode in MODES:
            execs = {}
            for name in METHODS:
                c, tc, mem = compile_one(name, mode, chunk, args_s, cfg.compile_repeats if timed else 1)
                execs[name] = c
                rows.append({"n": n, "mode": mode, "method": name, "chunk": chunk,
                             "compile_s": tc, "temp_bytes": mem, "timed": timed})
            if timed:
                times = time_round_robin(execs, args_c, cfg.min_repeats, cfg.max_repeats, cfg.budget_s)
                base = times["jax.vmap"]["median_s"]
                for r in rows:
                    if r["n"] == n and r["mode"] == mode:
                        r.update(times[r["method"]])
                        r["throughput_vs_vmap"] = base / r["median_s"]
            log(f"  N={n:>7} {mode:>4}: done" + ("" if timed else " (compile only)"))
    return rows


# ------------------------------------------------------------------------------------------------
# Report.


def fmt_ms(r: dict) -> str:
    return f"{r['median_s'] * 1e3:.1f} ±{r['mad_s'] * 1e3:.1f}" if "median_s" in r else "-"


def table_n(rows: list) -> str:
    lines = [
        "| N | method | fwd temp MiB | grad temp MiB | fwd compile s | grad compile s | fwd ms | grad ms "
        "| fwd x vmap | grad x vmap |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ns = sorted({r["n"] for r in rows})
    for n in ns:
        for name in METHODS:
            f = next(r for r in rows if r["n"] == n and r["method"] == name and r["mode"] == "fwd")
            g = next(r for r in rows if r["n"] == n and r["method"] == name and r["mode"] == "grad")
            fx = f"{f['throughput_vs_vmap']:.2f}" if "throughput_vs_vmap" in f else "-"
            gx = f"{g['throughput_vs_vmap']:.2f}" if "throughput_vs_vmap" in g else "-"
            lines.append(
                f"| {n} | {name} | {f['temp_bytes'] / MiB:.1f} | {g['temp_bytes'] / MiB:.1f} | {f['compile_s']:.2f} "
                f"| {g['compile_s']:.2f} | {fmt_ms(f)} | {fmt_ms(g)} | {fx} | {gx} |"
            )
    return "\n".join(lines)


def table_chunk(sweep: dict) -> str:
    def get(mode, name, chunk):
        return next(r for r in sweep[mode] if r["method"] == name and r["chunk"] == chunk)

    vf, vg = get("fwd", "jax.vmap", 0), get("grad", "jax.vmap", 0)
    lines = [
        f"jax.vmap baseline: fwd {fmt_ms(vf)} ms, grad {fmt_ms(vg)} ms, grad temp {vg['temp_bytes'] / MiB:.1f} MiB",
        "",
        "| chunk | chunkop fwd x vmap | chunkop grad x vmap | remat=False fwd | remat=False grad "
        "| lax.map fwd | lax.map grad | chunkop grad temp MiB | lax.map grad temp MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sweep["chunks"]:
        cells = [f"{get(m, name, c)['throughput_vs_vmap']:.2f}"
                 for name in ("chunkop", "chunkop(remat=False)", "lax.map") for m in MODES]
        lines.append(
            f"| {c} | " + " | ".join(cells)
            + f" | {get('grad', 'chunkop', c)['temp_bytes'] / MiB:.1f} | {get('grad', 'lax.map', c)['temp_bytes'] / MiB:.1f} |"
        )
    return "\n".join(lines)


def evaluate(rows: list, sweep: dict, chunk: int) -> dict:
    """Throughput ratios and the issue's targets."""
    timed = [r for r in rows if r.get("timed")]
    n_max = max(r["n"] for r in timed)

    def row(n, mode, name):
        return next(r for r in rows if r["n"] == n and r["mode"] == mode and r["method"] == name)

    out: dict = {"chunk": chunk, "n": n_max}
    for mode in MODES:
        out[f"{mode}_vs_vmap"] = row(n_max, mode, "chunkop")["throughput_vs_vmap"]
        out[f"{mode}_vs_vmap_remat_false"] = row(n_max, mode, "chunkop(remat=False)")["throughput_vs_vmap"]
        out[f"{mode}_vs_laxmap"] = row(n_max, mode, "lax.map")["median_s"] / row(n_max, mode, "chunkop")["median_s"]
        # Best-of-repeats ratio: a cross-check that is less sensitive to load from other processes.
        out[f"{mode}_vs_vmap_min"] = row(n_max, mode, "jax.vmap")["min_s"] / row(n_max, mode, "chunkop")["min_s"]
    out["fwd_target_met"] = out["fwd_vs_vmap"] >= FWD_TARGET
    out["grad_target_met"] = out["grad_vs_vmap"] >= GRAD_TARGET

    # Never slower than lax.map(batch_size) at the same chunk size, beyond noise: every comparison
    # of the N sweep (N > chunk) and of the chunk sweep.
    comps = []
    for variant in ("chunkop", "chunkop(remat=False)"):
        for n in sorted({r["n"] for r in timed}):
            if n <= chunk:
                continue
            for mode in MODES:
                slow, ratio, tol = slower_beyond_noise(row(n, mode, variant), row(n, mode, "lax.map"))
                comps.append({"where": f"N={n} C={chunk}", "variant": variant, "mode": mode,
                              "time_ratio": ratio, "tol": tol, "slower": slow})
        for c in sweep["chunks"]:
            for mode in MODES:
                a = next(r for r in sweep[mode] if r["method"] == variant and r["chunk"] == c)
                b = next(r for r in sweep[mode] if r["method"] == "lax.map" and r["chunk"] == c)
                slow, ratio, tol = slower_beyond_noise(a, b)
                comps.append({"where": f"N={sweep['n']} C={c}", "variant": variant, "mode": mode,
                              "time_ratio": ratio, "tol": tol, "slower": slow})
    out["laxmap_comparisons"] = comps
    out["laxmap_target_met"] = not any(c["slower"] for c in comps if c["variant"] == "chunkop")
    out["laxmap_target_met_remat_false"] = not any(c["slower"] for c in comps if c["variant"] != "chunkop")

    # Compile time flat in N: largest N (including compile-only points) vs the smallest chunked N.
    flat = {}
    for name in ("chunkop", "chunkop(remat=False)", "lax.map", "batchify", "jax.vmap"):
        for mode in MODES:
            pts = sorted((r["n"], r["compile_s"]) for r in rows if r["method"] == name and r["mode"] == mode
                         and r["n"] > chunk)
            if len(pts) >= 2:
                flat[f"{name} {mode}"] = pts[-1][1] / pts[0][1]
    out["compile_growth"] = flat
    out["compile_flat_met"] = all(v < COMPILE_FLAT_TOL for k, v in flat.items() if k.startswith("chunkop"))
    return out


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    styles = {"jax.vmap": "o-", "lax.map": "s--", "batchify": "^-.", "chunkop": "D-", "chunkop(remat=False)": "v:"}
    for name in METHODS:
        for ax, key, mode, scale in ((axes[0], "temp_bytes", "grad", 1 / MiB), (axes[1], "median_s", "grad", 1e3),
                                     (axes[2], "compile_s", "grad", 1.0)):
            pts = sorted((r["n"], r[key] * scale) for r in rows if r["method"] == name and r["mode"] == mode and key in r
                         and r[key] > 0)
            if pts:
                ax.plot(*zip(*pts), styles[name], label=name)
    chunk = rows[0]["chunk"]
    for ax, title, ylabel in ((axes[0], "grad: compiled temp memory", "temp MiB"),
                              (axes[1], "grad: run time (median)", "ms"),
                              (axes[2], "grad: lower+compile time", "s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (mapped axis size)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, chunk={chunk}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small N, few repeats (smoke run)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--chunk", type=int, default=None, help="skip the chunk sweep's choice; use this chunk size")
    cfg = p.parse_args(argv)
    if cfg.quick:
        ns, mem_only, chunks = [256, 1024, 4096], [16384], [64, 128, 256, 512, 1024]
        cfg.min_repeats, cfg.max_repeats, cfg.budget_s, cfg.compile_repeats = 3, 15, 0.5, 1
    else:
        ns, mem_only, chunks = [1024, 4096, 16384, 65536], [262144], [64, 128, 256, 512, 1024, 2048, 4096]
        cfg.min_repeats, cfg.max_repeats, cfg.budget_s, cfg.compile_repeats = 5, 30, 2.0, 3
    cfg.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
           "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform(),
           "quick": cfg.quick}
    log(f"# chunkop.vmap benchmark  (jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus, "
        f"{'quick' if cfg.quick else 'full'})")
    log(f"MLP {SIZES}, summed per-example cross-entropy; params unmapped, x/y mapped")

    sweep = chunk_sweep(max(ns), chunks, cfg)
    best, pick = pick_chunk(sweep)
    chunk = cfg.chunk or best
    log(f"  good chunk size (geomean of fwd/grad throughput vs jax.vmap): {best}; "
        f"best for fwd {pick['best_fwd_chunk']}, for grad {pick['best_grad_chunk']}; using {chunk}")

    rows = n_sweep(ns, mem_only, chunk, cfg)
    ev = evaluate(rows, sweep, chunk)

    log(f"\n## chunk-size sweep at N={sweep['n']} (throughput relative to jax.vmap, higher is better)\n")
    log(table_chunk(sweep))
    log(f"\n## N sweep at chunk_size={chunk} (time: median ± MAD; N={mem_only} compile-only)\n")
    log(table_n(rows))

    ok = lambda b: "MET" if b else "NOT MET"  # noqa: E731
    log(f"\n## Ratios at N={ev['n']}, chunk_size={chunk} (independent of the sweep that chose it)\n")
    log(f"- forward throughput chunkop / jax.vmap = {ev['fwd_vs_vmap']:.3f}  (target >= {FWD_TARGET}: "
        f"{ok(ev['fwd_target_met'])});  remat=False: {ev['fwd_vs_vmap_remat_false']:.3f};  "
        f"best-of-repeats ratio {ev['fwd_vs_vmap_min']:.3f}")
    log(f"- grad    throughput chunkop / jax.vmap = {ev['grad_vs_vmap']:.3f}  (target >= {GRAD_TARGET}: "
        f"{ok(ev['grad_target_met'])});  remat=False: {ev['grad_vs_vmap_remat_false']:.3f};  "
        f"best-of-repeats ratio {ev['grad_vs_vmap_min']:.3f}")
    log(f"- throughput chunkop / lax.map(batch_size={chunk}): fwd {ev['fwd_vs_laxmap']:.3f}, "
        f"grad {ev['grad_vs_laxmap']:.3f}")
    slow = [c for c in ev["laxmap_comparisons"] if c["slower"]]
    log(f"- never slower than lax.map beyond noise (chunkop, remat=True): {ok(ev['laxmap_target_met'])}; "
        f"remat=False: {ok(ev['laxmap_target_met_remat_false'])}  "
        f"({len(ev['laxmap_comparisons'])} comparisons, tolerance max(5%, 2x summed rel. MAD))")
    for c in slow:
        log(f"    slower: {c['variant']} {c['mode']} at {c['where']}: time ratio {c['time_ratio']:.3f} > 1+{c['tol']:.3f}")
    growth = ", ".join(f"{k} x{v:.2f}" for k, v in ev["compile_growth"].items())
    log(f"- compile time growth from the smallest chunked N to N={max(ns + mem_only)}: {growth}")
    log(f"  chunkop compile time flat in N (growth < {COMPILE_FLAT_TOL}x): {ok(ev['compile_flat_met'])}")

    result = {"env": env, "mlp_sizes": SIZES, "chunk_sweep": sweep, "chunk_choice": {"best": best, **pick},
              "chunk": chunk, "n_sweep": rows, "evaluation": ev,
              "targets": {"fwd_vs_vmap": FWD_TARGET, "grad_vs_vmap": GRAD_TARGET,
                          "compile_growth_max": COMPILE_FLAT_TOL},
              "wall_s": time.perf_counter() - t_start}

    def keyfix(o):  # JSON needs string keys
        if isinstance(o, dict):
            return {str(k): keyfix(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [keyfix(v) for v in o]
        return o

    (cfg.out / "vmap.json").write_text(json.dumps(keyfix(result), indent=1))
    plot(rows, cfg.out / "vmap_memory.png")
    log(f"\nwrote {cfg.out / 'vmap.json'} and {cfg.out / 'vmap_memory.png'}  "
        f"(total {time.perf_counter() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
