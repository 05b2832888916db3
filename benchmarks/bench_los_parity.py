"""chunkop's LOS operator against hand-written chunked JAX and plain unchunked JAX, many interleaved repeats.

    python benchmarks/bench_los_parity.py [--n-los 262144] [--chunk 4096] [--repeats 21]
        [--forms literal,expm1] [--out DIR]

Issue #8's speed target (within 1.1x of the fastest hand-written equivalent at the same chunk)
and issue #16's (within 1.1x of plain unchunked JAX) are ratios of a few percent, smaller than
the run-to-run spread of ``bench_los.py``'s 2-5 repeats on a shared machine. This script times
only the contenders, ``chunkop`` (``RowOperator``), the hand ``custom_vjp`` scan,
``lax.map(batch_size)`` and plain unchunked ``jax.vmap`` (its ``jax.linear_transpose``, and
grad / hvp of the unchunked loss), for ``matvec``, ``transpose``, ``grad`` and ``hvp`` (the
functions of ``bench_los.py``), for both weight forms (``literal``: the users'
``-diff(exp(-(d - b) / (d s b)))``; ``expm1``: the cancellation-free rewrite), compiled once and
then round-robin (the order reversing every round) for ``--repeats`` rounds per operation.
Writes ``DIR/los_parity.json`` and ``DIR/los_parity.md`` with the load of every operation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

METHODS = ("chunkop", "custom_vjp", "lax.map", "jax.vmap")
HAND = ("custom_vjp", "lax.map")
OPS = ("matvec", "transpose", "grad", "hvp")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=262144)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--forms", default=",".join(B.FORMS))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    load_start = [round(x, 2) for x in os.getloadavg()]
    times: dict = {}
    for form in forms:
        wl = B.Workload(20000, 256, a.chunk, form)
        d = wl.data(a.n_los)
        args = (d["rows"], d["x"], d["v"], d["y"])
        for op in OPS:  # one operation at a time: its methods interleaved
            execs = {m: jax.jit(wl.ops(m)[op]).lower(*B.structs(args)).compile() for m in METHODS}
            t = B.time_round_robin(execs, {k: args for k in execs}, a.repeats, 600.0)
            for m in METHODS:
                times[f"{form}|{m}|{op}"] = t[m]
            cells = "  ".join(f"{m} {1e3 * t[m]['median_s']:.1f} ({1e3 * t[m]['min_s']:.1f}) ms" for m in METHODS)
            print(f"[{form}] {op:9s} {cells}  load {t['chunkop']['load1']}", flush=True)
        del d
    res = {
        "machine": B.machine(),
        "config": {"n_los": a.n_los, "chunk": a.chunk, "repeats": a.repeats, "forms": forms},
        "load_start": load_start,
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "times": times,
    }
    lines = [
        f"LOS operator, sky 20000 x 256 float32, {a.n_los} lines, chunk {a.chunk}: median (min) of "
        f"{a.repeats} interleaved repeats per operation; load {res['load_start']} -> {res['load_end']}. "
        "`jax.vmap` is plain unchunked JAX.",
        "",
        "| form | op | chunkop | custom_vjp | lax.map | jax.vmap | chunkop / fastest hand-written | "
        "chunkop / jax.vmap | load (1 min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for form in forms:
        for op in OPS:
            t = {m: times[f"{form}|{m}|{op}"] for m in METHODS}
            cells = [f"{1e3 * t[m]['median_s']:.1f} ms ({1e3 * t[m]['min_s']:.1f})" for m in METHODS]
            hand = t["chunkop"]["median_s"] / min(t[m]["median_s"] for m in HAND)
            plain = t["chunkop"]["median_s"] / t["jax.vmap"]["median_s"]
            lines.append(
                f"| {form} | {op} | "
                + " | ".join(cells)
                + f" | **{hand:.2f}** | **{plain:.2f}** | {t['chunkop']['load1']} |"
            )
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "los_parity.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "los_parity.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
