"""lineax registrations for :class:`chunkop.RowOperator` and its transpose.

Tag queries answer from the operator's (unchecked) tags, as lineax does for its own implicit
operators; ``materialise`` and ``tridiagonal`` go through the chunked dense materialisation, so
they are meant for small operators; ``diagonal`` evaluates each diagonal entry on its basis
vector, a few rows at a time, without the ``n^2`` matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree

from .._tree import zeros_of
from .._vmap import vmap
from . import row_sharding
from .row_operator import AbstractRowOperator, RowOperator, TransposedRowOperator, row_form

__all__: list[str] = []


@lx.linearise.register(AbstractRowOperator)
@lx.linearise.register(TransposedRowOperator)
def _(operator):
    return operator  # already linear, nothing to cache


@lx.materialise.register(AbstractRowOperator)
@lx.materialise.register(TransposedRowOperator)
def _(operator):
    matrix = operator.as_matrix()
    in_struct, out_struct = operator.in_structure(), operator.out_structure()
    in_leaves = jax.tree_util.tree_leaves(in_struct)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_struct)
    if len(in_leaves) == 1 and len(out_leaves) == 1 and in_leaves[0].ndim == out_leaves[0].ndim == 1:
        return lx.MatrixLinearOperator(matrix, operator.tags)
    blocks, r0 = [], 0
    for o in out_leaves:
        r1 = r0 + int(np.prod(o.shape))
        parts, c0 = [], 0
        for i in in_leaves:
            c1 = c0 + int(np.prod(i.shape))
            parts.append(matrix[r0:r1, c0:c1].reshape(tuple(o.shape) + tuple(i.shape)))
            c0 = c1
        blocks.append(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(in_struct), parts))
        r0 = r1
    return lx.PyTreeLinearOperator(jax.tree_util.tree_unflatten(out_tree, blocks), out_struct, operator.tags)


def _check_square(operator, name: str) -> None:
    if operator.in_size() != operator.out_size():
        raise ValueError(
            f"lineax.{name}: the operator is not square (out_size {operator.out_size()}, in_size {operator.in_size()})."
        )


def _row_diagonal(operator: AbstractRowOperator) -> jax.Array:
    """The diagonal of a square RowOperator, without its ``n^2`` matrix.

    Output element ``i`` (in ``ravel_pytree`` order) belongs to row ``r`` (element ``k`` of
    output leaf ``L``); the diagonal entry is that element of ``row_fn(row_r, e_i)``, with ``e_i``
    the ``i``-th basis vector of the input space. Each row evaluates its ``m`` elements on their
    ``m`` basis vectors, a few rows at a time: ``O(n_rows * m * in_size)`` time, and at most
    about ``2**22`` input-sized entries of memory at once (instead of ``out_size * in_size``).
    """
    x0 = zeros_of(operator.in_structure())
    flat_x, unravel = ravel_pytree(x0)
    per_row = [int(np.prod(s.shape[1:])) for s in jax.tree_util.tree_leaves(operator.out_structure())]
    n, m = operator.n_rows, sum(per_row)
    # element j of a row's flat output: leaf L(j), position k(j) in it; global index offset_L + r size_L + k
    leaf_offset = np.cumsum([0] + [n * size for size in per_row])[:-1]
    offset = np.concatenate([np.full(size, leaf_offset[i]) for i, size in enumerate(per_row)]).astype(np.int64)
    stride = np.concatenate([np.full(size, size) for size in per_row]).astype(np.int64)
    within = np.concatenate([np.arange(size) for size in per_row]).astype(np.int64)
    row_fn = operator.row_fn

    def diag_row(row, r):
        positions = jnp.asarray(offset) + r * jnp.asarray(stride) + jnp.asarray(within)

        def element(j, pos):
            basis = jnp.zeros(flat_x.shape, flat_x.dtype).at[pos].set(1)
            return ravel_pytree(row_fn(row, unravel(basis)))[0][j]

        return jax.vmap(element)(jnp.arange(m), positions)

    chunk = max(1, min(operator.chunk_size, 2**22 // max(m * flat_x.size, 1)))
    blocks = row_sharding.map_rows(  # (n, m); rows over devices: each device its own rows
        lambda rows_and_r: vmap(diag_row, chunk_size=chunk)(*rows_and_r), (operator.rows, jnp.arange(n))
    )
    parts, start = [], 0
    for size in per_row:
        parts.append(blocks[:, start : start + size].reshape(n * size))
        start += size
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


@lx.diagonal.register(AbstractRowOperator)
@lx.diagonal.register(TransposedRowOperator)
def _(operator):
    _check_square(operator, "diagonal")
    return _row_diagonal(row_form(operator, "lineax.diagonal")[0])  # (a transpose has the same diagonal)


@lx.tridiagonal.register(AbstractRowOperator)
@lx.tridiagonal.register(TransposedRowOperator)
def _(operator):
    _check_square(operator, "tridiagonal")
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix, -1), jnp.diagonal(matrix), jnp.diagonal(matrix, 1)


def _has_real_dtype(operator) -> bool:
    leaves = jax.tree_util.tree_leaves((operator.in_structure(), operator.out_structure()))
    return all(not jnp.issubdtype(s.dtype, jnp.complexfloating) for s in leaves)


@lx.is_symmetric.register(AbstractRowOperator)
@lx.is_symmetric.register(TransposedRowOperator)
def _(operator):
    tags = operator.tags
    if lx.symmetric_tag in tags or lx.diagonal_tag in tags:
        return True
    semidefinite = lx.positive_semidefinite_tag in tags or lx.negative_semidefinite_tag in tags
    return semidefinite and _has_real_dtype(operator)


def _tag_query(query, *tags):
    @query.register(AbstractRowOperator)
    @query.register(TransposedRowOperator)
    def _(operator):
        return any(tag in operator.tags for tag in tags)


_tag_query(lx.is_diagonal, lx.diagonal_tag)
_tag_query(lx.is_tridiagonal, lx.tridiagonal_tag, lx.diagonal_tag)
_tag_query(lx.has_unit_diagonal, lx.unit_diagonal_tag)
_tag_query(lx.is_lower_triangular, lx.lower_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_upper_triangular, lx.upper_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_positive_semidefinite, lx.positive_semidefinite_tag)
_tag_query(lx.is_negative_semidefinite, lx.negative_semidefinite_tag)


@lx.conj.register(AbstractRowOperator)
def _(operator):
    if _has_real_dtype(operator):
        return operator
    row_fn = operator.row_fn
    return RowOperator(
        lambda row, x: jax.tree_util.tree_map(jnp.conj, row_fn(row, jax.tree_util.tree_map(jnp.conj, x))),
        operator.rows,
        operator.in_structure(),
        chunk_size=operator.chunk_size,
        tags=operator.tags,
        out_sharding=getattr(operator, "out_sharding", "rows"),
    )


@lx.conj.register(TransposedRowOperator)
def _(operator):
    return lx.conj(operator.operator).transpose()
