"""Shared helpers for the chunkop test suite.

Every test compares against a reference transform (``jax.vmap``, ``jax.lax.map``,
``jax.jacrev``/``jax.jacfwd``, finite differences); ``assert_tree_allclose`` checks tree
structure, shapes and dtypes exactly and values to a tolerance (exactly for ints, bools and
PRNG keys).
"""

from __future__ import annotations

import os
from pathlib import Path

from _device_checks import TEST_XLA_FLAGS

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import numpy as np
import pytest
from _tolerance import assert_tree_allclose  # noqa: F401  (the suite imports it from here)


def count_eqns(jaxpr) -> int:
    """Number of equations in a (closed) jaxpr, counting those of every sub-jaxpr."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            items = value if isinstance(value, (tuple, list)) else (value,)
            for item in items:
                if hasattr(item, "eqns") or (hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns")):
                    total += count_eqns(item)
    return total


def primitive_names(jaxpr) -> set[str]:
    """Names of every primitive in a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            items = value if isinstance(value, (tuple, list)) else (value,)
            for item in items:
                if hasattr(item, "eqns") or (hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns")):
                    names |= primitive_names(item)
    return names


def _usable_cpus() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota (a container
    limited to 2 CPUs on a 64-core host sees 64 in ``os.cpu_count()``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def _available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


#: Memory one test worker may use at its peak (its compiled programs and the 4-device subprocesses
#: it starts): ``-n auto`` starts no more workers than the available memory holds.
WORKER_BYTES = 3 << 30


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the README's test command): one worker per usable core, and no more than the
    available memory holds (on a many-core machine, one worker per core would run it out)."""
    workers = _usable_cpus()
    available = _available_bytes()
    if available is not None:
        workers = min(workers, max(1, available // WORKER_BYTES))
    return workers


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def temp_bytes(fn, *args) -> int:
    """The temp memory XLA reports for ``jax.jit(fn)`` compiled on ``args`` (deterministic on CPU)."""
    import jax

    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def make_los_rows(n: int, npix: int, seed: int = 0) -> dict:
    """Line-of-sight row data: ``operator_registry.make_los_rows`` (imported when first called, so
    that importing this module creates no JAX arrays)."""
    from operator_registry import make_los_rows as registry_make_los_rows

    return registry_make_los_rows(n, npix, seed)


class CompileCounter:
    """Counts XLA backend compilations while active (``with CompileCounter() as c: ...; c.count``)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self._active = False

    def _listener(self, event, duration, **kwargs):
        if self._active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        import jax.monitoring

        if not hasattr(CompileCounter, "_registered"):  # one listener for all counters, registered once
            CompileCounter._registered = []
            jax.monitoring.register_event_duration_secs_listener(
                lambda event, duration, **kw: [c._listener(event, duration, **kw) for c in CompileCounter._registered]
            )
        CompileCounter._registered.append(self)
        self._active = True
        return self

    def __exit__(self, *exc):
        self._active = False
        CompileCounter._registered.remove(self)
        return False
