"""``chunkop.sum`` / ``chunkop.mean``: reductions over a mapped axis, computed chunk by chunk.

Only a running sum is carried, so neither the per-element outputs nor (with ``remat``) their
residuals are ever held for the whole axis: the building block for full-batch losses and
gradient accumulation over micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._chunking import Remat, accumulation_dtype, sum_chunks, widen
from ._progress import Progress
from ._vmap import LoopSpec, _chunk_vmap, _Chunked, _moved, _wrap

__all__ = ["sum", "mean"]


def _result_dtype(reduce: Callable, dtype: Any) -> Any:
    """The dtype ``reduce(o, 0)`` (``jnp.sum``/``jnp.mean``) gives for inputs of ``dtype``."""
    return jax.eval_shape(lambda o: reduce(o, 0), jax.ShapeDtypeStruct((1,), dtype)).dtype


def sum_loop(jaxpr: Any, out_shapes: Any, spec: LoopSpec, *, divide: bool = False) -> Callable[[list, list], Any]:
    """``(consts, mapped) -> sum`` (or mean) over the mapped axis of the traced function's outputs.

    Chunk sums are accumulated in the dtype of the result (``jnp.sum``'s, or ``jnp.mean``'s:
    a mean of integers is summed in floating point, as ``jnp.mean`` does, never in a wrapping
    integer), widened to float32 for bfloat16/float16, and cast to the result's dtype at the end.
    """
    reduce = jnp.mean if divide else jnp.sum
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    final = [_result_dtype(reduce, s.dtype) for s in out_leaves]
    acc = [accumulation_dtype(d) for d in final]
    plan = spec.plan

    def loop(consts: list, mapped: list) -> Any:
        wide = widen(consts)

        def chunk_fn(chunk: list, m: int) -> list:
            outs = _chunk_vmap(jaxpr, spec, wide, consts, 0, m)(*chunk)
            return [jnp.sum(o, axis=0, dtype=d) for o, d in zip(outs, acc)]

        init = [jnp.zeros(s.shape, d) for s, d in zip(out_leaves, acc)]
        total = sum_chunks(chunk_fn, _moved(mapped, spec.axes), plan, spec.remat, init, spec.progress)
        if divide:  # the totals are inexact (see above): divide in their own dtype
            total = [t / jnp.asarray(plan.size, t.dtype) for t in total]
        return jax.tree_util.tree_unflatten(out_tree, [t.astype(d) for t, d in zip(total, final)])

    return loop


class _Summed(_Chunked):
    where = "chunkop.sum"
    shard_kind = "sum"
    reduce = staticmethod(jnp.sum)
    _loop = staticmethod(sum_loop)

    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        outs = jax.vmap(
            self.fun,
            in_axes=self.in_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )(*args, **kwargs)
        return jax.tree_util.tree_map(lambda o: self.reduce(o, axis=0), outs)

    def _join(self, chunk_outs: list, out_shapes: Any, n: int) -> Any:
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
        totals = []
        for k, s in enumerate(out_leaves):
            final = _result_dtype(self.reduce, s.dtype)
            acc = accumulation_dtype(final)
            total = sum(jnp.sum(c[k], axis=0, dtype=acc) for c in chunk_outs)
            if self.reduce is jnp.mean:
                total = total / jnp.asarray(n, acc)
            totals.append(total.astype(final))
        return jax.tree_util.tree_unflatten(out_tree, totals)


class _Averaged(_Summed):
    where = "chunkop.mean"
    shard_kind = "mean"
    reduce = staticmethod(jnp.mean)
    _loop = staticmethod(functools.partial(sum_loop, divide=True))


def _make(
    cls: type,
    fun: Callable,
    in_axes: Any,
    chunk_size: int | None,
    axis_size: int | None,
    remat: Remat,
    progress: Progress = None,
    memory_budget: int | None = None,
    spmd_axis_name: Any = None,
) -> Callable:
    return _wrap(
        fun,
        cls(
            fun,
            in_axes,
            chunk_size=chunk_size,
            axis_name=None,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
            remat=remat,
            progress=progress,
            memory_budget=memory_budget,
        ),
    )


def sum(  # noqa: A001
    fun: Callable,
    in_axes: int | tuple | list | None = 0,
    *,
    chunk_size: int | str | None,
    axis_size: int | None = None,
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
    spmd_axis_name: Any = None,
) -> Callable:
    """``lambda *a: jax.vmap(fun, in_axes)(*a)`` summed over the mapped axis, chunk by chunk.

    Equal to ``jax.tree.map(lambda o: o.sum(0), jax.vmap(fun, in_axes)(*args))`` without
    materialising the per-element outputs; memory under ``grad`` is bounded by the chunk.
    Arguments, errors and remainder handling are those of :func:`chunkop.vmap`. Sums of
    bool/int outputs follow ``jnp.sum``'s dtype rules; bfloat16/float16 outputs are summed in
    float32 (as ``jnp.sum`` does) and returned in their own dtype.

    Args:
        fun: function of one element; returns a pytree of arrays.
        in_axes: as in :func:`chunkop.vmap`.
        chunk_size: the largest number of elements vectorised at once; None for no chunking;
            ``"auto"`` to choose it from ``memory_budget`` (as in :func:`chunkop.vmap`).
        axis_size: size of the mapped axis when no argument is mapped.
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.
        memory_budget: as in :func:`chunkop.vmap`.
        spmd_axis_name: as in :func:`chunkop.vmap` (the mesh axes the mapped axis is sharded
            over; needed under ``jax.jit`` on an Auto mesh, see docs/scaling.md).

    Returns:
        A function returning the pytree of sums (each leaf with ``fun``'s per-element shape).

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> loss = chunkop.sum(lambda w, x: (x @ w) ** 2, in_axes=(None, 0), chunk_size=4)
        >>> jax.grad(loss)(jnp.ones(3), jnp.ones((10, 3)))
        Array([60., 60., 60.], dtype=float32)
    """
    return _make(_Summed, fun, in_axes, chunk_size, axis_size, remat, progress, memory_budget, spmd_axis_name)


def mean(
    fun: Callable,
    in_axes: int | tuple | list | None = 0,
    *,
    chunk_size: int | str | None,
    axis_size: int | None = None,
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
    spmd_axis_name: Any = None,
) -> Callable:
    """Like :func:`chunkop.sum`, divided by the size of the mapped axis.

    Args:
        fun: function of one element; returns a pytree of arrays.
        in_axes: as in :func:`chunkop.vmap`.
        chunk_size: the largest number of elements vectorised at once; None for no chunking;
            ``"auto"`` to choose it from ``memory_budget`` (as in :func:`chunkop.vmap`).
        axis_size: size of the mapped axis when no argument is mapped.
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.
        memory_budget: as in :func:`chunkop.vmap`.
        spmd_axis_name: as in :func:`chunkop.sum`.

    Returns:
        A function returning the pytree of means.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.mean(jnp.sin, chunk_size=4)(jnp.zeros(10))
        Array(0., dtype=float32)
    """
    return _make(_Averaged, fun, in_axes, chunk_size, axis_size, remat, progress, memory_budget, spmd_axis_name)
