"""Issue #40: the windowed row layout of ``chunkop.RowOperator`` against the plain one, on whatever
device JAX finds (the 2-core CPU here; the TPU v5e lent through the device tool).

    python benchmarks/bench_layout.py                       # CPU: 131072 and 1M lines, 200000 x 128 sky
    python benchmarks/bench_layout.py --lines 54000000 --n-pix 786432 --n-bins 516 --rounds 3 --solve
    python benchmarks/bench_layout.py --density 0.2,5,70 ...  # lines per pixel instead of --lines

The operator is the users' literal ``one_los`` (``-diff(exp(-(d - b) / (d s b)))``, ``s = 0.1 d``,
pixels uniform, distances log-normal) as a ``chunkop.RowOperator`` over ``{"pix", "d", "s"}``.
Per size, jitted functions of ``(A, x)`` / ``(A, y)`` (the operator an argument):

- ``plain``: ``layout="plain"`` (each chunk gathers its rows of ``x``; the transposes scatter-add
  them), the lines in the user's (random) order;
- ``windowed``: ``layout="windowed"``, the same lines: sorted once when the operator is built,
  ``A x`` and ``A^T y`` in the user's order (one permutation of ``n`` values each);
- ``windowed, sorted input``: the lines already sorted by pixel (a catalog sorted once):
  no permutation;
- ``floor``: the weights alone: the same operator on a one-row sky, every line reading row 0.

Operations: ``mv`` (``A x``), ``T`` (``A^T y``), ``grad`` (of ``0.5 |A x - y|^2`` w.r.t. ``x``).
Each: compiled temp memory (``memory_analysis``), then one warm-up call and ``--rounds`` rounds
over every (operator, operation), interleaved, median wall time. ``--solve`` adds a few
iterations of ``lineax.linear_solve`` (CG on ``A.normal(damping)``, and LSMR) per windowed operator.
The machine's load (``os.getloadavg``) is recorded before and after. Writes
``DIR/layout_<backend>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from explore_window import machine_info, temp_mib, timed  # (this folder: timing, temp memory, the machine)

import chunkop


def one_los(edges: np.ndarray):
    """The users' literal row function (``s`` a row leaf: the line's ``par_std``)."""

    def row_fn(row: dict, x: jax.Array) -> jax.Array:
        b = jnp.asarray(edges, jnp.float32)
        sf = jnp.exp(-(row["d"] - b) / (row["d"] * row["s"] * b))
        return jnp.dot(-jnp.diff(sf), x[row["pix"]])

    return row_fn


def lines(n: int, n_pix: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d = np.exp(np.log(1700.0) / 2 + rng.normal(size=n)).clip(40.0, 1700.0).astype(np.float32)
    return {"pix": rng.integers(0, n_pix, n).astype(np.int32), "d": d, "s": (0.1 * d).astype(np.float32)}


def one_size(n: int, n_pix: int, n_bins: int, chunk, rounds: int, solve: bool, which: list) -> dict:
    edges = np.geomspace(40.0, 1700.0, n_bins + 1)
    row_fn = one_los(edges)
    x_struct = jax.ShapeDtypeStruct((n_pix, n_bins), jnp.float32)
    raw = lines(n, n_pix)
    order = np.argsort(raw["pix"], kind="stable")
    rows = {k: jnp.asarray(v) for k, v in raw.items()}
    rows_sorted = {k: jnp.asarray(v[order]) for k, v in raw.items()}
    x = jax.random.uniform(jax.random.key(1), (n_pix, n_bins), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    y_sorted = jnp.asarray(np.asarray(y)[order])
    ops, build_s = {}, {}

    def build(name, rws, struct, **kw):
        t = time.perf_counter()
        A = chunkop.RowOperator(row_fn, rws, struct, chunk_size=chunk, **kw)
        jax.block_until_ready(jax.tree_util.tree_leaves(A))
        build_s[name] = time.perf_counter() - t
        ops[name] = A

    if "plain" in which:
        build("plain", rows, x_struct, layout="plain")
    if "windowed" in which:
        build("windowed", rows, x_struct, layout="windowed")
    if "sorted" in which:
        build("windowed, sorted input", rows_sorted, x_struct, layout="windowed")
    if "floor" in which:
        floor_rows = {**rows, "pix": jnp.zeros(n, jnp.int32)}
        build("floor", floor_rows, jax.ShapeDtypeStruct((1, n_bins), jnp.float32), layout="windowed")
    x1 = x[:1]
    mv = jax.jit(lambda A, v: A.mv(v))
    tmv = jax.jit(lambda A, v: A.T.mv(v))
    grad = jax.jit(jax.grad(lambda v, A, t: 0.5 * jnp.sum((A.mv(v) - t) ** 2)))
    fns, temps, info = {}, {}, {}
    for name, A in ops.items():
        xv = x1 if name == "floor" else x
        yv = y_sorted if name.endswith("sorted input") else y
        info[name] = {"chunk": A.chunk_size, "windows": A.spec.windows, "permuted": A.row_order is not None}
        fns[f"{name} | mv"] = lambda A=A, xv=xv: mv(A, xv)
        fns[f"{name} | T"] = lambda A=A, yv=yv: tmv(A, yv)
        fns[f"{name} | grad"] = lambda A=A, xv=xv, yv=yv: grad(xv, A, yv)
        temps[f"{name} | mv"] = temp_mib(lambda A, v: A.mv(v), A, xv)
        temps[f"{name} | T"] = temp_mib(lambda A, v: A.T.mv(v), A, yv)
        temps[f"{name} | grad"] = temp_mib(jax.grad(lambda v, A, t: 0.5 * jnp.sum((A.mv(v) - t) ** 2)), xv, A, yv)
    # agreement with the plain layout (user's order; the sorted input compared in its own order)
    agree = {}
    if "plain" in ops:  # one product at a time (at 54M lines, each x-space result is 1.9 GB)
        P = ops["plain"]
        inverse = np.argsort(order)
        products = {"mv": lambda A, yv: mv(A, x), "T": lambda A, yv: tmv(A, yv), "grad": lambda A, yv: grad(x, A, yv)}
        for k, product in products.items():
            ref = product(P, y)
            scale = float(jnp.maximum(jnp.abs(ref).max(), 1e-30))
            for name, A in ops.items():
                if name in ("plain", "floor"):
                    continue
                sorted_input = name.endswith("sorted input")
                got = product(A, y_sorted if sorted_input else y)
                if sorted_input and k == "mv":
                    got = jnp.asarray(np.asarray(got)[inverse])
                agree.setdefault(name, {})[k] = float(jnp.abs(got - ref).max()) / scale
                del got
            del ref
    load0 = os.getloadavg()
    times = timed(fns, rounds)
    res = {
        "lines": n,
        "n_pix": n_pix,
        "n_bins": n_bins,
        "density": n / n_pix,
        "operators": info,
        "build_s": build_s,
        "temp_mib": temps,
        "agreement": agree,
        "times": times,
        "load": [load0, os.getloadavg()],
    }
    if solve:
        res["solve"] = solves(ops, x, y, y_sorted)
    return res


def solves(ops: dict, x, y, y_sorted) -> dict:
    import lineax as lx

    out = {}
    for name, A in ops.items():
        if name in ("floor", "plain"):  # (the plain layout's products are timed above)
            continue
        yv = y_sorted if name.endswith("sorted input") else y
        for solver_name, run in (
            (
                "CG x3",
                lambda A, b: (
                    lx.linear_solve(A.normal(1.0), A.T.mv(b), lx.CG(rtol=0, atol=0, max_steps=3), throw=False).value
                ),
            ),
            ("LSMR x3", lambda A, b: lx.linear_solve(A, b, lx.LSMR(rtol=0, atol=0, max_steps=3), throw=False).value),
        ):
            f = jax.jit(run)
            key = f"{name} | {solver_name}"
            try:
                out[key] = {
                    "temp_mib": jax.jit(run).lower(A, yv).compile().memory_analysis().temp_size_in_bytes / 2**20
                }
                t = timed({key: lambda f=f, A=A, yv=yv: f(A, yv)}, 1)[key]
                out[key].update(median_ms=t["median_ms"], first_s=t["first_s"])
            except Exception as e:  # noqa: BLE001 - recorded (e.g. out of memory)
                out[key] = {"error": repr(e)[:300]}
            print(key, out[key], flush=True)
    return out


def table(results: list) -> str:
    rows = [
        "| lines | lines/pixel | bins | operator | chunk | window | op | ms | temp MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for key, t in r["times"].items():
            name, op = key.split(" | ")
            o = r["operators"][name]
            rows.append(
                f"| {r['lines']} | {r['density']:.2f} | {r['n_bins']} | {name} | {o['chunk']} | {o['windows']} | {op} "
                f"| {t['median_ms']:.1f} | {r['temp_mib'][key]:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", default="131072,1000000")
    p.add_argument("--density", default=None, help="lines per pixel (overrides --lines)")
    p.add_argument("--n-pix", type=int, default=200_000)
    p.add_argument("--n-bins", default="128")
    p.add_argument("--chunk", default="4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--which", default="plain,windowed,sorted,floor")
    p.add_argument("--solve", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = p.parse_args()
    chunk = a.chunk if a.chunk == "auto" else int(a.chunk)
    sizes = (
        [int(float(dn) * a.n_pix) for dn in a.density.split(",")] if a.density else [int(v) for v in a.lines.split(",")]
    )
    info = machine_info()
    results = []
    for nb in [int(b) for b in a.n_bins.split(",")]:
        for n in sizes:
            r = one_size(n, a.n_pix, nb, chunk, a.rounds, a.solve, a.which.split(","))
            results.append(r)
            print(
                json.dumps({k: r[k] for k in ("lines", "n_bins", "operators", "build_s", "agreement")}, default=str),
                flush=True,
            )
            for key, t in r["times"].items():
                print(f"  {key:40s} {t['median_ms']:10.1f} ms   temp {r['temp_mib'][key]:8.1f} MiB", flush=True)
    info["load_after"] = os.getloadavg()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{info['backend']}_{a.chunk}_{'_'.join(map(str, sizes))}"
    (out / f"layout_{tag}.json").write_text(json.dumps({"info": info, "results": results}, indent=1, default=str))
    (out / f"layout_{tag}.md").write_text(
        f"# bench_layout on {info['device']} (jax {info['jax']})\n\nload {info['load']} -> {info['load_after']}\n\n"
        + table(results)
        + "\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
