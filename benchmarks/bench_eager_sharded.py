"""Eager calls on inputs sharded over devices: XLA compiles and wall time per call.

Usage::

    python benchmarks/bench_eager_sharded.py [--devices 4] [--calls 6] [--out DIR]

Forced CPU devices (``--xla_force_host_platform_device_count``), Auto and Explicit meshes. For
``chunkop.vmap`` / ``chunkop.sum`` (chunk 3 and ``"auto"``, a function rebuilt per call and a new array as
an unmapped argument, as a training step makes) and a ``RowOperator`` whose rows are sharded (``A.mv``,
``A.T.mv``): the number of XLA compilations (JAX's ``backend_compile`` monitoring event) and the
wall time of each of ``--calls`` eager calls, the first included. Each result is checked against
``jax.vmap`` / the dense matrix. Next to them, plain ``jax.vmap`` of the same function on the
same sharded input, the strongest alternative where the problem fits. Writes
``DIR/eager_sharded.md``. Run it on two checkouts to compare them (``PYTHONPATH=<src>``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=4)
ap.add_argument("--calls", type=int, default=6)
ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
args = ap.parse_args()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import chunkop  # noqa: E402

COMPILES: list = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_kw: COMPILES.append(event) if "backend_compile" in event else None
)


def measure(call, check) -> tuple[list, list] | str:
    """Compiles and milliseconds of each of ``args.calls`` calls of ``call(k)``; or the error
    the call raises (an older checkout may)."""
    counts, times = [], []
    for k in range(args.calls):
        before, t0 = len(COMPILES), time.perf_counter()
        try:
            out = jax.block_until_ready(call(k))
        except Exception as e:  # noqa: BLE001 - reported in the table
            return f"raises {type(e).__name__}: {str(e).splitlines()[0][:60]}"
        times.append((time.perf_counter() - t0) * 1e3)
        counts.append(len(COMPILES) - before)
        check(k, out)
    return counts, times


def row(name: str, measured: tuple[list, list] | str) -> str:
    if isinstance(measured, str):
        return f"| {name} | {measured} | | | |"
    counts, times = measured
    later = times[1:]
    return (
        f"| {name} | {counts[0]} | {sum(counts[1:]) / len(counts[1:]):.1f} | {times[0]:.0f} ms "
        f"| {statistics.median(later):.1f} ms ({min(later):.1f}) |"
    )


def main() -> None:
    rng = np.random.default_rng(0)
    n = 64 * args.devices
    xs = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    rows = {
        "idx": jnp.asarray(rng.integers(0, 50, (n, 4)), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 1.5, (n, 4)), jnp.float32),
    }
    row_fn = lambda r, x: jnp.sum(r["w"] * x[r["idx"]])
    struct = jax.ShapeDtypeStruct((50,), jnp.float32)
    dense = np.asarray(chunkop.RowOperator(row_fn, rows, struct, chunk_size=5).as_matrix())
    x50, y = jnp.asarray(rng.normal(size=50), jnp.float32), jnp.asarray(rng.normal(size=n), jnp.float32)
    lines = [
        f"Eager calls on {args.devices} forced CPU devices, {n} rows sharded along the mapped axis; "
        f"{args.calls} calls each; load {[round(v, 2) for v in os.getloadavg()]} at start.",
        "",
        "| call | compiles, 1st call | compiles per later call | 1st call | later calls: median (min) |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("Auto", "Explicit"):
        mesh = jax.make_mesh((args.devices,), ("d",), axis_types=(getattr(AxisType, kind),))
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        w_of = lambda k: jnp.asarray([1.0 + k, -1.0, 0.5], jnp.float32)
        with jax.set_mesh(mesh):
            for chunk in (3, "auto"):
                for name in ("vmap", "sum"):
                    reduce = (lambda o: o) if name == "vmap" else (lambda o: o.sum(0))

                    def call(k, name=name, chunk=chunk):
                        # a new function object per call, as a training step makes; the array
                        # an unmapped argument (a closure over an array created under
                        # jax.set_mesh raised on the previous commit, on an Explicit mesh)
                        return getattr(chunkop, name)(lambda w, v: jnp.sin(v) * w, in_axes=(None, 0), chunk_size=chunk)(
                            w_of(k), x
                        )

                    def check(k, out, reduce=reduce):
                        np.testing.assert_allclose(out, reduce(jnp.sin(xs) * w_of(k)), rtol=1e-5, atol=1e-5)

                    lines.append(row(f"{kind}: chunkop.{name}, chunk {chunk}", measure(call, check)))

            def plain(k):
                return jax.vmap(lambda w, v: jnp.sin(v) * w, in_axes=(None, 0))(w_of(k), x)

            lines.append(row(f"{kind}: plain jax.vmap", measure(plain, lambda k, out: None)))
            rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
            ys = jax.device_put(y, NamedSharding(mesh, P("d")))
            A = chunkop.RowOperator(row_fn, rs, struct, chunk_size=5)
            check_mv = lambda k, out: np.testing.assert_allclose(out, dense @ x50, rtol=1e-4, atol=1e-4)
            check_t = lambda k, out: np.testing.assert_allclose(out, dense.T @ y, rtol=1e-4, atol=1e-4)
            lines.append(row(f"{kind}: RowOperator A.mv", measure(lambda k: A.mv(x50), check_mv)))
            lines.append(row(f"{kind}: RowOperator A.T.mv", measure(lambda k: A.T.mv(ys), check_t)))
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eager_sharded.md").write_text(text)


if __name__ == "__main__":
    main()
