"""A symbolic batch size (``jax.export`` shape polymorphism) meets chunkop (issue #26, finding 4).

``jax.vmap`` maps over an axis of symbolic size ``b``; chunking cannot (the number of chunks is
a static loop length), so a chunked call says so in chunkop's own words, naming the argument,
the symbolic size and the fix, instead of JAX's ``InconclusiveDimensionOperation`` from inside
``chunkop._axes``. Symbolic sizes on other (unmapped) axes are fine. A ``RowOperator`` whose rows
have a symbolic length says so too (it always chunks), naming the unchunked ``jax.vmap`` of ``row_fn``.
"""

from __future__ import annotations

import equinox as eqx
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


# -- RowOperator: rows of symbolic length ---------------------------------------------------------

X_STRUCT = jax.ShapeDtypeStruct((5,), jnp.float32)
SYMBOLIC_ROWS = {"i": jax.ShapeDtypeStruct((B,), jnp.int32), "w": jax.ShapeDtypeStruct((B,), jnp.float32)}


def row_fn(row, x):
    return row["w"] * x[row["i"]]


def _check_row_message(error):
    message = str(error)
    assert message.startswith("RowOperator:")
    assert "`rows`" in message and "rows['i']" in message  # the argument and its first leaf
    assert "symbolic size b" in message and "concrete" in message
    assert "jax.vmap(row_fn, in_axes=(0, None))" in message  # what works, unchunked
    assert not isinstance(error, jax.errors.InconclusiveDimensionOperation)


@pytest.mark.parametrize("use", ["build", "mv", "T.mv"])
@pytest.mark.parametrize("chunk_size", [4, "auto"])
def test_row_operator_with_symbolic_rows_gets_chunkops_error(chunk_size, use):
    """Built inside the exported function, the operator says so when it is built, whatever is
    then asked of it (before, ``mv``/``T.mv`` raised JAX's ``InconclusiveDimensionOperation``
    from the chunk plan, and ``"auto"`` from the planner at build)."""

    def fn(rows, x):
        A = chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=chunk_size)
        if use == "mv":
            return A.mv(x)
        if use == "T.mv":
            return A.T.mv(rows["w"])
        return x

    with pytest.raises(ValueError, match=r"RowOperator: .*symbolic size b") as info:
        export.export(jax.jit(fn))(SYMBOLIC_ROWS, X_STRUCT)
    _check_row_message(info.value)


@pytest.mark.parametrize("transposed", [False, True])
def test_row_operator_argument_with_symbolic_rows_gets_chunkops_error(transposed):
    """An operator built with concrete rows and passed to the exported function with rows of
    symbolic length (its leaves given as ``ShapeDtypeStruct``): ``mv``/``T.mv`` refuse it."""
    A = chunkop.RowOperator(row_fn, {"i": jnp.arange(4) % 5, "w": jnp.ones(4)}, X_STRUCT, chunk_size=2)
    spec = eqx_tree_with_symbolic_rows(A)

    def fn(A, x, y):
        return A.T.mv(y) if transposed else A.mv(x)

    y_struct = jax.ShapeDtypeStruct((B,), jnp.float32)
    with pytest.raises(ValueError, match=r"RowOperator: .*symbolic size b") as info:
        export.export(jax.jit(fn))(spec, X_STRUCT, y_struct)
    _check_row_message(info.value)


def eqx_tree_with_symbolic_rows(A):
    """``A`` with its leaves as ``ShapeDtypeStruct``, the rows' leading axis of size ``b``."""
    A = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), A)
    return eqx.tree_at(lambda op: op.rows, A, SYMBOLIC_ROWS)


def test_what_the_row_operator_message_names_works():
    """The unchunked alternative the message names exports with symbolic rows and gives the
    operator's values (``mv`` and ``T.mv``) at a concrete size."""

    def mv(rows, x):
        return jax.vmap(row_fn, in_axes=(0, None))(rows, x)

    def tmv(rows, y):
        return jax.linear_transpose(lambda x: mv(rows, x), X_STRUCT)(y)[0]

    y_struct = jax.ShapeDtypeStruct((B,), jnp.float32)
    exported_mv = export.export(jax.jit(mv))(SYMBOLIC_ROWS, X_STRUCT)
    exported_tmv = export.export(jax.jit(tmv))(SYMBOLIC_ROWS, y_struct)
    rows = {"i": jnp.array([0, 4, 2, 2, 1, 3, 0], jnp.int32), "w": jnp.linspace(0.5, 2.0, 7)}
    x, y = jnp.arange(5.0), jnp.linspace(-1.0, 1.0, 7)
    A = chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=3)
    assert_tree_allclose(exported_mv.call(rows, x), A.mv(x))
    assert_tree_allclose(exported_tmv.call(rows, y), A.T.mv(y), n_terms=2)


@pytest.mark.parametrize("reads", ["sum", "index"], ids=["x.sum()", "x[row['i']]"])
def test_row_operator_symbolic_in_structure_is_chunked(reads):
    """Only the rows' length must be concrete: an ``x`` of symbolic size is chunked over the
    (concrete) rows, with the values of a concrete ``x``."""
    fn_of_row = row_fn if reads == "index" else (lambda row, x: row["w"] * x.sum())
    rows = {"i": jnp.array([0, 2, 1, 0, 2], jnp.int32), "w": jnp.arange(1.0, 6.0)}

    def fn(x):
        A = chunkop.RowOperator(fn_of_row, rows, jax.ShapeDtypeStruct(x.shape, x.dtype), chunk_size=2)
        return A.mv(x), A.T.mv(jnp.ones(5))

    exported = export.export(jax.jit(fn))(jax.ShapeDtypeStruct((B,), jnp.float32))
    x = jnp.linspace(1.0, 2.0, 4)
    A = chunkop.RowOperator(fn_of_row, rows, jax.ShapeDtypeStruct((4,), jnp.float32), chunk_size=2)
    assert_tree_allclose(exported.call(x), (A.mv(x), A.T.mv(jnp.ones(5))), n_terms=5)


def test_symbolic_unmapped_axis_indexed_is_chunked():
    """The transforms alike: ``fun`` indexing an unmapped axis of symbolic size (``jax.vmap``
    exports it). Before: chunkop's trace folded operations on concrete values, which evaluated
    the index's ``dim_as_value`` eagerly ("Evaluation rule for dim_as_value is not implemented")."""
    idx = jnp.array([0, 1, 0, 1, 0, 1, 0, 1], jnp.int32)
    g = lambda i, x: x[i]
    spec = jax.ShapeDtypeStruct((B,), jnp.float32)
    export.export(jax.jit(lambda x: jax.vmap(g, in_axes=(0, None))(idx, x)))(spec)  # jax.vmap: fine
    exported = export.export(jax.jit(lambda x: chunkop.vmap(g, in_axes=(0, None), chunk_size=3)(idx, x)))(spec)
    x = jnp.array([2.0, 3.0, 5.0])
    assert_tree_allclose(exported.call(x), jax.vmap(g, in_axes=(0, None))(idx, x))
