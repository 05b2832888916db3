"""What a compiled chunk loop is keyed on, and the one bounded cache that holds them.

A chunked call traces the user's function afresh every time (as ``jax.vmap`` does), so the
result always reflects the state at call time. What is *reused* between calls is the jitted
chunk loop, and it is keyed by **what was traced**: a structural fingerprint of the jaxpr
(primitives, parameters, avals, literals, sub-jaxprs), never by the user's function or its
equality. Closed-over arrays are not part of the key: they are hoisted out of the jaxpr and
passed to the loop as arguments (closure conversion, see :mod:`chunkop._trace`).

A jaxpr can hold opaque Python callables: the rules of ``custom_jvp``/``custom_vjp``/
``custom_vmap`` functions and host callbacks. Those are keyed by *identity* (through a weak
reference, so a dead function never matches a new one that reuses its address), after
unwrapping JAX's own per-trace wrappers; the values a user-level rule closes over are keyed
by value (numbers, strings) or identity (arrays, tracers, other objects). A rule that reads
mutable state other than through its closure (a module global, an attribute of ``self``) is,
as under ``jax.jit``, read when JAX traces it. Anything that cannot be keyed makes the call
run uncached (correct, compiled afresh).

The cache is a bounded LRU (:data:`MAX_ENTRIES` loops). It holds jaxprs without their
constants, so no user array is kept alive by it, only (through custom rules) the rule
functions of at most that many loops. :func:`clear_caches` empties it.
"""

from __future__ import annotations

import collections
import enum
import functools
import threading
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from jax._src import linear_util as _lu  # WrappedFun: how JAX holds custom rules in a jaxpr
from jax.extend import core as jex_core

__all__ = [
    "Uncacheable",
    "ClosesOverTracer",
    "jaxpr_key",
    "callable_key",
    "value_key",
    "cached",
    "clear_caches",
    "MAX_ENTRIES",
]

MAX_ENTRIES = 128


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
    """A by-value key for plain data (numbers, strings, dtypes, treedefs, tuples of those)."""
    if isinstance(value, _SIMPLE):
        return (type(value).__name__, value)
    if isinstance(value, jax.tree_util.PyTreeDef):
        return ("treedef", value)
    if isinstance(value, (tuple, list, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
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
    return isinstance(value, _lu.WrappedFun) or (callable(value) and not isinstance(value, type))


def _is_jax_internal(fn: types.FunctionType) -> bool:
    return (getattr(fn, "__module__", None) or "").startswith(("jax._src", "jax.", "jaxlib"))


def _cells(fn: types.FunctionType) -> list[Any]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(None)
    return values


def callable_key(fn: Any, depth: int = 0) -> Hashable:
    """A key for a Python callable found in a jaxpr (a custom rule, a callback, a policy).

    JAX wraps user rules in per-trace closures and ``WrappedFun`` objects; those are unwrapped
    (their code, their callable cells and plain-data cells), so the key reaches the user's own
    function, which is keyed by identity together with what it closes over.
    """
    if depth > 24:
        raise Uncacheable("callable nested too deeply")
    if isinstance(fn, _lu.WrappedFun):
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
            parts = []
            for value in _cells(fn):
                if _is_function_like(value):
                    parts.append(callable_key(value, depth + 1))
                elif _is_simple(value):
                    parts.append(_simple_key(value))
            return ("jax", fn.__code__, tuple(parts))
        return ("user", _Ident(fn), tuple(value_key(v, depth + 1) for v in _cells(fn)))
    if (type(fn).__module__ or "").startswith(("jax._src", "jax.")):
        try:  # JAX's own callable objects (checkpoint policies ...) define value equality
            hash(fn)
            return ("jax-object", type(fn), fn)
        except TypeError:
            pass
    return ("object", _Ident(fn))


def _param_tuple_key(params: Any, depth: int) -> Hashable:
    items = params if isinstance(params, tuple) else (params,)
    parts = []
    for p in items:
        if _is_function_like(p):
            parts.append(callable_key(p, depth))
        elif _is_simple(p):
            parts.append(_simple_key(p))
        # other per-trace transform state (stores) is not part of the key
    return tuple(parts)


def value_key(value: Any, depth: int = 0) -> Hashable:
    """A key for a value a user-level rule closes over: by value for plain data, else by identity."""
    if isinstance(value, jax.core.Tracer):
        raise ClosesOverTracer(type(value).__name__)
    if _is_simple(value):
        return _simple_key(value)
    if _is_function_like(value):
        return callable_key(value, depth + 1)
    return ("ident", _Ident(value))


def _aval_key(aval: Any) -> Hashable:
    return (str(aval), getattr(aval, "weak_type", None))


def _literal_key(lit: Any) -> Hashable:
    val = lit.val
    if isinstance(val, (np.ndarray, np.generic)) or hasattr(val, "dtype"):
        arr = np.asarray(val)
        return ("lit", str(arr.dtype), arr.shape, arr.tobytes(), _aval_key(lit.aval))
    return ("lit", type(val).__name__, repr(val), _aval_key(lit.aval))


def _param_key(value: Any, depth: int) -> Hashable:
    if isinstance(value, jex_core.ClosedJaxpr):
        if value.consts:  # values baked into a sub-jaxpr: keyed by identity (no sharing, still correct)
            consts = tuple(("ident", _Ident(c)) if not _is_simple(c) else _simple_key(c) for c in value.consts)
        else:
            consts = ()
        return ("closed_jaxpr", jaxpr_key(value.jaxpr, depth + 1), consts)
    if isinstance(value, jex_core.Jaxpr):
        return ("jaxpr", jaxpr_key(value, depth + 1))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_param_key(v, depth) for v in value))
    if _is_function_like(value):
        return callable_key(value, depth)
    try:
        hash(value)
    except TypeError:
        raise Uncacheable(f"unhashable jaxpr parameter of type {type(value).__name__}") from None
    return ("param", type(value).__name__, value)


def jaxpr_key(jaxpr: Any, depth: int = 0) -> Hashable:
    """A structural fingerprint of a jaxpr: equal fingerprints compute the same function."""
    if depth > 64:
        raise Uncacheable("jaxpr nested too deeply")
    names: dict[Any, int] = {}

    def bind(v: Any) -> Hashable:
        names[v] = len(names)
        return _aval_key(v.aval)

    def ref(v: Any) -> Hashable:
        if isinstance(v, jex_core.Literal):
            return _literal_key(v)
        return names[v]

    head = (
        tuple(bind(v) for v in jaxpr.constvars),
        tuple(bind(v) for v in jaxpr.invars),
        str(jaxpr.effects),
    )
    eqns = []
    for eqn in jaxpr.eqns:
        params = tuple(sorted((k, _param_key(v, depth)) for k, v in eqn.params.items()))
        ins = tuple(ref(v) for v in eqn.invars)
        outs = tuple(("drop", _aval_key(v.aval)) if isinstance(v, jex_core.DropVar) else bind(v) for v in eqn.outvars)
        eqns.append((eqn.primitive.name, params, ins, outs))
    return (head, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars))


# -- the cache ------------------------------------------------------------------------------------

_LOOPS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def cached(key: Hashable, make: Callable[[], Callable]) -> Callable:
    """The compiled loop for ``key``, made by ``make()`` on a miss (least-recently-used eviction)."""
    with _LOCK:
        if key in _LOOPS:
            _LOOPS.move_to_end(key)
            return _LOOPS[key]
    loop = make()
    with _LOCK:
        _LOOPS[key] = loop
        while len(_LOOPS) > MAX_ENTRIES:
            _LOOPS.popitem(last=False)
    return loop


def clear_caches() -> None:
    """Drop every compiled chunk loop chunkop holds (their compiled programs go with them).

    chunkop never keys a cache by a user function, so this is never needed for correctness;
    it frees memory (the cache is bounded to ``MAX_ENTRIES`` loops in any case).

    Example:
        >>> import chunkop
        >>> chunkop.clear_caches()
    """
    with _LOCK:
        _LOOPS.clear()
