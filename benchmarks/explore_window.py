"""Issue #40, design input: the LOS products in plain JAX, today's layout against a sorted-once,
windowed one, on whatever device JAX finds (the TPU v5e lent, or the 2-core CPU).

    python benchmarks/explore_window.py --lines 54001664 --n-pix 786432 --n-bins 516 --out DIR
    python benchmarks/explore_window.py --seed-check --out DIR   # 132400 lines: 516 vs 512/640 bins

Every variant is written here in a few lines of JAX (no chunkop), with the users' literal
``one_los`` weights ``-diff(exp(-(d - b) / (d s b)))``, ``s = 0.1 d``, pixels uniform, distances
log-normal; a checkpointed ``lax.scan`` over chunks of ``--chunk`` lines:

- ``today``: lines in the user's (random) order, rows read by ``jnp.take(x, pix)`` (a gather by a
  1-D index, what chunkop's row-read evaluator emits); ``T`` and ``grad`` are JAX's transposes
  (a scatter-add of whole rows);
- ``floor``: the same on a one-row sky, every line reading row 0 (the weights alone);
- ``win_take`` / ``win_onehot``: lines sorted by pixel once, each chunk reading one window of
  ``W`` sky rows (``dynamic_slice``) and its rows from it by ``take`` or by a one-hot ``(C, W)``
  matmul (``precision=HIGHEST``); ``T`` and ``grad`` are JAX's own transposes of those;
- ``win_onehot_hand_T``: the transpose written by hand (one-hot^T matmul into the window, one
  ``dynamic_update_slice`` of the carried sky per chunk), to see whether JAX's own is as good;
- ``perm_rows``: ``win_onehot`` reading each chunk's rows through the permutation (rows kept in
  the user's order) instead of rows stored sorted;
- the permutation of the outputs: a gather of ``n`` scalars by the inverse permutation, and a
  scatter (unique indices) of ``n`` scalars.

Timing: one warm-up call, then ``--rounds`` rounds over every variant (interleaved), median.
Writes ``DIR/explore_window_<backend>.json``; ``--seed-check`` adds the optimized HLO of the
matvec at 516 and 512 bins (``DIR/hlo_mv_516.txt``, ``hlo_mv_512.txt``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HI = jax.lax.Precision.HIGHEST


def weights(d, s, b):
    d, s = d[:, None], s[:, None]
    return -jnp.diff(jnp.exp(-(d - b) / (d * s * b)), axis=-1)


def scan_chunks(body, n_chunks):
    def step(carry, i):
        return carry, body(i)

    _, ys = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), None, jnp.arange(n_chunks))
    return ys.reshape(-1)


def make_today(C, b):
    def mv(x, pix, d, s):
        n_chunks = pix.shape[0] // C

        def body(i):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * C, C)
            return jnp.sum(weights(sl(d), sl(s), b) * jnp.take(x, sl(pix), axis=0), -1)

        return scan_chunks(body, n_chunks)

    return mv


def make_split(C, b):
    def mv(x, pix, d, s):
        n_chunks = pix.shape[0] // C

        def body(i):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * C, C)
            p = sl(pix)
            rows = jnp.concatenate([jnp.take(x[:, :512], p, axis=0), jnp.take(x[:, 512:], p, axis=0)], -1)
            return jnp.sum(weights(sl(d), sl(s), b) * rows, -1)

        return scan_chunks(body, n_chunks)

    return mv


def make_window(C, W, b, how, perm=None):
    def read(win, local):
        if how == "take":
            return jnp.take(win, local, axis=0)
        onehot = (local[:, None] == jnp.arange(W, dtype=local.dtype)[None]).astype(win.dtype)
        return jnp.matmul(onehot, win, precision=HI)

    def mv(x, pix, d, s, starts, perm_=None):
        n_chunks = pix.shape[0] // C

        def body(i):
            if perm_ is None:
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * C, C)
            else:
                p = jax.lax.dynamic_slice_in_dim(perm_, i * C, C)
                sl = lambda a: jnp.take(a, p, axis=0)
            st = starts[i]
            win = jax.lax.dynamic_slice_in_dim(x, st, W, axis=0)
            return jnp.sum(weights(sl(d), sl(s), b) * read(win, sl(pix) - st), -1)

        return scan_chunks(body, n_chunks)

    return mv


def make_hand_T(C, W, b):
    def tmv(y, pix, d, s, starts, x_shape):
        n_chunks = pix.shape[0] // C

        def step(acc, i):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * C, C)
            st = starts[i]
            ct_rows = weights(sl(d), sl(s), b) * sl(y)[:, None]
            local = sl(pix) - st
            onehot = (local[:, None] == jnp.arange(W, dtype=local.dtype)[None]).astype(ct_rows.dtype)
            ct_win = jnp.matmul(onehot.T, ct_rows, precision=HI)
            old = jax.lax.dynamic_slice_in_dim(acc, st, W, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(acc, old + ct_win, st, axis=0), None

        acc, _ = jax.lax.scan(step, jnp.zeros(x_shape, y.dtype), jnp.arange(n_chunks))
        return acc

    return tmv


def timed(fns: dict, rounds: int) -> dict:
    out = {}
    for name, f in fns.items():  # warm-up (compiles)
        t = time.perf_counter()
        jax.block_until_ready(f())
        out[name] = {"first_s": time.perf_counter() - t, "samples": []}
    for r in range(rounds):
        names = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in names:
            t = time.perf_counter()
            jax.block_until_ready(fns[name]())
            out[name]["samples"].append(time.perf_counter() - t)
    for v in out.values():
        v["median_ms"] = 1e3 * statistics.median(v["samples"])
    return out


def machine_info() -> dict:
    """The backend, device, JAX version and the machine's load now (printed, and returned)."""
    info = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "load": os.getloadavg(),
    }
    print(info, flush=True)
    return info


def temp_mib(f, *args) -> float:
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def data(n, n_pix, n_bins, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    pix = jax.random.randint(k1, (n,), 0, n_pix, dtype=jnp.int32)
    d = jnp.exp(jnp.log(1700.0) / 2 + jax.random.normal(k2, (n,))).clip(40.0, 1700.0)
    return pix, d, 0.1 * d


def explore(a) -> dict:
    n, C, NP, NB = a.lines, a.chunk, a.n_pix, a.n_bins
    n = (n // C) * C
    b = jnp.asarray(np.geomspace(40, 1700, NB + 1), jnp.float32)
    pix, d, s = data(n, NP, NB)
    x = jax.random.uniform(jax.random.key(1), (NP, NB), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    t = time.perf_counter()
    order = jax.block_until_ready(jnp.argsort(pix, stable=True))
    sort_s = time.perf_counter() - t
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
    ps, ds, ss, ys = (jnp.take(v, order) for v in (pix, d, s, y))
    lo = ps.reshape(-1, C).min(1)
    hi = ps.reshape(-1, C).max(1)
    span = int((hi - lo).max()) + 1
    W = max(8, -(-span // 8) * 8) if a.window is None else a.window
    starts = jnp.minimum(lo, NP - W).astype(jnp.int32)
    print(f"n={n} C={C} sky={NP}x{NB}: window span {span}, W={W}, argsort {sort_s:.3f} s", flush=True)
    today = make_today(C, b)
    wt = make_window(C, W, b, "take")
    wo = make_window(C, W, b, "onehot")
    hand_T = make_hand_T(C, W, b)
    x1 = x[:1]
    zero = jnp.zeros_like(pix)
    J = jax.jit
    f = {
        "floor mv": (J(today), (x1, zero, d, s)),
        "floor T": (
            J(lambda yy, p, dd, sv: jax.linear_transpose(lambda v: today(v, p, dd, sv), x1)(yy)[0]),
            (y, zero, d, s),
        ),
        "today mv": (J(today), (x, pix, d, s)),
        "win_take mv": (J(wt), (x, ps, ds, ss, starts)),
        "win_onehot mv": (J(wo), (x, ps, ds, ss, starts)),
        "perm_rows mv": (J(lambda x, p, dd, sv, st, pe: wo(x, p, dd, sv, st, pe)), (x, pix, d, s, starts, order)),
        "win_take T": (
            J(lambda yy, p, dd, sv, st: jax.linear_transpose(lambda v: wt(v, p, dd, sv, st), x)(yy)[0]),
            (ys, ps, ds, ss, starts),
        ),
        "win_onehot T": (
            J(lambda yy, p, dd, sv, st: jax.linear_transpose(lambda v: wo(v, p, dd, sv, st), x)(yy)[0]),
            (ys, ps, ds, ss, starts),
        ),
        "win_onehot_hand T": (
            J(lambda yy, p, dd, sv, st: hand_T(yy, p, dd, sv, st, x.shape)),
            (ys, ps, ds, ss, starts),
        ),
        "win_take grad": (
            J(jax.grad(lambda x, p, dd, sv, st: 0.5 * jnp.sum((wt(x, p, dd, sv, st) - ys) ** 2))),
            (x, ps, ds, ss, starts),
        ),
        "win_onehot grad": (
            J(jax.grad(lambda x, p, dd, sv, st: 0.5 * jnp.sum((wo(x, p, dd, sv, st) - ys) ** 2))),
            (x, ps, ds, ss, starts),
        ),
        "perm y gather": (J(lambda v, i: jnp.take(v, i)), (ys, inv)),
        "perm y scatter": (J(lambda v, o: jnp.zeros_like(v).at[o].set(v, unique_indices=True)), (ys, order)),
    }
    if not a.skip_today_T:
        f["today T"] = (
            J(lambda yy, p, dd, sv: jax.linear_transpose(lambda v: today(v, p, dd, sv), x)(yy)[0]),
            (y, pix, d, s),
        )
        f["today grad"] = (
            J(jax.grad(lambda x, p, dd, sv: 0.5 * jnp.sum((today(x, p, dd, sv) - y) ** 2))),
            (x, pix, d, s),
        )
    res = {"n": n, "chunk": C, "n_pix": NP, "n_bins": NB, "window": W, "span": span, "argsort_s": sort_s}
    res["temp_mib"] = {}
    for k, (fn, args) in f.items():
        try:
            res["temp_mib"][k] = temp_mib(fn, *args)
        except Exception as e:  # noqa: BLE001 - recorded
            res["temp_mib"][k] = repr(e)[:300]
        print(k, "temp MiB", res["temp_mib"][k], flush=True)
    # agreement (user order): windowed mv (sorted) un-permuted vs today's; transposes vs today's/floor
    ref = f["today mv"][0](x, pix, d, s)
    got = jnp.take(f["win_onehot mv"][0](x, ps, ds, ss, starts), inv)
    res["rel_mv_onehot"] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
    got = jnp.take(f["win_take mv"][0](x, ps, ds, ss, starts), inv)
    res["rel_mv_take"] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
    t1 = f["win_onehot T"][0](ys, ps, ds, ss, starts)
    t2 = f["win_onehot_hand T"][0](ys, ps, ds, ss, starts)
    t3 = f["win_take T"][0](ys, ps, ds, ss, starts)
    res["rel_T_auto_vs_hand"] = float(jnp.abs(t1 - t2).max() / jnp.abs(t2).max())
    res["rel_T_take_vs_hand"] = float(jnp.abs(t3 - t2).max() / jnp.abs(t2).max())
    if "today T" in f:
        t0 = f["today T"][0](y, pix, d, s)
        res["rel_T_hand_vs_today"] = float(jnp.abs(t2 - t0).max() / jnp.abs(t0).max())
    print({k: v for k, v in res.items() if k.startswith("rel")}, flush=True)
    times = timed({k: (lambda fn=fn, args=args: fn(*args)) for k, (fn, args) in f.items()}, a.rounds)
    res["times"] = times
    for k, v in times.items():
        print(f"{k:24s} {v['median_ms']:10.1f} ms  (first {v['first_s']:.1f} s)", flush=True)
    return res


def seed_check(a, out: Path) -> dict:
    res = {}
    n, C = 132400, a.chunk
    n = (n // C) * C
    for NB in (516, 512, 640):
        b = jnp.asarray(np.geomspace(40, 1700, NB + 1), jnp.float32)
        pix, d, s = data(n, 786432, NB)
        x = jax.random.uniform(jax.random.key(1), (786432, NB), jnp.float32)
        y = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
        today = make_today(C, b)
        mv = jax.jit(today)
        T = jax.jit(lambda yy, p, dd, sv: jax.linear_transpose(lambda v: today(v, p, dd, sv), x)(yy)[0])
        res[NB] = {
            "temp_mib mv": temp_mib(today, x, pix, d, s),
            "temp_mib T": temp_mib(
                lambda yy, p, dd, sv: jax.linear_transpose(lambda v: today(v, p, dd, sv), x)(yy)[0], y, pix, d, s
            ),
        }
        fns = {"mv": lambda: mv(x, pix, d, s), "T": lambda: T(y, pix, d, s)}
        if NB in (516, 512):
            (out / f"hlo_mv_{NB}.txt").write_text(mv.lower(x, pix, d, s).compile().as_text())
        if NB == 516:  # the rows read in two column blocks, 512 + 4
            split = make_split(C, b)
            res["split temp_mib mv"] = temp_mib(split, x, pix, d, s)
            smv = jax.jit(split)
            fns["split mv"] = lambda: smv(x, pix, d, s)
            ref = mv(x, pix, d, s)
            res["split rel"] = float(jnp.abs(smv(x, pix, d, s) - ref).max() / jnp.abs(ref).max())
        t = timed(fns, a.rounds)
        res[NB].update({k: v["median_ms"] for k, v in t.items()})
        print(NB, res[NB], flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--n-pix", type=int, default=200_000)
    p.add_argument("--n-bins", type=int, default=128)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-today-T", action="store_true")
    p.add_argument("--seed-check", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    res = {"info": info}
    if a.seed_check:
        res["seed"] = seed_check(a, out)
    else:
        res["explore"] = explore(a)
    res["info"]["load_after"] = os.getloadavg()
    name = f"explore_window_{info['backend']}{'_seed' if a.seed_check else ''}_{a.lines}.json"
    (out / name).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
