"""``chunkop.sum`` / ``chunkop.mean``: reductions over a mapped axis, computed chunk by chunk.

Only a running sum is carried, so neither the per-element outputs nor (with ``remat``) their
residuals are ever held for the whole axis: the building block for full-batch losses and
gradient accumulation over micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ._chunking import Remat, sum_chunks
from ._progress import Progress
from ._vmap import _Chunked, _wrap

__all__ = ["sum", "mean"]


def _sum_dtype(dtype: Any) -> Any:
    """The dtype ``jnp.sum`` gives for inputs of ``dtype`` (bool/small ints are promoted)."""
    return jax.eval_shape(lambda o: jnp.sum(o, 0), jax.ShapeDtypeStruct((1,), dtype)).dtype


class _Summed(_Chunked):
    where = "chunkop.sum"
    divide = False

    def _finish(self, total: Any, n: int) -> Any:
        if not self.divide:
            return total
        return jax.tree_util.tree_map(lambda s: s / n, total)

    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        outs = jax.vmap(
            self.fun,
            in_axes=self.in_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )(*args, **kwargs)
        n = jax.tree_util.tree_leaves(outs)[0].shape[0] if jax.tree_util.tree_leaves(outs) else 0
        return self._finish(jax.tree_util.tree_map(lambda o: jnp.sum(o, axis=0), outs), n)

    def _combine(self, flat_fun, leaves, axes, plan, out_shapes):
        mapped, moved, body_in_axes = self._chunk_inputs(leaves, axes)

        def chunk_fn(chunk: list, m: int) -> Any:
            flat = list(leaves)
            for i, c in zip(mapped, chunk):
                flat[i] = c
            outs = self._vmapped(flat_fun, body_in_axes, 0, m)(*flat)
            return jax.tree_util.tree_map(lambda o: jnp.sum(o, axis=0), outs)

        init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), out_shapes)
        return self._finish(sum_chunks(chunk_fn, moved, plan, self.remat, init, self.progress), plan.size)


class _Averaged(_Summed):
    where = "chunkop.mean"
    divide = True


def _make(cls: type, fun: Callable, in_axes: Any, chunk_size: int | None, axis_size, remat, progress=None) -> Callable:
    return _wrap(
        fun,
        cls(
            fun,
            in_axes,
            chunk_size=chunk_size,
            axis_name=None,
            axis_size=axis_size,
            spmd_axis_name=None,
            remat=remat,
            progress=progress,
        ),
    )


def sum(  # noqa: A001
    fun: Callable,
    in_axes: int | None | tuple | list = 0,
    *,
    chunk_size: int | None,
    axis_size: int | None = None,
    remat: Remat = True,
    progress: Progress = None,
) -> Callable:
    """``lambda *a: jax.vmap(fun, in_axes)(*a)`` summed over the mapped axis, chunk by chunk.

    Equal to ``jax.tree.map(lambda o: o.sum(0), jax.vmap(fun, in_axes)(*args))`` without
    materialising the per-element outputs; memory under ``grad`` is bounded by the chunk.
    Arguments, errors and remainder handling are those of :func:`chunkop.vmap`. Sums of
    bool/int outputs follow ``jnp.sum``'s dtype rules.

    Args:
        fun: function of one element; returns a pytree of arrays.
        in_axes: as in :func:`chunkop.vmap`.
        chunk_size: the largest number of elements vectorised at once; None for no chunking.
        axis_size: size of the mapped axis when no argument is mapped.
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.

    Returns:
        A function returning the pytree of sums (each leaf with ``fun``'s per-element shape).

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> loss = chunkop.sum(lambda w, x: (x @ w) ** 2, in_axes=(None, 0), chunk_size=4)
        >>> jax.grad(loss)(jnp.ones(3), jnp.ones((10, 3)))
        Array([60., 60., 60.], dtype=float32)
    """
    return _make(_Summed, fun, in_axes, chunk_size, axis_size, remat, progress)


def mean(
    fun: Callable,
    in_axes: int | None | tuple | list = 0,
    *,
    chunk_size: int | None,
    axis_size: int | None = None,
    remat: Remat = True,
    progress: Progress = None,
) -> Callable:
    """Like :func:`chunkop.sum`, divided by the size of the mapped axis.

    Args:
        fun: function of one element; returns a pytree of arrays.
        in_axes: as in :func:`chunkop.vmap`.
        chunk_size: the largest number of elements vectorised at once; None for no chunking.
        axis_size: size of the mapped axis when no argument is mapped.
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.

    Returns:
        A function returning the pytree of means.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.mean(jnp.sin, chunk_size=4)(jnp.zeros(10))
        Array(0., dtype=float32)
    """
    return _make(_Averaged, fun, in_axes, chunk_size, axis_size, remat, progress)
