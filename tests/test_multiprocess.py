"""Row-sharded ``RowOperator`` across 2 processes x 2 CPU devices (``jax.distributed``, gloo).

Two local processes (``tests/_multiprocess_worker.py``) join one JAX runtime over 127.0.0.1 on a
free port; each builds its half of the rows with ``jax.make_array_from_process_local_data``.
``A x`` (gathered) and ``A^T A x`` must equal the single-process results computed here.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _device_checks import subprocess_env

import chunkop

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 150  # generous for a loaded 2-core CI machine; a normal run takes ~15-30 s


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_module():
    spec = importlib.util.spec_from_file_location("_mp_worker_defs", WORKER)
    mod = importlib.util.module_from_spec(spec)
    # only the problem definition is used; importing the worker has no side effects
    spec.loader.exec_module(mod)
    return mod


def test_two_processes_two_devices_each(tmp_path):
    env = subprocess_env("JAX_NUM_CPU_DEVICES")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"multi-process run did not finish in {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"

    mod = _worker_module()
    rows, x = mod.problem()
    A = chunkop.RowOperator(
        mod.row_fn,
        jax.tree_util.tree_map(jnp.asarray, rows),
        jax.ShapeDtypeStruct((mod.NPIX,), jnp.float32),
        chunk_size=5,
    )
    y_ref = np.asarray(A.mv(jnp.asarray(x)))
    ata_ref = np.asarray(A.T.mv(A.mv(jnp.asarray(x))))
    for i in range(2):
        got = np.load(tmp_path / f"result_{i}.npz")
        np.testing.assert_allclose(got["y"], y_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["ata"], ata_ref, rtol=1e-5, atol=1e-4)
