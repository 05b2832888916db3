"""lineax operator algebra and solves with ``RowOperator`` rows sharded over 1- and 4-device
meshes, Explicit and Auto, and ``chunkop.plan``'s per-shard sizes.

The checks live in ``tests/_lineax_mesh_checks.py`` and run in one subprocess, because the CPU
device count (``--xla_force_host_platform_device_count=4``) must be set before JAX starts and
this test process runs with one device. Each check compares with NumPy references built from
the rows (the dense matrix by ``np.add.at``; ``np.linalg.lstsq`` / ``solve`` in float64):

- the operator's structures are written as lineax normalises them, and are the types of the
  vectors it returns, so ``A.T @ A + lam * lx.IdentityLinearOperator(A.in_structure())``,
  ``A @ A.T``, ``2 * A - A`` and ``A.normal(lam)`` compose (eagerly and under ``jit``);
- an operator with unsharded rows used under ``jax.set_mesh`` of an Explicit mesh: its
  structures are typed replicated on that mesh, like the vectors made there (a solve, algebra);
- solves under ``jit``: CG on ``A.normal()`` for a wide operator (the minimum-norm solution)
  on every 4-device mesh, ``lx.Normal(lx.CG)`` and ``lx.LSMR`` with ``out_sharding="replicated"``
  on the Explicit mesh (and with row-sharded vectors on Auto), ``lx.Normal`` and damped normal
  equations for a tall one (on a 1-device Explicit mesh too, marked ``slow``: the same kernels
  with one shard, whose operator algebra runs by default);
- ``out_sharding="replicated"``: one all-gather in ``mv``, one all-reduce in ``T.mv``, and
  gradients w.r.t. the row weights equal to the unsharded operator's;
- ``chunkop.plan`` reports the per-shard plan a sharded call makes (``size``, ``shards``,
  ``global_size``), for ``chunkop.vmap`` and ``RowOperator``;
- docs/scaling.md's sharded ``RowOperator`` example (1000 unknowns, fewer rows) on 4 devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _device_checks import defined_checks, run_script

SCRIPT = Path(__file__).with_name("_lineax_mesh_checks.py")
NAMES = [
    "structures_as_lineax_normalises",
    "unsharded_operator_under_an_explicit_mesh",
    "operator_algebra",
    "solves_wide_and_tall",
    "replicated_out_collectives_and_grad",
    "plan_reports_shard_and_global_sizes",
    "docs_scaling_blocks_on_4_devices",
]


SLOW = ["solves_on_one_device"]  # pytest -m slow: the 4-device solves' code path with one shard


@pytest.fixture(scope="module")
def results() -> dict:
    return run_script(SCRIPT, NAMES)


@pytest.fixture(scope="module")
def slow_results() -> dict:
    return run_script(SCRIPT, SLOW)


def test_every_check_is_listed():
    assert sorted(defined_checks(SCRIPT)) == sorted(NAMES + SLOW)


@pytest.mark.parametrize("name", NAMES)
def test_lineax_mesh(results: dict, name: str) -> None:
    assert results.get(name) == "ok", results.get(name, "check not run")


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_lineax_mesh_slow(slow_results: dict, name: str) -> None:
    assert slow_results.get(name) == "ok", slow_results.get(name, "check not run")
