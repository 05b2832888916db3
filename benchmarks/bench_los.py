"""Benchmark the line-of-sight (LOS) operator: chunkop.RowOperator against the alternatives.

Usage::

    python benchmarks/bench_los.py            # full run, both weight forms (about 10-16 minutes on a 2-core CPU)
    python benchmarks/bench_los.py --quick    # smoke run (about two minutes)
    python benchmarks/bench_los.py --forms literal   # one weight form only
    python benchmarks/bench_los.py --out DIR  # write los.json, los.md, los_memory.png, los_time.png under DIR

Workload (examples/astro_los/los.py): a sky of ``20000 x 256`` (pixels x radial bins, edges
``geomspace(40, 1700, 257)``) seen by ``n_los`` lines, ``y_l = w(d_l, s_l) . sky[pix_l]`` with
``w = -diff(exp(-(d - b) / (d s b)))``, in two forms (``--forms``, both by default):

* ``literal``: the users' own expression, ``-jnp.diff(jnp.exp(...))`` (``los.los_weights_naive``);
* ``expm1``: the cancellation-free rewrite of ``examples/astro_los/los.py`` (``los.los_weights``).

Four operations:

* ``matvec``: ``A x``;
* ``transpose``: ``A^T y`` (each method's native transpose, else ``jax.linear_transpose`` or
  the VJP);
* ``grad``: ``grad_x |A x - b|^2``;
* ``hvp``: ``d/dt grad_x |A (x + t v) - b|^2`` (forward-over-reverse).

Methods (chunked ones use ``--chunk`` lines per chunk):

* ``chunkop``: ``chunkop.RowOperator`` (``A.mv``, ``A.T.mv``, autodiff through its custom_jvp);
* ``jax.vmap``: plain unchunked JAX, the reference: ``jax.vmap(row_fn)`` over all lines, its
  ``jax.linear_transpose``, and ``jax.grad`` / hvp of the unchunked loss;
* ``lax.map``: ``jax.lax.map(row_fn, rows, batch_size=chunk)``;
* ``custom_vjp``: a hand-written chunked ``jax.custom_vjp`` (the users' approach: a chunked
  forward scan and a chunked scatter-add backward scan);
* ``BCOO``: a precomputed ``jax.experimental.sparse.BCOO`` matrix (``n_los * n_bins`` stored
  weights + indices: the matrix's bytes are an *argument*, listed separately, and it must be
  rebuilt whenever ``d`` or ``s`` change; its build is measured as ``build``);
* ``lineax.Function``: ``lineax.FunctionLinearOperator`` over the unchunked function.

For every (method, operation, n_los): the compiled temp memory
(``jax.jit(f).lower(*ShapeDtypeStructs).compile().memory_analysis().temp_size_in_bytes``: what
XLA allocates beyond arguments and outputs) and the median run time of the compiled
executable, all methods of one (operation, n_los) timed round-robin (interleaved) so load from
other processes hits them alike. Failures (e.g. forward mode through ``custom_vjp``) are
recorded as ``fails: <error type>``; configurations whose temp + argument memory exceeds
``--mem-limit-gib`` are compiled (for their memory figure) but not run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.experimental import sparse

import chunkop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "astro_los"))
import los

METHODS = ("chunkop", "jax.vmap", "lax.map", "custom_vjp", "BCOO", "lineax.Function")
OPS = ("matvec", "transpose", "grad", "hvp")
MiB, GiB = 2**20, 2**30


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# The methods: each builds ``ops[name](args...)`` functions for one (n_los) configuration.


FORMS = ("literal", "expm1")


class Workload:
    def __init__(self, n_pix: int, n_bins: int, chunk: int, form: str = "expm1"):
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        self.n_pix, self.n_bins, self.chunk, self.form = n_pix, n_bins, chunk, form
        self.edges = los.bin_edges(n_bins)
        self.x_struct = jax.ShapeDtypeStruct((n_pix, n_bins), jnp.float32)
        self.weights = los.los_weights_naive if form == "literal" else los.los_weights

    def row_fn(self, row: dict, x: jax.Array) -> jax.Array:
        return jnp.dot(self.weights(row["d"], row["s"], self.edges), x[row["pix"]])

    def data(self, n_los: int, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        pix, d, s = los.draw_lines(n_los, self.n_pix, rng)
        k = jax.random.split(jax.random.key(seed), 3)
        return {
            "rows": {"pix": jnp.asarray(pix), "d": jnp.asarray(d), "s": jnp.asarray(s)},
            "x": jax.random.uniform(k[0], self.x_struct.shape, jnp.float32, 0.5, 1.5),
            "v": jax.random.normal(k[1], self.x_struct.shape, jnp.float32),
            "y": jax.random.normal(k[2], (n_los,), jnp.float32),
        }

    # -- forward functions f(rows, x) -> y, one per method ---------------------------------------

    def f_vmap(self, rows: dict, x: jax.Array) -> jax.Array:
        return jax.vmap(self.row_fn, (0, None))(rows, x)

    def f_laxmap(self, rows: dict, x: jax.Array) -> jax.Array:
        return jax.lax.map(lambda r: self.row_fn(r, x), rows, batch_size=self.chunk)

    def make_custom_vjp(self) -> Callable:
        """The users' approach: forward and backward written by hand as scans over chunks."""
        edges, chunk, weights = self.edges, self.chunk, self.weights

        def chunks(a):
            return a.reshape((a.shape[0] // chunk, chunk) + a.shape[1:])

        def pad(pix, d, s, g=None):
            """Pad to a whole number of chunks with harmless lines (pixel 0, d = 1700; zero cotangent)."""
            k = -pix.shape[0] % chunk
            if k:
                pix = jnp.concatenate([pix, jnp.zeros(k, pix.dtype)])
                d = jnp.concatenate([d, jnp.full(k, los.R_MAX, d.dtype)])
                s = jnp.concatenate([s, jnp.full(k, 0.1 * los.R_MAX, s.dtype)])
                g = None if g is None else jnp.concatenate([g, jnp.zeros(k, g.dtype)])
            return pix, d, s, g

        def forward(x, pix, d, s):
            n = pix.shape[0]
            pix, d, s, _ = pad(pix, d, s)

            def body(_, c):
                p, dd, ss = c
                return None, jnp.sum(weights(dd, ss, edges) * x[p], axis=-1)

            _, y = jax.lax.scan(body, None, (chunks(pix), chunks(d), chunks(s)))
            return y.reshape(-1)[:n]

        @jax.custom_vjp
        def f(x, pix, d, s):
            return forward(x, pix, d, s)

        def fwd(x, pix, d, s):
            return forward(x, pix, d, s), (x, pix, d, s)

        def bwd(res, g):
            x, pix0, d, s = res
            n = pix0.shape[0]
            pix, d, s, g = pad(pix0, d, s, g)

            def body(gx, c):
                p, dd, ss, gg = c
                w, w_vjp = jax.vjp(lambda a, b: weights(a, b, edges), dd, ss)
                gx = gx.at[p].add(gg[:, None] * w)  # scatter-add into the carried sky
                gd, gs = w_vjp(gg[:, None] * x[p])
                return gx, (gd, gs)

            gx, (gd, gs) = jax.lax.scan(body, jnp.zeros_like(x), (chunks(pix), chunks(d), chunks(s), chunks(g)))
            pix_ct = np.zeros(pix0.shape, dtype=jax.dtypes.float0)
            return gx, pix_ct, gd.reshape(-1)[:n], gs.reshape(-1)[:n]

        f.defvjp(fwd, bwd)
        return lambda rows, x: f(x, rows["pix"], rows["d"], rows["s"])

    def build_bcoo(self, rows: dict) -> sparse.BCOO:
        """The precomputed sparse matrix: ``n_los * n_bins`` weights with their (row, column) indices."""
        n, nb = rows["pix"].shape[0], self.n_bins
        w = self.weights(rows["d"], rows["s"], self.edges)  # (n, nb): all weights at once
        cols = rows["pix"][:, None] * nb + jnp.arange(nb, dtype=jnp.int32)[None, :]
        r = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, nb))
        idx = jnp.stack([r.reshape(-1), cols.reshape(-1)], axis=1)
        return sparse.BCOO((w.reshape(-1), idx), shape=(n, self.n_pix * nb), indices_sorted=True, unique_indices=True)

    # -- the four operations for each method ---------------------------------------------------

    def ops(self, method: str) -> dict[str, Callable]:
        """``{op: fn}``; every ``fn`` takes ``(state, x, v, y)`` with ``state`` = rows, or the matrix."""
        shape = self.x_struct.shape
        if method == "BCOO":

            def mv(M, x):
                return M @ x.reshape(-1)

            def rmv(M, y):
                (ct,) = jax.linear_transpose(lambda x: mv(M, x), self.x_struct)(y)
                return ct

        elif method == "chunkop":

            def op(rows):
                return chunkop.RowOperator(self.row_fn, rows, self.x_struct, chunk_size=self.chunk)

            def mv(rows, x):
                return op(rows).mv(x)

            def rmv(rows, y):
                return op(rows).T.mv(y)

        elif method == "lineax.Function":

            def op(rows):
                return lx.FunctionLinearOperator(lambda x: self.f_vmap(rows, x), self.x_struct)

            def mv(rows, x):
                return op(rows).mv(x)

            def rmv(rows, y):
                return op(rows).T.mv(y)

        else:
            f = {"jax.vmap": self.f_vmap, "lax.map": self.f_laxmap}.get(method)
            if method == "custom_vjp":
                f = self.make_custom_vjp()

            def mv(rows, x):
                return f(rows, x)

            if method == "custom_vjp":  # linear_transpose cannot see through custom_vjp: use the VJP

                def rmv(rows, y):
                    return jax.vjp(lambda x: f(rows, x), jnp.zeros(shape, jnp.float32))[1](y)[0]

            else:

                def rmv(rows, y):
                    (ct,) = jax.linear_transpose(lambda x: f(rows, x), self.x_struct)(y)
                    return ct

        def loss(state, x, y):
            return jnp.sum((mv(state, x) - y) ** 2)

        grad = jax.grad(loss, argnums=1)
        return {
            "matvec": lambda st, x, v, y: mv(st, x),
            "transpose": lambda st, x, v, y: rmv(st, y),
            "grad": lambda st, x, v, y: grad(st, x, y),
            "hvp": lambda st, x, v, y: jax.jvp(lambda x_: grad(st, x_, y), (x,), (v,))[1],
        }


# ------------------------------------------------------------------------------------------------
# Measurement.


def structs(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def compile_fn(fn: Callable, args: tuple) -> tuple:
    """(compiled, memory dict) or raises."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*structs(args)).compile()
    ma = compiled.memory_analysis()
    return compiled, {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "compile_s": time.perf_counter() - t0,
    }


def time_round_robin(execs: dict, args: dict, repeats: int, budget_s: float) -> dict:
    """Median and min seconds per call of each compiled executable, interleaved, after a warm-up call.

    Also the process CPU time per call (all threads; less sensitive to other processes taking
    the cores than the wall time) and the 1-minute load average before and after.
    """
    load_before = os.getloadavg()[0]
    one, one_cpu = {}, {}
    for k, c in execs.items():
        jax.block_until_ready(c(*args[k]))  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(c(*args[k]))
        one[k], one_cpu[k] = time.perf_counter() - t0, time.process_time() - c0
    reps = int(max(2, min(repeats, budget_s // max(sum(one.values()), 1e-9))))
    samples = {k: [one[k]] for k in execs}
    cpu = {k: [one_cpu[k]] for k in execs}
    for r in range(reps - 1):
        keys = list(execs)[:: (-1 if r % 2 else 1)]
        for k in keys:
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(execs[k](*args[k]))
            samples[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return {
        k: {
            "median_s": statistics.median(s),
            "min_s": min(s),
            "cpu_median_s": statistics.median(cpu[k]),
            "cpu_min_s": min(cpu[k]),
            "repeats": len(s),
            "load1": load,
        }
        for k, s in samples.items()
    }


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        "lineax": getattr(lx, "__version__", "?"),
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("Model name", "Architecture", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache"):
                info["lscpu " + k.strip()] = v.strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory_GiB"] = round(kb / 2**20, 1)
    except Exception:  # noqa: BLE001
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def check_agreement(wl: Workload, n: int, M_build: Callable) -> dict:
    """Max relative deviation of every method's four results from jax.vmap's (at a small n)."""
    data = wl.data(n, seed=1)
    M = M_build(data["rows"])
    out = {}
    ref = {op: jax.jit(fn)(data["rows"], data["x"], data["v"], data["y"]) for op, fn in wl.ops("jax.vmap").items()}
    for method in METHODS:
        state = M if method == "BCOO" else data["rows"]
        errs = {}
        for op, fn in wl.ops(method).items():
            try:
                got = jax.jit(fn)(state, data["x"], data["v"], data["y"])
                errs[op] = float(jnp.max(jnp.abs(got - ref[op])) / jnp.max(jnp.abs(ref[op])))
            except Exception as e:  # noqa: BLE001
                errs[op] = f"fails: {type(e).__name__}"
        out[method] = errs
    return out


def capabilities(wl: Workload, n: int) -> dict:
    """Which other transforms work for each method (the ones chunkop's custom_jvp is built for)."""
    data = wl.data(n, seed=2)
    rows, x = data["rows"], data["x"]
    fns = {
        "chunkop": lambda r, x: chunkop.RowOperator(wl.row_fn, r, wl.x_struct, chunk_size=wl.chunk).mv(x),
        "jax.vmap": wl.f_vmap,
        "lax.map": wl.f_laxmap,
        "custom_vjp": wl.make_custom_vjp(),
        "lineax.Function": lambda r, x: lx.FunctionLinearOperator(lambda v: wl.f_vmap(r, v), wl.x_struct).mv(x),
    }
    # every test takes the data as jit arguments (closed-over arrays would be constant-folded)
    tests = {
        "jax.jvp in x (forward mode)": lambda f, rows, x, y: jax.jvp(lambda v: f(rows, v), (x,), (x,))[1],
        "jax.linear_transpose": lambda f, rows, x, y: jax.linear_transpose(lambda v: f(rows, v), wl.x_struct)(y)[0],
        "grad w.r.t. s (row data)": lambda f, rows, x, y: jax.grad(lambda s: jnp.sum(f({**rows, "s": s}, x) ** 2))(
            rows["s"]
        ),
        "hvp w.r.t. s (fwd-over-rev)": lambda f, rows, x, y: jax.jvp(
            jax.grad(lambda s: jnp.sum(f({**rows, "s": s}, x) ** 2)), (rows["s"],), (rows["s"],)
        )[1],
        "reverse-over-reverse (grad of a grad-norm)": lambda f, rows, x, y: jax.grad(
            lambda v: jnp.sum(jax.grad(lambda u: jnp.sum(f(rows, u) ** 2))(v) ** 2)
        )(x),
    }
    M = jax.jit(wl.build_bcoo)(rows)
    fns["BCOO"] = lambda M, v: M @ v.reshape(-1)
    out = {}
    for m in METHODS:
        out[m] = {}
        for name, test in tests.items():
            if m == "BCOO" and "s" in name.split():
                out[m][name] = "n/a (weights precomputed)"
                continue
            try:
                jax.block_until_ready(
                    jax.jit(lambda st, x, y: test(fns[m], st, x, y))(M if m == "BCOO" else rows, x, data["y"])
                )
                out[m][name] = "ok"
            except Exception as e:  # noqa: BLE001
                out[m][name] = f"fails: {type(e).__name__}"
    return out


def run(cfg: argparse.Namespace) -> dict:
    res: dict = {
        "config": {
            "n_pix": cfg.n_pix,
            "n_bins": cfg.n_bins,
            "chunk": cfg.chunk,
            "n_los": cfg.n_los,
            "mem_limit_gib": cfg.mem_limit_gib,
            "repeats": cfg.repeats,
            "forms": list(cfg.forms),
        },
        "machine": machine(),
        "results": [],
        "bcoo_build": [],
        "agreement_with_vmap": {},
    }
    log(f"machine: {res['machine']}")
    log(
        f"sky {cfg.n_pix} x {cfg.n_bins} ({cfg.n_pix * cfg.n_bins * 4 / MiB:.0f} MiB), chunk {cfg.chunk}, "
        f"n_los {cfg.n_los}, weight forms {cfg.forms}"
    )
    for form in cfg.forms:
        wl = Workload(cfg.n_pix, cfg.n_bins, cfg.chunk, form)
        res["agreement_with_vmap"][form] = check_agreement(wl, 2 * cfg.chunk + 123, jax.jit(wl.build_bcoo))
        log(f"[{form}] max relative deviation from jax.vmap: {res['agreement_with_vmap'][form]}")
        if "capabilities" not in res:  # the same for both forms
            res["capabilities"] = capabilities(wl, 2 * cfg.chunk)
            log(f"capabilities: {res['capabilities']}")
        run_form(cfg, wl, res)
    return res


def run_form(cfg: argparse.Namespace, wl: Workload, res: dict) -> None:
    limit = cfg.mem_limit_gib * GiB
    form = wl.form
    for n in cfg.n_los:
        data = wl.data(n)
        log(f"\n## [{form}] n_los = {n} (weights n_los x n_bins = {n * cfg.n_bins * 4 / MiB:.0f} MiB)")
        # the BCOO matrix (built once per n, outside the timed operations)
        M = None
        build_c, build_mem = compile_fn(wl.build_bcoo, (data["rows"],))
        if build_mem["temp_bytes"] + build_mem["output_bytes"] <= limit:
            t0 = time.perf_counter()
            M = jax.block_until_ready(build_c(data["rows"]))
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            jax.block_until_ready(build_c(data["rows"]))
            build_s = min(build_s, time.perf_counter() - t0)
        else:
            build_s = None
        res["bcoo_build"].append(
            {"form": form, "n_los": n, **build_mem, "run_s": build_s, "matrix_bytes": build_mem["output_bytes"]}
        )
        log(
            f"  BCOO build: {build_mem['output_bytes'] / MiB:.0f} MiB matrix, temp "
            f"{build_mem['temp_bytes'] / MiB:.0f} MiB, {build_s if build_s is None else round(build_s, 3)} s"
        )
        for op in OPS:
            execs, args, entries = {}, {}, {}
            for method in METHODS:
                entry = {"form": form, "n_los": n, "method": method, "op": op}
                entries[method] = entry
                res["results"].append(entry)
                state = M if method == "BCOO" else data["rows"]
                if method == "BCOO" and M is None:
                    entry["status"] = "skipped: matrix over memory limit"
                    continue
                fn = wl.ops(method)[op]
                a = (state, data["x"], data["v"], data["y"])
                try:
                    c, mem = compile_fn(fn, a)
                except Exception as e:  # noqa: BLE001
                    entry["status"] = f"fails: {type(e).__name__}"
                    entry["error"] = str(e).splitlines()[0][:200]
                    continue
                entry.update(mem)
                if mem["temp_bytes"] + mem["argument_bytes"] + mem["output_bytes"] > limit:
                    entry["status"] = f"skipped: needs {(mem['temp_bytes'] + mem['argument_bytes']) / GiB:.1f} GiB"
                    continue
                entry["status"] = "ok"
                execs[method], args[method] = c, a
            if execs:
                try:
                    timings = time_round_robin(execs, args, cfg.repeats, cfg.budget_s)
                except Exception as e:  # noqa: BLE001  (e.g. out of memory at run time)
                    timings = {}
                    for method in execs:
                        entries[method]["status"] = f"fails at run time: {type(e).__name__}"
                for method, t in timings.items():
                    entries[method].update(t)
            line = "  ".join(f"{m}: {fmt_cell(entries[m])}" for m in METHODS)
            load = next((e["load1"] for e in entries.values() if "load1" in e), None)
            log(f"  {op:9s} {line}  (load {load})")
        del data, M


def fmt_cell(e: dict, what: str = "both") -> str:
    st = e.get("status", "?")
    if st != "ok" and "median_s" not in e:
        if "temp_bytes" in e and what != "time":
            return f"{e['temp_bytes'] / MiB:.0f} MiB ({st})"
        return st
    mem = f"{e['temp_bytes'] / MiB:.1f} MiB"
    t = f"{e['median_s'] * 1e3:.0f} ms" if e["median_s"] >= 0.01 else f"{e['median_s'] * 1e3:.1f} ms"
    if what == "mem":
        return mem
    if what == "time":
        return t
    return f"{t} / {mem}"


def _forms(res: dict) -> list:
    """The weight forms of a result file (files written before the literal form: expm1 only)."""
    return res["config"].get("forms", ["expm1"])


def _form_of(entry: dict) -> str:
    return entry.get("form", "expm1")


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"Sky {cfg['n_pix']} x {cfg['n_bins']} float32, chunk {cfg['chunk']} lines; cells: median time / "
        "compiled temp memory (XLA's temp allocation beyond arguments and outputs). `jax.vmap` is plain "
        "unchunked JAX (`jax.linear_transpose` of it for the transpose). Weight forms: `literal` = the users' "
        "`-diff(exp(-(d - b) / (d s b)))`, `expm1` = the cancellation-free rewrite.",
        "",
    ]
    agreement = res["agreement_with_vmap"]
    if "expm1" not in agreement and "literal" not in agreement:  # (older files: one form)
        agreement = {"expm1": agreement}
    for form in _forms(res):
        for op in OPS:
            lines.append(f"**{op}** ({form})")
            lines.append("")
            lines.append("| n_los | " + " | ".join(METHODS) + " | chunkop / jax.vmap |")
            lines.append("|---|" + "---|" * (len(METHODS) + 1))
            for n in cfg["n_los"]:
                cells, es = [], {}
                for m in METHODS:
                    e = next(
                        r
                        for r in res["results"]
                        if _form_of(r) == form and r["n_los"] == n and r["method"] == m and r["op"] == op
                    )
                    es[m] = e
                    cells.append(fmt_cell(e))
                ok = all("median_s" in es[m] for m in ("chunkop", "jax.vmap"))
                ratio = f"{es['chunkop']['median_s'] / es['jax.vmap']['median_s']:.2f}" if ok else "-"
                lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
            lines.append("")
        lines.append(
            f"**Agreement with jax.vmap** ({form}; max |result - vmap's| / max |vmap's|, n_los = "
            f"{2 * cfg['chunk'] + 123}: not a multiple of the chunk)"
        )
        lines.append("")
        lines.append("| method | " + " | ".join(OPS) + " |")
        lines.append("|---|" + "---|" * len(OPS))
        for m, errs in agreement[form].items():
            lines.append(
                f"| {m} | "
                + " | ".join(f"{v:.1e}" if isinstance(v, float) else v for v in (errs[o] for o in OPS))
                + " |"
            )
        lines.append("")
    caps = res["capabilities"]
    names = list(next(iter(caps.values())))
    lines.append("**Other transforms** (compiled and run at a small n_los)")
    lines.append("")
    lines.append("| method | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(caps[m][k] for k in names) + " |")
    lines.append("")
    lines.append("**BCOO matrix** (an argument of every BCOO operation, rebuilt whenever d or s change)")
    lines.append("")
    lines.append("| form | n_los | matrix bytes | build temp | build time |")
    lines.append("|---|---|---|---|---|")
    for b in res["bcoo_build"]:
        t = "skipped" if b["run_s"] is None else f"{b['run_s'] * 1e3:.0f} ms"
        lines.append(
            f"| {_form_of(b)} | {b['n_los']} | {b['matrix_bytes'] / MiB:.0f} MiB | "
            f"{b['temp_bytes'] / MiB:.0f} MiB | {t} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("matplotlib not installed: no PNGs")
        return []
    paths = []
    for form in _forms(res):
        paths += _plot_form(res, out, form, plt, matplotlib)
    return paths


def _plot_form(res: dict, out: Path, form: str, plt, matplotlib) -> list:
    paths = []
    ns = res["config"]["n_los"]
    for kind, key, scale, ylabel in (
        ("memory", "temp_bytes", MiB, "compiled temp memory (MiB)"),
        ("time", "median_s", 1e-3, "median time (ms)"),
    ):
        fig, axes = plt.subplots(1, len(OPS), figsize=(4.2 * len(OPS), 3.8), constrained_layout=True)
        for ax, op in zip(axes, OPS):
            for i, m in enumerate(METHODS):
                pts = [
                    (e["n_los"], e[key] / scale)
                    for e in res["results"]
                    if _form_of(e) == form and e["method"] == m and e["op"] == op and key in e and e[key] > 0
                ]
                if pts:
                    ax.loglog(
                        *zip(*pts),
                        marker="os^vDx"[i],
                        ls="-" if i % 2 == 0 else "--",
                        color=f"C{i}",
                        label=m,
                        lw=2.5 if m == "chunkop" else 1.2,
                        ms=6 if m == "chunkop" else 4,
                    )
            ax.set_title(op)
            ax.set_xlabel("n_los")
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns], fontsize=7)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[0].legend(fontsize=7)
        fig.suptitle(
            f"LOS operator ({form} weights), sky {res['config']['n_pix']} x {res['config']['n_bins']}: "
            f"{ylabel} vs n_los"
        )
        p = out / (f"los_{kind}.png" if form == "expm1" else f"los_{form}_{kind}.png")
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(str(p))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument(
        "--mem-limit-gib",
        type=float,
        default=6.0,
        help="run a configuration only if temp + argument + output memory is below this",
    )
    p.add_argument(
        "--forms",
        default=",".join(FORMS),
        help="comma-separated weight forms: literal (the users' -diff(exp(...))), expm1 (the rewrite)",
    )
    p.add_argument("--replot", action="store_true", help="only redo los.md and the PNGs from OUT/los.json")
    a = p.parse_args(argv)
    a.forms = [f for f in a.forms.split(",") if f]
    if any(f not in FORMS for f in a.forms):
        p.error(f"--forms: choose from {FORMS}")
    if a.replot:
        out = Path(a.out)
        res = json.loads((out / "los.json").read_text())
        md = markdown(res)
        (out / "los.md").write_text(md)
        res["figures"] = plot(res, out)
        log(md)
        return 0
    if a.quick:
        a.n_pix, a.n_bins, a.n_los, a.repeats, a.budget_s = 5000, 128, [4096, 16384], 3, 2.0
    else:
        a.n_pix, a.n_bins, a.n_los, a.repeats, a.budget_s = 20000, 256, [16384, 65536, 262144], 5, 8.0
    t0 = time.perf_counter()
    res = run(a)
    res["wall_s"] = time.perf_counter() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    res["figures"] = plot(res, out)
    (out / "los.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "los.md").write_text(md)
    log("\n" + md)
    log(f"wrote {out / 'los.json'}, {out / 'los.md'}, " + ", ".join(res["figures"]))
    log(f"total {res['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
