"""``RowOperator`` values against real references, for every operator of the registry.

``operator_registry.make_operators`` lists the problems (the canonical line-of-sight integral,
a well-conditioned least-squares problem, pytree inputs and outputs of mixed per-row shapes,
vector outputs, complex inputs and outputs, closures over arrays and scalars, int-only rows,
rows as a tuple or a single array); between them their chunk sizes leave a remainder, divide
``n_rows`` or cover it in one chunk. Each is checked against ``jax.vmap`` of its ``row_fn``,
its ``jax.linear_transpose`` and its dense matrix; the line-of-sight problem also at the other
chunk plans, and in the checks specific to it below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from conftest import assert_tree_allclose
from jax.flatten_util import ravel_pytree
from operator_registry import (
    NPIX,
    OPERATOR_IDS,
    ROWS,
    STRUCT,
    K,
    N,
    longest_sum,
    los_row,
    los_weights,
    make_los,
    make_operators,
    make_pytree,
)

import chunkop

# every operator at its own chunk size, and the line-of-sight one at the other chunk plans (at
# 10 rows: 3 leaves a remainder of 1, 5 divides, 16 is clipped to a single chunk; 10 would be
# the same plan as 16)
VALUE_CASES = [
    *(pytest.param(make, None, id=name) for make, name in zip(make_operators, OPERATOR_IDS)),
    *(pytest.param(make_los, chunk, id=f"los-chunk{chunk}") for chunk in (3, 5, 16)),
    pytest.param(make_pytree, 16, id="pytree-chunk16"),  # mixed per-row output shapes in one chunk
]


def flat(tree):
    return ravel_pytree(tree)[0]


def unflatten_like(tree, vector):
    """``vector`` cut and reshaped into the leaves of ``tree`` (keeping its own dtype)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    cuts = np.cumsum([np.size(a) for a in leaves])[:-1]
    parts = jnp.split(vector, cuts)
    return jax.tree_util.tree_unflatten(treedef, [p.reshape(np.shape(a)) for p, a in zip(parts, leaves)])


@pytest.mark.parametrize("make_operator, chunk", VALUE_CASES)
def test_values_structures_and_matrix(make_operator, chunk):
    """``mv``, ``T.mv``, ``as_matrix`` (of ``A`` and ``A.T``), ``row_fn``, the lineax views
    (``lineax.materialise`` of ``A`` and ``A.T``, ``lineax.conj``), ``chunkop.gram_diagonal``
    (its generic path) and the structures and sizes, against ``jax.vmap``,
    ``jax.linear_transpose`` and the dense matrix. (One jitted program per operator: the
    materialisations share the matrix's computation.)"""
    case = make_operator()
    chunk = case.chunk if chunk is None else chunk
    A, x, y = case.op(chunk=chunk), case.x(), case.y()

    @jax.jit
    def run(A, x, y):
        m, mt = lx.materialise(A), lx.materialise(A.T)
        got = {
            "mv": A.mv(x),
            "T": A.T.mv(y),
            "matrix": A.as_matrix(),
            "T_matrix": A.T.as_matrix(),
            "row_fn": jax.vmap(A.row_fn, (0, None))(A.rows, x),
            "T_row_fn": jax.vmap(A.T.row_fn, (0, None))(A.T.rows, x),
            "conj": flat(lx.conj(A).mv(x)),
            "materialise": (m.as_matrix(), m.mv(x)),
            "T_materialise": (mt.as_matrix(), mt.mv(y)),
            "gram": chunkop.gram_diagonal(A),
        }
        M = case.dense()
        ref = case.ref_mv(x)
        expected = {
            "mv": ref,
            "T": case.ref_T(y),
            "matrix": M,
            "T_matrix": M.T,
            "row_fn": ref,
            "T_row_fn": ref,
            "conj": jnp.conj(M) @ flat(x),
            "materialise": (M, ref),
            # (for a real input and complex outputs, lineax's materialised transpose keeps the
            # complex values, where A.T.mv keeps their real part)
            "T_materialise": (M.T, unflatten_like(x, M.T @ flat(y))),
            # the squared column norms, in the input's structure (real for a complex input)
            "gram": ravel_pytree(jax.tree_util.tree_map(jnp.real, x))[1](jnp.sum(jnp.abs(M) ** 2, axis=0)),
        }
        # and the matrix is the one the matvecs apply (on a real input space, the transpose of a
        # complex output is the real part, as jax.linear_transpose's)
        MTy = M.T @ flat(y)
        MTy = MTy if jnp.iscomplexobj(flat(x)) else jnp.real(MTy)
        return got, expected, (flat(got["mv"]), M @ flat(x)), (flat(got["T"]), MTy)

    got, expected, (mv_flat, Mx), (T_flat, MTy) = run(A, x, y)
    n = longest_sum(expected["matrix"])  # a row's or a column's products (the matrix: with the basis)
    assert_tree_allclose(got, expected, n_terms=n)
    assert_tree_allclose(mv_flat, Mx, n_terms=n)
    assert_tree_allclose(T_flat, MTy, n_terms=n)
    # structures, sizes and the transpose's identities
    n_rows = len(jax.tree_util.tree_leaves(case.rows)[0])
    assert A.in_structure() == case.in_structure
    assert A.out_structure() == case.out_structure()
    assert A.T.in_structure() == A.out_structure() and A.T.out_structure() == A.in_structure()
    assert (A.out_size(), A.in_size()) == expected["matrix"].shape
    assert (A.T.in_size(), A.T.out_size()) == expected["matrix"].shape
    assert A.n_rows == A.T.n_rows == n_rows
    assert A.chunk_size == A.T.chunk_size == chunk
    assert isinstance(A.T, chunkop.TransposedRowOperator)
    assert A.T.T is A and A.transpose().transpose() is A and A.T.operator is A and A.T.kernel_rows is A.kernel_rows
    # the rows in the user's order: the same values (the kernels' own when they come in order)
    assert_tree_allclose(A.T.rows, case.rows, n_terms=1)
    if A.row_order is None:
        assert A.rows is A.kernel_rows


# -- the line-of-sight problem --------------------------------------------------------------------

LOS = make_los()
X, Y = LOS.x(), LOS.y()
LOS_SUM = longest_sum(LOS.dense())  # A x: a row's K bins; A^T y: the rows through one pixel


def los_op(chunk=3, rows=ROWS, **kw):
    return LOS.op(chunk=chunk, rows=rows, **kw)


def test_weights_are_order_one():
    w = jax.vmap(los_weights)(ROWS)
    assert np.all(np.asarray(w) < 0) and 0.01 < float(jnp.max(jnp.abs(w))) < 1.0


def test_in_structure_from_arrays_and_numpy_chunk():
    A = chunkop.RowOperator(los_row, ROWS, X, chunk_size=np.int64(4))
    assert A.in_structure() == STRUCT
    assert A.chunk_size == 4 and type(A.chunk_size) is int
    assert_tree_allclose(A.mv(X), LOS.ref_mv(X), n_terms=LOS_SUM)


def test_tags():
    A = los_op(tags=lx.unit_diagonal_tag)
    assert A.tags == frozenset({lx.unit_diagonal_tag})
    B = los_op(tags=[lx.lower_triangular_tag])
    assert B.T.tags == frozenset({lx.upper_triangular_tag})
    assert los_op().tags == frozenset()


def test_numpy_inputs():
    A = los_op()
    assert_tree_allclose(A.mv(np.asarray(X)), LOS.ref_mv(X), n_terms=LOS_SUM)
    assert_tree_allclose(A.T.mv(np.asarray(Y)), LOS.ref_T(Y), n_terms=LOS_SUM)


def test_jit_of_operator_argument_and_closure():
    A = los_op()
    f = jax.jit(lambda op, x: op.mv(x))
    assert_tree_allclose(f(A, X), LOS.ref_mv(X), n_terms=LOS_SUM)
    g = jax.jit(lambda op, y: op.T.mv(y))
    assert_tree_allclose(g(A, Y), LOS.ref_T(Y), n_terms=LOS_SUM)
    # rows traced inside jit
    h = jax.jit(lambda rows, x: los_op(4, rows).mv(x))
    assert_tree_allclose(h(ROWS, X), LOS.ref_mv(X), n_terms=LOS_SUM)


def test_operator_arithmetic_with_lineax():
    A = los_op()
    M = LOS.dense()
    AtA = A.T @ A
    assert_tree_allclose(AtA.mv(X).reshape(-1), M.T @ (M @ X.reshape(-1)), n_terms=2 * LOS_SUM)  # two products
    assert_tree_allclose((2.0 * A).mv(X), 2.0 * LOS.ref_mv(X), n_terms=LOS_SUM)
    assert_tree_allclose((A + A).T.mv(Y), 2.0 * LOS.ref_T(Y), n_terms=LOS_SUM)
    assert M.shape == (N, NPIX * K)
