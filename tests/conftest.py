"""Shared helpers for the chunkop test suite.

Every test compares against a reference transform (``jax.vmap``, ``jax.lax.map``,
``jax.jacrev``/``jax.jacfwd``, finite differences); ``assert_tree_allclose`` checks tree
structure, shapes and dtypes exactly and values to a tolerance (exactly for ints, bools and
PRNG keys).
"""

from __future__ import annotations

import os

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
