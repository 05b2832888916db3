"""The LOS operator at the users' full size against its measured floors.

    python benchmarks/bench_floor.py [--chunk 4096] [--repeats 7] [--out DIR] [--small]

Sky 786432 x 516 float32 (1.5 GiB), 132400 lines (``--small``: 65536 x 516, 16384 lines, for a
quick check). Every function is jitted, compiled once, then timed round-robin (interleaved, the
order reversing every round; medians):

- ``A.mv``: ``chunkop.RowOperator`` (chunk ``--chunk``), ``lax.map(batch_size=chunk)`` and the
  hand-written chunked scan (the users' ``custom_vjp`` forward);
- the matvec's floor, the larger of (each the faster of one pass and a scan over chunks):
  computing every weight once (``sum(los_weights(d, s), 1)``:
  one sum per line, fused: no weight is written) and reading the gathered sky rows once
  (``sum(sky[pix], 1)``: the gather fused into the per-line sums);
- a check of that floor: both floors computed in the same chunked scan, independently of each
  other (only their per-line results are added): if XLA overlapped the compute-bound weights with
  the memory-bound gather, this would take the larger of the two, not their sum;
- ``A.T.mv``: chunkop and a hand scatter-add scan (zeros, then ``.at[pix].add(y w)`` chunk by
  chunk), against the transpose's floor: zero-filling the sky and scatter-adding ``n_los`` rows
  without weights, in one scatter (``zeros.at[pix].add(broadcast(y))``) or chunk by chunk; the
  faster of the two is the floor.

Writes ``DIR/floor.json`` and ``DIR/floor.md`` with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

import chunkop


def build(n_pix: int, n_bins: int, n_los: int, chunk: int) -> tuple[dict, dict]:
    """``(functions, arguments)``: every function takes ``(rows, sky, y)``."""
    edges = B.los.bin_edges(n_bins)
    x_struct = jax.ShapeDtypeStruct((n_pix, n_bins), jnp.float32)
    rng = np.random.default_rng(0)
    pix, d, s = B.los.draw_lines(n_los, n_pix, rng)
    rows = {"pix": jnp.asarray(pix), "d": jnp.asarray(d), "s": jnp.asarray(s)}
    sky = jax.random.uniform(jax.random.key(0), x_struct.shape, jnp.float32, 0.5, 1.5)
    y = jax.random.normal(jax.random.key(1), (n_los,), jnp.float32)

    def row_fn(row: dict, x: jax.Array) -> jax.Array:
        return jnp.dot(B.los.los_weights(row["d"], row["s"], edges), x[row["pix"]])

    def op(rows: dict) -> chunkop.RowOperator:
        return chunkop.RowOperator(row_fn, rows, x_struct, chunk_size=chunk)

    def split(data: dict) -> tuple[dict, dict]:
        """``data``'s full chunks, stacked ``(n_full, chunk, ...)``, and the rest."""
        k = n_los - n_los % chunk
        full = jax.tree_util.tree_map(lambda a: a[:k].reshape((k // chunk, chunk) + a.shape[1:]), data)
        return full, jax.tree_util.tree_map(lambda a: a[k:], data)

    def chunked(f, data):
        """``f`` over chunks of lines (a scan of the full chunks, then the rest): per-line results."""
        full, rest = split(data)
        out = jax.lax.scan(lambda _, c: (None, f(c)), None, full)[1]
        return jnp.concatenate([out.reshape(-1), f(rest)])

    def accumulated(update, data):
        """Zeros of the sky's shape, scatter-added into chunk by chunk: ``acc.at[pix].add(update(c))``."""
        full, rest = split(data)
        body = lambda acc, c: acc.at[c["pix"]].add(update(c))
        acc = jax.lax.scan(lambda acc, c: (body(acc, c), None), jnp.zeros(x_struct.shape, jnp.float32), full)[0]
        return body(acc, rest)

    def weights(c):
        return B.los.los_weights(c["d"], c["s"], edges)

    def weights_sum(rows):
        return jnp.sum(weights(rows), 1)

    def read_sum(rows, sky):
        return jnp.sum(sky[rows["pix"]], 1)

    def hand_forward(rows, sky, y):
        return chunked(lambda c: jnp.sum(weights(c) * sky[c["pix"]], axis=-1), rows)

    def hand_transpose(rows, sky, y):
        return accumulated(lambda c: c["y"][:, None] * weights(c), dict(rows, y=y))

    def scatter_only(rows, sky, y):
        """The hand scatter-add scan without weights (``y`` broadcast over the bins)."""
        return accumulated(
            lambda c: jnp.broadcast_to(c["y"][:, None], (c["y"].shape[0], n_bins)), {"pix": rows["pix"], "y": y}
        )

    fns = {
        "mv: chunkop": lambda rows, sky, y: op(rows).mv(sky),
        "mv: lax.map": lambda rows, sky, y: jax.lax.map(lambda r: row_fn(r, sky), rows, batch_size=chunk),
        "mv: hand scan": hand_forward,
        "mv floor: weights once": lambda rows, sky, y: weights_sum(rows),
        "mv floor: weights once, chunked": lambda rows, sky, y: chunked(weights_sum, rows),
        "mv floor: read gathered rows once": lambda rows, sky, y: read_sum(rows, sky),
        "mv floor: read gathered rows once, chunked": lambda rows, sky, y: chunked(lambda r: read_sum(r, sky), rows),
        "mv check: weights and read, independent, in one chunked scan": lambda rows, sky, y: chunked(
            lambda r: weights_sum(r) + read_sum(r, sky), rows
        ),
        "T.mv: chunkop": lambda rows, sky, y: op(rows).T.mv(y),
        "T.mv: hand scatter-add scan": hand_transpose,
        "T.mv floor: zero-fill + scatter-add": lambda rows, sky, y: (
            jnp.zeros(x_struct.shape, jnp.float32).at[rows["pix"]].add(jnp.broadcast_to(y[:, None], (n_los, n_bins)))
        ),
        "T.mv floor: zero-fill + chunked scatter-add": scatter_only,
    }
    return fns, {"rows": rows, "sky": sky, "y": y}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--small", action="store_true", help="65536 x 516 sky, 16384 lines")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    n_pix, n_bins, n_los = (65536, 516, 16384) if a.small else (786432, 516, 132400)
    res = {"machine": B.machine(), "load_start": [round(x, 2) for x in os.getloadavg()]}
    from chunkop._chunking import make_plan

    res["config"] = {
        "n_pix": n_pix,
        "n_bins": n_bins,
        "n_los": n_los,
        "chunk": a.chunk,
        "plan": str(make_plan(n_los, a.chunk)),
    }
    t0 = time.perf_counter()
    fns, data = build(n_pix, n_bins, n_los, a.chunk)
    args = (data["rows"], data["sky"], data["y"])
    execs = {k: jax.jit(f).lower(*args).compile() for k, f in fns.items()}
    ref_mv = execs["mv: lax.map"](*args)
    ref_t = execs["T.mv: hand scatter-add scan"](*args)
    agree = {
        "mv: chunkop vs lax.map": float(
            jnp.max(jnp.abs(execs["mv: chunkop"](*args) - ref_mv)) / jnp.max(jnp.abs(ref_mv))
        ),
        "T.mv: chunkop vs hand": float(
            jnp.max(jnp.abs(execs["T.mv: chunkop"](*args) - ref_t)) / jnp.max(jnp.abs(ref_t))
        ),
    }
    del ref_mv, ref_t
    times = B.time_round_robin(execs, {k: args for k in execs}, a.repeats, 120.0)
    res["agreement"] = agree
    res["times"] = times
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = time.perf_counter() - t0
    med = {k: v["median_s"] for k, v in times.items()}
    mv_floor = max(
        min(med["mv floor: weights once"], med["mv floor: weights once, chunked"]),
        min(med["mv floor: read gathered rows once"], med["mv floor: read gathered rows once, chunked"]),
    )
    t_floor = min(med["T.mv floor: zero-fill + scatter-add"], med["T.mv floor: zero-fill + chunked scatter-add"])
    res["ratios"] = {
        "A.mv / mv floor": med["mv: chunkop"] / mv_floor,
        "A.T.mv / T.mv floor": med["T.mv: chunkop"] / t_floor,
    }
    lines = [
        f"LOS operator at sky {n_pix} x {n_bins} float32, {n_los} lines, chunk {a.chunk} "
        f"(plan {res['config']['plan']}); medians of interleaved repeats; load {res['load_start']} -> "
        f"{res['load_end']}; {res['wall_s']:.0f} s.",
        "",
        "| function | median | min | x floor |",
        "|---|---:|---:|---:|",
    ]
    for k, v in times.items():
        floor = mv_floor if k.startswith("mv") else t_floor
        lines.append(
            f"| {k} | {1e3 * v['median_s']:.1f} ms | {1e3 * v['min_s']:.1f} ms | {v['median_s'] / floor:.2f} |"
        )
    lines += [
        "",
        "A.mv / floor (max of weights once, read gathered rows once; each the faster of one pass and chunked) = "
        f"{res['ratios']['A.mv / mv floor']:.2f} (target <= 1.25)",
        "A.T.mv / floor (zero-fill + scatter-add, the faster of one scatter and chunked) = "
        f"{res['ratios']['A.T.mv / T.mv floor']:.2f} (target <= 1.25)",
        f"agreement (max abs difference / max abs): {agree}",
    ]
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"floor{'_small' if a.small else ''}.json").write_text(json.dumps(res, indent=1, default=float))
    (out / f"floor{'_small' if a.small else ''}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
