"""``chunkop.sum`` / ``chunkop.mean``: reductions over a mapped axis, computed chunk by chunk.

Only a running sum is carried, so neither the per-element outputs nor (with ``remat``) their
residuals are ever held for the whole axis: the building block for full-batch losses and
gradient accumulation over micro-batches. Both are a :class:`chunkop._transform.Chunked` of
kind ``"sum"`` / ``"mean"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._chunking import Remat
from ._progress import Progress
from ._transform import Chunked

__all__ = ["sum", "mean"]


def _make(kind: str, fun: Callable, in_axes: Any, **kw: Any) -> Callable:
    return Chunked(fun, in_axes, kind=kind, where=f"chunkop.{kind}", **kw)


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
    return _make(
        "sum",
        fun,
        in_axes,
        chunk_size=chunk_size,
        axis_size=axis_size,
        remat=remat,
        progress=progress,
        memory_budget=memory_budget,
        spmd_axis_name=spmd_axis_name,
    )


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
    return _make(
        "mean",
        fun,
        in_axes,
        chunk_size=chunk_size,
        axis_size=axis_size,
        remat=remat,
        progress=progress,
        memory_budget=memory_budget,
        spmd_axis_name=spmd_axis_name,
    )
