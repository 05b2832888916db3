"""``chunk_size="auto"`` for a ``RowOperator``: the chunk of rows planned when it is built.

The measure (:func:`rows_temp_bytes`) is the worst of ``mv``, ``T.mv`` and their VJPs (with
respect to ``x``/``y``, the float leaves of the rows and the arrays ``row_fn`` closes over),
compiled at each candidate chunk of the search (:func:`chunkop._search.choose_chunk`). With rows
sharded over devices, the chunk is planned for one device's shard. The plan is cached per
traced ``row_fn``, row shapes, budget, cap and backend (:func:`chunkop._cache.cached_plan`), so
rebuilding an operator with new row values of the same shapes plans nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .. import _estimate
from .._budget import check_memory_budget
from .._cache import cached_plan
from .._memory import default_budget, program_temp_bytes, throughput_cap
from .._search import BudgetPlan, choose_chunk
from .._tree import struct_of as _struct
from . import kernels
from .row_sharding import row_mesh

__all__ = ["rows_temp_bytes", "plan_rows"]


def rows_temp_bytes(row_fn: Callable, rows: Any, in_structure: Any, chunk: int) -> int:
    """The compiled temp memory a ``RowOperator`` needs at ``chunk`` rows per chunk (the planner's measure).

    The worst of ``mv`` and ``T.mv`` and their VJPs (w.r.t. ``x``/``y``, the float leaves of
    ``rows`` and the arrays ``row_fn`` closes over).

    Args:
        row_fn: the per-row function ``row_fn(row, x)``.
        rows: the row pytree (arrays or ``jax.ShapeDtypeStruct``: only shapes and dtypes are used).
        in_structure: the structure of ``x``.
        chunk: the rows per chunk.

    Returns:
        The largest temp size in bytes among the four compiled programs.
    """
    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    row_structs = [_struct(x) for x in row_leaves]
    x_leaves, x_tree = jax.tree_util.tree_flatten(in_structure)
    spec, consts = kernels.make_spec(row_fn, jax.tree_util.tree_unflatten(row_tree, row_structs), in_structure, chunk)
    k, r = len(consts), len(row_structs)

    def mv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return kernels.apply(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(x_tree, flat[k + r :]))

    y_leaves, y_tree = jax.tree_util.tree_flatten(jax.eval_shape(mv, *consts, *row_structs, *x_leaves))

    def tmv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return kernels.apply_transpose(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(y_tree, flat[k + r :]))

    return max(
        program_temp_bytes(mv, [*consts, *row_structs, *x_leaves], "grad"),
        program_temp_bytes(tmv, [*consts, *row_structs, *y_leaves], "grad"),
    )


def plan_rows(row_fn: Callable, rows: Any, in_structure: Any, memory_budget: int | None) -> BudgetPlan:
    """The chunk of rows for a ``RowOperator`` built with ``chunk_size="auto"``.

    Plans for :func:`rows_temp_bytes` (the worst of ``mv``, ``T.mv`` and their VJPs), compiled
    at each candidate chunk. With rows sharded over devices, the chunk is planned for one
    device's shard.

    Args:
        row_fn: the per-row function ``row_fn(row, x)``.
        rows: the row pytree (its leading axis is the rows).
        in_structure: the structure of ``x``.
        memory_budget: the budget in bytes, or None for :func:`chunkop._memory.default_budget`.

    Returns:
        The (cached) :class:`chunkop.BudgetPlan`; ``size`` and ``shards`` per device.
    """
    budget = check_memory_budget(memory_budget, "RowOperator")
    budget = budget if budget is not None else default_budget()
    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    n = int(row_leaves[0].shape[0])
    mesh_axes = row_mesh(rows)
    shards = 1
    if mesh_axes is not None and n % mesh_axes.n_shards == 0:
        shards = mesh_axes.n_shards
        n //= shards
    row_structs = [jax.ShapeDtypeStruct((n,) + tuple(x.shape[1:]), x.dtype) for x in row_leaves]
    local_rows = jax.tree_util.tree_unflatten(row_tree, row_structs)
    cap = throughput_cap()

    # the same row_fn (by its traced jaxpr), row and x shapes, budget and device kind: the same plan
    spec, _ = kernels.make_spec(row_fn, local_rows, in_structure, 1)

    def compute() -> BudgetPlan:
        temp = lambda chunk: rows_temp_bytes(row_fn, local_rows, in_structure, chunk)
        estimate = _estimate.element_bytes(spec.jaxpr, n_inputs=len(row_leaves))
        return choose_chunk(temp, n, budget, mode="grad", cap=cap, element_bytes=estimate)._replace(shards=shards)

    if spec.key is None:
        return compute()
    shapes = tuple((s.shape, str(s.dtype)) for s in row_structs)
    return cached_plan(("rows", spec.key, shapes, shards, budget, cap, jax.default_backend()), compute)
