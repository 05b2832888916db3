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

No stage calls back into an earlier one: with sharded inputs the same trace is run, inside one
``jax.shard_map``, by a loop planned for each device's shard; the wrapper is never re-entered.
Eagerly, that ``shard_map`` is traced and planned without compiling, then run by a program
cached under the trace's by-value key (:func:`_sharded_program`), its constants passed in.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _budget, _sharding
from ._axes import (
    check_axis_size,
    check_in_axes_spec,
    check_out_axes_spec,
    check_remat,
    flat_in_axes,
    flat_out_axes,
    mapped_size,
    replace_at,
)
from ._cache import cached
from ._chunking import Remat, make_plan
from ._fingerprint import Uncacheable, setting_key
from ._loops import KINDS, LoopSpec, finish_sums, make_loop, sum_dtypes
from ._progress import Progress, check_progress
from ._trace import CollectiveError, Traced, trace_example
from ._tree import has_shape

__all__ = ["BoundChunked", "Chunked"]

#: The plan of each transform's last ``chunk_size="auto"`` call (read by ``Chunked.last_plan``):
#: kept beside the transforms, which are immutable, and dropped with them.
_LAST_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_WRAPPED = ("__module__", "__name__", "__qualname__", "__doc__")


class Chunked:
    """``fun`` mapped over an axis in chunks; ``kind`` says how the chunk outputs combine.

    Immutable once made; a descriptor like a function, so a transform defined in a class body
    (``@functools.partial(chunkop.vmap, in_axes=(None, 0))`` on a method) binds the instance as
    its first argument, as ``jax.vmap`` does (:class:`BoundChunked`). ``fun``'s name, docstring
    and module are copied (``__wrapped__`` is ``fun``), not its ``__dict__``: the transform's
    attributes (``fun``, ``in_axes`` ...) would otherwise be overwritten by those of a wrapped
    transform or of any callable object with attributes.

    Attributes:
        kind: ``"stack"`` (``jax.vmap``'s outputs), ``"sum"`` or ``"mean"`` over the mapped axis.
        where: the public name, for messages (``"chunkop.vmap"`` ...).
        last_plan: the :class:`chunkop.BudgetPlan` of the last ``chunk_size="auto"`` call.
    """

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
        return self if instance is None else BoundChunked(self, instance)

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
        leaves, treedef, axes, paths = self._flat_arguments(args, kwargs)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where, chunked=self.chunk_size is not None)
        chunk = self.chunk_size
        # -- stage 2: no chunking is exactly jax.vmap
        if chunk is None or (chunk != "auto" and n <= chunk):
            return self._unchunked(args, kwargs)
        sharded = _sharding.mapped_mesh_axes(leaves, axes, self.where, self.spmd_axis_name)
        if sharded is not None:
            return self._call_sharded(args, kwargs, leaves, treedef, axes, n, sharded)
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
            spmd_axis_name=self.spmd_axis_name,
            out_axes=self._flat_out_axes(traced.out_shapes),
            progress=self.progress,
        )
        if chunk == "auto":
            probe = spec._replace(progress=None)
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
        inputs, the plan each device makes for its shard (under ``jax.eval_shape``)."""
        leaves, treedef, axes, paths = self._flat_arguments(args, kwargs)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where)
        if n <= 1:
            return self._record(_budget.unchunked_plan(n, self.memory_budget, leaves))
        sharded = _sharding.mapped_mesh_axes(leaves, axes, self.where, self.spmd_axis_name)
        if sharded is not None:
            call, inputs, _ = self._shard_mapped(leaves, treedef, axes, n, sharded, plan_only=True)
            try:
                jax.eval_shape(call, *inputs)
            except _Fallback:
                pass  # a collective over axis_name: unchunked (last_plan says so)
            return self.last_plan
        traced = self._trace(leaves, treedef, axes, n)
        if traced is not None:
            self._plan(traced, axes, n, [leaves[i] for i, a in enumerate(axes) if a is not None])
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
    def _check_even(self, n: int, mesh_axes: _sharding.MeshAxes) -> int:
        shards = mesh_axes.n_shards
        if n % shards:
            raise ValueError(
                f"{self.where}: the mapped axis (size {n}) is sharded over mesh axes {mesh_axes.names} "
                f"of {shards} devices, which does not divide it; pad the inputs to a multiple of "
                f"{shards} or shard them evenly."
            )
        return shards

    def _sharded_specs(self, leaves: list, axes: list, mesh_axes: Any) -> tuple[list, list]:
        """The leaves a ``shard_map`` takes, the array-like ones (mapped ones split along their
        axis, the others replicated): their positions and specs. Other leaves (Python numbers,
        strings ...) reach ``fun`` as themselves."""
        at = [i for i, x in enumerate(leaves) if has_shape(x)]
        return at, [P() if axes[i] is None else _sharding.spec_at(axes[i], mesh_axes.names) for i in at]

    def _shard_mapped(
        self, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: Any, plan_only: bool = False
    ) -> tuple[Callable, list, dict]:
        """The ``jax.shard_map`` whose body runs stages 3-5 on one device's shard, its inputs
        (resharded to its specs) and what its trace found: ``fun`` traced once there
        (axis-size queries give the whole axis), the plan made for the shard, one loop. With
        ``plan_only`` (run it under ``jax.eval_shape``: nothing is compiled) the body stops
        after the plan and leaves ``found["prepared"] = (traced, spec)``. Raises
        :class:`_Fallback` while tracing when the call must run without ``shard_map``."""
        shards = self._check_even(n, mesh_axes)
        at, specs = self._sharded_specs(leaves, axes, mesh_axes)
        mapped_at = [i for i, a in enumerate(axes) if a is not None]
        found: dict = {}

        def local_result(*d: Any) -> Any:
            local = replace_at(leaves, at, d)
            traced = self._trace(local, treedef, axes, n, shards, mesh_axes.names)
            if traced is None or not traced.stageable:
                raise _Fallback(traced)
            mapped = [local[i] for i in mapped_at]
            spec = self._plan(traced, axes, n // shards, mapped, shards)
            if plan_only:
                found["prepared"], found["inputs"] = (traced, spec), d
                return None
            return _run_loop(self.kind, traced, spec, traced.consts, mapped), spec.out_axes

        call = _shard_map_call(self.kind, mesh_axes, specs, local_result, plan_only)
        return call, _sharding._conform([leaves[i] for i in at], specs, mesh_axes), found

    def _call_sharded(
        self, args: tuple, kwargs: dict, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: Any
    ) -> Any:
        """Each device chunks its own shard of the mapped axis (see :meth:`_shard_mapped`).

        Called eagerly (no input is a tracer), the ``shard_map`` is compiled once per key: the
        body is traced and planned under ``jax.eval_shape`` (``fun`` traced once, nothing
        compiled), and the compiled program, keyed like the loops by what was traced (by
        value), takes the trace's constants as arguments (also values of an enclosing
        transform ``fun`` closes over: closed over by the body, their types would carry the
        outer mesh; such a call is not cached). With traced inputs (under ``jit``, ``grad`` ...)
        the enclosing compilation already happens once: the body traces ``fun`` itself.

        A ``fun`` closing over a value typed on an Explicit mesh (an array created under
        ``jax.set_mesh``, a ``jax.vmap`` tracer there) cannot be traced in any ``shard_map``
        body: it is traced outside, without a mesh (:meth:`_call_sharded_traced_outside`); if
        it needs its mesh there too, a ``ValueError`` says to pass the value as an unmapped
        argument."""
        try:
            if any(isinstance(x, jax.core.Tracer) for x in leaves):
                call, inputs, _ = self._shard_mapped(leaves, treedef, axes, n, mesh_axes)
                return call(*inputs)
            return self._call_sharded_eager(leaves, treedef, axes, n, mesh_axes)
        except _Fallback as e:
            traced = e.args[0]
        except NotImplementedError as e:
            if "Closing over inputs to shard_map" not in str(e):
                raise
            try:  # trace outside the body, without a mesh, as a RowOperator's row_fn is
                return self._call_sharded_traced_outside(leaves, treedef, axes, n, mesh_axes)
            except Exception as outside:  # noqa: BLE001 - reported below, with the reason
                reason = f"{type(outside).__name__}: {str(outside).splitlines()[0] if str(outside) else ''}"
            raise ValueError(
                f"{self.where}: the mapped inputs are sharded over the Explicit mesh axes "
                f"{mesh_axes.names}, so each device chunks its shard inside a jax.shard_map; `fun` "
                f"closes over a value typed on that mesh (an array created under jax.set_mesh, or a "
                f"value of an enclosing jax.vmap), which JAX does not let a shard_map body close "
                f"over, and `fun` could not be traced outside the mesh context either (it uses the "
                f"mesh: a reshard, a sharding constraint, a mesh-axis collective). Pass that value "
                f"to the chunked function as an argument with in_axes=None (it then reaches every "
                f"device replicated), or use chunk_size=None (exactly jax.vmap, unchunked). JAX's "
                f"message: {str(e).splitlines()[0]} Traced outside the mesh: {reason}"
            ) from None
        if traced is None or self.axis_name is not None:  # a collective over axis_name: as jax.vmap
            return self._unchunked(args, kwargs)
        # a custom rule closes over a tracer of an enclosing transform: no staging boundary
        chunk = n if self.chunk_size == "auto" else self.chunk_size
        return self._unstaged(leaves, treedef, axes, n, chunk, traced.out_shapes)

    def _call_sharded_eager(self, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: Any) -> Any:
        """An eager sharded call: traced and planned once (no compile), then run by the cached
        program for what was traced (see :func:`_sharded_program`)."""
        plan_call, inputs, found = self._shard_mapped(leaves, treedef, axes, n, mesh_axes, plan_only=True)
        jax.eval_shape(plan_call, *inputs)  # stages 3-4 on one device's shard (raises _Fallback)
        traced, spec = found["prepared"]
        at, specs = self._sharded_specs(leaves, axes, mesh_axes)
        mapped_k = tuple(k for k, i in enumerate(at) if axes[i] is not None)
        # Each constant of the trace is an unmapped input of the body (read there from the
        # program's inputs), a value (passed in, replicated) or a value of an enclosing
        # transform (a jax.vmap / grad tracer: passed in too, since closed over by the body its
        # type would carry the outer mesh; such a call is not cached).
        body_inputs = {id(t): k for k, t in enumerate(found["inputs"])}
        body_trace = getattr(found["inputs"][0], "_trace", None) if found["inputs"] else None
        from_input = []
        for c in traced.consts:
            if id(c) not in body_inputs and isinstance(c, jax.core.Tracer) and getattr(c, "_trace", None) is body_trace:
                call, inputs, _ = self._shard_mapped(leaves, treedef, axes, n, mesh_axes)  # computed in the body
                return call(*inputs)
            from_input.append(body_inputs.get(id(c), -1))
        return self._run_sharded(traced, spec, mesh_axes, specs, mapped_k, inputs, tuple(from_input), "body")

    def _call_sharded_traced_outside(self, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: Any) -> Any:
        """A sharded call whose ``fun`` closes over values typed on an Explicit mesh (an array
        created under ``jax.set_mesh``), which no ``shard_map`` body may close over: ``fun`` is
        traced outside the body, in an empty mesh context (its equations then carry no mesh and
        run inside the body, as a ``RowOperator``'s ``row_fn`` does), planned for one device's
        shard, and run by :func:`_sharded_program` with its constants passed in as arguments.
        Raises when ``fun`` needs its mesh context (the caller then explains the limitation)."""
        shards = self._check_even(n, mesh_axes)
        at, specs = self._sharded_specs(leaves, axes, mesh_axes)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            traced = self._trace(leaves, treedef, axes, n, shards, mesh_axes.names)
            if traced is None or not traced.stageable:
                raise _Fallback(traced)
            local = [
                jax.ShapeDtypeStruct(replace_at(list(jax.typeof(x).shape), [a], [n // shards]), jax.typeof(x).dtype)
                for x, a in zip(leaves, axes)
                if a is not None
            ]
            spec = self._plan(traced, axes, n // shards, local, shards)
        inputs = _sharding._conform([leaves[i] for i in at], specs, mesh_axes)
        position = {id(leaves[i]): k for k, i in enumerate(at) if axes[i] is None}
        from_input = tuple(position.get(id(c), -1) for c in traced.consts)
        mapped_k = tuple(k for k, i in enumerate(at) if axes[i] is not None)
        return self._run_sharded(traced, spec, mesh_axes, specs, mapped_k, inputs, from_input, "outside")

    def _run_sharded(
        self,
        traced: Traced,
        spec: LoopSpec,
        mesh_axes: Any,
        specs: list,
        mapped_k: tuple,
        inputs: list,
        from_input: tuple,
        traced_where: str,
    ) -> Any:
        """Stage 5 of a sharded call: the jitted ``shard_map`` of ``traced``'s loop
        (:func:`_sharded_program`). The trace's constants are read from the program's inputs
        where ``from_input`` says so (unmapped arguments), else passed in, replicated. Cached
        under the trace's by-value key unless a constant is a tracer of an enclosing transform.
        ``traced_where``: inside the ``shard_map`` body or outside it (part of the key)."""
        passed = [c for c, k in zip(traced.consts, from_input) if k < 0]
        consts = passed
        if isinstance(mesh_axes.mesh, jax.sharding.Mesh):  # (under a trace the mesh is abstract)
            replicated = jax.sharding.NamedSharding(mesh_axes.mesh, P())
            consts = [c if isinstance(c, jax.core.Tracer) else jax.device_put(c, replicated) for c in passed]
        consts = _sharding._conform(consts, [P()] * len(consts), mesh_axes)
        stripped = traced._replace(consts=[])
        make = functools.partial(
            _sharded_program, self.kind, stripped, spec, mesh_axes, tuple(specs), mapped_k, from_input
        )
        key = None
        if not any(isinstance(c, jax.core.Tracer) for c in passed):  # (what the program depends on)
            key = _loop_key(
                self.kind,
                traced.key,
                spec,
                "sharded",
                traced_where,
                mesh_axes,
                tuple(specs),
                mapped_k,
                from_input,
                tuple(jax.typeof(x) for x in inputs),
                tuple(jax.typeof(c) for c in consts),
                self.axis_name,
            )
        program = make() if key is None else cached(key, make)
        return program(consts, inputs)

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


class BoundChunked:
    """A :class:`Chunked` transform bound to an instance (``Chunked.__get__``), as a method is:
    called, it passes the instance as the first argument (mapped as ``in_axes``' first entry
    says). Its other attributes (``last_plan``, ``chunk_size`` ...) are the transform's."""

    __slots__ = ("__func__", "__self__", "__weakref__")

    def __init__(self, transform: Chunked, instance: Any) -> None:
        object.__setattr__(self, "__func__", transform)
        object.__setattr__(self, "__self__", instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def plan_for(self, args: tuple, kwargs: dict) -> _budget.BudgetPlan:
        """:meth:`Chunked.plan_for` with the instance as the first argument (``chunkop.plan``)."""
        return self.__func__.plan_for((self.__self__, *args), kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__func__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a bound chunked transform is immutable; cannot set {name!r}.")

    def __repr__(self) -> str:
        return f"<bound {self.__func__!r} of {self.__self__!r}>"


def _run_loop(kind: str, traced: Traced, spec: LoopSpec, consts: list, mapped: list) -> Any:
    """Stage 5: the compiled loop of ``kind`` for ``traced`` and ``spec`` (cached when the trace
    could be keyed), run on ``consts`` and the mapped leaves."""
    make = functools.partial(make_loop, kind, traced.jaxpr, traced.out_shapes, spec)
    loop = make() if traced.key is None else _cached_loop(kind, traced.key, spec, make)
    return loop(consts, mapped)


def _shard_map_call(
    kind: str, mesh_axes: Any, specs: list, local_result: Callable, plan_only: bool = False
) -> Callable:
    """``jax.shard_map`` of ``local_result(*shards) -> (result, flat out_axes)`` over
    ``mesh_axes``, the inputs split by ``specs``: sums and means are combined over the devices
    (``psum``/``pmean``), stacked outputs come back along the mapped axis, unmapped ones
    replicated. With ``plan_only`` the body's result is discarded (it is traced for its plan)."""
    names = mesh_axes.names
    found: dict = {}

    def body(*d: Any) -> Any:
        res = local_result(*d)
        if plan_only:
            return ()
        out, out_axes = res
        if kind != "stack":
            combine = jax.lax.psum if kind == "sum" else jax.lax.pmean
            return jax.tree_util.tree_map(lambda o: combine(o, names), out)
        outs, found["tree"] = jax.tree_util.tree_flatten(out)
        found["oaxes"] = out_axes
        stacked = [jnp.moveaxis(o, a, 0) for o, a in zip(outs, out_axes) if a is not None]
        return stacked, [o for o, a in zip(outs, out_axes) if a is None]

    if plan_only:
        out_specs: Any = ()
    elif kind == "stack":  # (along the mapped axis, moved to the front; unmapped: replicated)
        out_specs = (_sharding.spec_at(0, names), P())
    else:
        out_specs = P()
    # check_vma=False: the chunk loops' carries start from (unvarying) zeros, which the
    # varying-manual-axes type check rejects; values and derivatives are checked by the tests.
    mapped_fn = jax.shard_map(
        body,
        mesh=mesh_axes.mesh,
        in_specs=tuple(specs),
        out_specs=out_specs,
        axis_names=set(mesh_axes.mesh.axis_names),
        check_vma=False,
    )

    def call(*d: Any) -> Any:
        out = mapped_fn(*d)
        if plan_only or kind != "stack":
            return out
        stacked, unmapped = iter(out[0]), iter(out[1])
        flat = [next(unmapped) if a is None else jnp.moveaxis(next(stacked), 0, a) for a in found["oaxes"]]
        return jax.tree_util.tree_unflatten(found["tree"], flat)

    return call


def _sharded_program(
    kind: str, traced: Traced, spec: LoopSpec, mesh_axes: Any, specs: tuple, mapped_k: tuple, from_input: tuple
) -> Callable[[list, list], Any]:
    """The jitted ``shard_map`` of an eager sharded call, ``(consts, inputs) -> result``: each
    device runs the loop of ``traced`` (traced in a ``shard_map`` body over the same mesh and
    specs) on its shards; the trace's constants are ``consts`` and, where ``from_input[k] >=
    0``, that input (an unmapped argument). Built from data only (``traced`` without its constants): a cached
    program keeps no user array alive."""

    def program(consts: list, inputs: list) -> Any:
        n_consts = len(consts)

        def local_result(*d: Any) -> Any:
            passed, shards = iter(d[:n_consts]), d[n_consts:]
            consts = [next(passed) if k < 0 else shards[k] for k in from_input]
            return _run_loop(kind, traced, spec, consts, [shards[k] for k in mapped_k]), spec.out_axes

        return _shard_map_call(kind, mesh_axes, [P()] * n_consts + list(specs), local_result)(*consts, *inputs)

    return jax.jit(program)


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


class _Fallback(Exception):
    """Raised while tracing a ``shard_map`` body: the call must run without it (``"auto"`` with a
    collective over ``axis_name`` runs as ``jax.vmap``; a custom rule closing over a tracer of
    an enclosing transform runs unrolled). Holds the body's trace (None for the former)."""


def _cached_loop(kind: str, key: Hashable, spec: LoopSpec, make: Callable[[], Callable]) -> Callable:
    """The jitted loop for ``(kind, key, spec)`` from the cache; made uncached when a setting
    (a ``remat`` policy, a ``progress`` callable) cannot be keyed."""
    full_key = _loop_key(kind, key, spec)
    return make() if full_key is None else cached(full_key, lambda: jax.jit(make()))
