"""One process of the multi-process test (tests/test_multiprocess.py); not collected by pytest.

Usage: ``python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``. Each process
owns 2 CPU devices; the mesh spans all processes' devices. The rows are built with
``jax.make_array_from_process_local_data`` from each process's own block of rows (no process
ever holds the others' rows); the results are written to ``OUT_DIR/result_{PROCESS_ID}.npz``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # (imported by the test only for `problem`: no side effects then)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

N_ROWS, NPIX, K = 96, 40, 3


def problem():
    """The global problem, identical in every process and in the test (seeded)."""
    rng = np.random.default_rng(7)
    rows = {
        "idx": rng.integers(0, NPIX, (N_ROWS, K)).astype(np.int32),
        "w": rng.uniform(0.5, 1.5, (N_ROWS, K)).astype(np.float32),
    }
    x = rng.normal(size=NPIX).astype(np.float32)
    return rows, x


def row_fn(r, x):
    return jnp.sum(r["w"] * jnp.sqrt(r["w"]) * x[r["idx"]])


def main(pid: int, nproc: int, port: int, out_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60
    )
    import chunkop

    assert jax.process_count() == nproc and len(jax.devices()) == 2 * nproc, jax.devices()
    mesh = jax.make_mesh((2 * nproc,), ("d",))
    rows, x = problem()
    per = N_ROWS // nproc
    local = {k: v[pid * per : (pid + 1) * per] for k, v in rows.items()}  # this process's rows only
    with jax.set_mesh(mesh):
        grows = {
            k: jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), v, (N_ROWS,) + v.shape[1:])
            for k, v in local.items()
        }
        gx = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x, x.shape)
        A = chunkop.RowOperator(row_fn, grows, jax.ShapeDtypeStruct((NPIX,), jnp.float32), chunk_size=5)
        y = jax.jit(lambda A, x: A.mv(x))(A, gx)
        assert tuple(y.sharding.spec)[:1] == ("d",), y.sharding
        ata = jax.jit(lambda A, x: A.T.mv(A.mv(x)))(A, gx)
        y_all = multihost_utils.process_allgather(y, tiled=True)
        ata_local = np.asarray(ata.addressable_shards[0].data)
    np.savez(os.path.join(out_dir, f"result_{pid}.npz"), y=np.asarray(y_all), ata=ata_local)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
