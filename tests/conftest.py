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

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _as_numpy(x):
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _canonical_dtype(x):
    if isinstance(x, jax.Array):
        return x.dtype
    return jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)


def assert_tree_allclose(actual, expected, *, rtol: float = 1e-5, atol: float = 1e-5, check_dtype: bool = True):
    """``actual`` equals ``expected``: same tree, shapes and dtypes; values to ``rtol``/``atol``."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"tree structure differs:\n  actual:   {a_tree}\n  expected: {e_tree}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        a_shape, e_shape = np.shape(a), np.shape(e)
        assert a_shape == e_shape, f"leaf {i}: shape {a_shape} != expected {e_shape}"
        if check_dtype:
            # Python scalars / NumPy arrays (which jax.vmap passes through unmapped outputs
            # untouched) are compared by the dtype JAX would give them.
            a_dtype, e_dtype = _canonical_dtype(a), _canonical_dtype(e)
            assert a_dtype == e_dtype, f"leaf {i}: dtype {a_dtype} != expected {e_dtype}"
        assert _is_key(a) == _is_key(e), f"leaf {i}: one is a PRNG key array and the other is not"
        an, en = _as_numpy(a), _as_numpy(e)
        if np.issubdtype(en.dtype, np.inexact):
            np.testing.assert_allclose(an, en, rtol=rtol, atol=atol, err_msg=f"leaf {i}")
        else:
            np.testing.assert_array_equal(an, en, err_msg=f"leaf {i}")


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

        if not getattr(CompileCounter, "_registered", None):
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
