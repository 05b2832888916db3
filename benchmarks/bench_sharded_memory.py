"""Per-device compiled memory and collectives of the row-sharded LOS operator at the users' size.

Usage::

    python benchmarks/bench_sharded_memory.py [--devices 4] [--chunk 8192]

Compile-only (nothing of sky size is allocated): the users' full problem (sky 786432 x 516
float32 = 1.6 GB, 132400 lines) with the lines sharded over ``--devices`` forced CPU devices
(``--xla_force_host_platform_device_count``), the sky replicated. For ``mv``, ``T.mv`` and
``A^T A`` it prints XLA's per-device memory analysis (arguments, outputs, temp) and the
collectives in the compiled program, next to the unsharded (one device) figures.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=4)
ap.add_argument("--chunk", type=int, default=8192)
a = ap.parse_args()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "astro_los"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import los  # noqa: E402  (examples/astro_los/los.py)
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N_PIX, N_BINS, N_LOS = 786432, 516, 132400
MiB = 2**20


def analyse(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    m = compiled.memory_analysis()
    coll = re.findall(
        r"= [^ ]+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", compiled.as_text()
    )
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, coll


def main() -> None:
    rng = np.random.default_rng(0)
    idx, d, s = los.draw_lines(N_LOS, N_PIX, rng)
    print(f"sky {N_PIX} x {N_BINS} float32 ({N_PIX * N_BINS * 4 / 2**30:.2f} GiB), {N_LOS} lines, chunk {a.chunk}")
    print("| layout | op | args / device | outputs / device | temp / device | collectives |")
    print("|---|---|---:|---:|---:|---|")
    for layout in ("1 device", f"rows over {a.devices} devices"):
        sharded = layout != "1 device"
        if sharded:
            mesh = jax.make_mesh((a.devices,), ("rows",))
            ctx = jax.set_mesh(mesh)
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx:
            if sharded:  # the lines sharded over the devices when the operator is built
                sh = NamedSharding(mesh, P("rows"))
                idx_, d_, s_ = (jax.device_put(jnp.asarray(v), sh) for v in (idx, d, s))
            else:
                idx_, d_, s_ = idx, d, s
            A = los.make_los_operator(idx_, d_, s_, n_pix=N_PIX, n_bins=N_BINS, chunk_size=a.chunk)
            if sharded:
                x = jax.ShapeDtypeStruct((N_PIX, N_BINS), jnp.float32, sharding=NamedSharding(mesh, P()))
                y = jax.ShapeDtypeStruct((N_LOS,), jnp.float32, sharding=NamedSharding(mesh, P("rows")))
            else:
                x = jax.ShapeDtypeStruct((N_PIX, N_BINS), jnp.float32)
                y = jax.ShapeDtypeStruct((N_LOS,), jnp.float32)
            for name, fn, arg in (
                ("mv", lambda A, x: A.mv(x), x),
                ("T.mv", lambda A, y: A.T.mv(y), y),
                ("A^T A", lambda A, x: A.T.mv(A.mv(x)), x),
            ):
                ab, ob, tb, coll = analyse(fn, A, arg)
                print(
                    f"| {layout} | {name} | {ab / MiB:.1f} MiB | {ob / MiB:.1f} MiB | {tb / MiB:.1f} MiB "
                    f"| {', '.join(coll) or 'none'} |"
                )


if __name__ == "__main__":
    main()
