"""A symbolic batch size (``jax.export`` shape polymorphism) meets chunkop (issue #26, finding 4).

``jax.vmap`` maps over an axis of symbolic size ``b``; chunking cannot (the number of chunks is
a static loop length), so a chunked call says so in chunkop's own words, naming the argument,
the symbolic size and the fix, instead of JAX's ``InconclusiveDimensionOperation`` from inside
``chunkop._axes``. Symbolic sizes on other (unmapped) axes are fine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_tree_allclose
from jax import export

import chunkop
from chunkop import _axes

(B,) = export.symbolic_shape("b")
SYMBOLIC_BATCH = jax.ShapeDtypeStruct((B, 3), jnp.float32)


def f(x):
    return jnp.sin(x).sum()


@pytest.mark.parametrize("chunk_size", [4, "auto"])
@pytest.mark.parametrize("name", ["vmap", "sum", "mean", "map"])
def test_symbolic_mapped_axis_gets_chunkops_error(name, chunk_size):
    where = f"chunkop.{name}"
    if name == "map":  # chunkop.map(f, xs), as jax.lax.map
        call = lambda xs: chunkop.map(f, xs, chunk_size=chunk_size)
    else:
        call = getattr(chunkop, name)(f, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"is mapped along axis 0") as info:
        export.export(jax.jit(call))(SYMBOLIC_BATCH)
    message = str(info.value)
    assert message.startswith(where + ":")
    assert "symbolic size b" in message and "concrete size" in message
    assert not isinstance(info.value, jax.errors.InconclusiveDimensionOperation)


def test_named_argument_in_the_message():
    def g(x, w):
        return (x * w["scale"]).sum()

    spec = {"scale": jax.ShapeDtypeStruct((B, 3), jnp.float32)}
    call = chunkop.vmap(g, in_axes=(None, 0), chunk_size=2)
    with pytest.raises(ValueError, match=r"args\[1\]\['scale'\] is mapped along axis 0, which has the symbolic size b"):
        export.export(jax.jit(call))(jax.ShapeDtypeStruct((3,), jnp.float32), spec)


def test_symbolic_unmapped_axis_is_chunked():
    """Only the mapped axis must be concrete: ``(8, b)`` chunked along its first axis works."""
    spec = jax.ShapeDtypeStruct((8, B), jnp.float32)
    exported = export.export(jax.jit(chunkop.vmap(f, chunk_size=3)))(spec)
    assert exported.out_avals[0].shape == (8,)
    x = jnp.linspace(-1.0, 1.0, 8 * 5).reshape(8, 5)
    assert_tree_allclose(exported.call(x), jax.vmap(f)(x), n_terms=5)  # sums of 5 sines


def test_unchunked_call_takes_the_symbolic_size():
    """``chunked=False`` (what ``chunk_size=None``, exactly ``jax.vmap``, means): the symbolic
    size comes back as ``jax.vmap`` takes it, and mismatches are still named."""
    seen = {}

    def probe(x):
        leaves = [x]
        seen["n"] = _axes.mapped_size(leaves, [0], ["args[0]"], None, chunked=False)
        with pytest.raises(ValueError, match="symbolic size b"):
            _axes.mapped_size(leaves, [0], ["args[0]"], None, chunked=True)
        with pytest.raises(ValueError, match="different sizes"):
            _axes.mapped_size([x, jnp.ones((3, 3))], [0, 0], ["args[0]", "args[1]"], None, chunked=False)
        return jax.vmap(f)(x)

    export.export(jax.jit(probe))(SYMBOLIC_BATCH)
    assert str(seen["n"]) == "b"
    with pytest.raises(ValueError, match="or use chunk_size=None"):  # the fix a chunked call is told
        export.export(jax.jit(lambda x: _axes.mapped_size([x], [0], ["args[0]"], None, chunked=True)))(SYMBOLIC_BATCH)


@pytest.mark.parametrize("name", ["vmap", "sum", "mean"])
def test_unchunked_call_exports_with_a_symbolic_batch_as_jax_vmap(name):
    """``chunk_size=None`` is exactly ``jax.vmap``: it exports with a symbolic batch, and the
    exported program gives ``jax.vmap``'s result at a concrete size."""
    call = getattr(chunkop, name)(f, chunk_size=None)
    exported = export.export(jax.jit(call))(SYMBOLIC_BATCH)
    x = jnp.arange(15.0, dtype=jnp.float32).reshape(5, 3)
    per_example = jax.vmap(f)(x)
    expected = {"vmap": per_example, "sum": per_example.sum(), "mean": per_example.mean()}[name]
    assert_tree_allclose(exported.call(x), expected, n_terms=len(x))
