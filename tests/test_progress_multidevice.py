"""``progress=`` with inputs (and operator rows) sharded over 4 CPU devices.

The checks live in ``tests/_multidevice_progress.py`` and run in one subprocess, because the CPU
device count (``--xla_force_host_platform_device_count=4``) must be set before JAX starts and
this test process runs with one device. Before, any ``progress=`` with sharded inputs raised
("ordered effects are not supported for more than 1 device").
"""

from __future__ import annotations

from pathlib import Path

from _device_checks import script_tests

SCRIPT = Path(__file__).with_name("_multidevice_progress.py")
NAMES = [
    "sum_forward_and_grad_explicit",
    "vmap_progress_true_plain_lines",
    "vmap_spmd_axis_name_auto_under_jit",
    "operator_sharded_rows",
    "partial_manual_mesh_clear_error",
]


results, test_every_check_is_listed, test_multidevice_progress = script_tests(SCRIPT, NAMES)
