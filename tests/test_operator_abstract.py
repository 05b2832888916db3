"""A new kind of row operator is one subclass of ``chunkop.AbstractRowOperator``.

The subclass below provides only ``rows``, ``tags``, ``row_fn``, ``chunk_size``,
``in_structure`` and its two kernels (plain dense products, not chunkop's scans); the
transpose, ``as_matrix``, ``check_linear``, ``gram_diagonal``, ``to_scipy`` and the lineax
registrations all work from those, and agree with the dense matrix.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from conftest import assert_tree_allclose

import chunkop

N, D = 6, 6


class DenseRows(chunkop.AbstractRowOperator):
    """``y_i = w_i . x``: rows are the matrix's rows, kernels are dense products."""

    rows: Any
    tags: frozenset = eqx.field(static=True, default=frozenset())

    @property
    def row_fn(self):
        return lambda row, x: jnp.dot(row, x)

    @property
    def chunk_size(self) -> int:
        return 2

    def in_structure(self):
        return jax.ShapeDtypeStruct((D,), self.rows.dtype)

    def apply(self, vector):
        return self.rows @ vector

    def apply_transpose(self, vector):
        return self.rows.T @ vector


W = jnp.asarray(np.random.default_rng(0).normal(size=(N, D)), jnp.float32)
X = jnp.arange(D, dtype=jnp.float32)
Y = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)


def test_subclass_gets_every_generic_feature():
    A = DenseRows(W)
    assert_tree_allclose(A.mv(X), W @ X, n_terms=D)
    assert_tree_allclose(A.T.mv(Y), W.T @ Y, n_terms=N)
    assert A.T.T is A and isinstance(A.T, chunkop.TransposedRowOperator)
    assert A.out_structure() == jax.ShapeDtypeStruct((N,), jnp.float32)
    assert_tree_allclose(A.as_matrix(), W, n_terms=D)  # products with the basis vectors
    assert_tree_allclose(A.T.as_matrix(), W.T, n_terms=N)
    assert max(chunkop.check_linear(A).values()) < 1e-5
    assert max(chunkop.check_linear(A.T).values()) < 1e-5
    assert_tree_allclose(chunkop.gram_diagonal(A), jnp.sum(W**2, axis=0), n_terms=N)
    assert_tree_allclose(lx.diagonal(A), jnp.diagonal(W), n_terms=D)
    assert_tree_allclose(lx.diagonal(A.T), jnp.diagonal(W), n_terms=N)
    assert_tree_allclose(lx.materialise(A).as_matrix(), W, n_terms=D)
    assert_tree_allclose(chunkop.to_scipy(A).rmatvec(np.asarray(Y)), W.T @ Y, n_terms=N)
    sol = lx.linear_solve(A, W @ X, lx.LU())
    np.testing.assert_allclose(sol.value, X, rtol=1e-3, atol=1e-3)


def test_subclass_kernel_mismatch_is_caught_by_check_linear():
    class WrongTranspose(DenseRows):
        def apply_transpose(self, vector):
            return 2.0 * (self.rows.T @ vector)

    with pytest.raises(ValueError, match=r"<A x, y>.*WrongTranspose\.apply_transpose\) does not transpose row_fn"):
        chunkop.check_linear(WrongTranspose(W))


def test_wrong_vector_is_rejected_with_the_subclass_name():
    with pytest.raises(ValueError, match=r"DenseRows\.mv: the input does not match"):
        DenseRows(W).mv(jnp.ones(D + 1))
    with pytest.raises(ValueError, match=r"DenseRows\.T\.mv: the input does not match"):
        DenseRows(W).T.mv(jnp.ones(N + 1))
