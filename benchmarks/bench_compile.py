"""Compile time of the LOS operator's jitted functions: chunkop vs plain ``jax.vmap`` and hand-written JAX.

    python benchmarks/bench_compile.py [--n-los 20000] [--chunk 4096] [--repeats 5] [--form expm1|literal] [--out DIR]

For each method of ``bench_los.py`` (``jax.vmap``, ``lax.map``, the hand ``custom_vjp``,
``chunkop``) and each of ``matvec``, ``transpose``, ``grad`` and ``hvp``: the time of
``jax.jit(f).lower(*structs)`` (tracing and lowering to StableHLO) and of ``.compile()`` (XLA),
with every cache emptied before each measurement (``jax.clear_caches()`` and
``chunkop.clear_caches()``), so each figure is a first compilation. Methods are interleaved (the
order reverses every repeat), after one untimed warm-up round; medians are reported, with the
machine's load before and after. Writes ``DIR/compile.json`` and ``DIR/compile.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

import chunkop

METHODS = ("jax.vmap", "lax.map", "custom_vjp", "chunkop")
OPS = ("matvec", "transpose", "grad", "hvp")


def measure(n_los: int, chunk: int, repeats: int, form: str = "expm1") -> dict:
    wl = B.Workload(20000, 256, chunk, form)
    d = wl.data(n_los)
    args = B.structs((d["rows"], d["x"], d["v"], d["y"]))
    samples: dict = {(m, op): [] for m in METHODS for op in OPS}
    for m in METHODS:  # warm-up: first-use costs (imports, lowering rules) are not compile time
        for op in OPS:
            jax.jit(wl.ops(m)[op]).lower(*args).compile()
    for r in range(repeats):
        for m in METHODS[:: (-1 if r % 2 else 1)]:
            for op in OPS:
                jax.clear_caches()
                chunkop.clear_caches()
                f = wl.ops(m)[op]
                t0 = time.perf_counter()
                lowered = jax.jit(f).lower(*args)
                t1 = time.perf_counter()
                lowered.compile()
                t2 = time.perf_counter()
                samples[(m, op)].append((t1 - t0, t2 - t1))
    out = {}
    for (m, op), s in samples.items():
        out[f"{m}|{op}"] = {
            "lower_s": statistics.median(a for a, _ in s),
            "compile_s": statistics.median(b for _, b in s),
            "total_s": statistics.median(a + b for a, b in s),
            "samples": s,
        }
    return out


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"Compile time, LOS operator ({cfg.get('form', 'expm1')} weights, sky 20000 x 256 float32, "
        f"{cfg['n_los']} lines, chunk {cfg['chunk']}; "
        f"plan: {cfg['plan']}), medians of {cfg['repeats']} first compilations per cell, interleaved; "
        f"load {res['load_start']} -> {res['load_end']}. Cells: lower (trace + StableHLO) + XLA compile = total "
        "(x jax.vmap's total).",
        "",
        "| op | " + " | ".join(METHODS) + " |",
        "|---|" + "---:|" * len(METHODS),
    ]
    for op in OPS:
        base = res["results"][f"jax.vmap|{op}"]["total_s"]
        cells = []
        for m in METHODS:
            e = res["results"][f"{m}|{op}"]
            cells.append(
                f"{1e3 * e['lower_s']:.0f} + {1e3 * e['compile_s']:.0f} = {1e3 * e['total_s']:.0f} ms "
                f"(x{e['total_s'] / base:.2f})"
            )
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--form", default="expm1", choices=B.FORMS, help="the weights: the expm1 rewrite or the users' literal formula"
    )
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    from chunkop._chunking import make_plan

    res = {"machine": B.machine(), "load_start": [round(x, 2) for x in os.getloadavg()]}
    plan = make_plan(a.n_los, a.chunk)
    res["config"] = {"n_los": a.n_los, "chunk": a.chunk, "repeats": a.repeats, "plan": str(plan), "form": a.form}
    res["results"] = measure(a.n_los, a.chunk, a.repeats, a.form)
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "compile" if a.form == "expm1" else f"compile_{a.form}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=float))
    md = markdown(res)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
