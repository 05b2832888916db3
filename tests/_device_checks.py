"""Multi-device checks in a subprocess: one runner for the check scripts, one for the test files.

JAX fixes its CPU device count when its backend starts, and the suite runs with one device, so
the multi-device checks (``tests/_multidevice_checks.py``, ``_multidevice_progress.py``,
``_lineax_mesh_checks.py``, ``_interaction_checks.py``) run in their own interpreter with
``--xla_force_host_platform_device_count=4``. A script registers its checks with ``@check``
and ends with ``run_checks(CHECKS, sys.argv[1:])``, printing one JSON object (check name -> "ok"
or the failure's traceback) as its last line; a test file reads it with :func:`run_script`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path


# The suite compiles cheaply (set by conftest.py, passed on to every subprocess here): LLVM at -O0
# and XLA's legacy CPU fusion emitters instead of the new MLIR ones, about 2.4x less backend
# compile time in all, compile-bound as the suite is (whole suite: 745 s -> 467 s on 2 cores).
# XLA's HLO passes run as at the default level, so optimized-HLO assertions are unchanged; the
# legacy emitters change some fusions, so compiled temp sizes can differ by a few hundred bytes
# (the planner's probes and the tests measure under the same flags). Benchmarks and examples run
# at XLA's defaults, and .ci/run reruns the docs' examples and test_reduce there. One test
# compiles at the default emitters (test_example_nifty: jaxlib 0.10.2's legacy emitters
# miscompile its plain jax.vmap reference).
def _jaxlib_version() -> tuple:
    from importlib.metadata import version

    return tuple(int(p) for p in version("jaxlib").split(".")[:2] if p.isdigit())


#: Whether this jaxlib's XLA still has the legacy CPU emitters' switch: it was removed by jaxlib
#: 0.11/0.12 (Python >= 3.12 installs those), where XLA aborts at start on an unknown flag.
LEGACY_EMITTERS = _jaxlib_version() < (0, 11)
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if LEGACY_EMITTERS else ""
)


def subprocess_env(*strip: str) -> dict:
    """The environment for a test subprocess on CPU: ``XLA_FLAGS`` reduced to the suite's own
    (the child adds its device count), and ``strip``'s variables removed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in strip}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_checks(checks: dict[str, Callable[[], None]], names: Sequence[str]) -> None:
    """Run the named checks (all when none is named); print the JSON result line (and timings
    on stderr)."""
    results = {}
    for name in names or list(checks):
        start = time.perf_counter()
        try:
            checks[name]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = traceback.format_exc()
        print(f"{time.perf_counter() - start:6.2f}s {name}", file=sys.stderr)
    print(json.dumps(results))


def run_script(script: Path, names: Sequence[str] = (), timeout: int = 900) -> dict:
    """Run a check script in a fresh interpreter on CPU (its own device count); its results."""
    proc = subprocess.run(
        [sys.executable, str(script), *names], capture_output=True, text=True, timeout=timeout, env=subprocess_env()
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"checks subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def script_tests(script: Path, names: Sequence[str]) -> tuple[Callable, Callable, Callable]:
    """A test module's share of a check script: ``results`` (a module-scoped fixture running the
    named checks in one subprocess), a test that the script defines exactly ``names``, and one test
    per name. Bind them at module level: ``results, test_every_check_is_listed, test_NAME =
    script_tests(SCRIPT, NAMES)`` (pytest collects the names they are bound to)."""
    import pytest

    @pytest.fixture(scope="module")
    def results() -> dict:
        return run_script(script, names)

    def listed() -> None:
        assert sorted(defined_checks(script)) == sorted(names)

    @pytest.mark.parametrize("name", names)
    def one(results: dict, name: str) -> None:
        assert results.get(name) == "ok", results.get(name, "check not run")

    return results, listed, one


def defined_checks(script: Path) -> list[str]:
    """The names of the ``@check`` functions a script defines (to compare with a test's list)."""
    text = script.read_text()
    return [line.split("def ")[1].split("(")[0] for line in text.split("@check\n")[1:]]
