"""The chunked kernels behind :class:`chunkop.RowOperator`, and their derivative rules.

An operator is ``y_i = row_fn(row_i, x)`` for ``i < n_rows``, linear in ``x``. Four kernels, each
a ``jax.lax.scan`` over chunks of rows with a ``jax.checkpoint``-ed body (so weights computed
from the row data are recomputed, never stored for all rows):

- ``forward(rows, x)``: the matvec. Per chunk, the vmapped ``row_fn`` is linearised at
  ``x = 0`` (exact: it is linear) into ``fn(x, *consts)``, where ``consts`` (gather indices,
  weights) are computed once per chunk (see :func:`_linear_parts`), then applied to ``x``;
- ``backward(rows, y)``: the transpose, ``jax.linear_transpose`` of the same ``fn`` applied to
  the chunk of ``y`` and accumulated into the ``x`` space;
- ``forward_drows`` / ``backward_drows``: their derivatives w.r.t. the float leaves of ``rows``
  (bilinear in ``(drows, x)`` / ``(drows, y)``).

``apply`` and ``apply_transpose`` wrap ``forward`` and ``backward`` in ``jax.custom_jvp`` whose
rules are expressed with the same kernels: ``d(A x) = A dx + (dA) x``. Everything is built from
ordinary JAX primitives, so ``jit``, ``vmap``, ``jvp``, ``grad``, ``linear_transpose``,
``hessian``, ``scan`` and ``checkpoint`` all compose; reverse mode transposes the kernels'
scans (each chunk recomputes its weights), forward mode evaluates the rules directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ._chunking import make_plan, stack_chunks, sum_chunks

__all__ = ["Spec", "apply", "apply_transpose"]


class Spec(NamedTuple):
    """Static description of an operator: hashable, passed as a non-differentiable argument."""

    row_fn: Callable[[Any, Any], Any]
    chunk_size: int
    in_leaves: tuple  # ShapeDtypeStructs of x's leaves
    in_tree: Any  # x's treedef

    def in_structure(self) -> Any:
        return jax.tree_util.tree_unflatten(self.in_tree, list(self.in_leaves))


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _row_tangent(row: Any, drow_floats: list) -> Any:
    """A tangent for ``row`` (one row or a chunk): given tangents on float leaves, float0 elsewhere."""
    leaves, tree = jax.tree_util.tree_flatten(row)
    it = iter(drow_floats)
    tangents = [
        next(it) if _is_float(leaf) else np.zeros(jnp.shape(leaf), dtype=jax.dtypes.float0)
        for leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(tree, tangents)


def _stack_rows(spec: Spec, per_chunk: Callable, mapped: list) -> Any:
    """Chunked ``per_chunk(token, *chunk) -> pytree`` over the leading (row) axis, stacked.

    ``token`` is a traced bool computed from the chunk's row numbers, so XLA cannot fold it to
    a constant (see :func:`_linear_parts`; its value never matters).
    """
    n = mapped[0].shape[0]
    plan = make_plan(n, spec.chunk_size)
    out_tree_box: list = []

    def chunk_fn(chunk: list, m: int) -> tuple[list, list]:
        out = per_chunk(chunk[0][0] % 2 == 0, *chunk[1:])
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves, []

    tokens = jnp.arange(n, dtype=jnp.int32)
    full, rem, _ = stack_chunks(chunk_fn, [tokens, *mapped], plan, True)
    leaves = [f.reshape((-1,) + f.shape[2:]) for f in full]
    if rem is not None:
        leaves = [jnp.concatenate([f, r]) for f, r in zip(leaves, rem)]
    return jax.tree_util.tree_unflatten(out_tree_box[0], leaves)


def _sum_rows(spec: Spec, per_chunk: Callable, mapped: list) -> Any:
    """Chunked sum over the leading (row) axis of ``per_chunk(token, *chunk) -> x-shaped pytree``."""
    n = mapped[0].shape[0]
    plan = make_plan(n, spec.chunk_size)
    init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), spec.in_structure())
    tokens = jnp.arange(n, dtype=jnp.int32)
    return sum_chunks(
        lambda chunk, m: per_chunk(chunk[0][0] % 2 == 0, *chunk[1:]), [tokens, *mapped], plan, True, init
    )


def _linear_parts(spec: Spec, rows_c: Any, token: jax.Array) -> tuple[Callable, list]:
    """One chunk's linear map ``x -> vmap(row_fn)(rows_c, x)`` as ``(fn, consts)``: ``fn(x, *consts)``.

    ``consts`` are what the map needs besides ``x`` (gather indices, the weights computed from the
    row data). They are computed inside a ``lax.cond`` whose two branches are identical (so the
    result never depends on ``token``): the conditional keeps XLA from fusing the weight
    computation into the consumer of the weights. Fused into a scatter's update loop (the
    transpose of a gather), the weights would be recomputed serially per element, which
    measured about 5x slower on CPU than computing them once per chunk, vectorised.
    """
    x0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), spec.in_structure())

    def parts(r: Any) -> tuple[Callable, list]:
        _, f_jvp = jax.linearize(lambda v: jax.vmap(spec.row_fn, (0, None))(r, v), x0)
        return jax.closure_convert(f_jvp, x0)

    fn, _ = parts(rows_c)
    consts = jax.lax.cond(token, lambda r: parts(r)[1], lambda r: parts(r)[1], rows_c)
    return fn, consts


# -- the four kernels ---------------------------------------------------------------------------


def forward(spec: Spec, rows: Any, x: Any) -> Any:
    """``y_i = row_fn(row_i, x)``, stacked over rows."""
    leaves, tree = jax.tree_util.tree_flatten(rows)

    def per_chunk(token: jax.Array, *chunk: Any) -> Any:
        fn, consts = _linear_parts(spec, jax.tree_util.tree_unflatten(tree, chunk), token)
        return fn(x, *consts)

    return _stack_rows(spec, per_chunk, leaves)


def forward_drows(spec: Spec, rows: Any, drows_floats: list, x: Any) -> Any:
    """``d/drows [row_fn(row_i, x)] . drow_i``, stacked over rows (linear in ``drows`` and ``x``)."""
    leaves, tree = jax.tree_util.tree_flatten(rows)
    n_leaves = len(leaves)

    def per_row(*flat: Any) -> Any:
        row = jax.tree_util.tree_unflatten(tree, flat[:n_leaves])
        drow = _row_tangent(row, list(flat[n_leaves:]))
        return jax.jvp(lambda r: spec.row_fn(r, x), (row,), (drow,))[1]

    return _stack_rows(spec, lambda token, *chunk: jax.vmap(per_row)(*chunk), leaves + list(drows_floats))


def _transpose_chunk(spec: Spec, rows_c: Any, y_c: Any, token: jax.Array | None = None) -> Any:
    """``A_c^T y_c`` for one chunk of rows: the transpose of the vmapped ``row_fn``."""
    if token is None:  # differentiated w.r.t. rows: plain linear_transpose (no cond to trace through)
        f = lambda v: jax.vmap(spec.row_fn, (0, None))(rows_c, v)  # noqa: E731
    else:
        fn, consts = _linear_parts(spec, rows_c, token)
        f = lambda v: fn(v, *consts)  # noqa: E731
    (ct,) = jax.linear_transpose(f, spec.in_structure())(y_c)
    return ct


def backward(spec: Spec, rows: Any, y: Any) -> Any:
    """``A^T y``: sum over rows of the transposed ``row_fn``, chunk by chunk."""
    r_leaves, r_tree = jax.tree_util.tree_flatten(rows)
    y_leaves, y_tree = jax.tree_util.tree_flatten(y)
    k = len(r_leaves)

    def per_chunk(token: jax.Array, *chunk: Any) -> Any:
        rows_c = jax.tree_util.tree_unflatten(r_tree, chunk[:k])
        return _transpose_chunk(spec, rows_c, jax.tree_util.tree_unflatten(y_tree, chunk[k:]), token)

    return _sum_rows(spec, per_chunk, r_leaves + y_leaves)


def backward_drows(spec: Spec, rows: Any, drows_floats: list, y: Any) -> Any:
    """``d/drows [A(rows)^T y] . drows``, accumulated in the ``x`` space."""
    r_leaves, r_tree = jax.tree_util.tree_flatten(rows)
    y_leaves, y_tree = jax.tree_util.tree_flatten(y)
    k, f = len(r_leaves), len(drows_floats)

    def per_chunk(token: jax.Array, *chunk: Any) -> Any:
        rows_c = jax.tree_util.tree_unflatten(r_tree, chunk[:k])
        drows_c = _row_tangent(rows_c, list(chunk[k : k + f]))
        y_c = jax.tree_util.tree_unflatten(y_tree, chunk[k + f :])
        return jax.jvp(lambda r: _transpose_chunk(spec, r, y_c), (rows_c,), (drows_c,))[1]

    return _sum_rows(spec, per_chunk, r_leaves + list(drows_floats) + y_leaves)


# -- custom_jvp wrappers ------------------------------------------------------------------------


def _is_zero(t: Any) -> bool:
    return isinstance(t, SymbolicZero)


def _instantiate(tree_t: Any, primal: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda t, p: jnp.zeros(jnp.shape(p), jnp.result_type(p)) if _is_zero(t) else t,
        tree_t,
        primal,
        is_leaf=_is_zero,
    )


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return jax.tree_util.tree_map(jnp.add, a, b)


def _linear_rule(kernel: Callable, kernel_drows: Callable, self_fn: Callable):
    """The JVP rule of ``v -> kernel(rows, v)``: ``kernel(rows, dv) + kernel_drows(rows, drows, v)``."""

    def rule(spec: Spec, primals: tuple, tangents: tuple) -> tuple:
        rows, v = primals
        drows, dv = tangents
        out = self_fn(spec, rows, v)
        dout = None
        dv_leaves = jax.tree_util.tree_leaves(dv, is_leaf=_is_zero)
        if not all(_is_zero(t) for t in dv_leaves):
            dout = self_fn(spec, rows, _instantiate(dv, v))
        float_rows = [
            (leaf, t)
            for leaf, t in zip(
                jax.tree_util.tree_leaves(rows), jax.tree_util.tree_leaves(drows, is_leaf=_is_zero)
            )
            if _is_float(leaf)
        ]
        if any(not _is_zero(t) for _, t in float_rows):
            drows_floats = [
                jnp.zeros(leaf.shape, leaf.dtype) if _is_zero(t) else t for leaf, t in float_rows
            ]
            dout = _add(dout, kernel_drows(spec, rows, drows_floats, v))
        if dout is None:
            dout = jax.tree_util.tree_map(jnp.zeros_like, out)
        return out, dout

    return rule


@functools.partial(jax.jit, static_argnums=(0,))
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply(spec: Spec, rows: Any, x: Any) -> Any:
    """The matvec ``A(rows) x`` (chunked; differentiable in ``rows`` and ``x`` to any order)."""
    return forward(spec, rows, x)


@functools.partial(jax.jit, static_argnums=(0,))
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply_transpose(spec: Spec, rows: Any, y: Any) -> Any:
    """The transposed matvec ``A(rows)^T y`` (chunked; differentiable to any order)."""
    return backward(spec, rows, y)


apply.__wrapped__.defjvp(_linear_rule(forward, forward_drows, apply), symbolic_zeros=True)
apply_transpose.__wrapped__.defjvp(
    _linear_rule(backward, backward_drows, apply_transpose), symbolic_zeros=True
)
