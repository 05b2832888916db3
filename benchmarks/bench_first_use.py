"""First use (issue #16 target 3): building and first calls with ``chunk_size="auto"`` against a fixed chunk.

    python benchmarks/bench_first_use.py [--rounds 3] [--out benchmarks/results]

Each measurement is a fresh Python process (nothing cached, JAX's compilation cache off), so
it counts everything a first call costs: planning, tracing and compiling. Two workloads:

* ``RowOperator``: the LOS operator of ``examples/astro_los/los.py`` (131072 lines, a 3072 x 96
  sky, the expm1 weights), built, then a jitted ``mv`` and a jitted ``grad`` of a least-squares
  loss, each run once;
* ``chunkop.vmap``: a 4-layer tanh MLP (64 wide) over 65536 examples: a jitted forward and a
  jitted ``grad`` of the summed output, each run once.

``chunk_size="auto"`` (default budget) and ``chunk_size=4096`` alternate round by round; wall
and process CPU time (all threads) are recorded with the load average before each process.
Writes ``first_use.json`` and ``first_use.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
sys.path.insert(0, {astro!r})
import jax, jax.numpy as jnp, numpy as np
import chunkop, los
workload, chunk = {workload!r}, {chunk!r}
t_import = time.perf_counter() - t0
t1, c1 = time.perf_counter(), time.process_time()
if workload == "RowOperator":
    pix, d, s = los.draw_lines(131072, 3072, np.random.default_rng(0))
    A = los.make_los_operator(pix, d, s, n_pix=3072, n_bins=96, chunk_size=chunk)
    x = jnp.ones((3072, 96), jnp.float32)
    jax.block_until_ready(jax.jit(lambda A, x: A.mv(x))(A, x))
    jax.block_until_ready(jax.jit(jax.grad(lambda x, A: 0.5 * jnp.sum((A.mv(x) - 1.0) ** 2)))(x, A))
    used = A.chunk_size
else:
    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
    X = jax.random.normal(jax.random.key(1), (65536, 64))
    jax.block_until_ready((w, X))
    t1, c1 = time.perf_counter(), time.process_time()
    def f(x):
        for _ in range(4):
            x = jnp.tanh(w @ x)
        return jnp.sum(x ** 2)
    g = chunkop.vmap(f, chunk_size=chunk)
    jax.block_until_ready(jax.jit(g)(X))
    jax.block_until_ready(jax.jit(jax.grad(lambda X: g(X).sum()))(X))
    used = chunkop.plan(g, X).chunk if chunk == "auto" else chunk
print(json.dumps(dict(wall=time.perf_counter() - t1, cpu=time.process_time() - c1, chunk=used)))
"""


def run(workload: str, chunk) -> dict:
    code = CHILD.format(astro=str(ROOT / "examples" / "astro_los"), workload=workload, chunk=chunk)
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), load=load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    results: dict = {}
    for r in range(args.rounds):
        for workload in ("RowOperator", "chunkop.vmap"):
            order = ("auto", 4096) if r % 2 == 0 else (4096, "auto")
            for chunk in order:
                m = run(workload, chunk)
                results.setdefault(workload, {}).setdefault(str(chunk), []).append(m)
                print(workload, chunk, m, flush=True)
    lines = [
        '# First use: `chunk_size="auto"` against a fixed chunk (fresh process each)',
        "",
        f"{args.rounds} rounds, alternating; medians. Load average (1 min) before each process: "
        f"{min(m['load'] for w in results.values() for c in w.values() for m in c):.2f}-"
        f"{max(m['load'] for w in results.values() for c in w.values() for m in c):.2f} on "
        f"{os.cpu_count()} cores. Written by `benchmarks/bench_first_use.py` on {time.strftime('%Y-%m-%d')}.",
        "",
        "| workload | chunk | wall s | CPU s | auto / fixed (wall) | auto / fixed (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    summary = {}
    for workload, by_chunk in results.items():
        med = {c: {k: statistics.median(m[k] for m in ms) for k in ("wall", "cpu")} for c, ms in by_chunk.items()}
        ratio = {k: med["auto"][k] / med["4096"][k] for k in ("wall", "cpu")}
        summary[workload] = dict(median=med, ratio=ratio, chunk_auto=by_chunk["auto"][0]["chunk"])
        for c in ("4096", "auto"):
            chosen = f"auto ({by_chunk['auto'][0]['chunk']})" if c == "auto" else c
            tail = f"{ratio['wall']:.2f}x | {ratio['cpu']:.2f}x" if c == "auto" else " | "
            lines.append(f"| {workload} | {chosen} | {med[c]['wall']:.2f} | {med[c]['cpu']:.2f} | {tail} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_use.json").write_text(json.dumps(dict(results=results, summary=summary), indent=1))
    (out / "first_use.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
