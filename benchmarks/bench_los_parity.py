"""chunkop's LOS operator against the hand-written chunked JAX it replaces, many interleaved repeats.

    python benchmarks/bench_los_parity.py [--n-los 262144] [--chunk 4096] [--repeats 21] [--out DIR]

Issue #8's speed target (within 1.1x of the fastest hand-written equivalent at the same chunk)
is a ratio of a few percent, smaller than the run-to-run spread of ``bench_los.py``'s 2-5
repeats on a shared machine. This script times only the contenders, ``chunkop``
(``RowOperator``), the hand ``custom_vjp`` scan and ``lax.map(batch_size)``, for ``matvec``,
``transpose``, ``grad`` and ``hvp`` (the functions of ``bench_los.py``), compiled once and then
round-robin (the order reversing every round) for ``--repeats`` rounds. Writes
``DIR/los_parity.json`` and ``DIR/los_parity.md`` with the load before and after.
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

METHODS = ("chunkop", "custom_vjp", "lax.map")
OPS = ("matvec", "transpose", "grad", "hvp")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=262144)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    load_start = [round(x, 2) for x in os.getloadavg()]
    wl = B.Workload(20000, 256, a.chunk)
    d = wl.data(a.n_los)
    args = (d["rows"], d["x"], d["v"], d["y"])
    execs = {}
    for m in METHODS:
        ops = wl.ops(m)
        for op in OPS:
            execs[f"{m}|{op}"] = jax.jit(ops[op]).lower(*B.structs(args)).compile()
    times = B.time_round_robin(execs, {k: args for k in execs}, a.repeats, 600.0)
    res = {
        "machine": B.machine(),
        "config": {"n_los": a.n_los, "chunk": a.chunk, "repeats": a.repeats},
        "load_start": load_start,
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "times": times,
    }
    lines = [
        f"LOS operator, sky 20000 x 256 float32, {a.n_los} lines, chunk {a.chunk}: median (min) of "
        f"{times[next(iter(times))]['repeats']} interleaved repeats; load {res['load_start']} -> {res['load_end']}.",
        "",
        "| op | chunkop | custom_vjp | lax.map | chunkop / fastest hand-written |",
        "|---|---:|---:|---:|---:|",
    ]
    for op in OPS:
        med = {m: times[f"{m}|{op}"]["median_s"] for m in METHODS}
        cells = [f"{1e3 * med[m]:.1f} ms ({1e3 * times[f'{m}|{op}']['min_s']:.1f})" for m in METHODS]
        ratio = med["chunkop"] / min(med["custom_vjp"], med["lax.map"])
        lines.append(f"| {op} | " + " | ".join(cells) + f" | **{ratio:.2f}** |")
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "los_parity.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "los_parity.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
