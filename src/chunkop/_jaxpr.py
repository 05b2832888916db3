"""What chunkop reads of JAX's internals, in one module: no other module imports ``jax._src`` or
tests the name of one of JAX's classes (``tests/test_design.py`` checks it).

The jaxpr types (from ``jax.extend.core`` where this JAX version exports them), the two walks
over a jaxpr that every module shares (:func:`find_eqn`, equations at any depth;
:func:`dependent_eqns`, data dependencies), the one test for a ``jax.custom_vjp`` call
(:func:`is_custom_vjp`), the context an equation is re-bound in when a jaxpr is evaluated
(:func:`eqn_context`), and the tests of JAX's own objects that have no public form (tracers by
transform, symbolic zeros, wrapped functions, unspecified shardings ...).

``jax.extend.core`` exports ``DropVar`` and ``jaxprs_in_params`` only in recent versions;
older ones (jax 0.9-0.10.0, the floor in ``pyproject.toml`` is 0.10.0) keep them in
``jax._src.core``. The floor is installed and smoke-tested by ``.ci/run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax._src import config as _config  # the eager constant folding switch: no public form
from jax._src import hijax as _hijax  # the custom rules' primitive classes: no public form
from jax._src import linear_util as _lu  # WrappedFun: how JAX holds custom rules in a jaxpr
from jax._src import source_info_util as _source_info  # no public form of eval_jaxpr's per-equation context
from jax._src.interpreters import batching as _batching  # vmappable types: no public registry
from jax.extend import core as _ext

try:  # where a host callback's op sharding is set (per device inside shard_map): no public form
    from jax._src.callback import _callback_op_sharding as callback_op_sharding
except ImportError:  # pragma: no cover  (another JAX: the caller falls back on jax.pure_callback)
    callback_op_sharding = None

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "WrappedFun",
    "callback_op_sharding",
    "define_primitive",
    "emit_python_callback",
    "instantiate_zeros",
    "lower_fun",
    "eager_constant_folding",
    "eval_context",
    "tracing",
    "is_batch_tracer",
    "is_checkpoint_answer",
    "is_forward_tracer",
    "is_jax_value_wrapper",
    "is_per_trace_store",
    "is_static_leaf",
    "is_symbolic_zero",
    "is_undefined_primal",
    "is_unspecified_sharding",
    "unwrap_jax_value",
    "Jaxpr",
    "Literal",
    "defined_in_jax",
    "dependent_eqns",
    "eqn_context",
    "find_eqn",
    "has_eqn",
    "hi_prim",
    "is_custom_rule",
    "is_custom_vjp",
    "is_symbolic_zeros_custom_vjp",
    "is_vmappable",
    "vmappables_registered",
    "jaxprs_in_params",
    "open_jaxpr",
    "scan_params_with_consts",
    "sub_jaxprs",
]

ClosedJaxpr = _ext.ClosedJaxpr
Jaxpr = _ext.Jaxpr
Literal = _ext.Literal
try:
    DropVar = _ext.DropVar
    jaxprs_in_params = _ext.jaxprs_in_params
except AttributeError:  # jax < 0.10
    from jax._src import core as _core

    DropVar = _core.DropVar
    jaxprs_in_params = _core.jaxprs_in_params


# The custom rules of jax_custom_vjp3 (and, jax >= 0.11, jax_custom_jvp3) are "hi" primitive
# objects: jax 0.10's VJPHiPrimitive, jax >= 0.11's HiPrim.
_HiPrim = tuple(getattr(_hijax, name) for name in ("HiPrim", "VJPHiPrimitive") if hasattr(_hijax, name)) or None


_BUILTIN_SPECS = frozenset(_batching.spec_types)  # JAX's own (Sum, Infer): never in a user's in_axes


def vmappables_registered() -> bool:
    """Whether any vmappable type (or spec type beyond JAX's own) is registered: the fast path."""
    return bool(_batching.vmappables) or not _batching.spec_types <= _BUILTIN_SPECS


def is_vmappable(value: Any) -> bool:
    """Whether ``value`` is an instance of a type registered with JAX's (experimental)
    ``batching.register_vmappable``, or of a registered ``in_axes``/``out_axes`` spec type:
    ``jax.vmap`` maps such values with the type's own ``to_elt``/``from_elt`` rules."""
    if isinstance(value, (bool, int, np.integer)) or value is None:
        return False
    return type(value) in _batching.vmappables or type(value) in _batching.spec_types


def hi_prim(value: Any) -> Any:
    """``value`` if it is a JAX "hi" primitive object (what a ``call_hi_primitive`` equation
    applies: a ``jax.custom_vjp`` under ``jax_custom_vjp3``, a ``jax.custom_jvp`` under
    ``jax_custom_jvp3``), else None. Its
    ``params`` hold the primal's trace (``traced``, whose ``.jaxpr`` is closed) and the rules."""
    return value if _HiPrim is not None and isinstance(value, _HiPrim) else None


def sub_jaxprs(eqn: Any) -> list:
    """The sub-jaxprs of an equation: JAX's ``jaxprs_in_params``, and a hi primitive's primal."""
    subs = list(jaxprs_in_params(eqn.params))
    prim = hi_prim(eqn.params.get("_prim"))
    traced = None if prim is None else prim.params.get("traced")
    if traced is not None and hasattr(traced, "jaxpr"):
        subs.append(traced.jaxpr)
    return subs


# jax >= 0.11 merged ``ClosedJaxpr`` into ``Jaxpr``: a jaxpr carries its constants' values, and
# ``closed.jaxpr`` is ``closed`` itself.
_MERGED = ClosedJaxpr is Jaxpr


def open_jaxpr(closed: Any) -> Any:
    """``closed``'s jaxpr without its constants' values: ``constvars`` stay the leading inputs,
    evaluated with the values passed to ``jax.core.eval_jaxpr``, and nothing of them is kept.

    What a compiled loop or an operator's static spec stores: on jax >= 0.11 ``closed.jaxpr`` is
    ``closed`` itself and would keep every constant alive; there the values are replaced by their
    abstract values (placeholders that are never evaluated).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> w = jnp.arange(3.0)
        >>> closed = jax.make_jaxpr(lambda x: x * w)(1.0)
        >>> jaxpr = open_jaxpr(closed)
        >>> len(jaxpr.constvars), jax.core.eval_jaxpr(jaxpr, [w], 2.0)[0].tolist()
        (1, [0.0, 2.0, 4.0])
    """
    if _MERGED:
        return closed.with_consts([v.aval for v in closed.constvars])
    return closed.jaxpr


def scan_params_with_consts(params: dict, body: Any, k: int) -> dict:
    """A ``scan`` equation's ``params`` for ``body``, which takes ``k`` more constants first.

    jax < 0.11 counts the constants (``num_consts``, with a ``linear`` flag each); jax >= 0.11
    groups the operands in ``ft_in`` (constants, carry, scanned inputs).
    """
    if "num_consts" in params:
        new = dict(params, jaxpr=body, num_consts=params["num_consts"] + k)
        if "linear" in params:
            new["linear"] = (False,) * k + tuple(params["linear"])
        return new
    from jax._src import flattree  # the operand groups' type: no public form

    consts, carry, xs = params["ft_in"].unpack()
    return dict(params, jaxpr=body, ft_in=flattree.pack(((flattree.nones(k), consts), carry, xs)))


def find_eqn(jaxpr: Any, test: Callable[[Any], bool]) -> Any:
    """The first equation of ``jaxpr``, at any depth, for which ``test(eqn)`` holds, or ``None``.

    Depth first: the equations inside an equation's sub-jaxprs (``jit``, ``cond`` branches,
    ``scan`` and ``while`` bodies, ``checkpoint`` ...) come before the equation itself.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> find_eqn(closed.jaxpr, lambda e: e.primitive.name == "sin").primitive.name
        'sin'
    """
    for eqn in jaxpr.eqns:
        for sub in sub_jaxprs(eqn):
            found = find_eqn(sub, test)
            if found is not None:
                return found
        if test(eqn):
            return eqn
    return None


def has_eqn(jaxpr: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``jaxpr`` has, at any depth, an equation for which ``test(eqn)`` holds."""
    return find_eqn(jaxpr, test) is not None


def custom_vjp3() -> bool:
    """Whether JAX's ``jax_custom_vjp3`` flag (its next ``custom_vjp`` implementation) is on."""
    return bool(getattr(jax.config, "jax_custom_vjp3", False))


_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vmap_call", "custom_lin")


def is_custom_rule(eqn: Any) -> bool:
    """Whether ``eqn`` calls a custom differentiation or batching rule (``jax.custom_jvp``,
    ``jax.custom_vjp``, ``custom_vmap``; also as the objects of ``jax_custom_jvp3``/``vjp3``)."""
    if eqn.primitive.name in _CUSTOM_RULES or is_custom_vjp(eqn):
        return True
    return any(type(v).__name__.startswith("CustomJVP") for v in eqn.params.values())


def is_custom_vjp(eqn: Any) -> bool:
    """Whether ``eqn`` calls a ``jax.custom_vjp`` function: a ``custom_vjp_call``, or (under
    ``jax_custom_vjp3``) a call of a ``CustomVJP...`` primitive object, possibly wrapped by
    ``jax.vmap`` (``VmapOf``, which keeps the wrapped one in ``params["prim"]``)."""
    return _custom_vjp_params(eqn) is not None


def is_symbolic_zeros_custom_vjp(eqn: Any) -> bool:
    """Whether ``eqn`` calls a ``jax.custom_vjp`` function whose rules were defined with
    ``defvjp(..., symbolic_zeros=True)`` (they see which inputs are perturbed and which output
    cotangents are symbolic zeros)."""
    params = _custom_vjp_params(eqn)
    return bool(params is not None and params.get("symbolic_zeros", False))


def _custom_vjp_params(eqn: Any) -> dict | None:
    """The parameters of the ``jax.custom_vjp`` call ``eqn`` makes (see :func:`is_custom_vjp`):
    the equation's own, or those of its ``CustomVJP...`` object; None if it makes none."""
    if eqn.primitive.name == "custom_vjp_call":
        return eqn.params
    for value in eqn.params.values():
        while value is not None:
            inner = getattr(value, "params", None)
            if type(value).__name__.startswith("CustomVJP"):
                return inner if isinstance(inner, dict) else {}
            value = inner.get("prim") if isinstance(inner, dict) else None
    return None


def dependent_eqns(jaxpr: Any, inputs: set) -> Iterator[tuple[Any, list[tuple[Any, set]]]]:
    """The equations of ``jaxpr`` that read a value depending on the variables in ``inputs``, in
    order, each with its sub-jaxprs and the sub-jaxpr inputs that depend on them: input by input
    where the sub-jaxpr's inputs line up with the equation's, else all of them.
    """
    depends = set(inputs)
    for eqn in jaxpr.eqns:
        hit = [not isinstance(v, Literal) and v in depends for v in eqn.invars]
        if not any(hit):
            continue
        depends.update(eqn.outvars)
        subs = [
            (sub, {v for v, h in zip(sub.invars, hit) if h} if len(sub.invars) == len(hit) else set(sub.invars))
            for sub in sub_jaxprs(eqn)
        ]
        yield eqn, subs


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """The context ``jax.core.eval_jaxpr`` binds an equation in: its source location and name
    stack (so JAX's messages point at the user's line) and its equation context (compute type,
    PRNG implementation, XLA metadata)."""
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


# -- JAX's own objects, recognised where JAX offers no public test ------------------------------

WrappedFun = _lu.WrappedFun


def defined_in_jax(module: str | None, jaxlib: bool = False) -> bool:
    """Whether a module name (a function's or a type's ``__module__``) is JAX's (or jaxlib's)."""
    return (module or "").startswith(("jax._src", "jax.", "jaxlib") if jaxlib else ("jax._src", "jax."))


def is_forward_tracer(x: Any) -> bool:
    """A tracer of a forward-mode transform (``jax.jvp``, ``jax.linearize``; ``jax.grad`` uses one)."""
    return type(x).__name__ in ("JVPTracer", "LinearizeTracer")


def is_batch_tracer(x: Any) -> bool:
    """A tracer of ``jax.vmap`` (its value ``.val``, batch dimension ``.batch_dim``, trace ``._trace``)."""
    return type(x).__name__ == "BatchTracer"


def is_symbolic_zero(x: Any) -> bool:
    """A symbolic zero tangent or cotangent (``ad.Zero``, ``custom_derivatives.SymbolicZero``)."""
    return type(x).__name__ in ("Zero", "SymbolicZero")


def is_undefined_primal(x: Any) -> bool:
    """A linear input of a transpose rule (``ad.UndefinedPrimal``: its ``aval`` only)."""
    return type(x).__name__ == "UndefinedPrimal"


def is_unspecified_sharding(sharding: Any) -> bool:
    """No sharding given (None, or JAX's ``UnspecifiedValue`` in a jit equation's parameters)."""
    return sharding is None or type(sharding).__name__ == "UnspecifiedValue"


def is_static_leaf(x: Any) -> bool:
    """A ``nondiff_argnums`` value among a custom rule's input avals (JAX's ``Static``)."""
    return type(x).__name__ == "Static"


def is_jax_value_wrapper(value: Any) -> bool:
    """JAX's wrappers of user values in ``WrappedFun`` parameters (``Unhashable``, ``Hashable`` ...)."""
    return type(value).__module__.startswith("jax._src") and type(value).__name__ in (
        "Unhashable",
        "Hashable",
        "HashableWrapper",
        "_HashableByObjectId",
    )


def unwrap_jax_value(value: Any) -> Any:
    """The user value a :func:`is_jax_value_wrapper` object wraps."""
    return value.x if type(value).__name__ == "HashableWrapper" else value.val


def is_per_trace_store(value: Any) -> bool:
    """JAX's per-trace bookkeeping in a ``WrappedFun``'s parameters (stores)."""
    return type(value).__name__ in ("Store", "EqualStore")


def is_checkpoint_answer(value: Any) -> bool:
    """An answer of a ``jax.checkpoint`` policy besides a bool (``Saveable``, ``Recompute``, ``Offloadable``)."""
    return type(value).__name__ in ("Saveable", "Recompute", "Offloadable")


def eager_constant_folding(enabled: bool) -> Any:
    """JAX's switch that computes operations on concrete values while tracing (a context
    manager), on when ``enabled``; a null context where this JAX has no such switch."""
    state = getattr(_config, "eager_constant_folding", None)
    return state(True) if state is not None and enabled else contextlib.nullcontext()


def eval_context() -> Any:
    """A context in which operations are computed now, whatever transform is tracing around it
    (JAX's evaluation trace): for values computed from concrete inputs only."""
    from jax._src import core as _core  # the evaluation trace: no public form

    context = getattr(_core, "eval_context", None)
    return context() if context is not None else contextlib.nullcontext()


def tracing() -> bool:
    """Whether a transform is tracing now (``jax.jit``, ``jax.grad``, ``jax.vmap`` ...): where
    ``jax.set_mesh`` refuses to run (it checks JAX's trace state, which has no public form)."""
    from jax._src import core as _core  # the trace state: no public form

    return not _core.trace_state_clean()


# -- chunkop's own primitives (the progress taps): their rules registered in JAX's tables -------


def define_primitive(
    name: str,
    *,
    multiple_results: bool = False,
    impl: Callable,
    abstract_eval: Callable,
    lowering: Callable,
    jvp: Callable | None = None,
    transpose: Callable | None = None,
    batch: Callable | None = None,
) -> Any:
    """A new primitive ``name`` with its rules: evaluation, abstract evaluation, lowering (not
    cached: it calls back into Python), and where given forward-mode, transpose and batching
    rules, in JAX's rule tables (``jax.interpreters.ad`` / ``batching`` / ``mlir``: the one place
    chunkop writes to them)."""
    from jax.interpreters import ad, batching, mlir

    prim = _ext.Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lowering, cacheable=False)
    if jvp is not None:
        ad.primitive_jvps[prim] = jvp
    if transpose is not None:
        ad.primitive_transposes[prim] = transpose
    if batch is not None:
        batching.primitive_batchers[prim] = batch
    return prim


def instantiate_zeros(x: Any) -> Any:
    """A tangent or cotangent as an array: a symbolic zero made concrete (``ad.instantiate_zeros``)."""
    from jax.interpreters import ad

    return ad.instantiate_zeros(x)


def lower_fun(fun: Callable, multiple_results: bool) -> Callable:
    """A lowering rule that lowers ``fun`` as JAX code (``mlir.lower_fun``)."""
    from jax.interpreters import mlir

    return mlir.lower_fun(fun, multiple_results=multiple_results)


def emit_python_callback(ctx: Any, callback: Callable, operands: list, **kwargs: Any) -> Any:
    """A host callback of plain NumPy arrays in a lowering (``mlir.emit_python_callback``, what
    ``jax.pure_callback`` lowers to, without its ``device_put`` of the operands)."""
    from jax.interpreters import mlir

    return mlir.emit_python_callback(ctx, callback, None, operands, ctx.avals_in, ctx.avals_out, **kwargs)
