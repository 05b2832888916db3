"""``chunk_size="auto"``: the plan of a call, made on the program the call will run.

This module is where the chunked transforms, ``RowOperator`` and :func:`plan` ask for a plan:
the checks of ``chunk_size``/``memory_budget``/``mode``, what a plan must cover (the transforms
the arguments are traced under, :func:`plan_mode`, and the enclosing ``jax.vmap``s, which the
candidate programs are compiled under, :func:`batching`), the one planner :func:`plan_program`
(``build(chunk)`` gives the programs a call runs at ``chunk``; the planner knows nothing else
of them), its use by the transforms (:func:`plan_traced`) and the public :func:`plan`. The
parts it is built on:

- :mod:`chunkop._memory`: what a program needs (compiled temp memory under the transforms a
  plan covers, :data:`MODES`) and what the device has (the default budget, the CPU cap);
- :mod:`chunkop._search`: the search for the largest chunk within the budget
  (:func:`choose_chunk`), the per-chunk overhead floor, and the :class:`BudgetPlan` it returns;
- :mod:`chunkop._estimate`: the compile-free estimates (an element's bytes, a chunk's fixed
  work) used on CPU under the throughput cap;
- :func:`chunkop._cache.cached_plan`: the plans, cached per call signature;
- :mod:`chunkop._operator.row_plan`: the plan of a ``RowOperator`` built with ``chunk_size="auto"``
  (its ``mv`` and ``T.mv`` given to :func:`plan_program`).

The planner imports nothing above it: a transform passes the loop to plan (``loop_at``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _estimate, _jaxpr
from ._axes import check_chunk_size
from ._cache import cached_plan
from ._fingerprint import Uncacheable, setting_key
from ._memory import MODES, check_mode, default_budget, program_temp_bytes, throughput_cap
from ._search import BudgetPlan, choose_chunk
from ._tree import struct_of as _struct

__all__ = [
    "MODES",
    "BudgetPlan",
    "check_memory_budget",
    "check_budget_needs_auto",
    "check_chunk_size_or_auto",
    "check_mode",
    "plan_mode",
    "Batching",
    "batching",
    "plan_program",
    "plan_traced",
    "plan",
    "not_planned",
]


def check_memory_budget(memory_budget: Any, where: str = "chunkop") -> int | None:
    """Validate ``memory_budget``: None (the default budget) or a positive number of bytes.

    Args:
        memory_budget: the value given.
        where: the caller, for the error messages.

    Returns:
        The budget in bytes (an int), or None.

    Raises:
        TypeError: for anything but a number (or None).
        ValueError: for a number below one byte, or not finite.
    """
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{where}: `memory_budget` must be a positive number of bytes or None, got "
            f"{memory_budget!r} of type {type(memory_budget).__name__}."
        )
    if not math.isfinite(memory_budget) or memory_budget < 1:
        raise ValueError(
            f"{where}: `memory_budget` must be a positive number of bytes (at least 1), got {memory_budget!r}."
        )
    return int(memory_budget)


def check_budget_needs_auto(chunk_size: Any, memory_budget: Any, where: str) -> None:
    """``memory_budget`` only means something with ``chunk_size="auto"``: refuse it otherwise.

    Args:
        chunk_size: the ``chunk_size`` given.
        memory_budget: the ``memory_budget`` given (None: not given).
        where: the caller, for the error message.

    Raises:
        ValueError: for a ``memory_budget`` with a ``chunk_size`` other than ``"auto"``.
    """
    if memory_budget is not None and chunk_size != "auto":
        raise ValueError(
            f'{where}: `memory_budget` is used only with chunk_size="auto" (it chooses the chunk), '
            f'but chunk_size={chunk_size!r}; pass chunk_size="auto", or drop memory_budget.'
        )


def check_chunk_size_or_auto(chunk_size: Any, *, allow_none: bool = True, where: str = "chunkop") -> Any:
    """Validate ``chunk_size``: ``"auto"``, or a chunk size.

    Args:
        chunk_size: the value given.
        allow_none: whether None (no chunking) is accepted.
        where: the caller, for the error messages.

    Returns:
        ``"auto"``, or the chunk size as validated by :func:`chunkop._axes.check_chunk_size`.

    Raises:
        TypeError: for a string other than ``"auto"`` (and as ``check_chunk_size`` raises).
    """
    if isinstance(chunk_size, str):
        if chunk_size == "auto":
            return "auto"
        raise TypeError(
            f"{where}: `chunk_size` must be a positive int, {'None, ' if allow_none else ''}or "
            f'"auto", got {chunk_size!r} of type str.'
        )
    return check_chunk_size(chunk_size, allow_none=allow_none, where=where)


# ----------------------------------------------------------------------------------------------
# What a plan must cover: the transforms the arguments are traced under, the enclosing batch.


def transform_depth(leaves: Sequence[Any]) -> int:
    """How many forward-mode levels (``jvp``/``linearize``, as ``grad`` and ``hvp`` use) the
    arguments are traced under: 0 outside any, 1 under ``grad``, 2 under ``jvp(grad)``."""
    depth = 0
    for x in leaves:
        d = 0
        while _jaxpr.is_forward_tracer(x):
            d += 1
            x = getattr(x, "primal", None)
        depth = max(depth, d)
    return depth


def plan_mode(leaves: Sequence[Any]) -> str:
    """The transforms to plan for: ``"grad"`` (forward and VJP: the default, since a
    ``jax.grad`` applied around an enclosing ``jax.jit`` is not visible at trace time), or
    ``"hvp"`` when the arguments are traced under two forward-mode levels."""
    return "hvp" if transform_depth(leaves) >= 2 else "grad"


class Batching(NamedTuple):
    """The enclosing ``jax.vmap``s a call is traced under, as the planner measures them.

    The planner compiles the candidate programs under the same ``jax.vmap``s (:meth:`wrap`), on
    the arguments with every batch dimension (:attr:`structs`), so what it measures is the
    program the call really compiles into: its chunk layout under the batch included.

    Attributes:
        sizes: the batch size of each enclosing ``jax.vmap``, innermost first.
        names: their axis names (None where unnamed), so a collective over one still binds.
        dims: per leaf, its batch dimension at each level (None: not batched there).
        structs: per leaf, its ``jax.ShapeDtypeStruct`` with every batch dimension.
        tangent: the batch found only in tangents (``jax.jacfwd``/``hessian`` around the call
            vmap over tangents, which the planner cannot rebuild): assumed to scale memory.
    """

    sizes: tuple[int, ...]
    names: tuple[Any, ...]
    dims: tuple[tuple[int | None, ...], ...]
    structs: tuple[Any, ...]
    tangent: int = 1

    @property
    def size(self) -> int:
        """The number of examples the call runs on at once: the product of every batch."""
        return math.prod(self.sizes) * self.tangent

    @property
    def measured(self) -> int:
        """The part of :attr:`size` that the measured programs include (the ``jax.vmap``s)."""
        return math.prod(self.sizes)

    def key(self) -> tuple:
        """What a cached plan depends on: the sizes, the dimensions and the batched shapes."""
        shapes = tuple((tuple(s.shape), str(s.dtype)) for s in self.structs)
        return (self.sizes, self.dims, shapes, self.tangent)

    def wrap(self, fn: Callable, at: Sequence[int]) -> Callable:
        """``fn`` of the leaves at positions ``at`` under the enclosing ``jax.vmap``s: a function
        of those leaves with every batch dimension (:attr:`structs`)."""
        for level, (size, name) in enumerate(zip(self.sizes, self.names)):
            fn = jax.vmap(fn, in_axes=tuple(self.dims[i][level] for i in at), axis_size=size, axis_name=name)
        return fn


def _tracer_levels(x: Any) -> tuple[Any, list[tuple[Any, int | None]], list[Any]]:
    """Peel ``x``'s tracers: its value under every transform, the ``jax.vmap`` levels it is
    batched at (``(trace, batch_dim)``, innermost first; forward-mode levels are skipped: they
    do not change shapes) and the ``jax.vmap`` traces found only in its tangents."""
    levels: list[tuple[Any, int | None]] = []
    tangent_traces: list[Any] = []
    for _ in range(64):
        if _jaxpr.is_batch_tracer(x):
            bd = x.batch_dim
            levels.append((x._trace, bd if isinstance(bd, int) else None))
            x = x.val
        elif _jaxpr.is_forward_tracer(x):
            t = getattr(x, "tangent", None)
            for _ in range(64):
                if _jaxpr.is_batch_tracer(t):
                    tangent_traces.append(t._trace)
                    t = t.val
                elif _jaxpr.is_forward_tracer(t):
                    t = getattr(t, "primal", None)
                else:
                    break
            x = x.primal
        else:
            break
    return x, levels, tangent_traces


def _depth(trace: Any) -> int:
    """How deeply ``trace`` is nested (its chain of parent traces): inner transforms are deeper."""
    depth = 0
    while trace is not None and depth < 256:
        depth += 1
        trace = getattr(trace, "parent_trace", None)
    return depth


def batching(leaves: Sequence[Any], batch_like: Sequence[int] = ()) -> Batching:
    """The enclosing ``jax.vmap``s the ``leaves`` are traced under (see :class:`Batching`).

    Args:
        leaves: the program's arguments (arrays, tracers or ``jax.ShapeDtypeStruct``).
        batch_like: positions of plain leaves (structures the program is built on, such as a
            ``RowOperator``'s ``x``) to batch at every level, along a new leading axis: what
            the call will pass there is not known when planning, and batched is the larger.

    Returns:
        The :class:`Batching`; ``sizes == ()`` outside any ``jax.vmap``.
    """
    peeled = [_tracer_levels(x) for x in leaves]
    traces: dict[int, Any] = {}
    for _, levels, _ in peeled:
        for trace, _ in levels:
            traces.setdefault(id(trace), trace)
    order = sorted(traces.values(), key=_depth, reverse=True)  # innermost first
    sizes = tuple(int(t.axis_data.size) for t in order)
    names = tuple(None if type(t.axis_data.name) is object else t.axis_data.name for t in order)
    extra = {id(t): t for _, _, ts in peeled for t in ts if id(t) not in traces}
    tangent = math.prod(int(t.axis_data.size) for t in extra.values())
    dims, structs = [], []
    for i, (base, levels, _) in enumerate(peeled):
        s = _struct(base)
        if i in batch_like:
            dims.append((0,) * len(order))
            structs.append(jax.ShapeDtypeStruct(sizes[::-1] + tuple(s.shape), s.dtype))
            continue
        at = {id(trace): d for trace, d in levels}
        dims.append(tuple(at.get(id(t)) for t in order))
        structs.append(s)
    return Batching(sizes, names, tuple(dims), tuple(structs), tangent)


def unchunked_plan(n: int, memory_budget: int | None, leaves: Sequence[Any]) -> BudgetPlan:
    """The plan of an ``"auto"`` call that does not chunk (an axis of one, or a collective)."""
    budget = memory_budget if memory_budget is not None else default_budget()
    return BudgetPlan(None, n, budget, plan_mode(leaves), None, 0, ())


# ----------------------------------------------------------------------------------------------
# The planner: one for the chunked transforms and RowOperator.

#: ``build(chunk)``: the programs to plan for at that chunk, each ``(fn, at)``: ``fn`` of the
#: leaves at positions ``at`` (the temp memory planned for is the worst of them).
Build = Callable[[int], Sequence[tuple[Callable, Sequence[int]]]]


def plan_program(
    build: Build,
    leaves: Sequence[Any],
    n: int,
    *,
    memory_budget: int | None,
    mode: str = "grad",
    key: Hashable | None = None,
    element_bytes: int | None = None,
    fixed_bytes: int | None = None,
    batch_like: Sequence[int] = (),
) -> BudgetPlan:
    """The (cached) ``"auto"`` plan of programs that chunk an axis of ``n``: the one planner.

    The planner knows a program only as ``build(chunk)``: the programs the call would run at
    ``chunk`` (a transform's loop; a ``RowOperator``'s ``mv`` and ``T.mv``), compiled on the
    shapes of ``leaves``. Under enclosing ``jax.vmap``s (the leaves are their tracers) it
    compiles them under the same ``jax.vmap``s (:func:`batching`), so the memory measured is
    the batched program's, chunk layout included; the budget and the temp memory are reported
    per example of that batch (``memory_budget`` divided by it, like the measured bytes). On
    CPU the search aims at the throughput cap (per example too), raised toward the per-chunk
    overhead floor (:func:`chunkop._search.overhead_floor`) from ``element_bytes`` and
    ``fixed_bytes``; with the cap far below the budget the chunk comes from those estimates
    without compiling (:func:`chunkop._search.choose_chunk`).

    Args:
        build: ``build(chunk) -> [(fn, at), ...]`` (see :data:`Build`).
        leaves: the arguments (arrays, tracers or ``jax.ShapeDtypeStruct``: shapes only).
        n: the size of the chunked axis (one device's shard of it when sharded).
        memory_budget: the budget in bytes, or None for :func:`chunkop._memory.default_budget`.
        mode: the transforms to plan for (:data:`MODES`).
        key: what the programs depend on besides the leaves' shapes, dtypes and (Explicit)
            shardings, ``n``, the budget, mode, cap and backend (e.g. the traced jaxpr's key);
            None: the plan is not cached.
        element_bytes: the estimated bytes of one element (:mod:`chunkop._estimate`), or None.
        fixed_bytes: the estimated fixed work of a chunk (:func:`chunkop._estimate.fixed_bytes`).
        batch_like: positions of plain leaves batched like the rest under enclosing vmaps.

    Returns:
        The :class:`BudgetPlan`; its ``chunk`` is None when the whole axis fits.

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> from chunkop._budget import plan_program
        >>> def build(chunk):  # one program, of leaf 0, whose temp memory grows with the chunk
        ...     return [(chunkop.sum(lambda r: jnp.sort(jnp.outer(r, r), axis=0)[0].sum(), chunk_size=chunk), [0])]
        >>> x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
        >>> p = plan_program(build, [x], 4096, memory_budget=2**20, mode="forward")
        >>> p.chunk is not None and p.compiled_bytes <= p.budget == 2**20
        True
    """
    batch = batching(leaves, batch_like)
    total = max(1, batch.size)
    budget = memory_budget if memory_budget is not None else default_budget()
    budget = max(1, budget // total)
    cap = throughput_cap()
    cap = None if cap is None else max(1, cap // total)

    def measure(fn: Callable, at: Sequence[int]) -> int:
        if batch.sizes:
            try:
                structs = [batch.structs[i] for i in at]
                whole = program_temp_bytes(batch.wrap(fn, at), structs, mode, forward_only_ok=False)
                return -(-whole // batch.measured)  # per example of the batch, rounded up
            except Exception:  # noqa: BLE001  (a program, or its derivative, JAX cannot batch here: per example)
                pass
        return program_temp_bytes(fn, [leaves[i] for i in at], mode)

    def compute() -> BudgetPlan:
        temp = lambda chunk: max(measure(fn, at) for fn, at in build(chunk))
        return choose_chunk(temp, n, budget, mode=mode, cap=cap, element_bytes=element_bytes, fixed_bytes=fixed_bytes)

    if key is None:
        return compute()
    # the leaves as the probes are compiled on them: shapes, dtypes and (Explicit) shardings
    avals = tuple((tuple(s.shape), str(s.dtype), s.sharding) for s in (_struct(x, typed=True) for x in leaves))
    full_key = (key, avals, batch.key(), n, budget, mode, cap, jax.default_backend())
    return cached_plan(full_key, compute)


def plan_traced(
    traced: Any,
    spec: Any,
    mapped: list,
    n: int,
    *,
    kind: str,
    memory_budget: int | None,
    loop_at: Callable[[int], Callable],
) -> BudgetPlan:
    """The (cached) plan of an ``"auto"`` transform, made on the program the call will run.

    The program at each probed chunk is the chunk loop built from the call's traced ``fun``
    (``traced``, a :class:`chunkop._trace.Traced`), compiled on the shapes of its constants and
    mapped inputs (``fun`` is not traced again, and no wrapper is re-entered), by
    :func:`plan_program`; the per-chunk overhead counted is the cotangents of ``fun``'s float
    constants (:func:`chunkop._estimate.fixed_bytes`) unless it is planned forward only.

    Args:
        traced: ``fun`` traced on one example.
        spec: the call's :class:`chunkop._loops.LoopSpec` (its plan is replaced per probe).
        mapped: the mapped argument leaves (arrays, tracers or ``jax.ShapeDtypeStruct``).
        n: the size of the mapped axis (one device's shard of it when sharded).
        kind: the loop's kind (``"stack"``, ``"sum"``, ``"mean"``).
        memory_budget: the budget in bytes, or None for :func:`default_budget`.
        loop_at: ``loop_at(chunk) -> loop``, the call's loop ``(consts, mapped) -> result`` at
            ``chunk``, built by the caller (the planner imports no loop module).

    Returns:
        The :class:`BudgetPlan`; its ``chunk`` is None when the whole axis fits.
    """
    leaves = [*traced.consts, *mapped]
    mode = plan_mode(leaves)
    k = len(traced.consts)

    def build(chunk: int) -> list:
        loop = loop_at(chunk)
        return [(lambda *flat: loop(list(flat[:k]), list(flat[k:])), range(len(leaves)))]

    key = None
    if traced.key is not None:
        try:
            key = ("auto", kind, traced.key, spec.axes, spec.out_axes, setting_key(spec.remat), spec.spmd_axis_name)
        except Uncacheable:
            key = None
    jaxpr = traced.jaxpr
    consts = jaxpr.constvars if mode != "forward" else []  # (their cotangents, summed per chunk)
    return plan_program(
        build,
        leaves,
        n,
        memory_budget=memory_budget,
        mode=mode,
        key=key,
        element_bytes=_estimate.element_bytes(jaxpr),
        fixed_bytes=_estimate.fixed_bytes(jaxpr, operands=consts),
    )


# ----------------------------------------------------------------------------------------------
# chunkop.plan.


def plan(f: Any, *args: Any, **kwargs: Any) -> BudgetPlan:
    """The memory plan of a ``chunk_size="auto"`` transform for these arguments (nothing runs).

    Args:
        f: a function made by ``chunkop.vmap`` / ``sum`` / ``mean`` (or ``chunkop.map``'s
            wrapper) with ``chunk_size="auto"``, or a ``chunkop.RowOperator`` (or its transpose)
            built with ``chunk_size="auto"``.
        *args: the positional arguments ``f`` would be called with (only their shapes and
            dtypes are used: they may be tracers); not needed for an operator.
        **kwargs: its keyword arguments, likewise.

    Returns:
        The :class:`BudgetPlan`: ``chunk`` (None: no chunking), ``budget``, ``mode``,
        ``predicted_bytes``, ``compiled_bytes`` and the ``probes`` compiled. Plans are cached per
        call signature, so calling ``f`` with the same arguments then plans nothing. With the
        mapped axis (or the operator's rows) sharded over devices, it is the plan each device
        makes for its own shard: ``size`` per shard, ``shards`` and ``global_size``.

    Raises:
        TypeError: when ``f`` is not an ``"auto"`` chunked transform or operator.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.vmap(jnp.sin, chunk_size="auto", memory_budget=2**30)
        >>> chunkop.plan(f, jnp.zeros(1000)).chunk is None  # the whole axis fits: no chunking
        True
    """
    plan_for = getattr(f, "plan_for", None)  # the one protocol: see not_planned
    if plan_for is None:
        raise not_planned(f)
    return plan_for(args, kwargs)


def not_planned(f: Any) -> TypeError:
    """The error of :func:`plan` for ``f``, which makes no ``"auto"`` plan.

    Every object :func:`plan` takes has a method ``plan_for(args, kwargs)`` returning its
    :class:`BudgetPlan` (the transforms, their bound methods, ``jacrev``/``jacfwd``, the row
    operators and their transposes); one that was not made with ``chunk_size="auto"`` raises
    this error from it.
    """
    return TypeError(
        f'chunkop.plan: expected a chunkop transform made with chunk_size="auto" (or a RowOperator '
        f"built with it), got {f!r}."
    )
