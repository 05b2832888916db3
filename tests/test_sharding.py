"""Sharded inputs (chunkop.vmap/map/sum/mean) and sharded rows (RowOperator) over 4 CPU devices.

The checks live in ``tests/_multidevice_checks.py`` and run in one subprocess, because the
CPU device count (``--xla_force_host_platform_device_count=4``) must be set before JAX starts
and this test process runs with one device. Each check compares with an unsharded reference
(``jax.vmap``, the dense matrix), asserts the output's sharding, and inspects the compiled
program's collectives (no all-gather; one all-reduce for sums and ``T.mv``).
"""

from __future__ import annotations

from pathlib import Path

from _device_checks import script_tests

SCRIPT = Path(__file__).with_name("_multidevice_checks.py")
NAMES = [
    "vmap_values_explicit",
    "auto_plan_keyed_by_the_arguments_sharding",
    "vmap_values_auto",
    "vmap_chunks_each_local_shard",
    "sharded_temp_memory_bounded_by_the_chunk",
    "vmap_other_axes_and_pytrees",
    "vmap_grad",
    "vmap_spmd_axis_name_auto_under_jit",
    "vmap_axis_name_collective_on_shards_refused",
    "vmap_same_function_on_two_meshes",
    "eager_sharded_calls_compile_once_per_key",
    "closures_over_enclosing_transforms_on_sharded_inputs",
    "vmap_sum_mapped_axis_on_a_other_axis_on_b",
    "check_linear_of_sharded_rows_inside_set_mesh",
    "map_sharded",
    "sum_mean_values_grad_one_allreduce",
    "sum_spmd_axis_name_auto_under_jit",
    "grad_of_unmapped_parameters_one_allreduce_per_call",
    "operator_row_fn_sees_the_mesh",
    "operator_segment_transpose_sharded_rows",
    "operator_eager_calls_compile_once_per_key",
    "operator_sharded_rows_explicit",
    "operator_sharded_rows_auto",
    "operator_windowed_sharded_rows",
    "device_put_inputs_under_jit_and_grad_without_set_mesh",
    "gram_diagonal_of_sharded_rows",
]


results, test_every_check_is_listed, test_multidevice = script_tests(SCRIPT, NAMES)
