"""Issue #40: how fast can a device permute ``n`` float32 values (lines in the user's order <-> sorted)?

Lines in random order cost the windowed layout one permutation of ``n`` values per product; at
54M lines on a TPU v5e that was 0.40-0.46 s, above the issue's bars. This script times the ways a
permutation can be written in JAX, on whatever device JAX finds:

- ``gather``: ``y[p]`` (``jnp.take``, JAX's default out-of-bounds handling);
- ``gather_promise``: ``y.at[p].get(mode="promise_in_bounds", unique_indices=True)``;
- ``scatter``: ``zeros.at[q].set(y, unique_indices=True)`` with ``q`` the inverse permutation;
- ``sort``: ``jax.lax.sort_key_val(q, y)`` (the permutation as a sort by the inverse);
- ``rows``: ``y`` viewed as rows of 128, the rows gathered block by block and the lane picked
  by a comparison with an iota (a gather of ``n / 128``-row blocks instead of ``n`` scalars);
- ``network``: the select stages of a Benes network on ``2**ceil(log2 n)`` values (``2 log2 - 1``
  stages, each an elementwise select between ``y`` and ``y`` rolled by the stage's stride) with
  random switch settings: one stage within rows of 128 and one across rows are timed, the whole
  network estimated from them (unrolled, XLA keeps every stage's buffers: 20 GiB); the time of
  applying any permutation so (the settings of a given one are a host computation this script
  does not do).

    python benchmarks/explore_permute.py [--n 54000000] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from explore_window import timed

BLOCK = 1 << 20  # outputs per block of the ``rows`` method


def rows_method(y: jax.Array, p: jax.Array) -> jax.Array:
    n = y.shape[0]
    pad = -n % 128
    y2 = jnp.pad(y, (0, pad)).reshape(-1, 128)
    m = -(-n // BLOCK) * BLOCK
    pp = jnp.pad(p, (0, m - n)).reshape(-1, BLOCK)
    lanes = jnp.arange(128, dtype=jnp.int32)

    def block(_, idx):
        rows = y2[idx >> 7]  # (BLOCK, 128)
        return None, jnp.sum(jnp.where(lanes == (idx & 127)[:, None], rows, 0.0), axis=1)

    _, out = jax.lax.scan(block, None, pp)
    return out.reshape(-1)[:n]


def network_method(y: jax.Array, r: jax.Array, stages: list[int]) -> jax.Array:
    """Benes-network select stages: stage k pairs element i with i ^ stride_k and swaps the pair
    where its lower member's switch bit is set. (Timing only: every stage reads its bits from one
    random bit array ``r``, one byte per element, as a stored setting would be read; the
    settings of a given permutation would be one array per stage.)"""
    n = r.shape[0]
    z = jnp.pad(y, (0, n - y.shape[0])).reshape(-1, 128)
    r = r.reshape(z.shape)
    lane = jnp.arange(128, dtype=jnp.int32)[None, :]
    row = jnp.arange(z.shape[0], dtype=jnp.int32)[:, None]
    for stride in stages:
        if stride < 128:
            up = (lane & stride) == 0  # partner at +stride
            roll = lambda a, s=stride: jnp.where(up, jnp.roll(a, -s, axis=1), jnp.roll(a, s, axis=1))
            m = jnp.where(up, r, jnp.roll(r, stride, axis=1))
        else:
            k = stride // 128
            up = (row & k) == 0
            roll = lambda a, k=k: jnp.where(up, jnp.roll(a, -k, axis=0), jnp.roll(a, k, axis=0))
            m = jnp.where(up, r, jnp.roll(r, k, axis=0))
        z = jnp.where(m, roll(z), z)
        z, r = jax.lax.optimization_barrier((z, r))  # one stage at a time (XLA would hoist every mask)
    return z.reshape(-1)  # (all 2**k values: the padding moves too)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=54_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip", default="", help="comma-separated methods not to run")
    a = ap.parse_args()
    load0 = os.getloadavg()
    n = a.n
    rng = np.random.default_rng(0)
    p_np = rng.permutation(n).astype(np.int32)
    q_np = np.empty_like(p_np)
    q_np[p_np] = np.arange(n, dtype=np.int32)
    y = jnp.asarray(rng.normal(size=n), jnp.float32)
    p, q = jnp.asarray(p_np), jnp.asarray(q_np)
    want = np.asarray(y)[p_np]
    log2 = math.ceil(math.log2(n))
    stages = [1 << k for k in range(log2)] + [1 << k for k in range(log2 - 2, -1, -1)]
    fns = {
        "gather": jax.jit(lambda y, p: y[p]),
        "gather_promise": jax.jit(lambda y, p: y.at[p].get(mode="promise_in_bounds", unique_indices=True)),
        "scatter": jax.jit(lambda y, q: jnp.zeros_like(y).at[q].set(y, unique_indices=True)),
        "sort": jax.jit(lambda y, q: jax.lax.sort_key_val(q, y)[1]),
        "rows": jax.jit(rows_method),
    }
    args = {"gather": (y, p), "gather_promise": (y, p), "scatter": (y, q), "sort": (y, q), "rows": (y, p)}
    skip = set(filter(None, a.skip.split(",")))
    results = {}
    for name in list(fns):
        if name in skip:
            del fns[name]
            continue
        got = np.asarray(fns[name](*args[name]))
        results[name] = {"exact": bool(np.array_equal(got, want))}
    if "network" not in skip:
        masks = jnp.asarray(rng.random(1 << log2) < 0.5)
        for name, one in (("network_lane_stage", [8]), ("network_row_stage", [128 * 64])):
            fns[name] = jax.jit(lambda y, m, one=one: network_method(y, m, one))
            args[name] = (y, masks)
            out = np.asarray(fns[name](y, masks))
            padded = np.pad(np.asarray(y), (0, (1 << log2) - n))
            results[name] = {"exact": bool(np.array_equal(np.sort(out), np.sort(padded)))}  # a permutation
    timing = timed({k: (lambda f=f, k=k: f(*args[k])) for k, f in fns.items()}, a.rounds)
    load1 = os.getloadavg()
    for k, v in timing.items():
        results[k]["median_ms"] = v["median_ms"]
        results[k]["first_s"] = v["first_s"]
    if "network" not in skip:  # the whole network: 7 + 6 stages within rows of 128, the rest across rows
        lane, row = results["network_lane_stage"]["median_ms"], results["network_row_stage"]["median_ms"]
        results["network (estimate)"] = {"exact": None, "median_ms": 13 * lane + (len(stages) - 13) * row}
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "n": n, "load": [load0, load1]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"permute_{jax.default_backend()}_{n}"
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# explore_permute on {meta['device']} (jax {jax.__version__}), n = {n}", "", f"load {load0} -> {load1}"]
    lines += ["", "| method | ms | exact |", "|---|---:|---|"]
    lines += [f"| {k} | {v.get('median_ms', float('nan')):.1f} | {v['exact']} |" for k, v in results.items()]
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
