"""What a compiled chunk loop is keyed on: structural fingerprints of traced programs.

A chunked call traces the user's function afresh every time (as ``jax.vmap`` does), so the
result always reflects the state at call time. What is *reused* between calls is the jitted
chunk loop, and it is keyed by **what was traced**: a structural fingerprint of the jaxpr
(primitives, parameters, avals, literals, sub-jaxprs), never by the user's function or its
equality. Closed-over arrays are not part of the key: they are hoisted out of the jaxpr and
passed to the loop as arguments (closure conversion, see :mod:`chunkop._trace`).

A jaxpr can hold opaque Python callables. The rules of ``custom_jvp``/``custom_vjp`` functions
are keyed by **what they trace to**: the JVP rule, the forward rule and the backward rule are
traced (on the call's avals, as JAX itself would trace them when differentiating) and keyed like
any jaxpr, their constants by value (arrays by their bytes). So a rule's ``nondiff_argnums``
values, the cells it closes over, the globals and NumPy arrays it reads, and a rule defined
afresh on every call all key by what they compute, never by identity. Rules nested inside a
rule's jaxpr (second-order rules) and other callables (host callbacks, checkpoint policies) are
keyed by identity only when they are defined at module level (they live as long as their
module; held through a weak reference, together with what they close over, by value); a
callback is called when the program runs, so what it reads then is never stale. A callable made
per call (a lambda, a closure, a callable object) can only be keyed by identity, so such a call
runs uncached: a cached loop would keep it and what it closes over alive. Floats are keyed by
their bits (``0.0`` and ``-0.0`` differ, ``nan`` matches itself). Anything that cannot be keyed
safely (a large array baked into a sub-jaxpr or a rule, an unhashable parameter) makes the call
run uncached: correct, compiled afresh, and never kept. The caches that hold what is keyed: :mod:`chunkop._cache`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import sys
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from . import _jaxpr

__all__ = ["Uncacheable", "ClosesOverTracer", "jaxpr_key", "callable_key", "setting_key", "value_key"]


class Uncacheable(Exception):
    """Raised while building a key for something that cannot be keyed safely."""


class ClosesOverTracer(Uncacheable):
    """A custom rule in the jaxpr closes over a tracer of an enclosing transform.

    Such a rule cannot be traced later behind a staging boundary (``jit``, ``scan``,
    ``checkpoint``): the tracer would be out of its scope there.
    """


class _Ident:
    """Identity of a live object, held weakly: equal only to an ``_Ident`` of the same live object."""

    __slots__ = ("_id", "_ref")

    def __init__(self, obj: Any) -> None:
        try:
            self._ref = weakref.ref(obj)
        except TypeError:
            raise Uncacheable(f"cannot hold {type(obj).__name__} weakly") from None
        self._id = id(obj)

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Ident):
            return NotImplemented
        mine = self._ref()
        return mine is not None and mine is other._ref()


_SIMPLE = (str, bytes, int, float, complex, bool, type(None), np.dtype, enum.Enum, type)


def _simple_key(value: Any) -> Hashable:
    """A by-value key for plain data (numbers, strings, dtypes, treedefs, tuples and sets of those).

    Floats are keyed by their bits: ``0.0 == -0.0`` and ``nan != nan`` would otherwise make a
    key match a different value, or never match itself.
    """
    if isinstance(value, float):
        return (type(value).__name__, value.hex())
    if isinstance(value, complex):
        return (type(value).__name__, value.real.hex(), value.imag.hex())
    if isinstance(value, _SIMPLE):
        return (type(value).__name__, value)
    if isinstance(value, jax.tree_util.PyTreeDef):
        return ("treedef", value)
    if isinstance(value, (tuple, list, frozenset, set)):  # (jax >= 0.11's policies close over a set)
        items = sorted(value, key=repr) if isinstance(value, (frozenset, set)) else value
        return (type(value).__name__, tuple(_simple_key(v) for v in items))
    raise Uncacheable(type(value).__name__)


def _is_simple(value: Any) -> bool:
    try:
        _simple_key(value)
    except Uncacheable:
        return False
    return True


def _is_function_like(value: Any) -> bool:
    """A callable (not a class), or JAX's ``WrappedFun`` (which holds one but is not callable)."""
    return isinstance(value, _jaxpr.WrappedFun) or (callable(value) and not isinstance(value, type))


def _is_jax_internal(fn: types.FunctionType) -> bool:
    return _jaxpr.defined_in_jax(getattr(fn, "__module__", None), jaxlib=True)


def _cells(fn: types.FunctionType) -> list[Any]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(None)
    return values


def _jax_cell_key(value: Any, depth: int) -> Hashable | None:
    """A cell of one of JAX's own closures, as part of its key: a callable, plain data, a
    ``nondiff_argnums`` value (JAX's ``Static``) by value, tuples and lists of those, and JAX's
    own value types by value (jax 0.12.1's custom_jvp rule holds its arguments, the static ones
    among them, in such a flat tree); None for what is not part of the key (per-trace state:
    stores, memo dicts, traces)."""
    if _is_function_like(value):
        return callable_key(value, depth)
    if _jaxpr.is_static_leaf(value):
        return ("static", value_key(value.val, depth))
    if _is_simple(value):
        return _simple_key(value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_jax_cell_key(v, depth + 1) for v in value))
    if (
        _jaxpr.defined_in_jax(type(value).__module__)
        and not _jaxpr.is_per_trace_store(value)
        and type(value).__eq__ is not object.__eq__
    ):
        # JAX's own value types (jax 0.12.1's flat trees of a rule's arguments, their Static
        # nondiff values among them) define value equality: keyed by value, never dropped
        try:
            hash(value)
        except TypeError:
            raise Uncacheable(f"unhashable {type(value).__name__} in a JAX closure") from None
        return ("jax-value", type(value), value)
    return None


def callable_key(fn: Any, depth: int = 0) -> Hashable:
    """A key for a Python callable found in a jaxpr (a custom rule, a callback, a policy).

    JAX wraps user rules in per-trace closures and ``WrappedFun`` objects; those are unwrapped
    (their code, their callable cells and plain-data cells), so the key reaches the user's own
    function, which is keyed by identity together with what it closes over.
    """
    if depth > 24:
        raise Uncacheable("callable nested too deeply")
    if isinstance(fn, _jaxpr.WrappedFun):
        transforms = tuple(
            (callable_key(gen, depth + 1), _param_tuple_key(params, depth + 1)) for gen, params in fn.transforms
        )
        return ("wrapped", callable_key(fn.f, depth + 1), transforms, _param_tuple_key(fn.params, depth + 1))
    if isinstance(fn, functools.partial):
        return (
            "partial",
            callable_key(fn.func, depth + 1),
            tuple(value_key(a, depth + 1) for a in fn.args),
            tuple(sorted((k, value_key(v, depth + 1)) for k, v in fn.keywords.items())),
        )
    if isinstance(fn, types.MethodType):
        return ("method", callable_key(fn.__func__, depth + 1), value_key(fn.__self__, depth + 1))
    if isinstance(fn, types.FunctionType):
        if _is_jax_internal(fn):
            # JAX's own closure: its code, plus what of its cells is a callable or plain data.
            # Per-trace state (stores, memo dicts, sentinels, traces) is not part of the key.
            parts = [_jax_cell_key(value, depth + 1) for value in _cells(fn)]
            return ("jax", fn.__code__, tuple(p for p in parts if p is not None))
        if not _is_module_level(fn):
            # A function made per call (a lambda, a closure) can only be keyed by identity: a
            # cached loop would keep it and what it closes over alive and compile per call anyway.
            for value in _cells(fn):  # but one closing over a tracer must say so (see ClosesOverTracer)
                try:
                    value_key(value, depth + 1)
                except ClosesOverTracer:
                    raise
                except Uncacheable:
                    pass
            raise Uncacheable(f"{fn.__qualname__} is defined inside a function: keyed only by identity")
        return ("user", _Ident(fn), tuple(value_key(v, depth + 1) for v in _cells(fn)))
    if _jaxpr.defined_in_jax(type(fn).__module__):
        if dataclasses.is_dataclass(fn):
            # JAX's wrappers of a user callable (a host callback's flat wrapper ...): the fields,
            # the user's callable among them, keyed like any other (never held by the key).
            fields = tuple(getattr(fn, f.name) for f in dataclasses.fields(fn))
            return ("jax-dataclass", type(fn), tuple(value_key(v, depth + 1) for v in fields))
        try:  # JAX's own callable objects (checkpoint policies ...) define value equality
            hash(fn)
            return ("jax-object", type(fn), fn)
        except TypeError:
            pass
    raise Uncacheable(f"callable object of type {type(fn).__name__} can only be keyed by identity")


def setting_key(value: Any) -> Hashable:
    """A key for a wrapper's setting (``progress``, ``remat``): True/False/None by value, a
    callable by identity (held weakly).

    Unlike a callable found in a jaxpr, a setting is the wrapper's own: the loop calls the same
    object the key names (a progress callback at run time, a checkpoint policy while tracing),
    so identity is exact; a wrapper built once and called many times reuses its loop.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, types.MethodType):
        return ("method", _Ident(value.__func__), _Ident(value.__self__))
    return ("setting", _Ident(value))


def _is_module_level(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is what its module's name for it refers to (a ``def`` at module or class
    level): such a function lives as long as its module, so keying it by identity keeps nothing
    alive that would otherwise die."""
    if "<" in fn.__qualname__:  # <lambda>, <locals>
        return False
    obj: Any = sys.modules.get(fn.__module__ or "")
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn or getattr(obj, "__func__", None) is fn


def _param_tuple_key(params: Any, depth: int) -> Hashable:
    """A key for a ``WrappedFun``'s (or one transform's) parameters: user values wrapped by JAX
    (``nondiff_argnums`` values, static arguments) by value, stores skipped, anything else keyed
    as :func:`value_key` does (never silently dropped)."""
    items = params if isinstance(params, tuple) else (params,)
    parts = []
    for p in items:
        if _jaxpr.is_per_trace_store(p):
            continue
        if isinstance(p, tuple):
            parts.append(_param_tuple_key(p, depth + 1))
        elif isinstance(p, jax.tree_util.PyTreeDef) or _is_simple(p):
            parts.append(_simple_key(p))
        else:
            parts.append(value_key(p, depth + 1))
    return tuple(parts)


def value_key(value: Any, depth: int = 0) -> Hashable:
    """A key for a value a rule or callback closes over.

    By value for plain data and arrays (:func:`array_key`: a NumPy array changed in place keys
    differently), a callable by :func:`callable_key`, any other object by identity.
    """
    if isinstance(value, jax.core.Tracer):
        raise ClosesOverTracer(type(value).__name__)
    if _is_simple(value):
        return _simple_key(value)
    if _is_array(value):
        return array_key(value)
    if _is_function_like(value):
        return callable_key(value, depth + 1)
    if _jaxpr.is_jax_value_wrapper(value):
        return ("wrapped-value", value_key(_jaxpr.unwrap_jax_value(value), depth + 1))
    if _jaxpr.defined_in_jax(type(value).__module__):
        try:  # JAX's own value objects (avals, shardings ...) define value equality
            hash(value)
            return ("jax-object", type(value), value)
        except TypeError:
            pass
    if isinstance(value, (types.ModuleType, type)):
        return ("ident", _Ident(value))
    # Any other object can only be keyed by identity: a cached loop would keep it alive, and
    # what it holds may change without its identity changing. The call runs uncached.
    raise Uncacheable(f"object of type {type(value).__name__} can only be keyed by identity")


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic, jax.Array))


# Arrays baked into a compiled loop (constants of a rule or of a sub-jaxpr) are keyed by their
# bytes up to this many elements; a larger one makes the call run uncached.
MAX_KEYED_ELEMENTS = 1 << 16


def array_key(value: Any) -> Hashable:
    """An array's value as a key: dtype, shape and bytes (:data:`MAX_KEYED_ELEMENTS` at most)."""
    if isinstance(value, jax.core.Tracer):
        raise ClosesOverTracer(type(value).__name__)
    if int(np.prod(np.shape(value))) > MAX_KEYED_ELEMENTS:
        raise Uncacheable(f"array of shape {np.shape(value)} too large to key by value")
    try:
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
            value = jax.random.key_data(value)
        host = np.asarray(value)
    except Exception as err:  # whatever cannot be read back cannot be keyed
        raise Uncacheable(f"cannot read {type(value).__name__} back to the host") from err
    return ("array", str(host.dtype), host.shape, host.tobytes(), getattr(value, "weak_type", None))


def _aval_key(aval: Any) -> Hashable:
    """An abstract value by value: its type as printed, its weak type, and its sharding (the
    mesh included: inside a ``shard_map`` body, ``f32[3]`` on a ``('d',)`` mesh and on an
    ``('a', 'b')`` mesh print alike, but a jaxpr of one cannot run in the other)."""
    sharding = getattr(aval, "sharding", None)
    try:
        hash(sharding)
    except TypeError:
        sharding = str(sharding)
    return (str(aval), getattr(aval, "weak_type", None), sharding)


def _literal_key(lit: Any) -> Hashable:
    val = lit.val
    if isinstance(val, (np.ndarray, np.generic)) or hasattr(val, "dtype"):
        arr = np.asarray(val)
        return ("lit", str(arr.dtype), arr.shape, arr.tobytes(), _aval_key(lit.aval))
    return ("lit", type(val).__name__, repr(val), _aval_key(lit.aval))


def _param_key(value: Any, depth: int, rule_depth: int) -> Hashable:
    if isinstance(value, _jaxpr.ClosedJaxpr):
        # values baked into a sub-jaxpr (an inner jit's closure, say) are keyed by value
        consts = tuple(value_key(c, depth) for c in value.consts)
        return ("closed_jaxpr", jaxpr_key(value.jaxpr, depth + 1, rule_depth), consts)
    if isinstance(value, _jaxpr.Jaxpr):
        return ("jaxpr", jaxpr_key(value, depth + 1, rule_depth))
    if _jaxpr.hi_prim(value) is not None:
        return _hi_prim_key(value, depth, rule_depth)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_param_key(v, depth, rule_depth) for v in value))
    if _is_function_like(value):
        return callable_key(value, depth)
    if _is_simple(value):
        return _simple_key(value)
    try:
        hash(value)
    except TypeError:
        raise Uncacheable(f"unhashable jaxpr parameter of type {type(value).__name__}") from None
    return ("param", type(value).__name__, value)


def _hi_prim_key(prim: Any, depth: int, rule_depth: int) -> Hashable:
    """A hi primitive (jax >= 0.11: a ``custom_jvp``/``custom_vjp`` under ``jax_custom_jvp3``/
    ``vjp3``): its type and parameters, the primal's trace by its closed jaxpr (structure, and
    constants by value), the rules by :func:`callable_key` (what they close over by value)."""
    parts = []
    for name, value in sorted(prim.params.items()):
        jaxpr = getattr(value, "jaxpr", None) if name == "traced" else None
        parts.append((name, _param_key(value if jaxpr is None else jaxpr, depth + 1, rule_depth)))
    # the inputs' structure, with nondiff_argnums values as Static leaves: keyed by value
    is_static = _jaxpr.is_static_leaf
    leaves, tree = jax.tree_util.tree_flatten(prim.in_avals, is_leaf=is_static)
    ins = tuple(("static", value_key(x.val, depth + 1)) if is_static(x) else str(x) for x in leaves)
    return ("hi_prim", type(prim).__name__, tuple(parts), str(tree), ins)


# -- custom rules, keyed by what they trace to --------------------------------------------------

# Rules are traced into the key this many levels deep (a rule whose own jaxpr calls a custom
# function: that inner function's rules are keyed by identity and closure, see callable_key) ...
_RULE_LEVELS = 1
# ... except a call, inside a rule, of the custom function whose rule is being keyed (JAX's
# documented pattern: a JVP rule or forward rule that calls the primal): a back-reference to that
# enclosing key, by depth. The user functions of the rules being keyed, outermost first:
_KEYING: list = []


def _user_function(fn: Any, depth: int = 0) -> Any:
    """The user's function inside JAX's wrappers of a rule (``WrappedFun``, partials, JAX's own
    closures), or None."""
    if depth > 24:
        return None
    if isinstance(fn, _jaxpr.WrappedFun):
        return _user_function(fn.f, depth + 1)
    if isinstance(fn, functools.partial):
        return _user_function(fn.func, depth + 1)
    if isinstance(fn, types.FunctionType):
        if not _is_jax_internal(fn):
            return fn
        for value in _cells(fn):
            if _is_function_like(value) and (found := _user_function(value, depth + 1)) is not None:
                return found
    return None


def _rule_function(eqn: Any) -> Any:
    """The user's rule a ``custom_jvp_call``/``custom_vjp_call`` equation applies (its JVP rule,
    or its backward rule), or None."""
    p = eqn.params
    return _user_function(p.get("jvp_jaxpr_fun", p.get("bwd")))


@contextlib.contextmanager
def _keying(rule: Any):
    _KEYING.append(rule)
    try:
        yield
    finally:
        _KEYING.pop()


def _is_inexact(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)


def _traced_key(jaxpr: Any, consts: Any, depth: int, rule_depth: int) -> Hashable:
    """A traced rule: its jaxpr's structure and its constants by value."""
    if isinstance(jaxpr, _jaxpr.ClosedJaxpr):
        jaxpr, consts = jaxpr.jaxpr, [*jaxpr.consts, *consts]
    return (jaxpr_key(jaxpr, depth + 1, rule_depth + 1), tuple(value_key(c, depth) for c in consts))


def _trace_rule(thunk: Callable[[], Any]) -> Any:
    try:
        return thunk()
    except Uncacheable:
        raise
    except Exception as err:  # a rule that cannot be traced here runs uncached
        raise Uncacheable(f"custom rule could not be traced for the cache key: {err!r}") from err


def _custom_jvp_key(eqn: Any, depth: int, rule_depth: int) -> Hashable:
    """``custom_jvp_call``: the primal jaxpr and the JVP rule traced as JAX traces it under ``jvp``
    (float inputs perturbed; the rule's ``nondiff_argnums`` values, closure and globals are
    what it traces to)."""
    p = eqn.params
    nc = p["num_consts"]
    in_zeros = tuple(not _is_inexact(v.aval) for v in eqn.invars[nc:])
    jaxpr, consts, out_zeros = _trace_rule(lambda: p["jvp_jaxpr_fun"].call_wrapped(*in_zeros))
    return (
        "custom_jvp",
        jaxpr_key(p["call_jaxpr"].jaxpr, depth + 1, rule_depth),
        nc,
        p["symbolic_zeros"],
        _traced_key(jaxpr, consts, depth, rule_depth),
        tuple(out_zeros),
    )


def _custom_vjp_key(eqn: Any, depth: int, rule_depth: int) -> Hashable:
    """``custom_vjp_call``: the primal jaxpr, the forward rule and the backward rule, each traced
    on the avals JAX gives it under ``vjp`` (residuals from the forward rule, cotangents of the
    outputs)."""
    p = eqn.params
    nc = p["num_consts"]
    in_avals = [v.aval for v in eqn.invars]
    nonzeros = tuple(_is_inexact(a) for a in in_avals[nc:])
    fwd_jaxpr, fwd_consts = _trace_rule(lambda: p["fwd_jaxpr_thunk"].call_wrapped(*nonzeros))
    out_tree, res_tree, input_fwds = p["out_trees"]()
    n_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    res_out = iter(v.aval for v in fwd_jaxpr.outvars[:n_res_out])
    res_avals = [next(res_out) if f is None else in_avals[f] for f in input_fwds]
    ct_avals = [v.aval.to_tangent_aval() for v in eqn.outvars]

    def bwd(*args: Any) -> list:
        outs = p["bwd"].call_wrapped(*args)
        # symbolic zeros (no cotangent for an input) as None: part of the traced output's tree
        return [None if o is None or _jaxpr.is_symbolic_zero(o) else o for o in outs]

    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in [*res_avals, *ct_avals]]
    bwd_closed = _trace_rule(lambda: jax.make_jaxpr(bwd)(*structs))
    return (
        "custom_vjp",
        jaxpr_key(p["call_jaxpr"].jaxpr, depth + 1, rule_depth),
        nc,
        p["symbolic_zeros"],
        _traced_key(fwd_jaxpr, fwd_consts, depth, rule_depth),
        _traced_key(bwd_closed, (), depth, rule_depth),
        (out_tree, res_tree, tuple(input_fwds)),
    )


_RULE_KEYS = {"custom_jvp_call": _custom_jvp_key, "custom_vjp_call": _custom_vjp_key}


def _eqn_params_key(eqn: Any, depth: int, rule_depth: int) -> Hashable:
    rule_key = _RULE_KEYS.get(eqn.primitive.name)
    if rule_key is not None:
        rule = _rule_function(eqn)
        if rule is not None and any(rule is r for r in _KEYING):
            # the enclosing rule's own function called inside it: its key is being built
            back = len(_KEYING) - max(i for i, r in enumerate(_KEYING) if r is rule)
            return ("recursive", back, _param_key(eqn.params["call_jaxpr"], depth, rule_depth))
        if rule_depth < _RULE_LEVELS:
            try:
                with _keying(rule):
                    return rule_key(eqn, depth, rule_depth)
            except Uncacheable:
                raise
            except Exception as err:  # JAX's internal params differ (another version): run uncached
                raise Uncacheable(f"cannot key {eqn.primitive.name}: {err!r}") from err
    return tuple(sorted((k, _param_key(v, depth, rule_depth)) for k, v in eqn.params.items()))


def jaxpr_key(jaxpr: Any, depth: int = 0, rule_depth: int = 0) -> Hashable:
    """A structural fingerprint of a jaxpr: equal fingerprints compute the same function.

    ``rule_depth`` counts the custom rules traced on the way here (see :data:`_RULE_LEVELS`).
    """
    if depth > 64:
        raise Uncacheable("jaxpr nested too deeply")
    names: dict[Any, int] = {}

    def bind(v: Any) -> Hashable:
        names[v] = len(names)
        return _aval_key(v.aval)

    def ref(v: Any) -> Hashable:
        if isinstance(v, _jaxpr.Literal):
            return _literal_key(v)
        return names[v]

    head = (
        tuple(bind(v) for v in jaxpr.constvars),
        tuple(bind(v) for v in jaxpr.invars),
        str(jaxpr.effects),
    )
    eqns = []
    for eqn in jaxpr.eqns:
        params = _eqn_params_key(eqn, depth, rule_depth)
        ins = tuple(ref(v) for v in eqn.invars)
        outs = tuple(("drop", _aval_key(v.aval)) if isinstance(v, _jaxpr.DropVar) else bind(v) for v in eqn.outvars)
        eqns.append((eqn.primitive.name, params, ins, outs))
    return (head, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars))
