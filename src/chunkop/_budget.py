"""``chunk_size="auto"``: the plan of a call, made on the program the call will run.

This module is where the chunked transforms, ``RowOperator`` and :func:`plan` ask for a plan:
the checks of ``chunk_size``/``memory_budget``/``mode``, what a plan must cover (the transforms
the arguments are traced under, :func:`plan_mode`, and the enclosing ``jax.vmap``s that multiply
the memory, :func:`enclosing_batch`), the (cached) plan of a transform's call on the loop it
traced (:func:`plan_traced`) and the public :func:`plan`. The parts it is built on:

- :mod:`chunkop._memory`: what a program needs (compiled temp memory under the transforms a
  plan covers, :data:`MODES`) and what the device has (the default budget, the CPU cap);
- :mod:`chunkop._search`: the search for the largest chunk within the budget
  (:func:`choose_chunk`), and the :class:`BudgetPlan` it returns;
- :mod:`chunkop._estimate`: the compile-free estimate used on CPU under the throughput cap;
- :func:`chunkop._cache.cached_plan`: the plans, cached per call signature;
- :mod:`chunkop._operator.row_plan`: the plan of a ``RowOperator`` built with ``chunk_size="auto"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _estimate
from ._axes import check_chunk_size
from ._cache import cached_plan
from ._chunking import make_plan
from ._loops import make_loop
from ._memory import MODES, check_mode, default_budget, program_temp_bytes, throughput_cap
from ._search import BudgetPlan, choose_chunk

__all__ = [
    "MODES",
    "BudgetPlan",
    "check_memory_budget",
    "check_budget_needs_auto",
    "check_chunk_size_or_auto",
    "check_mode",
    "plan_mode",
    "enclosing_batch",
    "plan_traced",
    "plan",
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
# chunk_size="auto" on the chunked transforms (chunkop.vmap / map / sum / mean / jacrev / jacfwd).


def transform_depth(leaves: Sequence[Any]) -> int:
    """How many forward-mode levels (``jvp``/``linearize``, as ``grad`` and ``hvp`` use) the
    arguments are traced under: 0 outside any, 1 under ``grad``, 2 under ``jvp(grad)``."""
    depth = 0
    for x in leaves:
        d = 0
        while type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
            d += 1
            x = getattr(x, "primal", None)
        depth = max(depth, d)
    return depth


def plan_mode(leaves: Sequence[Any]) -> str:
    """The transforms to plan for: ``"grad"`` (forward and VJP: the default, since a
    ``jax.grad`` applied around an enclosing ``jax.jit`` is not visible at trace time), or
    ``"hvp"`` when the arguments are traced under two forward-mode levels."""
    return "hvp" if transform_depth(leaves) >= 2 else "grad"


def enclosing_batch(leaves: Sequence[Any]) -> int:
    """The number of examples enclosing ``jax.vmap``s (also ``jacfwd``/``hessian``, which vmap
    over basis vectors) run a call on at once: the product of their batch sizes, 1 outside any.

    One compiled chunk loop under such a vmap holds that many chunks' temporaries at once, so
    ``"auto"`` plans for ``memory_budget`` divided by it.
    """

    def batch(x: Any, depth: int) -> int:
        if depth > 16:
            return 1
        kind = type(x).__name__
        if kind == "BatchTracer":
            bd = x.batch_dim
            size = int(x.val.shape[bd]) if isinstance(bd, int) else 1
            return size * batch(x.val, depth + 1)
        if kind in ("JVPTracer", "LinearizeTracer"):
            return max(batch(x.primal, depth + 1), batch(getattr(x, "tangent", None), depth + 1))
        return 1

    return max([batch(x, 0) for x in leaves], default=1)


def unchunked_plan(n: int, memory_budget: int | None, leaves: Sequence[Any]) -> BudgetPlan:
    """The plan of an ``"auto"`` call that does not chunk (an axis of one, or a collective)."""
    budget = memory_budget if memory_budget is not None else default_budget()
    return BudgetPlan(None, n, budget, plan_mode(leaves), None, 0, ())


def plan_traced(traced: Any, spec: Any, mapped: list, n: int, *, kind: str, memory_budget: int | None) -> BudgetPlan:
    """The (cached) plan of an ``"auto"`` transform, made on the program the call will run.

    The candidate programs are the chunk loop built from the call's traced ``fun`` (``traced``,
    a :class:`chunkop._trace.Traced`) at each probed chunk, compiled on the shapes of its
    constants and mapped inputs (``fun`` is not traced again, and no wrapper is re-entered).
    The budget is ``memory_budget`` (default: :func:`default_budget`) divided by the batch of
    enclosing ``jax.vmap``s (:func:`enclosing_batch`). The planner knows the program only as
    "the loop of this kind at chunk c" (:func:`chunkop._loops.make_loop`).

    Args:
        traced: ``fun`` traced on one example.
        spec: the call's :class:`chunkop._loops.LoopSpec` (its plan is replaced per probe).
        mapped: the mapped argument leaves (arrays, tracers or ``jax.ShapeDtypeStruct``).
        n: the size of the mapped axis (one device's shard of it when sharded).
        kind: the loop's kind (``"stack"``, ``"sum"``, ``"mean"``).
        memory_budget: the budget in bytes, or None for :func:`default_budget`.

    Returns:
        The :class:`BudgetPlan`; its ``chunk`` is None when the whole axis fits.
    """
    leaves = [*traced.consts, *mapped]
    budget = memory_budget if memory_budget is not None else default_budget()
    budget = max(1, budget // enclosing_batch(leaves))
    mode = "forward" if traced.derivative_error else plan_mode(leaves)  # (it cannot be differentiated)
    k = len(traced.consts)
    probe_spec = spec._replace(progress=None)

    def temp_bytes(chunk: int) -> int:
        loop = make_loop(kind, traced.jaxpr, traced.out_shapes, probe_spec._replace(plan=make_plan(n, min(chunk, n))))
        return program_temp_bytes(lambda *flat: loop(list(flat[:k]), list(flat[k:])), leaves, mode)

    def compute() -> BudgetPlan:
        estimate = _estimate.element_bytes(traced.jaxpr)
        return choose_chunk(temp_bytes, n, budget, mode=mode, cap=throughput_cap(), element_bytes=estimate)

    if traced.key is None:
        return compute()
    from ._cache import Uncacheable, setting_key

    try:
        remat = setting_key(spec.remat)
    except Uncacheable:
        return compute()
    avals = tuple((tuple(jax.typeof(x).shape), str(jax.typeof(x).dtype)) for x in leaves)
    key = ("auto", kind, traced.key, avals, spec.axes, spec.out_axes, n, budget, mode, remat)
    key += (spec.spmd_axis_name, jax.default_backend())
    return cached_plan(key, compute)


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
    target = getattr(f, "operator", f)
    if hasattr(target, "budget_plan") and hasattr(target, "rows"):
        if target.budget_plan is None:
            raise TypeError('chunkop.plan: this RowOperator was not built with chunk_size="auto".')
        return target.budget_plan
    if getattr(f, "chunk_size", None) == "auto" and hasattr(f, "jacobian_of"):  # chunkop.jacrev / jacfwd
        jax.eval_shape(functools.partial(f, **kwargs), *args)  # plans (cached) what a call would; runs nothing
        return f.last_plan
    if getattr(f, "chunk_size", None) != "auto" or not hasattr(f, "plan_for"):
        raise TypeError(
            f'chunkop.plan: expected a chunkop transform made with chunk_size="auto" (or such a '
            f"RowOperator), got {f!r}."
        )
    return f.plan_for(args, kwargs)
