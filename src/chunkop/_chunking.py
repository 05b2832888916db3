"""The chunk plan: how a mapped axis of size ``n`` is cut, and the checkpointed scan over it.

A mapped axis of size ``n`` is cut into ``n // chunk`` full chunks, run by one
``jax.lax.scan`` whose body is ``jax.checkpoint``-ed (so reverse mode stores only the scan's
inputs and recomputes each chunk's intermediates), followed by one remainder chunk of
``n % chunk`` elements, computed by a second call of the same chunk function at that size.
No padding is used: padded rows can poison gradients (``log(0)``), and clamped dynamic slices
silently re-read rows; a separately traced remainder has neither problem.

How the scan reads its chunks: when ``chunk`` divides ``n`` (or without ``remat``) the mapped
inputs are reshaped to ``(n // chunk, chunk, ...)`` and scanned over, which is free. When it
does not, slicing off the first ``n - n % chunk`` rows for that reshape would copy the inputs,
so the scan runs over chunk indices instead and each chunk is read with an in-bounds
``lax.dynamic_slice`` *inside* the checkpointed body: nothing is copied, and reverse mode saves
only the index.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _jaxpr
from ._cache import register_cache
from ._progress import Progress, progress_hook
from ._sharding import explicit_context

__all__ = [
    "ChunkPlan",
    "make_plan",
    "divisors",
    "fusion_barrier",
    "rematerialise",
    "stack_chunks",
    "sum_chunks",
    "accumulation_dtype",
    "widen",
    "narrow",
]

Remat = bool | Callable[..., Any]


class ChunkPlan(NamedTuple):
    """How an axis of ``size`` elements is cut into chunks of ``chunk`` elements."""

    size: int
    chunk: int
    n_full: int
    rem: int


def accumulation_dtype(dtype: Any) -> Any:
    """What sums over chunks accumulate in: float32 for floats narrower than 32 bits, else ``dtype``."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return dtype


def widen(tree: Any) -> Any:
    """``tree`` with every leaf in its :func:`accumulation_dtype`.

    Operands that every chunk reads (unmapped constants) enter the scan widened and each chunk
    narrows its copy back (exactly: bf16 -> f32 -> bf16 is lossless), so reverse mode sums their
    cotangents over chunks in the scan's carry in float32.
    """

    def one(a: Any) -> Any:
        dtype = jnp.result_type(a)
        return a if accumulation_dtype(dtype) == dtype else jnp.asarray(a, accumulation_dtype(dtype))

    return jax.tree_util.tree_map(one, tree)


def narrow(tree: Any, like: Any) -> Any:
    """``tree`` cast back, leaf by leaf, to the dtypes of ``like`` (what :func:`widen` widened)."""
    return jax.tree_util.tree_map(
        lambda a, l: a if jnp.result_type(a) == jnp.result_type(l) else a.astype(jnp.result_type(l)), tree, like
    )


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (``n >= 1``), in no particular order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


@functools.lru_cache(maxsize=1024)  # registered with clear_caches below
def make_plan(size: int, chunk: int) -> ChunkPlan:
    """The plan for ``size`` elements in chunks of at most ``chunk`` (``chunk`` is clipped to ``size``).

    When ``chunk`` does not divide ``size`` but a divisor of ``size`` between ``3 chunk / 4`` and
    ``chunk`` does, the largest such divisor is the chunk: every chunk then has the same size, so
    no remainder chunk is traced and compiled (at 20000 rows in chunks of 4096, 5 chunks of 4000
    instead of 4 of 4096 and one of 3616: the compile time of ``jit(grad)`` of the LOS operator
    fell by 40%). Otherwise the plan keeps ``size // chunk`` full chunks and a remainder.

    Example:
        >>> make_plan(20000, 4096)
        ChunkPlan(size=20000, chunk=4000, n_full=5, rem=0)
        >>> make_plan(23, 5)  # 23 is prime: 4 chunks of 5 and a remainder of 3
        ChunkPlan(size=23, chunk=5, n_full=4, rem=3)
    """
    chunk = max(1, min(chunk, size))
    if size % chunk:
        chunk = max([d for d in divisors(size) if 4 * d >= 3 * chunk and d <= chunk], default=chunk)
    n_full, rem = divmod(size, chunk)
    return ChunkPlan(size, chunk, n_full, rem)


register_cache(make_plan.cache_clear)


def _is_plain(a: Any) -> bool:
    """Whether ``a`` is a numeric or boolean array (not, e.g., an array of PRNG keys)."""
    dtype = a.dtype if hasattr(a, "dtype") else jnp.result_type(a)
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _index_predicate(key: jax.Array | int) -> jax.Array:
    """A scalar ``True`` computed from a chunk index, which XLA cannot prove true.

    ``(bits of the index | 1) != 0`` holds for every index. The index first passes through
    ``lax.optimization_barrier``: a constant index (the remainder chunk's, or the full chunk's
    once XLA inlines a scan of one step) would otherwise be folded, and the conditional with
    it. XLA:CPU removes that barrier only after it has simplified the conditionals, so the
    conditional stays (``tests/test_remainder_transpose.py`` checks the optimized HLO).
    """
    index = jax.lax.optimization_barrier(jnp.asarray(key, jnp.int32))
    return (jax.lax.bitcast_convert_type(index, jnp.uint32) | 1) != 0


def fusion_barrier(chunk: Any, key: jax.Array | int | None = None) -> Any:
    """A chunk's mapped operands, passed through a conditional XLA cannot remove (CPU only).

    Applied by the chunk loops to every chunk they read (not to a plan of one chunk, which reads
    no slice), with ``key`` the chunk's index: the scan's index for the full chunks, the Python
    int ``n_full`` for the remainder (``None`` stands for index 0).

    The scan reads each chunk as a slice of the stacked rows (a ``dynamic-slice`` of the
    scan's input). XLA:CPU fuses that slice into the loop fusion that computes the weights
    from the row data, which for weights read twice (the users' literal
    ``-diff(exp(-(d - b) / (d s b)))``) runs far slower than the same fusion fed by plain
    buffers (figures: ``benchmarks/RESULTS.md``). Passing the chunk's operands through a
    ``lax.cond`` on a predicate that is always true but opaque to XLA (:func:`_index_predicate`;
    the false branch returns zeros) makes the chunk a separate buffer: XLA keeps a conditional
    whose branches differ, and nothing fuses across it. The weights still fuse into their
    consumer (the gather-dot of the matvec, the scatter-add's update of the transpose), which
    is the fastest form where the weights are cheap (the expm1 form). Neither
    ``lax.optimization_barrier`` on the computed weights (absent from XLA:CPU's optimized HLO)
    nor a ``lax.cond`` passing them through two identical branches separates them. Checked on
    the optimized HLO (``tests/test_operator_fusion.py``).

    The predicate comes from the chunk index, never from the chunk's data, for every chunk
    alike: under ``jax.vmap`` (an operator over sets of rows) a predicate computed from the
    batched chunk would be batched, and JAX would turn the conditional into a ``select``, which
    fuses; the index is never batched. And under ``jax.linear_transpose`` the data is linear,
    so no predicate may be computed from it.

    The barrier is chosen per platform when the program is lowered
    (``jax.lax.platform_dependent``): the conditional on CPU, the chunk unchanged on every other
    platform. So a program exported on a CPU host for an accelerator
    carries no barrier, and one exported for several platforms carries it for CPU only.
    """
    leaves, tree = jax.tree_util.tree_flatten(chunk)
    gated = [i for i, a in enumerate(leaves) if _is_plain(a) and np.size(a)]
    if not gated:
        return chunk
    index = 0 if key is None else key

    def on_cpu(index: jax.Array | int, ls: list) -> list:
        return jax.lax.cond(
            _index_predicate(index), lambda ls: list(ls), lambda ls: [jnp.zeros_like(a) for a in ls], ls
        )

    def elsewhere(index: jax.Array | int, ls: list) -> list:
        return list(ls)

    through = jax.lax.platform_dependent(index, [leaves[i] for i in gated], cpu=on_cpu, default=elsewhere)
    for i, a in zip(gated, through):
        leaves[i] = a
    return jax.tree_util.tree_unflatten(tree, leaves)


def rematerialise(fn: Callable, remat: Remat, recompute_custom_vjp: bool = False) -> Callable:
    """Wrap ``fn`` in ``jax.checkpoint`` (``remat=True``), a checkpoint policy (callable), or nothing.

    Under JAX's ``jax_custom_vjp3`` flag (without ``jax_remat3``), JAX 0.10 cannot differentiate
    ``jax.checkpoint`` around ``jax.vmap`` of a ``jax.custom_vjp`` function in reverse mode, in
    either order ("can't apply forward-mode autodiff (jvp) to a custom_vjp function"). With
    ``recompute_custom_vjp`` (the transforms' loops), a chunk whose trace calls one is then
    rematerialised by :func:`_recomputed` instead (see there for what that allows); every other
    chunk, and every chunk without ``recompute_custom_vjp`` (the operator kernels, whose chunks must
    stay linearly transposable), keeps ``jax.checkpoint``.
    """
    if remat is False:
        return fn
    policy = None if remat is True else remat
    checkpointed = jax.checkpoint(fn, prevent_cse=False, policy=policy)
    if not (recompute_custom_vjp and _checkpoint_breaks_custom_vjp()):
        return checkpointed

    def call(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not _jaxpr.has_eqn(closed.jaxpr, _jaxpr.is_custom_vjp):
            return checkpointed(*args)
        jaxpr, n_consts = closed.jaxpr, len(closed.consts)

        def run(*flat: Any) -> list:
            return jax.core.eval_jaxpr(jaxpr, list(flat[:n_consts]), *flat[n_consts:])

        symbolic_zeros = _jaxpr.has_eqn(jaxpr, _jaxpr.is_symbolic_zeros_custom_vjp)
        out = _recomputed(run, symbolic_zeros)(*closed.consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

    return call


def _checkpoint_breaks_custom_vjp() -> bool:
    """Whether ``jax.checkpoint`` cannot be differentiated around ``jax.vmap`` of a ``custom_vjp``:
    ``jax_custom_vjp3`` on and ``jax_remat3`` (whose checkpoint can) off."""
    return _jaxpr.custom_vjp3() and not getattr(jax.config, "jax_remat3", False)


def _recomputed(run: Callable[..., list], symbolic_zeros: bool = False) -> Callable[..., list]:
    """``run`` (a function of flat arrays: the chunk's closed-over values, then its inputs)
    rematerialised without ``jax.checkpoint``: a ``jax.custom_vjp`` whose forward rule saves
    only its inputs and whose backward rule recomputes ``run`` under ``jax.vjp``.

    The residuals are the chunk's inputs, as with the checkpoint: the closed-over values are
    the scan's constants, saved once, not per chunk (compiled temp memory equal to the
    checkpoint's with the flag off). The backward rule is plain JAX, so it is differentiated
    again for reverse mode of any order; the forward rule computes the primal through
    ``jax.vjp`` (its pullback unused), so the ``custom_vjp`` functions inside run their own
    forward rules, which an enclosing ``jvp`` (``jax.hessian``'s) differentiates. Forward mode
    through the chunk itself raises JAX's "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function", also where ``jax.vmap`` would not differentiate the ``custom_vjp``
    (a tangent only of values it does not read, e.g. a ``jax.jvp`` w.r.t. the mapped input of
    a traced constant's custom_vjp): pass ``remat=False`` there. A ``remat`` policy saves
    nothing more here. ``run`` closes over no tracer (a ``custom_vjp`` function may not).

    With ``symbolic_zeros`` (the chunk calls a ``custom_vjp`` whose rules take symbolic zeros)
    this one takes them too, and both its rules differentiate ``run`` w.r.t. the perturbed inputs
    only (the others held fixed), the backward rule only the outputs whose cotangent is not a
    symbolic zero: the rules inside then see the ``perturbed`` flags and ``SymbolicZero``
    cotangents they see under ``jax.vmap`` (differentiating every input told them that every
    input was perturbed, and gave them zero arrays for outputs nothing reads). Which inputs are
    perturbed reaches the backward rule in the residuals' tree: each input is in the first or
    the second of two tuples, ``None`` in the other. Without it every input is differentiated,
    as the rules cannot tell: a ``custom_vjp`` inside that no perturbed input reaches would be
    left for an enclosing transform, and jax 0.10.2 fails to ``vmap`` one under
    ``jax_custom_vjp3`` when nothing it reads is batched (``jax.hessian``'s outer vmap; the
    ``jax.vmap`` reference fails so too), which differentiating it here avoids.
    """

    @jax.custom_vjp
    def recomputed(*flat: Any) -> list:
        return run(*flat)

    def forward(*primals: Any) -> tuple[list, tuple]:
        flat = [p.value for p in primals] if symbolic_zeros else list(primals)
        perturbed = [p.perturbed for p in primals] if symbolic_zeros else [True] * len(flat)
        varying = _pick(flat, perturbed)
        out = jax.vjp(_restricted(run, flat, perturbed), *varying)[0] if varying else run(*flat)
        residuals = (
            tuple(v if p else None for v, p in zip(flat, perturbed)),
            tuple(None if p else v for v, p in zip(flat, perturbed)),
        )
        return out, residuals

    def backward(residuals: tuple, cotangents: list) -> tuple:
        varying, fixed = residuals
        perturbed = [v is not None for v in varying]
        flat = [v if p else c for v, c, p in zip(varying, fixed, perturbed)]
        nonzero = [not _jaxpr.is_symbolic_zero(c) for c in cotangents]
        if not (any(perturbed) and any(nonzero)):
            return (None,) * len(flat)
        some = lambda *xs: _pick(_restricted(run, flat, perturbed)(*xs), nonzero)
        pullback = jax.vjp(some, *_pick(flat, perturbed))[1]
        cts = iter(pullback(_pick(list(cotangents), nonzero)))
        return tuple(next(cts) if p else None for p in perturbed)

    recomputed.defvjp(forward, backward, symbolic_zeros=symbolic_zeros)
    return recomputed


def _pick(xs: Sequence[Any], which: Sequence[bool]) -> list:
    """The items of ``xs`` where ``which`` is true."""
    return [x for x, w in zip(xs, which) if w]


def _restricted(run: Callable[..., list], flat: Sequence[Any], perturbed: Sequence[bool]) -> Callable[..., list]:
    """``run`` as a function of the inputs marked ``perturbed`` only, the others fixed at their
    value in ``flat``."""

    def restricted(*varying: Any) -> list:
        it = iter(varying)
        return run(*[next(it) if p else v for v, p in zip(flat, perturbed)])

    return restricted


def _full_chunks(
    chunk_fn: Callable[[list, int], Any],
    mapped: Sequence[jax.Array],
    plan: ChunkPlan,
    remat: Remat,
    recompute: bool,
    by_index: bool = False,
) -> tuple[Any, Callable[[Any], Any]]:
    """What the scan runs over, and the (rematerialised) body applied to one item of it.
    ``by_index``: read chunks by index also in an Explicit mesh context (a device's loop under
    ``jax.vmap`` over the devices, where the index read's reverse mode passes JAX's checks)."""
    index = jnp.arange(plan.n_full, dtype=jnp.int32)  # (also the barrier's predicate: never batched)
    # Chunks are read by index from the inputs inside the body: a scan over a reshape
    # (n_full, chunk, ...) of them would be free alone, but under an enclosing jax.vmap the scan's
    # batching rule moves the batch axis behind the chunk axis, copying every batched input. Under
    # an Explicit mesh context a dividing chunk still scans the reshape: there the reverse mode of
    # the index read (a dynamic_update_slice of an unsharded chunk into a cotangent JAX types as
    # sharded) fails JAX's sharding checks.
    # Without remat the residuals cost far more than a copy; an empty axis has no chunk to read.
    if remat is False or plan.size == 0 or (plan.rem == 0 and not by_index and explicit_context()):
        cut = plan.n_full * plan.chunk
        xs = [(x[:cut] if plan.rem else x).reshape((plan.n_full, plan.chunk) + x.shape[1:]) for x in mapped]
        apply = lambda item: chunk_fn(fusion_barrier(list(item[0]), key=item[1]), plan.chunk)
        return (xs, index), rematerialise(apply, remat, recompute)

    def read_and_apply(i: jax.Array) -> Any:
        start = i * plan.chunk  # in bounds: start + chunk <= n_full * chunk <= n, so no clamping
        chunk = [jax.lax.dynamic_slice_in_dim(x, start, plan.chunk, axis=0) for x in mapped]
        return chunk_fn(fusion_barrier(chunk, key=i), plan.chunk)

    return index, rematerialise(read_and_apply, remat, recompute)


def _remainder(
    chunk_fn: Callable[[list, int], Any], mapped: Sequence[jax.Array], plan: ChunkPlan, remat: Remat, recompute: bool
) -> Any:
    """``chunk_fn`` on the last ``n % chunk`` elements (only called when there are some)."""
    cut = plan.n_full * plan.chunk
    apply = lambda rest: chunk_fn(fusion_barrier(list(rest), key=plan.n_full), plan.rem)
    return rematerialise(apply, remat, recompute)([x[cut:] for x in mapped])


def _unmapped_widened(chunk_fn: Callable, unmapped: Any) -> Callable[[list, int], Any]:
    """``chunk_fn(chunk, unmapped, m)`` as ``(chunk, m) -> ...``: ``unmapped`` enters the loop
    :func:`widen`-ed (here, outside it) and each chunk narrows its copy back (inside), so
    reverse mode sums its cotangents over the chunks in the wide dtype."""
    wide = widen(unmapped)
    return lambda chunk, m: chunk_fn(chunk, narrow(wide, unmapped), m)


def stack_chunks(
    chunk_fn: Callable[[list, Any, int], tuple[list, list]],
    mapped: Sequence[jax.Array],
    plan: ChunkPlan,
    remat: Remat,
    carried_like: Sequence[Any] = (),
    progress: Progress = None,
    recompute_custom_vjp: bool = False,
    axes: Sequence[int] | None = None,
    by_index: bool = False,
    unmapped: Any = (),
) -> tuple[list, list]:
    """Run ``chunk_fn`` over every chunk of the mapped arrays (leading axis ``plan.size``).

    Args:
        chunk_fn: ``chunk_fn(chunk_arrays, unmapped, m) -> (ys, zs)`` for a chunk of ``m``
            elements. ``ys`` are stacked over chunks; ``zs`` (values that do not vary over the
            axis) are carried, the last one wins.
        mapped: arrays whose leading axis is the mapped axis.
        plan: the chunk plan.
        remat: whether (or with which policy) to rematerialise each chunk.
        carried_like: shape/dtype structs of ``zs``.
        progress: None/False, True (a progress bar) or ``progress(k, n)``: see ``_progress``.
        recompute_custom_vjp: see :func:`rematerialise`.
        axes: where each of ``chunk_fn``'s ``ys`` has its chunk axis (default: 0 for all).
        by_index: see :func:`_full_chunks`.
        unmapped: a pytree every chunk reads whole (constants, parameters): it enters the loop
            :func:`widen`-ed and reaches ``chunk_fn`` narrowed back to its own dtypes, so
            reverse mode sums its cotangents over chunks in at least float32.

    Returns:
        ``(ys, zs)``: every ``ys`` leaf stacked over the whole axis (``plan.size`` long, at its
        position in ``axes``): the full chunks' outputs joined, then the remainder's.
    """
    chunk_fn = _unmapped_widened(chunk_fn, unmapped)
    if plan.n_full == 1 and not plan.rem:  # one chunk (an "auto" plan that fits): no loop, no report
        ys, zs = rematerialise(lambda c: chunk_fn(c, plan.chunk), remat, recompute_custom_vjp)(list(mapped))
        return list(ys), list(zs)
    xs, full_fn = _full_chunks(chunk_fn, mapped, plan, remat, recompute_custom_vjp, by_index)
    hook = progress_hook(plan, progress)
    xs, full_fn = hook.scan(xs, full_fn)

    def body(carry: list, item: Any) -> tuple[list, list]:
        ys, zs = full_fn(item)
        return list(zs), list(ys)

    init = [jnp.zeros(z.shape, z.dtype) for z in carried_like]
    zs, ys_full = jax.lax.scan(body, init, xs, length=plan.n_full)
    ys_rem = None
    if plan.rem:
        ys_rem, zs = hook.remainder(_remainder(chunk_fn, mapped, plan, remat, recompute_custom_vjp))
        ys_rem, zs = list(ys_rem), list(zs)
    return _join(ys_full, ys_rem, plan, [0] * len(ys_full) if axes is None else list(axes)), zs


def _join(ys_full: list, ys_rem: list | None, plan: ChunkPlan, axes: list) -> list:
    """The full chunks' stacked outputs (``(n_full, ...)``, each chunk's own axis at ``axes[k]``)
    joined along that axis into one of ``n_full * chunk``, then the remainder's appended."""
    out = []
    for k, (y, a) in enumerate(zip(ys_full, axes)):
        y = jnp.moveaxis(y, 0, a)  # (..., n_full, chunk, ...)
        y = y.reshape(y.shape[:a] + (plan.n_full * plan.chunk,) + y.shape[a + 2 :])  # (no -1: may be empty)
        out.append(y if ys_rem is None else jnp.concatenate([y, ys_rem[k]], axis=a))
    return out


def sum_chunks(
    chunk_fn: Callable[[list, Any, int], Any],
    mapped: Sequence[jax.Array],
    plan: ChunkPlan,
    remat: Remat,
    init: Any,
    progress: Progress = None,
    recompute_custom_vjp: bool = False,
    by_index: bool = False,
    unmapped: Any = (),
) -> Any:
    """``init + sum over chunks of chunk_fn(chunk_arrays, unmapped, m)`` (a pytree like ``init``).

    The running sum is carried in the :func:`widen`-ed dtypes of ``init`` (each chunk's sum
    widened into it) and returned in ``init``'s dtypes; only it is carried, so neither the
    forward pass nor (with ``remat``) the backward pass holds per-element outputs.
    ``recompute_custom_vjp``: see :func:`rematerialise`; ``by_index``: see
    :func:`_full_chunks`; ``unmapped``: as for :func:`stack_chunks`.
    """
    like, init = init, widen(init)
    per_chunk = _unmapped_widened(chunk_fn, unmapped)
    chunk_fn = lambda chunk, m: widen(per_chunk(chunk, m))
    if plan.n_full == 1 and not plan.rem:  # one chunk: no loop, no report
        one = rematerialise(lambda c: chunk_fn(c, plan.chunk), remat, recompute_custom_vjp)(list(mapped))
        return narrow(jax.tree_util.tree_map(jnp.add, init, one), like)
    xs, full_fn = _full_chunks(chunk_fn, mapped, plan, remat, recompute_custom_vjp, by_index)
    hook = progress_hook(plan, progress)
    xs, full_fn = hook.scan(xs, full_fn)

    def body(acc: Any, item: Any) -> tuple[Any, None]:
        return jax.tree_util.tree_map(jnp.add, acc, full_fn(item)), None

    acc, _ = jax.lax.scan(body, init, xs, length=plan.n_full)
    if plan.rem:
        rest = _remainder(chunk_fn, mapped, plan, remat, recompute_custom_vjp)
        acc = jax.tree_util.tree_map(jnp.add, acc, hook.remainder(rest))
    return narrow(acc, like)
