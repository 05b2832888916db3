"""Issue #16: the LOS operator with the users' literal weights, against plain unchunked JAX.

    python benchmarks/bench_literal.py                  # about 4-6 minutes on a 2-core CPU
    python benchmarks/bench_literal.py --quick          # smaller problem, fewer repeats (~1-2 min)
    python benchmarks/bench_literal.py --n-los 131072 --chunk 4096 --repeats 15 --out DIR

Workload: ``bench_los.Workload`` (sky 20000 x 256 float32, edges ``geomspace(40, 1700, 257)``),
both weight forms: ``literal`` (the users' ``-diff(exp(-(d - b) / (d s b)))``, unrewritten) and
``expm1`` (the cancellation-free rewrite of ``examples/astro_los/los.py``).

Methods, per operation (``matvec``, ``transpose``, ``grad`` of ``|A x - b|^2`` w.r.t. ``x``,
``hvp`` forward-over-reverse):

* ``chunkop``: ``RowOperator`` (``A.mv``, ``A.T.mv``, autodiff through its ``custom_jvp``);
* ``chunkop (no barrier)``: the same with ``_chunking.fusion_barrier`` replaced by the identity,
  compiled in the same process: what the fusion barrier buys, measured in the same run;
* ``jax.vmap``: plain unchunked JAX, the reference: ``jax.vmap(row_fn)``, ``jax.linear_transpose``
  of it, ``jax.grad`` / hvp of the unchunked loss;
* ``chunkop.vmap``: ``chunkop.vmap(row_fn, (0, None), chunk_size=chunk)`` as the forward, and
  ``jax.linear_transpose`` / ``jax.grad`` / hvp of it (no custom rule, no barrier).

Plus two batched operations (``vmap`` of the transpose over 4 vectors ``y``, and over 2 sets of
rows: there the barrier's predicate is batched and JAX turns the conditional into a ``select``).

All methods of one operation are compiled first, then timed round-robin (order reversing every
round): min and median wall time, process CPU time (all threads; less sensitive to other
processes), and the load average. For chunkop's executables the optimized HLO is inspected: the
number of ``conditional`` instructions kept by XLA, and the fusions in which an ``exponential``
is computed from a ``dynamic-slice`` (the slow pattern of issue #16). Writes
``DIR/los_literal.json`` and ``DIR/los_literal.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

import chunkop
from chunkop import _chunking

METHODS = ("chunkop", "chunkop (no barrier)", "jax.vmap", "chunkop.vmap")
OPS = ("matvec", "transpose", "grad", "hvp", "transpose, vmap over 4 y", "transpose, vmap over 2 row sets")


def exp_fed_by_slice(text: str) -> list[str]:
    """Computations of an optimized HLO module where an ``exponential`` is computed from a ``dynamic-slice``."""
    bad = []
    for m in re.finditer(r"^(%[\w.\-]+) \(.*?\{\n(.*?)^\}", text, re.S | re.M):
        defs = {}
        for line in m.group(2).splitlines():
            d = re.match(r"^\s*(?:ROOT )?(%[\w.\-]+) = .*? ([\w\-]+)\((.*)$", line)
            if d:
                defs[d.group(1)] = (d.group(2), re.findall(r"%[\w.\-]+", d.group(3).split("),")[0]))
        stack = [a for opcode, args in defs.values() if opcode == "exponential" for a in args]
        seen: set = set()
        while stack:
            a = stack.pop()
            if a in seen or a not in defs:
                continue
            seen.add(a)
            if defs[a][0] == "dynamic-slice":
                bad.append(m.group(1))
                break
            stack.extend(defs[a][1])
    return bad


def functions(wl: B.Workload, method: str) -> dict:
    """``{op: f(rows, x, v, y, rows2, Y)}`` for one method."""
    xs = wl.x_struct
    if method == "jax.vmap":
        mv = wl.f_vmap
    elif method == "chunkop.vmap":
        mv = lambda r, x: chunkop.vmap(wl.row_fn, (0, None), chunk_size=wl.chunk)(r, x)
    else:
        mv = lambda r, x: chunkop.RowOperator(wl.row_fn, r, xs, chunk_size=wl.chunk).mv(x)

    if method.startswith("chunkop") and method != "chunkop.vmap":

        def rmv(r, y):
            return chunkop.RowOperator(wl.row_fn, r, xs, chunk_size=wl.chunk).T.mv(y)

    else:

        def rmv(r, y):
            return jax.linear_transpose(lambda u: mv(r, u), xs)(y)[0]

    def loss(x, r, y):
        return jnp.sum((mv(r, x) - y) ** 2)

    grad = jax.grad(loss)
    return {
        "matvec": lambda r, x, v, y, r2, Y: mv(r, x),
        "transpose": lambda r, x, v, y, r2, Y: rmv(r, y),
        "grad": lambda r, x, v, y, r2, Y: grad(x, r, y),
        "hvp": lambda r, x, v, y, r2, Y: jax.jvp(lambda u: grad(u, r, y), (x,), (v,))[1],
        "transpose, vmap over 4 y": lambda r, x, v, y, r2, Y: jax.vmap(lambda yy: rmv(r, yy))(Y),
        "transpose, vmap over 2 row sets": lambda r, x, v, y, r2, Y: jax.vmap(rmv)(r2, Y[:2]),
    }


def compile_all(wl: B.Workload, op: str, args: tuple) -> tuple[dict, dict]:
    execs, hlo = {}, {}
    for m in METHODS:
        jax.clear_caches()
        if m == "chunkop (no barrier)":
            saved, _chunking.fusion_barrier = _chunking.fusion_barrier, lambda chunk, key=None: chunk
        try:
            t0 = time.perf_counter()
            c = jax.jit(functions(wl, m)[op]).lower(*B.structs(args)).compile()
            compile_s = time.perf_counter() - t0
        finally:
            if m == "chunkop (no barrier)":
                _chunking.fusion_barrier = saved
        execs[m] = c
        text = c.as_text()
        hlo[m] = {
            "conditionals": text.count(" conditional("),
            "exp_from_dynamic_slice": exp_fed_by_slice(text),
            "temp_bytes": int(c.memory_analysis().temp_size_in_bytes),
            "compile_s": compile_s,
        }
    jax.clear_caches()
    return execs, hlo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=131072)
    p.add_argument("--n-pix", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--forms", default=",".join(B.FORMS))
    p.add_argument("--ops", default="|".join(OPS), help="'|'-separated subset of the ops (with --out elsewhere)")
    p.add_argument("--quick", action="store_true", help="n_los 32768, 5 repeats")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    if a.quick:
        a.n_los, a.repeats = 32768, 5
    forms = [f for f in a.forms.split(",") if f]
    t_start = time.perf_counter()
    res: dict = {
        "machine": B.machine(),
        "config": {"n_los": a.n_los, "n_pix": a.n_pix, "n_bins": 256, "chunk": a.chunk, "repeats": a.repeats},
        "forms": forms,
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "results": [],
    }
    for form in forms:
        wl = B.Workload(a.n_pix, 256, a.chunk, form)
        d, d2 = wl.data(a.n_los), wl.data(a.n_los, seed=1)
        rows2 = jax.tree_util.tree_map(lambda p, q: jnp.stack([p, q]), d["rows"], d2["rows"])
        Y = jnp.stack([d["y"], d2["y"], -d["y"], 2 * d2["y"]])
        args = (d["rows"], d["x"], d["v"], d["y"], rows2, Y)
        for op in [o for o in a.ops.split("|") if o]:
            execs, hlo = compile_all(wl, op, args)
            ref = execs["jax.vmap"](*args)
            t = B.time_round_robin(execs, {k: args for k in execs}, a.repeats, 600.0)
            for m in METHODS:
                err = float(jnp.max(jnp.abs(execs[m](*args) - ref)) / jnp.max(jnp.abs(ref)))
                res["results"].append({"form": form, "op": op, "method": m, **t[m], **hlo[m], "rel_err_vs_vmap": err})
            plain = t["jax.vmap"]["median_s"]
            cells = "  ".join(
                f"{m} {1e3 * t[m]['median_s']:.1f} ({1e3 * t[m]['min_s']:.1f}) ms x{t[m]['median_s'] / plain:.2f}"
                for m in METHODS
            )
            print(f"[{form}] {op}: {cells}  load {t['chunkop']['load1']}", flush=True)
        del d, d2, rows2, args
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = time.perf_counter() - t_start
    md = markdown(res)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "los_literal.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "los_literal.md").write_text(md)
    print(md)
    return 0


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [
        f"LOS operator, sky {c['n_pix']} x {c['n_bins']} float32, {c['n_los']} lines, chunk {c['chunk']}: "
        f"median (min) wall time of {c['repeats']} interleaved repeats, and the ratio of medians to plain "
        f"unchunked `jax.vmap`; load {res['load_start']} -> {res['load_end']}, {res['wall_s']:.0f} s. "
        "HLO: conditionals XLA kept / fusions computing an `exp` from a `dynamic-slice` (chunkop's executables).",
        "",
        "| form | op | " + " | ".join(METHODS) + " | chunkop HLO | load (1 min) |",
        "|---|---|" + "---:|" * len(METHODS) + "---|---|",
    ]
    for form in res["forms"]:
        for op in OPS:
            e = {r["method"]: r for r in res["results"] if r["form"] == form and r["op"] == op}
            if not e:  # (not run: --ops)
                continue
            plain = e["jax.vmap"]["median_s"]
            cells = [
                f"{1e3 * e[m]['median_s']:.1f} ms ({1e3 * e[m]['min_s']:.1f}) x{e[m]['median_s'] / plain:.2f}"
                for m in METHODS
            ]
            h = e["chunkop"]
            lines.append(
                f"| {form} | {op} | "
                + " | ".join(cells)
                + f" | {h['conditionals']} / {len(h['exp_from_dynamic_slice'])} | {h['load1']} |"
            )
    lines.append("")
    lines.append(
        "Compiled temp memory (MiB): "
        + "; ".join(
            f"{r['form']} {r['op']} {r['method']} {r['temp_bytes'] / 2**20:.1f}"
            for r in res["results"]
            if r["op"] in ("transpose", "grad")
        )
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
