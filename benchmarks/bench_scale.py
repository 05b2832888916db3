"""Issue #16: the LOS operator on the users' full sky, scaling the number of lines of sight.

    python benchmarks/bench_scale.py                      # 132400, 1M, 4M lines: ~6-10 min on a 2-core CPU
    python benchmarks/bench_scale.py --lines 132400,1000000   # skip 4M (~3 min)
    python benchmarks/bench_scale.py --lines 54000000 --repeats 1 --literal-lines ""
                                 # the star count of the published 3-D dust map (11 min, 6.2 GiB peak)
    python benchmarks/bench_scale.py --out DIR           # write DIR/scale.json
    python benchmarks/bench_scale.py --devices 4 ...     # rows sharded over 4 host CPU devices

Sky: healpix nside 256 (786432 pixels) x 516 distance bins, float32 (1.6 GB), edges
``geomspace(40, 1700, 517)``. Lines: ``los.draw_lines`` (uniform pixels, log-normal distances).
The operator is the example's (``examples/astro_los/los.py``): ``los.make_los_operator``, a
``chunkop.RowOperator`` with the cancellation-free ``expm1`` weights; the users' literal row
function (``-jnp.diff(jnp.exp(-(d - b) / (d * s * b)))``, ``los.los_weights_naive``) runs too,
as a ``RowOperator`` of the same form, at ``--literal-lines``.

Per (form, lines, chunk) three jitted functions of ``(rows, sky, y)``, each building the
operator from the traced rows:

* ``mv``: ``A.mv(sky)``, the forward;
* ``T.mv``: ``A.T.mv(y)``, the transpose (writes the whole 1.6 GB sky-shaped output);
* ``grad``: ``jax.grad`` of ``0.5 * ||A sky - y||^2`` w.r.t. ``sky``.

For each: the compiled temp memory (``memory_analysis().temp_size_in_bytes``: buffers besides
arguments and outputs), the compile time, and the run time: one warm-up call, then the median
of ``--repeats`` calls (each ended by ``block_until_ready``), with the process CPU time per call
(all threads) beside the wall time. Per line = median / lines; the marginal per-line cost
between successive sizes and a least-squares fit ``t = a + b * lines`` (``a``: the fixed cost,
e.g. zero-filling the 1.6 GB output of ``T.mv``) show whether the time is linear in the lines.

``chunk_size="auto"`` (the operator's default) runs once, at ``--auto-lines``, expm1 form: the
first construction of the operator plans (compiles ``mv``/``T.mv`` and their VJPs at a few
chunks), timed separately from the second, cached one.

``--memory-lines`` (default 54000000) are compiled only, not run: the temp memory at the dust
map's star count, from shapes alone (no 54M-line arrays are made).

``--devices N`` (N > 1) starts JAX with N host CPU devices (``--xla_force_host_platform_device_count``)
and shards the rows and the data along the lines over them (the sky is replicated: one copy
per device, 1.6 GB each); the operator then runs one chunk loop per device's rows and sums the
transpose's partial skies across devices. ``--ops`` picks the functions (default all three).
The process's peak resident memory (``ru_maxrss``, monotone over a run) is recorded after each
size.

The 1-minute load average (``os.getloadavg``, as ``uptime``) is recorded before and after every
size; the benchmark itself keeps both cores of a 2-core machine busy (load ~2), so a figure is
labelled ``under load`` when the load average exceeds ``--loaded-above`` (2.5).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _devices_from_argv(argv: list[str]) -> int:
    """``--devices N`` read before JAX starts (the host device count is fixed at start-up)."""
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 1


if _devices_from_argv(sys.argv) > 1:
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
    )

import jax  # noqa: E402 (after the device count is set)
import jax.numpy as jnp  # noqa: E402 (after the device count is set)
import numpy as np  # noqa: E402 (after the device count is set)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B  # noqa: E402 (after the device count is set)

import chunkop  # noqa: E402 (after the device count is set)
from chunkop._memory import free_memory  # noqa: E402 (after the device count is set)

los = B.los
N_PIX, N_BINS = 786432, 516  # healpix nside 256 x 516 distance bins
OPS = ("mv", "T.mv", "grad")
MiB = 2**20


def log(msg: str) -> None:
    print(msg, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def make_operator(form: str, edges: np.ndarray, chunk: int | str) -> Callable:
    """``rows -> RowOperator`` for one weight form: the example's operator (``expm1``), or the
    users' literal row function in a ``RowOperator`` built the same way."""
    x_struct = jax.ShapeDtypeStruct((N_PIX, N_BINS), jnp.float32)

    def literal_row_fn(row: dict, sky: jax.Array) -> jax.Array:
        return jnp.dot(los.los_weights_naive(row["d"], row["s"], edges), sky[row["pix"]])

    def op(rows: dict) -> chunkop.RowOperator:
        if form == "expm1":
            return los.make_los_operator(rows["pix"], rows["d"], rows["s"], n_pix=N_PIX, edges=edges, chunk_size=chunk)
        return chunkop.RowOperator(literal_row_fn, rows, x_struct, chunk_size=chunk)

    return op


def functions(op) -> dict:
    def loss(sky, rows, y):
        r = op(rows).mv(sky) - y
        return 0.5 * jnp.sum(r * r)  # (not vdot: a dot of line-sharded vectors needs an out_sharding)

    grad = jax.grad(loss)
    return {
        "mv": lambda rows, sky, y: op(rows).mv(sky),
        "T.mv": lambda rows, sky, y: op(rows).T.mv(y),
        "grad": lambda rows, sky, y: grad(sky, rows, y),
    }


def shardings(devices: int) -> tuple:
    """``(lines, replicated)``: the shardings of line-indexed arrays and of the sky (None, None
    on one device)."""
    if devices <= 1:
        return None, None
    mesh = jax.make_mesh((devices,), ("lines",))
    P = jax.sharding.PartitionSpec
    return jax.sharding.NamedSharding(mesh, P("lines")), jax.sharding.NamedSharding(mesh, P())


def structs(n_lines: int, devices: int = 1) -> tuple:
    lines, replicated = shardings(devices)
    vec = lambda dtype: jax.ShapeDtypeStruct((n_lines,), dtype, sharding=lines)
    rows = {"pix": vec(jnp.int32), "d": vec(jnp.float32), "s": vec(jnp.float32)}
    return rows, jax.ShapeDtypeStruct((N_PIX, N_BINS), jnp.float32, sharding=replicated), vec(jnp.float32)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux: ``ru_maxrss`` in KiB)."""
    return 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def compile_op(fn, args: tuple) -> tuple:
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile()
    ma = c.memory_analysis()
    return c, {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "compile_s": round(time.perf_counter() - t0, 3),
    }


def time_call(c, args: tuple, repeats: int) -> dict:
    """Warm-up call, then ``repeats`` calls: median / min wall and CPU seconds."""
    load_before = load()
    out = c(*args)
    jax.block_until_ready(out)
    del out
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = c(*args)
        jax.block_until_ready(out)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del out
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "cpu_median_s": statistics.median(cpu),
        "samples_s": [round(t, 4) for t in wall],
        "load_before": load_before,
        "load_after": load(),
    }


@jax.jit
def make_sky() -> jax.Array:
    """A positive 786432 x 516 float32 sky in one fused kernel (no 2x random-bits temp)."""
    p = jax.lax.broadcasted_iota(jnp.float32, (N_PIX, N_BINS), 0)
    k = jax.lax.broadcasted_iota(jnp.float32, (N_PIX, N_BINS), 1)
    return 1.0 + 0.5 * jnp.sin(1e-3 * p + 0.05 * k) * jnp.cos(0.013 * p)


def data(n_lines: int, seed: int = 0, devices: int = 1) -> tuple:
    rng = np.random.default_rng(seed)
    pix, d, s = los.draw_lines(n_lines, N_PIX, rng)
    y = rng.standard_normal(n_lines).astype(np.float32)
    lines, _ = shardings(devices)
    put = (lambda a: jax.device_put(a, lines)) if lines is not None else jnp.asarray
    return {"pix": put(pix), "d": put(d), "s": put(s)}, put(y)


def run_config(
    form: str, n_lines: int, chunk, edges, sky, rows, y, repeats: int, check: bool, ops=OPS, devices: int = 1
) -> list[dict]:
    op = make_operator(form, edges, chunk)
    fns = functions(op)
    args = (rows, sky, y)
    out = []
    results = {}
    for name in ops:
        c, mem = compile_op(fns[name], structs(n_lines, devices))
        t = time_call(c, args, repeats)
        if check and name in ("mv", "T.mv"):
            results[name] = c(*args)
        del c
        e = {"form": form, "lines": n_lines, "chunk": chunk, "op": name, "devices": devices, **mem, **t}
        e["peak_rss_bytes"] = peak_rss_bytes()  # the process so far (before the adjoint check)
        e["per_line_us"] = 1e6 * t["median_s"] / n_lines
        out.append(e)
        log(
            f"  [{form} {n_lines} chunk={chunk}] {name:5s} median {t['median_s']:.3f} s "
            f"(min {t['min_s']:.3f}, cpu {t['cpu_median_s']:.2f}) = {e['per_line_us']:.3f} us/line; "
            f"temp {mem['temp_bytes'] / MiB:.1f} MiB; compile {mem['compile_s']:.1f} s; "
            f"load {t['load_before'][0]} -> {t['load_after'][0]}"
        )
    if check and {"mv", "T.mv"} <= set(ops):  # adjoint test <A x, y> = <x, A^T y> (float32 sums)
        if devices > 1:  # on the host in float64 (a vdot of sharded vectors needs an out_sharding)
            host = lambda a: np.asarray(jax.device_get(a), np.float64).ravel()
            ax_y = float(np.dot(host(results["mv"]), host(y)))
            x_aty = float(np.dot(host(sky), host(results["T.mv"])))
        else:
            ax_y = float(jnp.vdot(results["mv"], y))
            x_aty = float(jnp.vdot(sky, results["T.mv"]))
        rel = abs(ax_y - x_aty) / max(abs(ax_y), abs(x_aty))
        for e in out:
            e["adjoint_rel_err"] = rel
        log(f"  adjoint check <Ax,y> vs <x,A^T y>: rel. diff {rel:.2e}")
        del results
    return out


def linearity(entries: list[dict]) -> dict:
    """Per (form, chunk, op): marginal per-line cost between successive sizes and the fit ``a + b n``."""
    out = {}
    keys = sorted({(e["form"], str(e["chunk"]), e["op"]) for e in entries})
    for form, chunk, op in keys:
        pts = sorted(
            (e["lines"], e["median_s"]) for e in entries if (e["form"], str(e["chunk"]), e["op"]) == (form, chunk, op)
        )
        if len(pts) < 2:
            continue
        n, t = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        b, a = np.polyfit(n, t, 1)
        marginal = [float(1e6 * (t[i + 1] - t[i]) / (n[i + 1] - n[i])) for i in range(len(n) - 1)]
        out[f"{form} / {chunk} / {op}"] = {
            "lines": [int(x) for x in n],
            "marginal_us_per_line": [round(m, 4) for m in marginal],
            "fit_us_per_line": round(float(1e6 * b), 4),
            "fit_fixed_s": round(float(a), 4),
            "fit_max_rel_residual": round(float(np.max(np.abs(a + b * n - t) / t)), 4),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", default="132400,1000000,4000000", help="comma-separated line counts (expm1 form)")
    p.add_argument("--literal-lines", default="132400,1000000", help="line counts for the users' literal weights")
    p.add_argument("--auto-lines", type=int, default=1000000, help='line count of the chunk_size="auto" run (0: skip)')
    p.add_argument("--memory-lines", default="54000000", help="line counts compiled only (temp memory), not run")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loaded-above", type=float, default=2.5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--devices", type=int, default=1, help="host CPU devices the rows are sharded over")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated functions, of {OPS}")
    a = p.parse_args(argv)
    ops = tuple(x for x in a.ops.split(",") if x)
    if not set(ops) <= set(OPS):
        p.error(f"--ops must name some of {OPS}, got {a.ops!r}")
    if a.devices != jax.device_count():
        p.error(
            f"--devices {a.devices}: JAX started with {jax.device_count()} devices (pass --devices on the command line)"
        )
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    lines, literal_lines, memory_lines = ints(a.lines), ints(a.literal_lines), ints(a.memory_lines)
    sizes = sorted(set(lines) | set(literal_lines) | ({a.auto_lines} if a.auto_lines else set()))
    t_start = time.perf_counter()
    edges = los.bin_edges(N_BINS)
    res: dict = {
        "machine": B.machine(),
        "config": {
            "n_pix": N_PIX,
            "n_bins": N_BINS,
            "sky_bytes": N_PIX * N_BINS * 4,
            "chunk": a.chunk,
            "repeats": a.repeats,
            "lines": lines,
            "literal_lines": literal_lines,
            "auto_lines": a.auto_lines,
            "memory_lines": memory_lines,
            "loaded_above": a.loaded_above,
            "devices": a.devices,
            "ops": list(ops),
        },
        "uptime_start": uptime(),
        "sizes": [],
        "results": [],
    }
    log(f"start: {res['uptime_start']}")
    t0 = time.perf_counter()
    sky = jax.block_until_ready(make_sky())
    if a.devices > 1:
        sky = jax.block_until_ready(jax.device_put(sky, shardings(a.devices)[1]))
    res["sky_fill_s"] = round(time.perf_counter() - t0, 3)
    for n in sizes:
        rows, y = data(n, devices=a.devices)
        size = {"lines": n, "uptime_before": uptime(), "load_before": load()}
        log(f"{n} lines: {size['uptime_before']}")
        t_size = time.perf_counter()
        if n in lines:
            res["results"] += run_config("expm1", n, a.chunk, edges, sky, rows, y, a.repeats, True, ops, a.devices)
        if n in literal_lines:
            res["results"] += run_config("literal", n, a.chunk, edges, sky, rows, y, a.repeats, False, ops, a.devices)
        if n == a.auto_lines:
            jax.block_until_ready(rows)
            free = [free_memory()]
            t0 = time.perf_counter()
            A = los.make_los_operator(rows["pix"], rows["d"], rows["s"], n_pix=N_PIX, edges=edges, chunk_size="auto")
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            A2 = los.make_los_operator(rows["pix"], rows["d"], rows["s"], n_pix=N_PIX, edges=edges, chunk_size="auto")
            cached_s = time.perf_counter() - t0
            free.append(free_memory())
            plan = chunkop.plan(A)
            res["auto"] = {
                "lines": n,
                "first_build_s": round(first_s, 3),
                "cached_build_s": round(cached_s, 3),
                "chunk": A.chunk_size,
                "same_chunk_cached": A2.chunk_size == A.chunk_size,
                "budget_bytes": plan.budget,
                "budget_bytes_second": chunkop.plan(A2).budget,
                "cap_bytes": plan.cap,
                "compiled_bytes": plan.compiled_bytes,
                "probes": [list(x) for x in plan.probes],
                "free_memory_bytes": free,
            }
            log(
                f'  chunk_size="auto": first build (plans) {first_s:.2f} s, cached {cached_s:.3f} s; chunk '
                f"{A.chunk_size}, probes {plan.probes}"
            )
            del A, A2
            res["results"] += run_config("expm1", n, "auto", edges, sky, rows, y, a.repeats, check=False)
        size["peak_rss_bytes"] = peak_rss_bytes()
        log(f"  peak resident memory so far: {size['peak_rss_bytes'] / 2**30:.2f} GiB")
        size["load_after"] = load()
        size["uptime_after"] = uptime()
        size["wall_s"] = round(time.perf_counter() - t_size, 1)
        res["sizes"].append(size)
        del rows, y
    res["memory_only"] = []
    for n in memory_lines:
        for form in ("expm1", "literal"):
            for name, fn in functions(make_operator(form, edges, a.chunk)).items():
                _, mem = compile_op(fn, structs(n))
                res["memory_only"].append({"form": form, "lines": n, "chunk": a.chunk, "op": name, **mem})
                log(f"  [{form} {n} chunk={a.chunk}] {name:5s} compiled only: temp {mem['temp_bytes'] / MiB:.1f} MiB")
    res["linearity"] = linearity(res["results"])
    res["uptime_end"] = uptime()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    for e in res["results"]:
        e["under_load"] = max(e["load_before"][0], e["load_after"][0]) > a.loaded_above
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(res, indent=1, default=float))
    md = markdown(res)
    log("\n" + md)
    log(f"wrote {out / 'scale.json'}; total {res['wall_s']:.0f} s")
    return 0


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [
        f"Sky {c['n_pix']} x {c['n_bins']} float32 ({c['sky_bytes'] / 1e9:.2f} GB); warm-up + median of "
        f"{c['repeats']} calls; per line = median / lines; `*` = under load (1-min load > {c['loaded_above']}); "
        f"rows sharded over {c.get('devices', 1)} device(s).",
        "",
        "| form | lines | chunk | op | median | per line | cpu | temp | compile | load | peak RSS so far |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for e in res["results"]:
        star = " *" if e["under_load"] else ""
        lines.append(
            f"| {e['form']} | {e['lines']} | {e['chunk']} | {e['op']} | {e['median_s']:.3f} s{star} | "
            f"{e['per_line_us']:.3f} us | {e['cpu_median_s']:.2f} s | {e['temp_bytes'] / MiB:.1f} MiB | "
            f"{e['compile_s']:.1f} s | {e['load_before'][0]} -> {e['load_after'][0]} | "
            f"{e['peak_rss_bytes'] / 2**30:.2f} GiB |"
        )
    for e in res.get("memory_only", []):
        lines.append(
            f"| {e['form']} | {e['lines']} | {e['chunk']} | {e['op']} | compiled only | | | "
            f"{e['temp_bytes'] / MiB:.1f} MiB | {e['compile_s']:.1f} s | | |"
        )
    lines += ["", "| form / chunk / op | lines | marginal us/line | fit us/line | fit fixed s | max rel. residual |"]
    lines.append("|---|---|---|---:|---:|---:|")
    for k, v in res["linearity"].items():
        lines.append(
            f"| {k} | {v['lines']} | {v['marginal_us_per_line']} | {v['fit_us_per_line']} | "
            f"{v['fit_fixed_s']} | {v['fit_max_rel_residual']} |"
        )
    if "auto" in res:
        au = res["auto"]
        lines += [
            "",
            f'`chunk_size="auto"` at {au["lines"]} lines: first build (plans) {au["first_build_s"]} s, cached '
            f"{au['cached_build_s']} s; chunk {au['chunk']} (cap {au['cap_bytes']}, compiled "
            f"{au['compiled_bytes']} B; probes {au['probes']})",
        ]
    rss = ", ".join(
        f"{z['lines']}: {z['peak_rss_bytes'] / 2**30:.2f} GiB" for z in res["sizes"] if "peak_rss_bytes" in z
    )
    lines += ["", f"peak resident memory after each size: {rss}"] if rss else []
    lines += ["", f"sky fill {res['sky_fill_s']} s; {res['uptime_start']} -> {res['uptime_end']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
