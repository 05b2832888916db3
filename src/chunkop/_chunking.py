"""The chunk plan: how a mapped axis of size ``n`` is cut, and the checkpointed scan over it.

A mapped axis of size ``n`` is cut into ``n // chunk`` full chunks, run by one
``jax.lax.scan`` whose body is ``jax.checkpoint``-ed (so reverse mode stores only the scan's
inputs and recomputes each chunk's intermediates), followed by one remainder chunk of
``n % chunk`` elements, computed by a second call of the same chunk function at that size.
No padding is used: padded rows can poison gradients (``log(0)``), and clamped dynamic slices
silently re-read rows; a separately traced remainder has neither problem. The price: when
``n % chunk != 0`` the first ``n - n % chunk`` rows of each mapped input are sliced off before
the reshape, and XLA materialises that slice (one copy of the mapped inputs, as in
``jax.lax.map(..., batch_size=...)``); when ``chunk`` divides ``n`` the reshape is free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ChunkPlan", "make_plan", "rematerialise", "stack_chunks", "sum_chunks"]

Remat = bool | Callable[..., Any]


class ChunkPlan(NamedTuple):
    """How an axis of ``size`` elements is cut into chunks of ``chunk`` elements."""

    size: int
    chunk: int
    n_full: int
    rem: int


def make_plan(size: int, chunk: int) -> ChunkPlan:
    """The plan for ``size`` elements in chunks of at most ``chunk`` (``chunk`` is clipped to ``size``)."""
    chunk = max(1, min(chunk, size))
    n_full, rem = divmod(size, chunk)
    return ChunkPlan(size, chunk, n_full, rem)


def rematerialise(fn: Callable, remat: Remat) -> Callable:
    """Wrap ``fn`` in ``jax.checkpoint`` (``remat=True``), a checkpoint policy (callable), or nothing."""
    if remat is False:
        return fn
    policy = None if remat is True else remat
    return jax.checkpoint(fn, prevent_cse=False, policy=policy)


def _split(x: jax.Array, plan: ChunkPlan) -> tuple[jax.Array, jax.Array | None]:
    """``x`` (leading axis ``plan.size``) as ``(n_full, chunk, ...)`` full chunks and a remainder."""
    cut = plan.n_full * plan.chunk
    main = x[:cut] if plan.rem else x
    main = main.reshape((plan.n_full, plan.chunk) + x.shape[1:])
    rem = x[cut:] if plan.rem else None
    return main, rem


def _split_all(mapped: Sequence[jax.Array], plan: ChunkPlan) -> tuple[list, list]:
    pairs = [_split(x, plan) for x in mapped]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def stack_chunks(
    chunk_fn: Callable[[list, int], tuple[list, list]],
    mapped: Sequence[jax.Array],
    plan: ChunkPlan,
    remat: Remat,
    carried_like: Sequence[Any] = (),
) -> tuple[list, list | None, list]:
    """Run ``chunk_fn`` over every chunk of the mapped arrays (leading axis ``plan.size``).

    Args:
        chunk_fn: ``chunk_fn(chunk_arrays, m) -> (ys, zs)`` for a chunk of ``m`` elements. ``ys``
            are stacked over chunks; ``zs`` (values that do not vary over the axis) are carried,
            the last one wins.
        mapped: arrays whose leading axis is the mapped axis.
        plan: the chunk plan.
        remat: whether (or with which policy) to rematerialise each chunk.
        carried_like: shape/dtype structs of ``zs``.

    Returns:
        ``(ys_full, ys_rem, zs)``: ``ys_full`` leaves have shape ``(n_full, *chunk_out_shape)``;
        ``ys_rem`` is the remainder chunk's ``ys`` (None when ``n % chunk == 0``).
    """
    main, rem = _split_all(mapped, plan)
    full_fn = rematerialise(lambda xs: chunk_fn(xs, plan.chunk), remat)

    def body(carry: list, xs: list) -> tuple[list, list]:
        ys, zs = full_fn(xs)
        return list(zs), list(ys)

    init = [jnp.zeros(z.shape, z.dtype) for z in carried_like]
    zs, ys_full = jax.lax.scan(body, init, main, length=plan.n_full)
    ys_rem = None
    if plan.rem:
        ys_rem, zs = rematerialise(lambda xs: chunk_fn(xs, plan.rem), remat)(rem)
        ys_rem, zs = list(ys_rem), list(zs)
    return ys_full, ys_rem, zs


def sum_chunks(
    chunk_fn: Callable[[list, int], Any],
    mapped: Sequence[jax.Array],
    plan: ChunkPlan,
    remat: Remat,
    init: Any,
) -> Any:
    """Accumulate ``init + sum over chunks of chunk_fn(chunk_arrays, m)`` (a pytree of arrays).

    Only the running sum is carried, so neither the forward pass nor (with ``remat``) the
    backward pass holds per-element outputs.
    """
    main, rem = _split_all(mapped, plan)
    full_fn = rematerialise(lambda xs: chunk_fn(xs, plan.chunk), remat)

    def body(acc: Any, xs: list) -> tuple[Any, None]:
        return jax.tree_util.tree_map(jnp.add, acc, full_fn(xs)), None

    acc, _ = jax.lax.scan(body, init, main, length=plan.n_full)
    if plan.rem:
        part = rematerialise(lambda xs: chunk_fn(xs, plan.rem), remat)(rem)
        acc = jax.tree_util.tree_map(jnp.add, acc, part)
    return acc
