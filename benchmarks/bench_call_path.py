"""The Python path of one warm eager call: time per call and the chunkop functions it passes through.

Usage::

    python benchmarks/bench_call_path.py                      # this checkout
    python benchmarks/bench_call_path.py --against REV        # also REV (a git worktree), interleaved
    python benchmarks/bench_call_path.py --out DIR            # write call_path.json/.md under DIR

Issue #24 asks that the one engine costs no more per call than the code it replaced: an eager
``chunkop.vmap`` call (plain arrays, outside ``jax.jit``), an eager ``A.mv`` and ``A.T.mv`` of a
``RowOperator``. For each, after warm-up (everything compiled and cached):

* **ms per call**: the median of 7 blocks of 50 calls, the blocks of the two checkouts
  alternated in one run (each checkout in its own interpreter, started once), with
  ``jax.vmap`` (or the dense matrix product) as the floor a user has;
* **calls**, **functions** and **depth**: the calls into functions defined in ``chunkop``
  during one call (``sys.setprofile``), how many distinct functions those are, and the deepest
  nesting of chunkop frames (the hops from the user's call to JAX).

The load average (``os.getloadavg``) is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKS, PER_BLOCK = 7, 50

WORKER = r"""
import inspect, json, sys, time, os
import jax, jax.numpy as jnp, numpy as np
import chunkop

pkg = os.path.dirname(chunkop.__file__)
rng = np.random.default_rng(0)
w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
xs = jnp.asarray(rng.normal(size=(1000, 8)), jnp.float32)
f = lambda x: jnp.tanh(w @ x)
cv = chunkop.vmap(f, chunk_size=128)
jv = jax.vmap(f)
rows = {"idx": jnp.asarray(rng.integers(0, 500, 4096), jnp.int32),
        "s": jnp.asarray(rng.uniform(size=4096), jnp.float32)}
row_fn = lambda r, x: r["s"] * x[r["idx"]].sum()
layout = os.environ.get("CALL_PATH_LAYOUT")  # (a checkout without the option: its one layout)
kw = {"layout": layout} if layout and "layout" in inspect.signature(chunkop.RowOperator).parameters else {}
A = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((500, 4), jnp.float32), chunk_size=512, **kw)
x = jnp.asarray(rng.normal(size=(500, 4)), jnp.float32)
y = jnp.asarray(rng.normal(size=(4096,)), jnp.float32)
M = jnp.asarray(np.asarray(jax.jacfwd(A.mv)(x)).reshape(4096, -1))
dense = jax.jit(lambda M, v: M @ v.reshape(-1))
denseT = jax.jit(lambda M, v: M.T @ v)
CASES = {
    "chunkop.vmap": lambda: cv(xs), "jax.vmap": lambda: jv(xs),
    "A.mv": lambda: A.mv(x), "dense mv": lambda: dense(M, x),
    "A.T.mv": lambda: A.T.mv(y), "dense T.mv": lambda: denseT(M, y),
}
for fn in CASES.values():
    for _ in range(5):
        jax.block_until_ready(fn())

def path(fn):
    calls, names, depth, deepest = 0, set(), 0, 0
    def prof(frame, event, arg):
        nonlocal calls, depth, deepest
        if not frame.f_code.co_filename.startswith(pkg):
            return
        if event == "call":
            calls += 1
            depth += 1
            deepest = max(deepest, depth)
            code = frame.f_code
            names.add((code.co_filename, getattr(code, "co_qualname", code.co_name)))
        elif event == "return":
            depth -= 1
    sys.setprofile(prof)
    try:
        jax.block_until_ready(fn())
    finally:
        sys.setprofile(None)
    return calls, len(names), deepest

print(json.dumps({k: path(fn) for k, fn in CASES.items()}), flush=True)
for line in sys.stdin:
    out = {}
    for k, fn in CASES.items():
        t = time.perf_counter()
        for _ in range(int(line)):
            r = fn()
        jax.block_until_ready(r)
        out[k] = (time.perf_counter() - t) / int(line) * 1e3
    print(json.dumps(out), flush=True)
"""


def start(src: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(src), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None, help="a git revision to compare with (checked out as a worktree)")
    parser.add_argument(
        "--layout", default=None, help="the RowOperator's layout= where the checkout has it (plain: the path alone)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.layout:
        os.environ["CALL_PATH_LAYOUT"] = args.layout  # (the workers inherit it)
    sources = {"this": ROOT / "src"}
    if args.against:
        tree = Path("/tmp") / f"chunkop-call-path-{args.against}"
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.against], check=True)
        sources[args.against] = tree / "src"
    load_before = [round(v, 2) for v in os.getloadavg()]
    workers = {name: start(src) for name, src in sources.items()}
    paths = {name: json.loads(w.stdout.readline()) for name, w in workers.items()}
    times: dict = {name: {} for name in workers}
    for b in range(BLOCKS):
        order = list(workers) if b % 2 == 0 else list(workers)[::-1]
        for name in order:
            workers[name].stdin.write(f"{PER_BLOCK}\n")
            workers[name].stdin.flush()
            for k, v in json.loads(workers[name].stdout.readline()).items():
                times[name].setdefault(k, []).append(v)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    load_after = [round(v, 2) for v in os.getloadavg()]
    result = {
        "load": [load_before, load_after],
        "cpus": os.cpu_count(),
        "paths": paths,
        "ms": {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()},
    }
    lines = [
        f"Warm eager calls: median ms of {BLOCKS} alternated blocks of {PER_BLOCK}; chunkop calls / distinct "
        f"functions / deepest nesting per call (`sys.setprofile`). Load {load_before} -> {load_after}, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| call | "
        + " | ".join(f"{n}: ms" for n in workers)
        + " | "
        + " | ".join(f"{n}: calls / functions / depth" for n in workers)
        + " |",
        "|---|" + "---:|" * (2 * len(workers)),
    ]
    for k in paths["this"]:
        ms = " | ".join(f"{result['ms'][n][k]:.3f}" for n in workers)
        cf = " | ".join(" / ".join(map(str, paths[n][k])) for n in workers)
        lines.append(f"| {k} | {ms} | {cf} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "call_path.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "call_path.md").write_text(text)


if __name__ == "__main__":
    main()
