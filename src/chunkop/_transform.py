"""The one chunked transform behind ``chunkop.vmap``, ``map``, ``sum`` and ``mean``.

:class:`Chunked` maps ``fun`` over an axis in chunks; its ``kind`` (see :data:`chunkop._loops.KINDS`)
says how the chunk outputs combine. Every call goes through one pipeline, each stage once:

1. the arguments are checked (``in_axes`` against the call, the mapped axis' size);
2. ``chunk_size=None`` (or ``>= n``) is exactly ``jax.vmap`` (sharded inputs and collectives
   included);
3. ``fun`` is traced once, on one example (:func:`chunkop._trace.trace_example`);
4. the plan is made as data: the chunk (from the budget for ``"auto"``, on that trace), the
   sharding (each device chunks its own shard), the progress setting (:class:`LoopSpec`);
5. one compiled loop runs (:func:`chunkop._loops.make_loop`, cached by what was traced).

No stage calls back into an earlier one: with sharded inputs the same stages plan one device's
shard, and one compiled program runs each device's loop (:func:`chunkop._loops.device_loop`);
the wrapper is never re-entered.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

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
    uses_vmappables,
)
from ._cache import cached
from ._chunking import Remat, make_plan
from ._fingerprint import Uncacheable, setting_key
from ._loops import KINDS, LoopSpec, device_loop, finish_sums, make_loop, sum_dtypes
from ._progress import Progress, check_progress
from ._sharding import check_even
from ._trace import CollectiveError, Traced, trace_example
from ._tree import resized

__all__ = ["Bound", "Chunked"]

#: The plan of each transform's last ``chunk_size="auto"`` call (read by ``Chunked.last_plan``):
#: kept beside the transforms, which are immutable, and dropped with them.
_LAST_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_WRAPPED = ("__module__", "__name__", "__qualname__", "__doc__")


@dataclasses.dataclass(init=False, eq=False, repr=False)
class Chunked:
    """``fun`` mapped over an axis in chunks; ``kind`` says how the chunk outputs combine.

    Immutable once made; a descriptor like a function, so a transform defined in a class body
    (``@functools.partial(chunkop.vmap, in_axes=(None, 0))`` on a method) binds the instance as
    its first argument, as ``jax.vmap`` does (:class:`Bound`). ``fun``'s name, docstring
    and module are copied (``__wrapped__`` is ``fun``), not its ``__dict__``: the transform's
    attributes (``fun``, ``in_axes`` ...) would otherwise be overwritten by those of a wrapped
    transform or of any callable object with attributes.

    Attributes:
        kind: ``"stack"`` (``jax.vmap``'s outputs), ``"sum"`` or ``"mean"`` over the mapped axis.
        where: the public name, for messages (``"chunkop.vmap"`` ...).
        last_plan: the :class:`chunkop.BudgetPlan` of the last ``chunk_size="auto"`` call.
    """

    # declared (set once, checked, by __init__; never again: __setattr__ refuses)
    fun: Callable
    kind: str
    where: str
    arg_names: tuple
    in_axes: Any
    out_axes: Any
    chunk_size: int | str | None
    memory_budget: int | None
    axis_name: Hashable | None
    axis_size: int | None
    spmd_axis_name: Any
    remat: Remat
    progress: Progress

    def __init__(
        self,
        fun: Callable,
        in_axes: Any,
        out_axes: Any = 0,
        *,
        kind: str,
        where: str,
        chunk_size: int | str | None,
        axis_name: Hashable | None = None,
        axis_size: int | None = None,
        spmd_axis_name: Any = None,
        remat: Remat = True,
        progress: Progress = None,
        memory_budget: int | None = None,
        arg_names: tuple[str, ...] = (),
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"chunkop: `kind` must be one of {KINDS}, got {kind!r}.")
        if not callable(fun):
            raise TypeError(f"{where}: `fun` must be callable, got {fun!r}.")
        chunk_size = _budget.check_chunk_size_or_auto(chunk_size, where=where)
        memory_budget = _budget.check_memory_budget(memory_budget, where)
        _budget.check_budget_needs_auto(chunk_size, memory_budget, where)
        settings = {
            "fun": fun,
            "kind": kind,
            "where": where,
            "arg_names": arg_names,
            "in_axes": check_in_axes_spec(in_axes, where),
            "out_axes": check_out_axes_spec(out_axes, where) if kind == "stack" else 0,
            "chunk_size": chunk_size,
            "memory_budget": memory_budget,
            "axis_name": axis_name,
            "axis_size": check_axis_size(axis_size, where),
            "spmd_axis_name": spmd_axis_name,
            "remat": check_remat(remat, where),
            "progress": check_progress(progress, where),
        }
        settings.update({name: getattr(fun, name) for name in _WRAPPED if hasattr(fun, name)})
        settings["__wrapped__"] = fun
        for name, value in settings.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self.where}: a chunked transform is immutable; make a new one to change {name!r}.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{self.where}: a chunked transform is immutable; cannot delete {name!r}.")

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """As a function's: looked up on an instance, the transform bound to it."""
        return self if instance is None else Bound(self, instance)

    def __repr__(self) -> str:
        return f"<{self.where} of {getattr(self, '__qualname__', self.fun)!s}, chunk_size={self.chunk_size!r}>"

    @property
    def last_plan(self) -> _budget.BudgetPlan | None:
        """The :class:`chunkop.BudgetPlan` of the last ``chunk_size="auto"`` call (or
        :meth:`plan_for`); None before any."""
        return _LAST_PLANS.get(self)

    def _record(self, plan: _budget.BudgetPlan) -> _budget.BudgetPlan:
        _LAST_PLANS[self] = plan
        return plan

    # -- stage 1: checks -------------------------------------------------------------------------
    def _flat_arguments(self, args: tuple, kwargs: dict) -> tuple[list, Any, list, list]:
        return flat_in_axes(self.in_axes, args, kwargs, self.where, arg_names=self.arg_names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if uses_vmappables(self.in_axes, args, kwargs):  # JAX's vmappable types: as jax.vmap
            return self._unchunked(args, kwargs)
        leaves, treedef, axes, paths = self._flat_arguments(args, kwargs)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where, chunked=self.chunk_size is not None)
        chunk = self.chunk_size
        # -- stage 2: no chunking is exactly jax.vmap
        if chunk is None or (chunk != "auto" and n <= chunk):
            return self._unchunked(args, kwargs)
        sharded = _sharding.mapped_mesh_axes(leaves, axes, self.where, self.spmd_axis_name)
        if sharded is not None and sharded.n_shards > 1:
            return self._call_sharded(args, kwargs, leaves, treedef, axes, n, sharded)
        if sharded is not None:  # over mesh axes of one device: as on one device
            leaves = _sharding.unsplit(leaves, axes, sharded)
        if chunk == "auto" and n <= 1:
            return self._unchunked(args, kwargs)
        # -- stage 3: fun traced once
        traced = self._trace(leaves, treedef, axes, n)
        if traced is None:  # "auto" with a collective over axis_name: unchunked, as jax.vmap
            return self._unchunked(args, kwargs)
        mapped = [leaves[i] for i, a in enumerate(axes) if a is not None]
        # -- stage 4: the plan, as data
        spec = self._plan(traced, axes, n, mapped)
        if not traced.stageable:
            if self.axis_name is not None:  # unrolled chunks would each see their own axis size
                return self._unchunked(args, kwargs)
            return self._unstaged(leaves, treedef, axes, n, spec.plan.chunk, traced.out_shapes)
        # -- stage 5: one compiled loop
        return self._passed_through(_run_loop(self.kind, traced, spec, traced.consts, mapped), traced)

    # -- stage 3 ---------------------------------------------------------------------------------
    def _trace(
        self, leaves: list, treedef: Any, axes: list, n: int, shards: int = 1, names: tuple = ()
    ) -> Traced | None:
        """``fun`` traced once on one example; None when ``"auto"`` meets a collective over
        ``axis_name`` (the call then runs unchunked, as ``jax.vmap``). ``shards``: the number
        of devices the mapped axis is sharded over (each chunks ``n / shards``)."""
        chunk = self.chunk_size
        local = n // shards
        try:
            return trace_example(
                self.fun,
                leaves,
                treedef,
                axes,
                local,
                axis_name=self.axis_name,
                chunk_size=local - 1 if chunk == "auto" else min(chunk, local),
                where=self.where,
                axis_env_size=n,
            )
        except CollectiveError as e:
            if chunk == "auto":  # chunks would each see part of the axis: unchunked instead
                self._record(_budget.unchunked_plan(n, self.memory_budget, leaves))
                return None
            if shards == 1:
                raise
            raise ValueError(
                f"{self.where}: `fun` uses {e.used}, but the mapped inputs are sharded over mesh axes "
                f"{names} of {shards} devices, so each device would see only its own shard ({local} of "
                f"{n}) and, with chunk_size={chunk}, only a chunk of it: a silently wrong result. Use "
                f"chunk_size=None (exactly jax.vmap), replicate the inputs, or compute the "
                f"reduction with chunkop.sum."
            ) from None

    # -- stage 4 ---------------------------------------------------------------------------------
    def _plan(self, traced: Traced, axes: list, n: int, mapped: list, shards: int = 1) -> LoopSpec:
        """The loop's spec for an axis of ``n`` (one device's shard when ``shards > 1``). For
        ``"auto"`` the chunk is planned on the traced program (recorded: ``last_plan``); a plan that
        fits the whole axis is one chunk without remat or progress."""
        chunk = self.chunk_size
        spec = LoopSpec(
            axes=tuple(a for a in axes if a is not None),
            plan=make_plan(n, n if chunk == "auto" else min(chunk, n)),
            remat=self.remat,
            spmd_axis_name=self.spmd_axis_name if shards == 1 else None,  # (devices: device_loop's)
            out_axes=self._flat_out_axes(traced.out_shapes),
            progress=self.progress,
            devices=shards,
        )
        if chunk == "auto":
            # (probes: one device's loop alone, as a single-device program; the index read's reverse
            # mode under an Explicit mesh context fails JAX's sharding checks outside the devices' vmap)
            probe = spec._replace(progress=None, devices=1)
            plan = _budget.plan_traced(
                traced,
                spec,
                mapped,
                n,
                kind=self.kind,
                memory_budget=self.memory_budget,
                loop_at=lambda c: make_loop(
                    self.kind, traced.jaxpr, traced.out_shapes, probe._replace(plan=make_plan(n, min(c, n)))
                ),
            )
            self._record(plan._replace(shards=shards) if shards > 1 else plan)
            spec = spec._replace(plan=make_plan(n, plan.chunk or n))
        if spec.plan.n_full == 1 and not spec.plan.rem:  # the whole axis (or shard) in one chunk: as jax.vmap
            spec = spec._replace(remat=False, progress=None)
        return spec

    def plan_for(self, args: tuple, kwargs: dict) -> _budget.BudgetPlan:
        """The ``"auto"`` plan a call with these arguments makes (``chunkop.plan``): stages 1-4,
        nothing compiled but the planner's probes (also cached for the call). With sharded
        inputs, the plan each device makes for its shard (under ``jax.eval_shape``).

        Raises:
            TypeError: when the transform was not made with ``chunk_size="auto"``.
        """
        if self.chunk_size != "auto":
            raise _budget.not_planned(self)
        leaves, treedef, axes, paths = self._flat_arguments(args, kwargs)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where)
        if n <= 1:
            return self._record(_budget.unchunked_plan(n, self.memory_budget, leaves))
        sharded = _sharding.mapped_mesh_axes(leaves, axes, self.where, self.spmd_axis_name)
        shards = 1 if sharded is None else check_even(n, sharded, f"{self.where}: the mapped axis")
        traced = self._trace(leaves, treedef, axes, n, shards, () if sharded is None else sharded.names)
        if traced is not None:  # (else a collective over axis_name: unchunked, last_plan says so)
            self._plan(traced, axes, n // shards, _local_structs(leaves, axes, n // shards), shards)
        return self.last_plan

    def _flat_out_axes(self, out_shapes: Any) -> tuple:
        return tuple(flat_out_axes(self.out_axes, out_shapes, self.where)) if self.kind == "stack" else ()

    # -- stage 5 (the loop: :func:`_run_loop`) ---------------------------------------------------
    def _passed_through(self, out: Any, traced: Traced) -> Any:
        """An unmapped output that is one of ``fun``'s unmapped inputs unchanged (a constant of
        the trace, ``out_axes=None``) is returned as that very array, as ``jax.vmap`` does:
        not a copy made by the loop."""
        if self.kind != "stack":
            return out
        consts = {id(v): c for v, c in zip(traced.jaxpr.constvars, traced.consts)}
        leaves, tree = jax.tree_util.tree_flatten(out)
        oaxes = self._flat_out_axes(traced.out_shapes)
        for k, (v, a) in enumerate(zip(traced.jaxpr.outvars, oaxes)):
            if a is None and id(v) in consts and isinstance(consts[id(v)], jax.Array):
                leaves[k] = consts[id(v)]
        return jax.tree_util.tree_unflatten(tree, leaves)

    # -- sharded inputs: the same stages, the loop run on each device's shard ----------------------
    def _call_sharded(
        self, args: tuple, kwargs: dict, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: Any
    ) -> Any:
        """Each device chunks its own shard of the mapped axis (:func:`chunkop._loops.device_loop`).

        The same stages as an unsharded call, in the caller's mesh context: ``fun`` traced once
        (axis-size queries give the whole axis), the plan made for one device's shard, one
        compiled program, cached like the loops by what was traced. No ``shard_map``: ``fun``
        sees what ``jax.vmap`` shows it (closed-over mesh arrays, sharding constraints, concrete
        values in Python control flow)."""
        shards = check_even(n, mesh_axes, f"{self.where}: the mapped axis")
        traced = self._trace(leaves, treedef, axes, n, shards, mesh_axes.names)
        if traced is None:  # "auto" with a collective over axis_name: as jax.vmap
            return self._unchunked(args, kwargs)
        spec = self._plan(traced, axes, n // shards, _local_structs(leaves, axes, n // shards), shards)
        if not traced.stageable:
            if self.axis_name is not None:
                return self._unchunked(args, kwargs)
            return self._unstaged(leaves, treedef, axes, n, spec.plan.chunk, traced.out_shapes)
        make = functools.partial(device_loop, self.kind, traced.jaxpr, traced.out_shapes, spec, mesh_axes)
        key = _loop_key(self.kind, traced.key, spec, "devices", mesh_axes)
        program = jax.jit(make()) if key is None else cached(key, lambda: jax.jit(make()))
        mapped = [leaves[i] for i, a in enumerate(axes) if a is not None]
        mapped = _sharding.conform(mapped, [_sharding.spec_at(a, mesh_axes.names) for a in spec.axes], mesh_axes)
        with _sharding.mesh_context(mesh_axes):
            out = program(traced.consts, mapped)
        return self._passed_through(out, traced)

    # -- without a loop --------------------------------------------------------------------------
    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        """The result when nothing is chunked: ``jax.vmap`` (then the sum or mean)."""
        vmapped = functools.partial(
            jax.vmap,
            self.fun,
            in_axes=self.in_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )
        if self.kind != "stack":
            outs = vmapped()(*args, **kwargs)
            reduce = jnp.mean if self.kind == "mean" else jnp.sum
            return jax.tree_util.tree_map(lambda o: reduce(o, axis=0), outs)
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

    def _unstaged(self, leaves: list, treedef: Any, axes: list, n: int, chunk: int, out_shapes: Any) -> Any:
        """The result by a Python loop of ``jax.vmap`` calls of ``fun``, chunk by chunk.

        The fallback for a ``fun`` whose custom rule closes over a tracer of an enclosing
        transform: no staging boundary (``jit``, ``scan``, ``checkpoint``) may come between the
        rule and that tracer, so the chunks are unrolled. Values equal ``jax.vmap``'s; the
        program's size grows with ``n / chunk_size`` and reverse mode is not bounded by the chunk.
        """
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
        oaxes = list(self._flat_out_axes(out_shapes)) or [0] * len(out_leaves)
        chunks = []
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            flat = [x if a is None else jax.lax.slice_in_dim(x, start, start + m, axis=a) for x, a in zip(leaves, axes)]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            vmapped = jax.vmap(
                self.fun,
                in_axes=self.in_axes,
                out_axes=self.out_axes,
                axis_size=m,
                spmd_axis_name=self.spmd_axis_name,
            )
            chunks.append(jax.tree_util.tree_leaves(vmapped(*args, **kwargs)))
        if self.kind == "stack":
            joined = [
                chunks[-1][k] if a is None else jnp.concatenate([c[k] for c in chunks], axis=a)
                for k, a in enumerate(oaxes)
            ]
            return jax.tree_util.tree_unflatten(out_tree, joined)
        final, acc = sum_dtypes(self.kind, out_leaves)
        totals = [sum(jnp.sum(c[k], axis=0, dtype=d) for c in chunks) for k, d in enumerate(acc)]
        return jax.tree_util.tree_unflatten(out_tree, finish_sums(totals, self.kind, n, final))


class Bound:
    """A transform (a :class:`Chunked`, a ``chunkop.jacrev``/``jacfwd``) bound to an instance
    (their ``__get__``), as a method is: called, it passes the instance as the first argument
    (for a :class:`Chunked`, mapped as ``in_axes``' first entry says). Its other attributes
    (``last_plan``, ``chunk_size`` ...) are the transform's."""

    __slots__ = ("__func__", "__self__", "__weakref__")

    def __init__(self, transform: Chunked, instance: Any) -> None:
        object.__setattr__(self, "__func__", transform)
        object.__setattr__(self, "__self__", instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def plan_for(self, args: tuple, kwargs: dict) -> _budget.BudgetPlan:
        """The transform's ``plan_for`` with the instance as the first argument (``chunkop.plan``)."""
        return self.__func__.plan_for((self.__self__, *args), kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__func__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a bound transform is immutable; cannot set {name!r}.")

    def __repr__(self) -> str:
        return f"<bound {self.__func__!r} of {self.__self__!r}>"


def _run_loop(kind: str, traced: Traced, spec: LoopSpec, consts: list, mapped: list) -> Any:
    """Stage 5: the compiled loop of ``kind`` for ``traced`` and ``spec`` (cached when the trace
    could be keyed), run on ``consts`` and the mapped leaves."""
    make = functools.partial(make_loop, kind, traced.jaxpr, traced.out_shapes, spec)
    loop = jax.jit(make()) if traced.key is None else _cached_loop(kind, traced.key, spec, make)
    return loop(consts, mapped)


def _local_structs(leaves: list, axes: list, local: int) -> list:
    """The mapped leaves' shapes with ``local`` elements along their mapped axis (one device's
    shard), what the planner compiles its probes on."""
    return [resized(x, a, local) for x, a in zip(leaves, axes) if a is not None]


def _loop_key(kind: str, traced_key: Hashable | None, spec: LoopSpec, *more: Any) -> Hashable | None:
    """The cache key of a compiled loop (or of a sharded program around one, ``more`` its mesh,
    specs and types): ``kind``, the trace's by-value key and the plan, with its ``remat`` /
    ``progress`` settings keyed; None when something cannot be keyed (the call runs uncached)."""
    if traced_key is None:
        return None
    try:
        key = (kind, traced_key, spec._replace(remat=setting_key(spec.remat), progress=setting_key(spec.progress)))
        key += more
        hash(key)
    except (Uncacheable, TypeError):
        return None
    return key


def _cached_loop(kind: str, key: Hashable, spec: LoopSpec, make: Callable[[], Callable]) -> Callable:
    """The jitted loop for ``(kind, key, spec)`` from the cache; made uncached when a setting
    (a ``remat`` policy, a ``progress`` callable) cannot be keyed: jitted afresh and dropped with
    the call (run eagerly instead, its primitives would sit in JAX's own eager caches, keeping
    what the jaxpr's rules close over alive)."""
    full_key = _loop_key(kind, key, spec)
    return jax.jit(make()) if full_key is None else cached(full_key, lambda: jax.jit(make()))
