"""The compiled chunk loops: ``(consts, mapped) -> result`` for each kind of chunked transform.

A loop is built from the traced jaxpr (:func:`chunkop._trace.trace_example`) and static settings
only (:class:`LoopSpec`), never from the wrapper that holds the user's function, so a cached loop
keeps no user function alive. Three kinds:

- ``"stack"`` (``chunkop.vmap`` / ``map``): per-element outputs stacked at their ``out_axes``;
- ``"sum"`` / ``"mean"`` (``chunkop.sum`` / ``mean``): a running sum over the chunks, in the
  dtype of ``jnp.sum``'s (``jnp.mean``'s) result, widened to float32 for half precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._chunking import ChunkPlan, Remat, accumulation_dtype, stack_chunks, sum_chunks
from ._progress import Progress
from ._sharding import MeshAxes, on_devices
from ._trace import eval_traced

__all__ = ["KINDS", "LoopSpec", "device_loop", "finish_sums", "make_loop", "result_dtype", "sum_dtypes"]

#: The kinds of chunked transform: how chunk outputs combine.
KINDS = ("stack", "sum", "mean")


class LoopSpec(NamedTuple):
    """Everything static about one chunk loop besides the jaxpr (hashable: part of its key)."""

    axes: tuple  # the mapped axis of each mapped leaf
    plan: ChunkPlan
    remat: Remat
    spmd_axis_name: Any
    out_axes: tuple  # flat, one per output leaf (stacking loops only)
    progress: Progress = None
    devices: int = 1  # > 1: the loop of one device's shard, run by device_loop


def result_dtype(kind: str, dtype: Any) -> Any:
    """The dtype a ``"sum"``/``"mean"`` of outputs of ``dtype`` has (``jnp.sum``'s / ``jnp.mean``'s)."""
    reduce = jnp.mean if kind == "mean" else jnp.sum
    return jax.eval_shape(lambda o: reduce(o, 0), jax.ShapeDtypeStruct((1,), dtype)).dtype


def sum_dtypes(kind: str, out_leaves: list) -> tuple[list, list]:
    """The result dtypes of a ``"sum"``/``"mean"`` of outputs like ``out_leaves`` (``jnp.sum``'s /
    ``jnp.mean``'s), and the dtypes the chunk sums accumulate in (float32 for half precision)."""
    final = [result_dtype(kind, s.dtype) for s in out_leaves]
    return final, [accumulation_dtype(d) for d in final]


def finish_sums(totals: list, kind: str, size: int, final: list) -> list:
    """The accumulated ``totals`` over an axis of ``size`` as the result: divided by ``size`` for
    ``"mean"`` (in the totals' own, inexact, dtype), cast to the ``final`` dtypes."""
    if kind == "mean":
        totals = [t / jnp.asarray(size, t.dtype) for t in totals]
    return [t.astype(d) for t, d in zip(totals, final)]


def _chunk_vmap(jaxpr: Any, spec: LoopSpec, consts: list, out_axes: Any, m: int) -> Callable:
    """One chunk of ``m`` examples: ``jax.vmap`` of the traced jaxpr (constants unmapped)."""

    def one(*example: Any) -> tuple:
        return tuple(eval_traced(jaxpr, consts, *example))

    return jax.vmap(one, in_axes=0, out_axes=out_axes, axis_size=m, spmd_axis_name=spec.spmd_axis_name)


def _moved(mapped: list, axes: tuple) -> list:
    return [jnp.moveaxis(x, a, 0) if a else x for x, a in zip(mapped, axes)]


def _stack_loop(jaxpr: Any, out_shapes: Any, spec: LoopSpec) -> Callable[[list, list], Any]:
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    oaxes = list(spec.out_axes)
    stacked = [k for k, a in enumerate(oaxes) if a is not None]
    carried = [k for k, a in enumerate(oaxes) if a is None]

    def loop(consts: list, mapped: list) -> Any:
        def chunk_fn(chunk: list, consts: list, m: int) -> tuple[list, list]:
            outs = _chunk_vmap(jaxpr, spec, consts, tuple(oaxes), m)(*chunk)
            return [outs[k] for k in stacked], [outs[k] for k in carried]

        ys, zs = stack_chunks(
            chunk_fn,
            _moved(mapped, spec.axes),
            spec.plan,
            spec.remat,
            [out_leaves[k] for k in carried],
            progress=spec.progress,
            recompute_custom_vjp=True,
            axes=[oaxes[k] for k in stacked],
            by_index=spec.devices > 1,
            unmapped=consts,
        )
        result: list[Any] = [None] * len(out_leaves)
        for j, k in enumerate(stacked):
            result[k] = ys[j]
        for j, k in enumerate(carried):
            result[k] = zs[j]
        return jax.tree_util.tree_unflatten(out_tree, result)

    return loop


def _sum_loop(jaxpr: Any, out_shapes: Any, spec: LoopSpec, kind: str) -> Callable[[list, list], Any]:
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    final, acc = sum_dtypes(kind, out_leaves)
    accumulate = _accumulation(jaxpr, spec, acc)

    def loop(consts: list, mapped: list) -> Any:
        total = accumulate(consts, mapped, _zero_sums(out_leaves, acc))
        return jax.tree_util.tree_unflatten(out_tree, finish_sums(total, kind, spec.plan.size, final))

    return loop


def _zero_sums(out_leaves: list, acc: list, lead: tuple = ()) -> list:
    """The running sums' starting values, in the accumulation dtypes ``acc`` (``lead``
    prepended to each shape)."""
    return [jnp.zeros(lead + tuple(s.shape), d) for s, d in zip(out_leaves, acc)]


def _accumulation(jaxpr: Any, spec: LoopSpec, acc: list) -> Callable[[list, list, list], list]:
    """``(consts, mapped, init) -> init + the chunk sums`` (flat, in the accumulation dtypes ``acc``)."""

    def accumulate(consts: list, mapped: list, init: list) -> list:
        def chunk_fn(chunk: list, consts: list, m: int) -> list:
            outs = _chunk_vmap(jaxpr, spec, consts, 0, m)(*chunk)
            return [jnp.sum(o, axis=0, dtype=d) for o, d in zip(outs, acc)]

        return sum_chunks(
            chunk_fn,
            _moved(mapped, spec.axes),
            spec.plan,
            spec.remat,
            init,
            spec.progress,
            recompute_custom_vjp=True,
            by_index=spec.devices > 1,
            unmapped=consts,
        )

    return accumulate


def device_loop(
    kind: str, jaxpr: Any, out_shapes: Any, spec: LoopSpec, mesh_axes: MeshAxes
) -> Callable[[list, list], Any]:
    """The chunk loop over mapped leaves whose mapped axis is sharded over ``mesh_axes``: the loop
    of one device's shard run by every device on its own (the device layout,
    :func:`chunkop._sharding.on_devices`: ``fun`` sees what ``jax.vmap`` shows it; the
    constants' cotangents sum on each device and are added once at the end). Stacked outputs
    are joined back along their ``out_axes`` (sharded like the inputs); sums add the devices'
    running sums (one all-reduce) before ``"mean"`` divides.

    Args:
        kind, jaxpr, out_shapes: as :func:`make_loop`.
        spec: the loop of one device's shard (``spmd_axis_name`` None: its chunks are local;
            ``devices``: the number of devices).
        mesh_axes: the mesh axes the mapped axis is sharded over.

    Returns:
        ``(consts, mapped_leaves) -> result``, on the whole (sharded) leaves.
    """
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    shards = mesh_axes.n_shards
    if kind == "stack":
        per_device = make_loop(kind, jaxpr, out_shapes, spec)

        def loop(consts: list, mapped: list) -> Any:
            local = lambda m, c, _: jax.tree_util.tree_leaves(per_device(c, m))
            oaxes = list(spec.out_axes)
            spread = None not in oaxes  # (on_devices: a carried output keeps the constants whole)
            outs = on_devices(local, mapped, spec.axes, consts, mesh_axes, out_axes=oaxes, spread=spread)
            return jax.tree_util.tree_unflatten(out_tree, outs)

        return loop
    final, acc = sum_dtypes(kind, out_leaves)
    accumulate = _accumulation(jaxpr, spec, acc)

    def loop(consts: list, mapped: list) -> Any:
        # The running sums start per device (created here, not broadcast by the scan's batching
        # rule inside the loop: jax 0.10 loses the mesh there on Explicit meshes).
        init = _zero_sums(out_leaves, acc, (shards,))
        local = lambda m, c, i: accumulate(c, m, i)
        total = on_devices(local, mapped, spec.axes, consts, mesh_axes, reduce=True, per_device=init)
        return jax.tree_util.tree_unflatten(out_tree, finish_sums(total, kind, shards * spec.plan.size, final))

    return loop


def make_loop(kind: str, jaxpr: Any, out_shapes: Any, spec: LoopSpec) -> Callable[[list, list], Any]:
    """The chunk loop ``(consts, mapped_leaves) -> result`` of one kind of transform.

    Args:
        kind: ``"stack"`` (outputs stacked over chunks at ``spec.out_axes``), ``"sum"`` or
            ``"mean"`` (over the mapped axis, accumulated chunk by chunk; a mean of integers is
            summed in floating point, as ``jnp.mean`` does, never in a wrapping integer).
        jaxpr: ``fun`` traced on one example (its constvars: ``consts``; invars: one example of
            each mapped leaf).
        out_shapes: ``fun``'s per-example output structure (``jax.ShapeDtypeStruct`` leaves).
        spec: the loop's static settings (chunk plan, remat, progress ...).

    Returns:
        The loop, a pure function of the constants' and the mapped leaves' values.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._chunking import make_plan
        >>> from chunkop._loops import LoopSpec, make_loop
        >>> closed = jax.make_jaxpr(lambda x: 2 * x)(jnp.float32(0))
        >>> spec = LoopSpec(axes=(0,), plan=make_plan(6, 4), remat=True, spmd_axis_name=None, out_axes=())
        >>> make_loop("sum", closed.jaxpr, jax.ShapeDtypeStruct((), jnp.float32), spec)([], [jnp.ones(6)])
        Array(12., dtype=float32)
    """
    if kind == "stack":
        return _stack_loop(jaxpr, out_shapes, spec)
    if kind in ("sum", "mean"):
        return _sum_loop(jaxpr, out_shapes, spec, kind)
    raise ValueError(f"make_loop: `kind` must be one of {KINDS}, got {kind!r}.")
