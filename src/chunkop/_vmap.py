"""``chunkop.vmap`` and ``chunkop.map``: ``jax.vmap`` computed in sequential, rematerialised chunks."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _budget, _sharding
from ._axes import (
    check_axis_size,
    check_in_axes_spec,
    check_out_axes_spec,
    check_remat,
    flat_in_axes,
    flat_out_axes,
    mapped_size,
)
from ._cache import Uncacheable, cached, setting_key
from ._chunking import ChunkPlan, Remat, make_plan, narrow, stack_chunks, widen
from ._progress import Progress, check_progress
from ._trace import eval_traced, trace_example

__all__ = ["vmap", "map"]


def _wrap(fun: Callable, wrapper: Any) -> Any:
    """Give ``wrapper`` ``fun``'s name, docstring and ``__wrapped__``.

    Unlike ``functools.wraps``, ``fun.__dict__`` is *not* copied: the wrapper is a ``_Chunked``
    instance whose attributes (``fun``, ``in_axes``, ...) would otherwise be overwritten by
    those of a wrapped ``_Chunked`` (nesting) or of any callable object with attributes.
    """
    return functools.update_wrapper(wrapper, fun, updated=())


# ----------------------------------------------------------------------------------------------
# The compiled chunk loops. Built from the traced jaxpr and static settings only (never from the
# wrapper, which holds the user's function), so a cached loop keeps no user function alive.


class LoopSpec(NamedTuple):
    """Everything static about one chunk loop besides the jaxpr (hashable: part of its key)."""

    axes: tuple  # the mapped axis of each mapped leaf
    plan: ChunkPlan
    remat: Remat
    spmd_axis_name: Any
    out_axes: tuple  # flat, one per output leaf (stacking loops only)
    progress: Progress = None


def _chunk_vmap(jaxpr: Any, spec: LoopSpec, wide: list, consts: list, out_axes: Any, m: int) -> Callable:
    """One chunk of ``m`` examples: ``jax.vmap`` of the traced jaxpr (constants unmapped, given
    widened as ``wide`` and narrowed back to the dtypes of ``consts``)."""

    def one(*example: Any) -> tuple:
        return tuple(eval_traced(jaxpr, narrow(wide, consts), *example))

    return jax.vmap(one, in_axes=0, out_axes=out_axes, axis_size=m, spmd_axis_name=spec.spmd_axis_name)


def _refusing_derivatives(loop: Callable, message: str) -> Callable:
    """``loop`` unchanged forward; its JVP (so any derivative through it) raises ``message``."""

    @jax.custom_jvp
    def guarded(consts: list, mapped: list) -> Any:
        return loop(consts, mapped)

    @guarded.defjvp
    def _(primals: tuple, tangents: tuple) -> Any:
        raise ValueError(message)

    return guarded


def _moved(mapped: list, axes: tuple) -> list:
    return [jnp.moveaxis(x, a, 0) if a else x for x, a in zip(mapped, axes)]


def stack_loop(jaxpr: Any, out_shapes: Any, spec: LoopSpec) -> Callable[[list, list], Any]:
    """``(consts, mapped) -> outputs`` of ``jax.vmap``, stacked over chunks at ``spec.out_axes``."""
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    oaxes = list(spec.out_axes)
    stacked = [k for k, a in enumerate(oaxes) if a is not None]
    carried = [k for k, a in enumerate(oaxes) if a is None]
    plan = spec.plan

    def loop(consts: list, mapped: list) -> Any:
        wide = widen(consts)

        def chunk_fn(chunk: list, m: int) -> tuple[list, list]:
            outs = _chunk_vmap(jaxpr, spec, wide, consts, tuple(oaxes), m)(*chunk)
            return [outs[k] for k in stacked], [outs[k] for k in carried]

        ys_full, ys_rem, zs = stack_chunks(
            chunk_fn,
            _moved(mapped, spec.axes),
            plan,
            spec.remat,
            [out_leaves[k] for k in carried],
            progress=spec.progress,
        )
        result: list[Any] = [None] * len(out_leaves)
        for j, k in enumerate(stacked):
            a = oaxes[k]
            y = jnp.moveaxis(ys_full[j], 0, a)  # (..., n_full, chunk, ...)
            y = y.reshape(y.shape[:a] + (plan.n_full * plan.chunk,) + y.shape[a + 2 :])
            if ys_rem is not None:
                y = jnp.concatenate([y, ys_rem[j]], axis=a)
            result[k] = y
        for j, k in enumerate(carried):
            result[k] = zs[j]
        return jax.tree_util.tree_unflatten(out_tree, result)

    return loop


# ----------------------------------------------------------------------------------------------
# The shared machinery of every chunked transform: argument checks, tracing, the loop cache.


class _Chunked(abc.ABC):
    """A ``fun`` mapped over an axis in chunks. Subclasses define how chunk outputs combine."""

    where = "chunkop.vmap"
    shard_kind = "stack"  # how per-device results combine (see _sharding.call_sharded)

    def __init__(
        self,
        fun: Callable,
        in_axes: Any,
        *,
        chunk_size: int | None,
        axis_name: Hashable | None,
        axis_size: int | None,
        spmd_axis_name: Any,
        remat: Remat,
        progress: Progress = None,
        memory_budget: int | None = None,
    ) -> None:
        if not callable(fun):
            raise TypeError(f"{self.where}: `fun` must be callable, got {fun!r}.")
        self.fun = fun
        self.in_axes = check_in_axes_spec(in_axes, self.where)
        self.chunk_size = _budget.check_chunk_size_or_auto(chunk_size, where=self.where)
        self.memory_budget = _budget.check_memory_budget(memory_budget, self.where)
        _budget.check_budget_needs_auto(self.chunk_size, self.memory_budget, self.where)
        self.last_plan: _budget.BudgetPlan | None = None  # set by chunk_size="auto" calls
        self.axis_name = axis_name
        self.axis_size = check_axis_size(axis_size, self.where)
        self.spmd_axis_name = spmd_axis_name
        self.remat = check_remat(remat, self.where)
        self.progress = check_progress(progress, self.where)

    def _flat_arguments(self, args: tuple, kwargs: dict) -> tuple[list, Any, list, list]:
        return flat_in_axes(self.in_axes, args, kwargs, self.where)

    # -- per call ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline: checks -> no-chunk shortcut -> ``fun`` traced once -> plan -> one loop."""
        leaves, treedef, axes, paths = self._flat_arguments(args, kwargs)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where)
        chunk = self.chunk_size
        whole = _sharding.local_global_size() if self.axis_name is not None else None  # in a shard
        if chunk is None or (chunk != "auto" and n <= chunk):
            if whole is None or whole == n:
                return self._unchunked(args, kwargs)  # exactly jax.vmap, sharded inputs included
            chunk = n  # one device's whole shard: one chunk, axis-size queries giving the whole axis
        sharded = _sharding.mapped_mesh_axes(leaves, axes, self.where, self.spmd_axis_name)
        if sharded is not None:  # each device chunks its own shard (see _sharding)
            return _sharding.call_sharded(self, self.shard_kind, leaves, treedef, axes, n, sharded)
        if chunk == "auto" and n <= 1:
            return self._unchunked(args, kwargs)
        traced, spec = self._trace_and_plan(leaves, treedef, axes, n, chunk, whole)
        if traced is None:  # "auto" with a collective over axis_name: unchunked, as jax.vmap
            return self._unchunked(args, kwargs)
        mapped = [i for i, a in enumerate(axes) if a is not None]
        if not traced.stageable:
            if self.axis_name is not None:  # unrolled chunks would each see their own axis size
                return self._unchunked(args, kwargs)
            chunks = self._unstaged_chunks(leaves, treedef, axes, n, spec.plan.chunk)
            return self._join(chunks, traced.out_shapes, n)
        make = functools.partial(self._loop, traced.jaxpr, traced.out_shapes, spec)
        loop = make() if traced.key is None else self._cached_loop(traced.key, spec, make)
        if traced.derivative_error is not None:
            loop = _refusing_derivatives(loop, traced.derivative_error)
        return self._passed_through(loop(traced.consts, [leaves[i] for i in mapped]), traced)

    def _passed_through(self, out: Any, traced: Any) -> Any:
        """``out`` as it is (the stacking transforms return unmapped inputs themselves)."""
        return out

    def _trace_and_plan(
        self, leaves: list, treedef: Any, axes: list, n: int, chunk: int | str, whole: int | None = None
    ) -> tuple[Any, LoopSpec | None]:
        """``fun`` traced once on one example, and the loop's spec at ``chunk``.

        For ``"auto"`` the chunk is planned on that trace (``self.last_plan``); a plan that fits
        the whole axis is one chunk without remat or progress. Returns ``(None, None)`` when
        ``"auto"`` meets a collective over ``axis_name``: the call then runs unchunked. ``whole``
        is the whole axis' size when ``n`` is one device's shard of it.
        """
        try:
            traced = trace_example(
                self.fun,
                leaves,
                treedef,
                axes,
                n,
                axis_name=self.axis_name,
                chunk_size=n - 1 if chunk == "auto" else chunk,
                remat=self.remat,
                where=self.where,
                axis_env_size=whole,
            )
        except ValueError:
            if chunk == "auto" and self.axis_name is not None:
                # a collective over axis_name: chunks would each see part of the axis
                self.last_plan = _budget.unchunked_plan(n, self.memory_budget, leaves)
                return None, None
            raise
        mapped = [i for i, a in enumerate(axes) if a is not None]
        spec = LoopSpec(
            axes=tuple(axes[i] for i in mapped),
            plan=make_plan(n, n if chunk == "auto" else chunk),
            remat=self.remat,
            spmd_axis_name=self.spmd_axis_name,
            out_axes=self._flat_out_axes(traced.out_shapes),
            progress=self.progress,
        )
        if chunk == "auto":  # the chunk from the budget, planned on the traced program itself
            self.last_plan = _budget.plan_traced(self, traced, spec, [leaves[i] for i in mapped], n)
            chunk = self.last_plan.chunk or n
            spec = spec._replace(plan=make_plan(n, chunk))
            if chunk == n:  # the whole axis fits: one chunk, as jax.vmap (fun is not traced again)
                spec = spec._replace(remat=False, progress=None)
        return traced, spec

    def _unstaged_chunks(self, leaves: list, treedef: Any, axes: list, n: int, chunk: int) -> list:
        """Each chunk's per-example outputs, by a Python loop of ``jax.vmap`` calls of ``fun``.

        The fallback for a ``fun`` whose custom rule closes over a tracer of an enclosing
        transform: no staging boundary (``jit``, ``scan``, ``checkpoint``) may come between the
        rule and that tracer, so the chunks are unrolled. Values equal ``jax.vmap``'s; the
        program's size grows with ``n / chunk_size`` and reverse mode is not bounded by the chunk.
        """
        outs = []
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            flat = [x if a is None else jax.lax.slice_in_dim(x, start, start + m, axis=a) for x, a in zip(leaves, axes)]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            vmapped = jax.vmap(
                self.fun,
                in_axes=self.in_axes,
                out_axes=self._out_axes_spec(),
                axis_size=m,
                spmd_axis_name=self.spmd_axis_name,
            )
            outs.append(jax.tree_util.tree_leaves(vmapped(*args, **kwargs)))
        return outs

    def _out_axes_spec(self) -> Any:
        return 0

    @abc.abstractmethod
    def _join(self, chunk_outs: list, out_shapes: Any, n: int) -> Any:
        """Combine the per-chunk flat outputs of :meth:`_unstaged_chunks`."""

    def _cached_loop(self, key: Hashable, spec: LoopSpec, make: Callable[[], Callable]) -> Callable:
        try:
            full_key = (
                type(self).__name__,
                key,
                spec._replace(remat=setting_key(spec.remat), progress=setting_key(spec.progress)),
            )
            hash(full_key)
        except (Uncacheable, TypeError):
            return make()
        return cached(full_key, lambda: jax.jit(make()))

    def _flat_out_axes(self, out_shapes: Any) -> tuple:
        return ()

    @abc.abstractmethod
    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        """The result when nothing is chunked (``chunk_size`` is None or >= the axis size)."""

    @staticmethod
    @abc.abstractmethod
    def _loop(jaxpr: Any, out_shapes: Any, spec: LoopSpec) -> Callable[[list, list], Any]:
        """The chunk loop ``(consts, mapped_leaves) -> result`` (stack, sum, ...)."""


class _VMapped(_Chunked):
    def __init__(self, fun: Callable, in_axes: Any, out_axes: Any, **kw: Any) -> None:
        super().__init__(fun, in_axes, **kw)
        self.out_axes = check_out_axes_spec(out_axes, self.where)

    def _flat_out_axes(self, out_shapes: Any) -> tuple:
        return tuple(flat_out_axes(self.out_axes, out_shapes, self.where))

    _loop = staticmethod(stack_loop)

    def _out_axes_spec(self) -> Any:
        return self.out_axes

    def _passed_through(self, out: Any, traced: Any) -> Any:
        """An unmapped output that is one of ``fun``'s unmapped inputs unchanged (a constant of
        the trace, ``out_axes=None``) is returned as that very array, as ``jax.vmap`` does:
        not a copy made by the loop."""
        consts = {id(v): c for v, c in zip(traced.jaxpr.constvars, traced.consts)}
        leaves, tree = jax.tree_util.tree_flatten(out)
        oaxes = self._flat_out_axes(traced.out_shapes)
        for k, (v, a) in enumerate(zip(traced.jaxpr.outvars, oaxes)):
            if a is None and id(v) in consts and isinstance(consts[id(v)], jax.Array):
                leaves[k] = consts[id(v)]
        return jax.tree_util.tree_unflatten(tree, leaves)

    def _join(self, chunk_outs: list, out_shapes: Any, n: int) -> Any:
        out_tree = jax.tree_util.tree_structure(out_shapes)
        oaxes = flat_out_axes(self.out_axes, out_shapes, self.where)
        joined = [
            chunk_outs[-1][k] if a is None else jnp.concatenate([c[k] for c in chunk_outs], axis=a)
            for k, a in enumerate(oaxes)
        ]
        return jax.tree_util.tree_unflatten(out_tree, joined)

    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        vmapped = functools.partial(
            jax.vmap,
            self.fun,
            in_axes=self.in_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )
        try:
            return vmapped(out_axes=self.out_axes)(*args, **kwargs)
        except ValueError:
            # A bad `out_axes` gets the same message as on the chunked path; any other error
            # (from `fun` itself) is jax.vmap's, re-raised as is.
            try:
                shapes = jax.eval_shape(vmapped(out_axes=0), *args, **kwargs)
            except Exception:  # noqa: BLE001 - fun's own error: re-raised below as jax.vmap's
                shapes = None
            if shapes is not None:
                per_example = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes)
                flat_out_axes(self.out_axes, per_example, self.where)
            raise


def vmap(
    fun: Callable,
    in_axes: int | tuple | list | None = 0,
    out_axes: Any = 0,
    *,
    chunk_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
) -> Callable:
    """``jax.vmap`` that computes the mapped axis in sequential chunks of at most ``chunk_size``.

    The result equals ``jax.vmap(fun, in_axes, out_axes, ...)`` (up to float reduction order).
    The mapped axis of size ``n`` is cut into chunks of at most ``chunk_size`` run by one
    ``jax.lax.scan``: equal chunks when a divisor of ``n`` lies in ``[3/4 chunk_size,
    chunk_size]`` (20000 in chunks of 4096 runs as 5 x 4000), else ``n // chunk_size`` chunks
    plus one remainder chunk of ``n % chunk_size`` elements; each chunk is vectorised with
    ``jax.vmap``. With ``remat=True`` (default) each chunk is wrapped in
    ``jax.checkpoint``, so under ``grad``/``vjp``/``hessian`` the backward pass stores only the
    chunk inputs and recomputes one chunk at a time: temp memory is bounded by the chunk, not by
    ``n`` (apart from the per-example outputs themselves). When ``n % chunk_size != 0`` the scan
    reads each full chunk with an in-bounds dynamic slice inside the checkpointed body, so the
    inputs are not copied either. ``chunk_size=None`` or ``chunk_size >= n`` is exactly
    ``jax.vmap``.

    Tracing: when chunking, each call traces ``fun`` once on one abstract example (as
    ``jax.vmap`` traces it once per call; ``chunk_size="auto"`` plans on that same trace), so
    results always reflect the state at call time. Operations on unmapped concrete values alone
    are computed while tracing, as under ``jax.vmap`` (``if float(w.sum()) > 0:`` works).
    Arrays ``fun`` closes over, unmapped array arguments and tracers of enclosing transforms are
    hoisted out of that trace and passed to the compiled chunk loop as arguments (closure
    conversion); the loop is cached by what was traced (the jaxpr's structure, shapes and
    dtypes; ``custom_jvp``/``custom_vjp`` rules by what they trace to), never by ``fun``, so
    repeated calls compile once. Unmapped non-array arguments reach ``fun`` as ``jax.vmap``
    passes them. See :func:`chunkop.clear_caches`.

    Collectives over ``axis_name`` (``psum`` of mapped values, ``axis_index``, ``all_gather``
    ...) cannot be computed chunk by chunk; ``fun`` using one with ``chunk_size < n`` raises
    ``ValueError`` (also when only a custom rule uses it). Queries of the axis size
    (``lax.axis_size``, ``lax.psum`` of an unmapped value) give the full size ``n``.

    Args:
        fun: function to map. Keyword arguments are mapped over their axis 0 (as ``jax.vmap``).
        in_axes: int, None, or a tuple/list with one entry per positional argument, each a
            prefix pytree of that argument with int (negative allowed) or None leaves.
        out_axes: prefix pytree of the output with int or None leaves; None for outputs that do
            not vary over the mapped axis (an error, as in ``jax.vmap``, if they do).
        chunk_size: the largest number of elements vectorised at once; None for no chunking;
            ``"auto"`` for the largest chunk whose compiled temp memory (forward and VJP;
            also the Hessian-vector product when called under two ``jvp`` levels) fits
            ``memory_budget``, found from XLA's memory analysis once per call signature
            (no chunking when the whole axis fits); on CPU with the default budget, where only
            the 16 MiB throughput cap binds, from a compile-free estimate instead. Under an
            enclosing ``jax.vmap`` the budget is shared by its batch. See ``docs/scaling.md``.
        axis_name: name of the mapped axis, for collectives (see above).
        axis_size: size of the mapped axis; needed only when no argument is mapped.
        spmd_axis_name: passed to the per-chunk ``jax.vmap``.
        remat: True to rematerialise each chunk in reverse mode (bounded memory, about one extra
            forward pass of compute); False to store every chunk's residuals (memory grows
            with ``n``, as ``jax.lax.map``); or a ``jax.checkpoint`` policy to save some.
        progress: True to show progress on stderr (a tqdm bar on a terminal or in Jupyter when
            tqdm is installed, a ``\r`` line on a terminal, plain lines at most once a second in
            a log), reported from inside the compiled loop, eagerly and under ``jit``; or a
            callable ``progress(k, n)`` called on the host with ``k`` of ``n`` chunks done (the
            remainder counts as one). About 20 reports per loop (the first, the last and every
            ``ceil(n/20)``-th chunk), each call of the loop one run with ``k`` rising to ``n``;
            under ``jit(grad)`` the backward loop reports. Reports are asynchronous
            (``jax.effects_barrier()`` waits for them). None or False (default): nothing is
            added to the program. No report when not chunking.
        memory_budget: bytes of temp memory for ``chunk_size="auto"`` (only then: with
            another ``chunk_size`` it is refused); None for ``chunkop.settings().budget_fraction``
            (half) of the device's free memory.

    Returns:
        A function with ``fun``'s signature whose outputs have the mapped axis at ``out_axes``.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.vmap(lambda x, w: jnp.tanh(x @ w), in_axes=(0, None), chunk_size=3)
        >>> f(jnp.ones((10, 4)), jnp.ones((4, 2))).shape
        (10, 2)
    """
    return _wrap(
        fun,
        _VMapped(
            fun,
            in_axes,
            out_axes,
            chunk_size=chunk_size,
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
            remat=remat,
            progress=progress,
            memory_budget=memory_budget,
        ),
    )


class _Mapped(_VMapped):
    where = "chunkop.map"

    def _flat_arguments(self, args: tuple, kwargs: dict) -> tuple[list, Any, list, list]:
        # chunkop.map's only argument is `xs`: messages name it so (not `args[0]`).
        return flat_in_axes(self.in_axes, args, kwargs, self.where, arg_names=("xs",))


def map(  # noqa: A001
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str = "auto",
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
) -> Any:
    """``jax.lax.map(f, xs)`` over the leading axis of the pytree ``xs``, ``chunk_size`` at a time.

    Like ``jax.lax.map(f, xs, batch_size=chunk_size)``, but each chunk is rematerialised in
    reverse mode, so memory under ``grad`` stays bounded by the chunk. As :func:`chunkop.vmap`,
    ``f`` is traced on every call and the compiled chunk loop is reused by what was traced, so
    repeated eager calls compile once.

    Args:
        f: function of one slice of ``xs``.
        xs: pytree of arrays sharing a leading axis.
        chunk_size: the number of slices vectorised at once (a positive int), or ``"auto"``
            (the default; as in :func:`chunkop.vmap`: planned from ``memory_budget``, by
            compiling the chunk loop at a few sizes, once per signature).
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.
        memory_budget: as in :func:`chunkop.vmap`.

    Returns:
        The stacked outputs of ``f``, leading axis ``xs``'s leading axis.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.map(lambda x: x.sum(), jnp.ones((7, 3)), chunk_size=2)
        Array([3., 3., 3., 3., 3., 3., 3.], dtype=float32)
    """
    chunk_size = _budget.check_chunk_size_or_auto(chunk_size, allow_none=False, where=_Mapped.where)
    mapped = _Mapped(
        f,
        0,
        0,
        chunk_size=chunk_size,
        axis_name=None,
        axis_size=None,
        spmd_axis_name=None,
        remat=remat,
        progress=progress,
        memory_budget=memory_budget,
    )
    return mapped(xs)
