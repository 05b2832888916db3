"""A RowOperator with rows sharded over 4 host CPU devices: mv / T.mv / grad times and temp memory.

    python benchmarks/bench_sharded_layout.py explicit   # or: auto (the mesh's axis type)

Prints one json line: ``{op: [median ms of 5 calls, compiled temp MiB]}``. 131072 lines, a
20000 x 64 sky, the users' literal weights, chunk 4096. Run it with two versions of ``src`` on
``PYTHONPATH``, alternating, to compare them (RESULTS.md, "Sharded rows: the device layout").
"""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import chunkop

N, NPIX, NB = 131072, 20000, 64


def main(kind: str) -> dict:
    rng = np.random.default_rng(0)
    rows = {
        "pix": jnp.asarray(rng.integers(0, NPIX, N), jnp.int32),
        "d": jnp.asarray(rng.uniform(50, 1000, N), jnp.float32),
    }
    edges = jnp.asarray(np.geomspace(40, 1700, NB + 1), jnp.float32)

    def row_fn(r, sky):
        w = -jnp.diff(jnp.exp(-(r["d"] - edges) / (r["d"] * edges)))
        return w @ sky[r["pix"]]

    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    out = {}
    with jax.set_mesh(jax.make_mesh((4,), ("d",), axis_types=types)):
        sky_struct = jax.ShapeDtypeStruct((NPIX, NB), jnp.float32)
        A = chunkop.RowOperator(row_fn, jax.device_put(rows, P("d")), sky_struct, chunk_size=4096)
        sky = jnp.ones((NPIX, NB))
        y = jax.device_put(jnp.ones(N), P("d"))
        fns = {
            "mv": (jax.jit(lambda A, s: A.mv(s)), (A, sky)),
            "T.mv": (jax.jit(lambda A, y: A.T.mv(y)), (A, y)),
            "grad": (jax.jit(jax.grad(lambda s, A: 0.5 * jnp.sum(A.mv(s) ** 2))), (sky, A)),
        }
        for name, (f, args) in fns.items():
            compiled = f.lower(*args).compile()
            jax.block_until_ready(f(*args))
            times = []
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - t)
            out[name] = (float(np.median(times)) * 1e3, compiled.memory_analysis().temp_size_in_bytes / 2**20)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "explicit")))
