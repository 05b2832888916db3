"""``progress=`` with inputs (and operator rows) sharded over 4 CPU devices.

The checks live in ``tests/_multidevice_progress.py`` and run in one subprocess, because the CPU
device count (``--xla_force_host_platform_device_count=4``) must be set before JAX starts and
this test process runs with one device. Before, any ``progress=`` with sharded inputs raised
("ordered effects are not supported for more than 1 device").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_multidevice_progress.py")
NAMES = [
    "sum_forward_and_grad_explicit",
    "vmap_progress_true_plain_lines",
    "vmap_spmd_axis_name_auto_under_jit",
    "operator_sharded_rows",
    "partial_manual_mesh_clear_error",
]


@pytest.fixture(scope="module")
def results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SCRIPT), *NAMES], capture_output=True, text=True, timeout=900, env=env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"checks subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_every_check_is_listed():
    text = SCRIPT.read_text()
    defined = [line.split("def ")[1].split("(")[0] for line in text.split("@check\n")[1:]]
    assert sorted(defined) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_multidevice_progress(results: dict, name: str) -> None:
    assert results.get(name) == "ok", results.get(name, "check not run")
