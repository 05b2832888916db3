"""``chunk_size="auto"`` for a ``RowOperator``: the chunk of rows planned when it is built.

The measure (:func:`rows_temp_bytes`) is the worst of ``mv``, ``T.mv`` and their VJPs (with
respect to ``x``/``y``, the float leaves of the rows and the arrays ``row_fn`` closes over),
compiled at each candidate chunk of the search (:func:`chunkop._search.choose_chunk`). With rows
sharded over devices, the chunk is planned for one device's shard. The plan is cached per
traced ``row_fn``, row shapes, budget, cap and backend (:func:`chunkop._cache.cached_plan`), so
rebuilding an operator with new row values of the same shapes plans nothing. ``row_fn`` is
traced once per build, by the operator: the plan evaluates that trace at every candidate chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _estimate
from .._budget import check_memory_budget, plan_program
from .._memory import program_temp_bytes
from .._search import BudgetPlan
from .._sharding import check_even
from .._tree import resized
from . import kernels
from .row_sharding import row_mesh

__all__ = ["rows_temp_bytes", "plan_rows"]


def _row_programs(spec: kernels.Spec, rows: Any, chunk: int, k: int, windows_at: Callable | None = None) -> list:
    """``mv`` and ``T.mv`` at ``chunk`` rows per chunk, as the planner takes them: ``(fn, at)``
    over the leaves ``[*consts, *rows, *x, *y]`` (``k`` constants). ``row_fn`` is not traced
    again: every candidate chunk evaluates the one traced ``spec`` (in the windowed layout, with
    the windows ``windows_at(chunk)`` of that chunk)."""
    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    windows = None if windows_at is None else windows_at(chunk)
    spec = spec.at(chunk, windows=windows)  # (measured without progress reports)
    x_tree, nx, ny, r = spec.in_tree, len(spec.in_leaves), len(spec.out_leaves), len(row_leaves)
    y_tree = spec.out_tree

    def mv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return kernels.apply(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(x_tree, flat[k + r :]))

    def tmv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return kernels.apply_transpose(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(y_tree, flat[k + r :]))

    common = list(range(k + r))
    return [
        (mv, common + list(range(k + r, k + r + nx))),
        (tmv, common + list(range(k + r + nx, k + r + nx + ny))),
    ]


def _row_leaves(spec: kernels.Spec, consts: tuple, rows: Any) -> list:
    """The leaves the operator's programs take, ``[*consts, *rows, *x, *y]``."""
    row_leaves = jax.tree_util.tree_leaves(rows)
    n = int(row_leaves[0].shape[0])
    y_leaves = [jax.ShapeDtypeStruct((n, *o.shape), o.dtype) for o in spec.out_leaves]
    return [*consts, *row_leaves, *spec.in_leaves, *y_leaves]


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
    spec, consts = kernels.make_spec(row_fn, rows, in_structure, chunk)
    leaves = _row_leaves(spec, consts, rows)
    programs = _row_programs(spec, rows, chunk, len(consts))
    return max(program_temp_bytes(fn, [leaves[i] for i in at], "grad") for fn, at in programs)


def plan_rows(
    spec: kernels.Spec,
    consts: tuple,
    rows: Any,
    memory_budget: int | None,
    windows_at: Callable | None = None,
    layout_key: Any = None,
) -> BudgetPlan:
    """The chunk of rows for a ``RowOperator`` built with ``chunk_size="auto"``.

    Plans for :func:`rows_temp_bytes` (the worst of ``mv``, ``T.mv`` and their VJPs), compiled
    at each candidate chunk, with the planner of the chunked transforms
    (:func:`chunkop._budget.plan_program`): built under an enclosing ``jax.vmap`` (rows that are
    its tracers: an operator per set of rows), the programs are measured under it, ``x`` and
    ``y`` taken as batched too. With rows sharded over devices, the chunk is planned for one
    device's shard. The per-chunk overhead counted against small chunks on CPU is the ``x``
    space (each use of ``x`` in ``row_fn`` makes a buffer of its size per chunk of ``T.mv``) and
    the closed-over float arrays (:func:`chunkop._estimate.fixed_bytes`).

    Args:
        spec: ``row_fn`` traced when the operator was built (:func:`kernels.make_spec`): the
            plan evaluates it, never traces ``row_fn`` again.
        consts: the arrays ``row_fn`` closes over (from the same trace).
        rows: the row pytree (its leading axis is the rows).
        memory_budget: the budget in bytes, or None for :func:`chunkop._memory.default_budget`.
        windows_at: in the windowed layout, ``windows_at(chunk)``: the rows of each window at
            that chunk (:func:`row_layout.window_sizes`), which the programs read (and the
            estimate counts per row); None for the plain layout.
        layout_key: what the windows depend on (the sorted targets' digest), for the plan's key.

    Returns:
        The (cached) :class:`chunkop.BudgetPlan`; ``size`` and ``shards`` per device.
    """
    budget = check_memory_budget(memory_budget, "RowOperator")
    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    n = int(jax.typeof(row_leaves[0]).shape[0])
    mesh_axes = row_mesh(rows)
    # (the one even-split check: rows split unevenly are refused here as by the kernels)
    shards = 1 if mesh_axes is None else check_even(n, mesh_axes, "RowOperator: the rows")
    n //= shards
    if shards > 1:  # one device's shard: plain shapes (sharded rows are not traced under a vmap here)
        rows = jax.tree_util.tree_unflatten(row_tree, [resized(x, 0, n) for x in row_leaves])
    leaves = _row_leaves(spec, consts, rows)
    k, r = len(consts), len(row_leaves)
    jaxpr = spec.jaxpr
    x_vars = jaxpr.invars[r:]
    planned = spec.at(1, windows=None)  # keyed without the operator's chunk size and progress setting
    key = None if planned.key is None else ("rows", planned.key, shards, layout_key)
    element_bytes = _estimate.element_bytes(jaxpr, n_inputs=r)
    if windows_at is not None and element_bytes is not None and n:
        # each chunk also reads its windows: their rows per row of the chunk, at a chunk of 4096
        ref = min(n, 4096)
        per_x_row = [int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize for s in spec.in_leaves]
        element_bytes += int(sum(w * b for w, b in zip(windows_at(ref), per_x_row)) / ref)
    plan = plan_program(
        lambda chunk: _row_programs(spec, rows, chunk, k, windows_at),
        leaves,
        n,
        memory_budget=budget,
        mode="grad",
        key=key,
        element_bytes=element_bytes,
        fixed_bytes=_estimate.fixed_bytes(jaxpr, r, operands=[*jaxpr.constvars, *x_vars]),
        batch_like=range(k + r, len(leaves)),
    )
    return plan._replace(shards=shards) if shards > 1 else plan  # (the cached plan itself)
