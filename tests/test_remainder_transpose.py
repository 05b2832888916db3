"""Chunk plans with a remainder chunk under ``jax.linear_transpose`` (issue #24, finding 2).

On CPU every chunk a loop reads passes through ``_chunking.fusion_barrier``, a ``lax.cond`` on
a predicate that is always true. That predicate comes from the chunk's index, never from its
data: in a linear function the mapped data is linear, and ``jax.linear_transpose`` cannot
transpose a predicate computed from it (a bare ``AssertionError`` when the remainder's predicate
came from its data). The checks here:

- ``jax.linear_transpose`` of ``chunkop.vmap`` and ``chunkop.sum`` against that of ``jax.vmap``
  and the dense matrix, for plans with a remainder (also one full chunk and a remainder), with
  equal chunks and with one chunk; ``lineax.FunctionLinearOperator(...).T.mv``; a
  ``RowOperator`` with a remainder under ``jax.linear_transpose`` of ``mv`` and of ``T.mv``;
- XLA:CPU keeps the remainder's conditional (its index is a constant XLA must not fold), also
  under ``jax.vmap`` and in the transposed program;
- the index predicate is true for every index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from conftest import assert_tree_allclose, primitive_names

import chunkop
from chunkop import _chunking

N, D, OUT = 10, 3, 2
W = jnp.asarray(np.random.default_rng(0).normal(size=(OUT, D)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(N, D)), jnp.float32)
X_STRUCT = jax.ShapeDtypeStruct((N, D), jnp.float32)

# (chunk, n_full, rem) for N = 10: full chunks and a remainder; one full chunk and a remainder;
# equal chunks; one chunk
PLANS = [(4, 2, 2), (7, 1, 3), (5, 2, 0), (N, 1, 0)]


def row(x: jax.Array) -> jax.Array:
    """A linear map of one example: ``(D,) -> (OUT,)``."""
    return jnp.sin(1.0) * (W @ x) + 2.0 * x[:OUT]


def dense() -> jax.Array:
    """The matrix of ``jax.vmap(row)`` on the flattened ``(N, D)`` input."""
    return jax.jacfwd(lambda x: jax.vmap(row)(x).reshape(-1))(X).reshape(N * OUT, N * D)


@pytest.mark.parametrize("chunk, n_full, rem", PLANS)
def test_plans(chunk, n_full, rem):
    assert _chunking.make_plan(N, chunk)[2:] == (n_full, rem)


@pytest.mark.parametrize("chunk", [p[0] for p in PLANS])
@pytest.mark.parametrize("jit", [False, True])
def test_linear_transpose_of_vmap(chunk, jit):
    f = chunkop.vmap(row, chunk_size=chunk)
    y = jnp.asarray(np.random.default_rng(2).normal(size=(N, OUT)), jnp.float32)
    transpose = jax.linear_transpose(f, X_STRUCT)
    got = (jax.jit(transpose) if jit else transpose)(y)
    want = jax.linear_transpose(jax.vmap(row), X_STRUCT)(y)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(got[0].reshape(-1), dense().T @ y.reshape(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [p[0] for p in PLANS])
@pytest.mark.parametrize("jit", [False, True])
def test_linear_transpose_of_sum(chunk, jit):
    f = chunkop.sum(row, chunk_size=chunk)
    y = jnp.asarray([0.5, -1.5], jnp.float32)
    transpose = jax.linear_transpose(f, X_STRUCT)
    got = (jax.jit(transpose) if jit else transpose)(y)
    M = dense().reshape(N, OUT, N * D).sum(axis=0)  # the sum over examples
    assert_tree_allclose(got[0].reshape(-1), M.T @ y, rtol=1e-5, atol=1e-5)


def test_linear_transpose_with_several_mapped_inputs_and_unmapped_constants():
    """Two mapped inputs (a pytree) and an unmapped linear input, chunks of 4 with a remainder."""

    def f(a, b, c):
        return {"u": a * c, "v": jnp.dot(b, c[: b.shape[-1]])}

    structs = (
        jax.ShapeDtypeStruct((N, 4), jnp.float32),
        jax.ShapeDtypeStruct((N, 3), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.float32),
    )
    ours = chunkop.vmap(lambda a, b: f(a, b, 2.0 * jnp.arange(4.0)), chunk_size=4)
    ref = jax.vmap(lambda a, b: f(a, b, 2.0 * jnp.arange(4.0)))
    ct = {"u": jnp.ones((N, 4)), "v": jnp.arange(float(N))}
    assert_tree_allclose(
        jax.linear_transpose(ours, *structs[:2])(ct), jax.linear_transpose(ref, *structs[:2])(ct), rtol=1e-6
    )
    # the unmapped input is linear too: its cotangent sums over chunks, the remainder included
    c_linear = lambda c: chunkop.vmap(lambda a, b: f(a, b, c), chunk_size=4)(jnp.ones((N, 4)), jnp.ones((N, 3)))
    c_ref = lambda c: jax.vmap(lambda a, b: f(a, b, c))(jnp.ones((N, 4)), jnp.ones((N, 3)))
    assert_tree_allclose(
        jax.linear_transpose(c_linear, structs[2])(ct), jax.linear_transpose(c_ref, structs[2])(ct), rtol=1e-6
    )


def test_linear_transpose_under_vmap():
    """``jax.vmap`` over cotangents: the barrier's predicate comes from the index and stays unbatched."""
    f = chunkop.vmap(row, chunk_size=4)
    ys = jnp.asarray(np.random.default_rng(3).normal(size=(3, N, OUT)), jnp.float32)
    got = jax.vmap(jax.linear_transpose(f, X_STRUCT))(ys)
    want = jax.vmap(jax.linear_transpose(jax.vmap(row), X_STRUCT))(ys)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-5)
    if jax.default_backend() == "cpu":
        text = jax.jit(jax.vmap(jax.linear_transpose(f, X_STRUCT))).lower(ys).compile().as_text()
        assert text.count("conditional(") >= 2, "XLA removed a barrier under vmap"


@pytest.mark.parametrize("chunk", [4, 7])
def test_lineax_function_operator_transpose(chunk):
    op = lx.FunctionLinearOperator(chunkop.vmap(row, chunk_size=chunk), X_STRUCT)
    y = jnp.asarray(np.random.default_rng(4).normal(size=(N, OUT)), jnp.float32)
    assert_tree_allclose(op.T.mv(y).reshape(-1), dense().T @ y.reshape(-1), rtol=1e-5, atol=1e-5)
    assert_tree_allclose(op.mv(X).reshape(-1), dense() @ X.reshape(-1), rtol=1e-5, atol=1e-5)
    total = lx.FunctionLinearOperator(chunkop.sum(row, chunk_size=chunk), X_STRUCT)
    assert_tree_allclose(
        total.T.mv(jnp.asarray([1.0, -2.0])).reshape(-1),
        dense().reshape(N, OUT, N * D).sum(axis=0).T @ jnp.asarray([1.0, -2.0]),
        rtol=1e-5,
        atol=1e-5,
    )


# -- a RowOperator with a remainder -----------------------------------------------------------

NPIX, K, ROWS_N, ROW_CHUNK = 5, 3, 11, 4  # two chunks of 4 and a remainder of 3


def _rows() -> dict:
    rng = np.random.default_rng(5)
    return {
        "pix": jnp.asarray(rng.integers(0, NPIX, ROWS_N), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 2.0, (ROWS_N, K)), jnp.float32),
    }


def op_row(r: dict, x: jax.Array) -> jax.Array:
    return jnp.dot(jnp.exp(-r["w"]), x[r["pix"]])


def test_row_operator_with_remainder_under_linear_transpose():
    assert _chunking.make_plan(ROWS_N, ROW_CHUNK)[2:] == (2, 3)
    rows, xs = _rows(), jax.ShapeDtypeStruct((NPIX, K), jnp.float32)
    A = chunkop.RowOperator(op_row, rows, xs, chunk_size=ROW_CHUNK)
    M = jax.jacfwd(lambda x: jax.vmap(op_row, (0, None))(rows, x))(jnp.zeros((NPIX, K))).reshape(ROWS_N, -1)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(NPIX, K)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(7).normal(size=ROWS_N), jnp.float32)
    ys = jax.ShapeDtypeStruct((ROWS_N,), jnp.float32)
    for transform in (lambda f: f, jax.jit):
        (got_T,) = transform(jax.linear_transpose(A.mv, xs))(y)
        assert_tree_allclose(got_T.reshape(-1), M.T @ y, rtol=1e-5, atol=1e-5)
        (got,) = transform(jax.linear_transpose(A.T.mv, ys))(x)  # the barrier gates the (linear) y
        assert_tree_allclose(got, M @ x.reshape(-1), rtol=1e-5, atol=1e-5)


# -- the barrier of the remainder, in XLA:CPU's optimized HLO ----------------------------------


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the barrier is XLA:CPU-specific")
@pytest.mark.parametrize("chunk", [4, 7])  # a scan of two chunks or of one (XLA inlines it)
def test_remainder_barrier_kept_in_optimized_hlo(chunk):
    """One conditional per chunk program: the scan's body and the remainder, forward and transposed."""
    f = chunkop.vmap(lambda x: jnp.exp(x) * 2.0, chunk_size=chunk)
    forward = jax.jit(f).lower(X_STRUCT).compile().as_text()
    assert forward.count("conditional(") == 2, forward
    g = chunkop.vmap(row, chunk_size=chunk)
    transposed = jax.jit(jax.linear_transpose(g, X_STRUCT)).lower(jnp.zeros((N, OUT))).compile().as_text()
    assert transposed.count("conditional(") == 2, transposed
    assert "cond" in primitive_names(jax.make_jaxpr(jax.linear_transpose(g, X_STRUCT))(jnp.zeros((N, OUT))))


# -- the predicate ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, -1, 2**31 - 1, -(2**31), np.int32(7)])
def test_index_predicate_is_always_true(index):
    assert bool(_chunking._index_predicate(index))
    assert bool(jax.jit(_chunking._index_predicate)(jnp.int32(index)))


def test_barrier_passes_every_leaf_through():
    """Numeric leaves pass through the conditional, PRNG keys and empty leaves around it."""
    keys = jax.random.split(jax.random.key(0), 4)
    chunk = {"k": keys, "e": jnp.zeros((4, 0)), "v": jnp.full(4, jnp.nan), "b": jnp.zeros(4, bool)}
    for key in (None, 3, jnp.int32(-(2**31))):
        assert_tree_allclose(jax.jit(lambda c, key=key: _chunking.fusion_barrier(c, key))(chunk), chunk)
    assert_tree_allclose(_chunking.fusion_barrier({"k": keys}), {"k": keys})
