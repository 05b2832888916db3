"""lineax registrations for :class:`chunkop.RowOperator` and its transpose.

Tag queries answer from the operator's (unchecked) tags, as lineax does for its own implicit
operators; ``materialise``, ``diagonal`` and ``tridiagonal`` go through the chunked dense
materialisation, so they are meant for small operators.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np

from ._operator import AbstractRowOperator, RowOperator, TransposedRowOperator

__all__: list[str] = []


@lx.linearise.register(AbstractRowOperator)
def _(operator):
    return operator  # already linear, nothing to cache


@lx.materialise.register(AbstractRowOperator)
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
            f"lineax.{name}: the operator is not square (out_size {operator.out_size()}, "
            f"in_size {operator.in_size()})."
        )


@lx.diagonal.register(AbstractRowOperator)
def _(operator):
    _check_square(operator, "diagonal")
    return jnp.diagonal(operator.as_matrix())


@lx.tridiagonal.register(AbstractRowOperator)
def _(operator):
    _check_square(operator, "tridiagonal")
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix, -1), jnp.diagonal(matrix), jnp.diagonal(matrix, 1)


def _has_real_dtype(operator) -> bool:
    leaves = jax.tree_util.tree_leaves((operator.in_structure(), operator.out_structure()))
    return all(not jnp.issubdtype(s.dtype, jnp.complexfloating) for s in leaves)


@lx.is_symmetric.register(AbstractRowOperator)
def _(operator):
    tags = operator.tags
    if lx.symmetric_tag in tags or lx.diagonal_tag in tags:
        return True
    semidefinite = lx.positive_semidefinite_tag in tags or lx.negative_semidefinite_tag in tags
    return semidefinite and _has_real_dtype(operator)


def _tag_query(query, *tags):
    @query.register(AbstractRowOperator)
    def _(operator):
        return any(tag in operator.tags for tag in tags)


_tag_query(lx.is_diagonal, lx.diagonal_tag)
_tag_query(lx.is_tridiagonal, lx.tridiagonal_tag, lx.diagonal_tag)
_tag_query(lx.has_unit_diagonal, lx.unit_diagonal_tag)
_tag_query(lx.is_lower_triangular, lx.lower_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_upper_triangular, lx.upper_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_positive_semidefinite, lx.positive_semidefinite_tag)
_tag_query(lx.is_negative_semidefinite, lx.negative_semidefinite_tag)


@lx.conj.register(RowOperator)
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
    )


@lx.conj.register(TransposedRowOperator)
def _(operator):
    return lx.conj(operator.operator).transpose()
