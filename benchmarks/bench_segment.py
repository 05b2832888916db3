"""``RowOperator``'s two transposes, the scatter-add and the per-target segment sum, timed together.

    python benchmarks/bench_segment.py [--n-los 262144] [--n-pix 20000] [--n-bins 256]
        [--chunk 4096] [--repeats 7] [--targets uniform,sorted,skewed,same] [--out DIR]

``A.T.mv`` of the LOS operator (``bench_los.Workload``, ``y_l = w(d_l, s_l) . sky[pix_l]``) built
twice from the same rows: ``segment_key=None`` (``jax.linear_transpose``'s scatter-add: every row
of a chunk adds into the sky, rows with one target into the same elements) and
``segment_key="pix"`` (each chunk sorted by target, summed per target by a segmented scan,
written once per target). Target distributions: ``uniform`` (every pixel alike, the catalog's
order random), ``sorted`` (the same lines sorted by pixel, as a catalog grouped on the sky),
``skewed`` (``pix = floor(n_pix * u**4)``: a quarter of the lines in 0.4% of the pixels) and
``same`` (every line one pixel: the worst contention).

For each distribution the two executables are compiled, checked against each other (the largest
difference relative to the largest element), run twice more to check that each repeats bitwise,
then timed round-robin (``bench_los.time_round_robin``: the order reverses every round), with
the load average before and after. On CPU the scatter has no contention to lose to; the figures
that decide whether the segment sum should be the default on GPU come from running this script
on one (``benchmarks/gpu_tables.sh``). Writes ``DIR/segment_<backend>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

import chunkop

TARGETS = ("uniform", "sorted", "skewed", "same")
METHODS = {"scatter": None, "segment": "pix"}


def rows_for(kind: str, rows: dict, n_pix: int, seed: int = 1) -> dict:
    """The workload's rows with their targets drawn as ``kind`` says."""
    rng = np.random.default_rng(seed)
    n = rows["pix"].shape[0]
    if kind == "uniform":
        return rows
    if kind == "sorted":
        order = jnp.argsort(rows["pix"], stable=True)
        return jax.tree_util.tree_map(lambda a: a[order], rows)
    if kind == "skewed":
        pix = np.floor(n_pix * rng.uniform(size=n) ** 4).astype(np.int32)
    elif kind == "same":
        pix = np.zeros(n, np.int32)
    else:
        raise ValueError(f"--targets: unknown distribution {kind!r}; one of {TARGETS}")
    return {**rows, "pix": jnp.asarray(pix, rows["pix"].dtype)}


def run(a: argparse.Namespace) -> dict:
    wl = B.Workload(a.n_pix, a.n_bins, a.chunk)
    data = wl.data(a.n_los)
    res: dict = {
        "machine": B.machine(),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "targets": {},
    }
    for kind in a.targets.split(","):
        rows = rows_for(kind, data["rows"], a.n_pix)
        pix = np.asarray(rows["pix"])
        distinct = [len(np.unique(pix[i : i + a.chunk])) for i in range(0, len(pix), a.chunk)]
        ops = {
            m: chunkop.RowOperator(wl.row_fn, rows, wl.x_struct, chunk_size=a.chunk, segment_key=key)
            for m, key in METHODS.items()
        }
        execs = {m: jax.jit(lambda op, y: op.T.mv(y)).lower(op, data["y"]).compile() for m, op in ops.items()}
        args = {m: (ops[m], data["y"]) for m in ops}
        out = {m: np.asarray(execs[m](*args[m])) for m in execs}
        scale = float(np.abs(out["scatter"]).max())
        entry = {
            "distinct_targets_per_chunk": float(np.mean(distinct)),
            "max_rel_difference": float(np.abs(out["segment"] - out["scatter"]).max()) / scale,
            "repeats_bitwise": {m: bool(np.array_equal(out[m], np.asarray(execs[m](*args[m])))) for m in execs},
            "times": B.time_round_robin(execs, args, a.repeats, 300.0),
        }
        t = entry["times"]
        entry["segment_over_scatter"] = t["segment"]["median_s"] / t["scatter"]["median_s"]
        res["targets"][kind] = entry
        print(
            f"{kind:8s} scatter {1e3 * t['scatter']['median_s']:8.1f} ms  segment "
            f"{1e3 * t['segment']['median_s']:8.1f} ms  ratio {entry['segment_over_scatter']:.2f}  "
            f"rel diff {entry['max_rel_difference']:.1e}  bitwise {entry['repeats_bitwise']}  "
            f"load {t['scatter']['load1']}",
            flush=True,
        )
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    return res


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    lines = [
        f"# `A.T.mv`: scatter-add vs per-target segment sum ({m['backend']})",
        "",
        f"LOS operator, {c['n_los']} lines, sky {c['n_pix']} x {c['n_bins']} float32, chunk {c['chunk']}; "
        f"jax {m['jax']}, {m.get('lscpu Model name', m['platform'])}; load {res['load_start']} at the start, "
        f"{res['load_end']} at the end. Median of up to {c['repeats']} interleaved calls "
        "(`benchmarks/bench_segment.py`).",
        "",
        "| targets | distinct per chunk | scatter (ms) | segment (ms) | segment / scatter | max rel. diff "
        "| bitwise repeat (scatter, segment) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for kind, e in res["targets"].items():
        t = e["times"]
        rb = e["repeats_bitwise"]
        lines.append(
            f"| {kind} | {e['distinct_targets_per_chunk']:.0f} | {1e3 * t['scatter']['median_s']:.1f} | "
            f"{1e3 * t['segment']['median_s']:.1f} | {e['segment_over_scatter']:.2f} | "
            f"{e['max_rel_difference']:.1e} | {rb['scatter']}, {rb['segment']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=262144)
    p.add_argument("--n-pix", type=int, default=20000)
    p.add_argument("--n-bins", type=int, default=256)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    res = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"segment_{res['machine']['backend']}"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
