"""``spmd_axis_name`` without ``jax.set_mesh``: the mesh from the mapped inputs, as ``jax.vmap``.

The checks live in ``tests/_mesh_from_inputs_checks.py`` and run in one subprocess with 4 CPU
devices (``--xla_force_host_platform_device_count=4`` must be set before JAX starts; this test
process runs with one). Each compares ``chunkop.vmap`` / ``sum`` / ``mean`` with ``jax.vmap`` on
the same inputs: values, gradients, output shardings and the compiled collectives. Before, with
no context mesh, ``spmd_axis_name`` named nothing and an input placed ``P('d')`` on an Auto mesh
was all-gathered under ``jax.jit``; inside a context, an uneven axis raised and a replicated input
on an Explicit mesh came back split.
"""

from __future__ import annotations

from pathlib import Path

from _device_checks import script_tests

SCRIPT = Path(__file__).with_name("_mesh_from_inputs_checks.py")
NAMES = [
    "auto_mesh_jit_without_set_mesh",
    "auto_mesh_replicated_input_stays_replicated",
    "uneven_split_as_jax_vmap",
    "explicit_mesh_replicated_input",
    "two_d_auto_mesh_without_set_mesh",
    "the_mesh_only_where_the_mapped_inputs_agree",
]


results, test_every_check_is_listed, test_mesh_from_inputs = script_tests(SCRIPT, NAMES)
