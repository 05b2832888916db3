"""``fun`` on sharded inputs sees what it sees under ``jax.vmap`` (issue #24, finding 1); and the
transform object itself (immutable, binds like a function).

The sharded checks live in ``tests/_sharded_layout_checks.py`` and run in one subprocess with 4
CPU devices. Those the current sharded path (a manual ``jax.shard_map`` whose body traces
``fun``) still fails are ``xfail(strict=True)`` with the error it gives: a device layout
(``(devices, n / devices)`` under ``jax.vmap(spmd_axis_name=...)``) fixed each of them, but was
not adopted (see ``KNOWN``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from _device_checks import defined_checks, run_script
from conftest import assert_tree_allclose

import chunkop

SCRIPT = Path(__file__).with_name("_sharded_layout_checks.py")
NAMES = [
    "closure_over_mesh_array_indexed",
    "closure_over_prng_key_folded_with_data",
    "sharding_constraint_inside_fun",
    "concrete_unmapped_values_in_python",
    "jacobians_on_explicit_mesh",
]
#: What the manual shard_map path still raises. The device layout ran them all, but on an Explicit
#: mesh it needs fun's examples traced with their mesh type (``_trace._example_struct``) and the
#: sum loop's accumulators created on the mesh (JAX 0.10.2: ``jax.vmap`` along an Explicit mesh
#: axis under ``jit`` fails on sub-jaxpr values created without a mesh), it fails where
#: ``jax.vmap`` fails (a replicated table gathered by sharded indices), and its compiled temp
#: memory was not bounded by the chunk (a shard-sized copy forward; under ``grad`` the unchunked
#: program's temp).
KNOWN = {
    "closure_over_mesh_array_indexed": "Context mesh ... (Manual) should match the mesh of sharding",
    "closure_over_prng_key_folded_with_data": "Explicit mesh: closing over inputs to shard_map is not "
    "implemented; traced outside the mesh: a key dtype error",
    "sharding_constraint_inside_fun": "P(UNCONSTRAINED, ...) cannot contain P.UNCONSTRAINED ... (Manual,)",
    "concrete_unmapped_values_in_python": "ConcretizationTypeError inside the shard_map body",
}


_RESULTS: dict = {}


def _result(name: str) -> str:
    """The check's result, run alone in its own 4-device interpreter (so that the known failures,
    marked slow, cost nothing in the default run)."""
    if name not in _RESULTS:
        _RESULTS.update(run_script(SCRIPT, [name]))
    return _RESULTS.get(name, "check not run")


def test_every_check_is_listed():
    assert sorted(defined_checks(SCRIPT)) == sorted(NAMES)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[n]), pytest.mark.slow]) if n in KNOWN else n
        for n in NAMES
    ],
)
def test_sharded_like_jax_vmap(name: str) -> None:
    assert _result(name) == "ok", _result(name)


# -- the transform object ----------------------------------------------------------------------

X = jnp.linspace(-1.0, 1.0, 21).reshape(7, 3)


class Model:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    @functools.partial(chunkop.vmap, in_axes=(None, 0), chunk_size=3)
    def apply(self, x):
        return jnp.tanh(x * self.scale)

    @functools.partial(chunkop.sum, in_axes=(None, 0), chunk_size="auto")
    def total(self, x):
        return jnp.sin(x * self.scale)

    @functools.partial(jax.vmap, in_axes=(None, 0))
    def reference(self, x):
        return jnp.tanh(x * self.scale)


def test_partial_transform_on_a_method_binds_the_instance_as_jax_vmap_does():
    m = Model(2.0)
    assert_tree_allclose(m.apply(X), m.reference(X), n_terms=3)
    assert_tree_allclose(jax.jit(m.apply)(X), m.reference(X), n_terms=3)
    assert_tree_allclose(m.total(X), jnp.sin(X * 2.0).sum(0), n_terms=7)
    assert m.total.last_plan is not None  # the transform's plan, read through the bound method
    assert chunkop.plan(m.total, X) == m.total.last_plan  # chunkop.plan passes the instance too
    assert m.apply.__name__ == "apply" and Model.apply.__wrapped__.__name__ == "apply"


def test_transform_is_immutable():
    f = chunkop.vmap(jnp.sin, chunk_size=3)
    for name, value in (("chunk_size", 5), ("fun", jnp.cos), ("last_plan", None)):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(f, name, value)
    with pytest.raises(AttributeError, match="immutable"):
        del f.fun
    assert f.chunk_size == 3 and f.last_plan is None
