"""``fun`` on sharded inputs sees what it sees under ``jax.vmap`` (issue #24, finding 1); and the
transform object itself (immutable, binds like a function).

The sharded checks live in ``tests/_sharded_layout_checks.py`` and run in one subprocess with 4
CPU devices, against ``jax.vmap`` on the unsharded input. Each failed under the former sharded
path (a manual ``jax.shard_map`` whose body traced ``fun``); the device layout
(:func:`chunkop._loops.device_loop`: the mapped axis as ``(devices, shard)``, each device's loop
under ``jax.vmap`` over the device axis, in the caller's mesh context) runs them all.
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
_RESULTS: dict = {}


def _result(name: str) -> str:
    """The checks' results, run together in one 4-device interpreter."""
    if not _RESULTS:
        _RESULTS.update(run_script(SCRIPT, NAMES))
    return _RESULTS.get(name, "check not run")


def test_every_check_is_listed():
    assert sorted(defined_checks(SCRIPT)) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
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
