"""Tracing the user's function once per call, on one example, with its closure converted.

``fun`` is traced with ``jax.make_jaxpr`` on one example of the mapped arguments (abstract,
the mapped axis removed); unmapped arguments reach it exactly as ``jax.vmap`` passes them
(Python numbers, strings, ``None``, NumPy arrays and arbitrary objects as themselves, arrays
concretely). Every array the trace reads without it being a mapped argument (closed-over arrays,
unmapped array arguments, tracers of enclosing transforms) becomes a *constant* of the jaxpr;
the constants are handed to the compiled chunk loop as arguments, never baked into it. So the
result always reflects the state at call time, and one compiled loop serves every call that
traces to the same jaxpr (see :mod:`chunkop._cache`).

The trace runs under ``axis_env=[(axis_name, n)]``: queries of the axis size (``lax.axis_size``,
``lax.psum`` of an unbatched value) fold to the full size ``n`` exactly as under ``jax.vmap``.
Collectives whose value depends on the other elements (``psum`` of batched values,
``axis_index``, ``all_gather`` ...) cannot be computed chunk by chunk and raise ``ValueError``,
also when they appear only in a ``custom_jvp``/``custom_vjp`` rule.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _jaxpr
from ._axes import replace_at
from ._cache import ClosesOverTracer, Uncacheable, jaxpr_key
from ._tree import is_float as _is_float

__all__ = ["Traced", "trace_example", "eval_traced"]

_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vmap_call", "custom_lin")


class Traced(NamedTuple):
    """``fun`` on one example, closure-converted.

    Attributes:
        jaxpr: the jaxpr; its ``constvars`` are the hoisted constants, its ``invars`` the
            mapped arguments' leaves (one example each), its ``outvars`` the output leaves.
        consts: the values of ``jaxpr.constvars`` for this call (arrays or tracers).
        out_shapes: ``fun``'s per-example output, as a pytree of ``jax.ShapeDtypeStruct``.
        key: a hashable fingerprint of ``jaxpr`` and the output tree, or None when the jaxpr
            holds something that cannot be keyed safely (the call then runs uncached).
        stageable: False when a custom rule in the jaxpr closes over a tracer of an enclosing
            transform: then the chunks must run without a staging boundary (see
            :class:`chunkop._cache.ClosesOverTracer`).
        derivative_error: when set, the compiled loop runs forward but cannot be differentiated
            (``jax_custom_vjp3`` with a ``custom_vjp`` under remat): differentiating it raises a
            ``ValueError`` with this message.
    """

    jaxpr: Any
    consts: list
    out_shapes: Any
    key: Hashable | None
    stageable: bool = True
    derivative_error: str | None = None


def _example_struct(x: Any, axis: int) -> jax.ShapeDtypeStruct:
    """The abstract value of one example of ``x`` mapped along ``axis``."""
    aval = jax.typeof(x)
    shape = tuple(d for k, d in enumerate(aval.shape) if k != axis)
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def eval_traced(jaxpr: Any, consts: list, *args: Any) -> list:
    """Evaluate a traced jaxpr (its flat outputs) on the current trace."""
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


# -- collectives over the mapped axis -------------------------------------------------------------


def _mentions(value: Any, name: Hashable) -> bool:
    items = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
    for item in items:
        try:
            if type(item) is type(name) and item == name:
                return True
        except Exception:  # noqa: BLE001 - an array-valued param (ambiguous truth value): not an axis name
            continue
    return False


def _subjaxprs(value: Any):
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if hasattr(item, "eqns"):
            yield item
        elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
            yield item.jaxpr


def _refers_to_axis(eqn: Any, name: Hashable) -> bool:
    """Whether one equation is a collective over axis ``name``.

    Collectives carry a ``NamedAxisEffect`` (``psum``, ``pmax``, ``axis_index``, ``all_gather``
    ...) or name the axis in an ``axis_name`` parameter (``ppermute`` has no effect). Other
    parameters are not looked at: a ``jit`` whose ``name`` happens to equal the axis name, or a
    ``reduce_sum`` over ``axes=(0,)`` with ``axis_name=0``, is not a collective.
    """
    for effect in getattr(eqn, "effects", ()):
        if _mentions(getattr(effect, "name", None), name):
            return True
    return _mentions(eqn.params.get("axis_name"), name)


def _uses_axis(jaxpr: Any, name: Hashable) -> str | None:
    """The first primitive in ``jaxpr`` (recursively) that is a collective over axis ``name``."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found = _uses_axis(sub, name)
                if found:
                    return found
        if _refers_to_axis(eqn, name):
            return eqn.primitive.name
    return None


def _has_eqn(jaxpr: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``jaxpr`` (recursively) has an equation for which ``test(eqn)`` holds."""
    for eqn in jaxpr.eqns:
        if test(eqn):
            return True
        for value in eqn.params.values():
            if any(_has_eqn(sub, test) for sub in _subjaxprs(value)):
                return True
    return False


def _is_custom_rule(eqn: Any) -> bool:
    return eqn.primitive.name in _CUSTOM_RULES or _is_custom_vjp(eqn)


def _is_custom_vjp(eqn: Any) -> bool:
    # custom_vjp_call, or (under jax_custom_vjp3) a `call_hi_primitive` of a CustomVJPTraced
    return eqn.primitive.name == "custom_vjp_call" or any(
        type(v).__name__.startswith("CustomVJP") for v in eqn.params.values()
    )


def _derivative_jaxprs(closed: Any, env: list) -> list:
    """The jaxprs of the JVP and the VJP of ``closed`` (w.r.t. its float inputs and constants).

    Custom rules are traced only when differentiated: tracing the derivatives here shows the
    collectives a rule uses. A derivative that cannot be traced (``jvp`` of a ``custom_vjp``
    function, say) is skipped: it would fail with JAX's own error when used.
    """
    jaxpr = closed.jaxpr
    avals = [v.aval for v in jaxpr.constvars] + [v.aval for v in jaxpr.invars]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    n_consts = len(jaxpr.constvars)
    floats = [k for k, s in enumerate(structs) if _is_float(s)]
    if not floats:
        return []

    def float_fn(all_args: list) -> Callable:
        def f(*fl: Any) -> list:
            full = list(all_args)
            for k, v in zip(floats, fl):
                full[k] = v
            outs = eval_traced(jaxpr, full[:n_consts], *full[n_consts:])
            return [o for o in outs if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]

        return f

    def jvp(*all_args: Any) -> Any:
        fl = [all_args[k] for k in floats]
        return jax.jvp(float_fn(list(all_args)), fl, [jnp.ones_like(v) for v in fl])[1]

    def vjp(*all_args: Any) -> Any:
        fl = [all_args[k] for k in floats]
        out, pullback = jax.vjp(float_fn(list(all_args)), *fl)
        return pullback(out)

    found = []
    for derivative in (jvp, vjp):
        try:
            found.append(jax.make_jaxpr(derivative, axis_env=env)(*structs).jaxpr)
        except Exception:  # noqa: BLE001 - see the docstring
            continue
    return found


def _check_collectives(closed: Any, axis_name: Hashable, n: int, chunk_size: int, where: str) -> None:
    jaxprs = [closed.jaxpr]
    if _has_eqn(closed.jaxpr, _is_custom_rule):
        jaxprs += _derivative_jaxprs(closed, [(axis_name, n)])
    for jaxpr in jaxprs:
        prim = _uses_axis(jaxpr, axis_name)
        if prim is not None:
            raise ValueError(
                f"{where}: `fun` uses the collective `{prim}` over axis_name={axis_name!r}"
                + (" (in a custom_jvp/custom_vjp rule)" if jaxpr is not closed.jaxpr else "")
                + f", but with chunk_size={chunk_size} < axis size {n} each chunk would see only "
                f"part of the axis, giving a silently wrong result. Use chunk_size=None (or >= {n}) "
                f"for collectives, or compute the reduction outside the chunked function (e.g. with "
                f"chunkop.sum). (Axis-size queries, `lax.axis_size` or `lax.psum` of an unbatched "
                f"value, are fine.)"
            )


# -- constants baked into inner jits ---------------------------------------------------------------


def _jit_with_consts(eqn: Any) -> bool:
    sub = eqn.params.get("jaxpr")
    return eqn.primitive.name in ("jit", "pjit") and isinstance(sub, _jaxpr.ClosedJaxpr) and bool(sub.consts)


def _eval_inlining_jits(jaxpr: Any, consts: list, *args: Any) -> list:
    """Evaluate ``jaxpr`` like ``jax.core.eval_jaxpr``, but inline every ``jit`` whose jaxpr holds
    constants (an inner ``jax.jit`` closing over arrays), so that those arrays become constants of
    the enclosing trace (hoisted) instead of values baked into the program."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jaxpr.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if _jit_with_consts(eqn):
            sub = eqn.params["jaxpr"]
            outs = _eval_inlining_jits(sub.jaxpr, list(sub.consts), *invals)
        else:
            with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds an equation
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, _jaxpr.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


# -- tracing ---------------------------------------------------------------------------------------


def _fold_concrete(axis_name: Hashable | None) -> Any:
    """While tracing ``fun``: operations on concrete (unmapped, eager) values only are computed
    then, as under ``jax.vmap``, so ``fun`` may use them in Python control flow
    (``if float(w.sum()) > 0``); their results are hoisted like any other constant.

    Not with an ``axis_name``: a collective without operands (``lax.axis_index``) would be
    computed outside the axis' scope. Not inside a ``shard_map`` body (a mesh axis is Manual):
    a value computed eagerly there would carry the enclosing mesh's type, not the body's.
    """
    from jax._src import config as _config  # no public switch for this yet

    state = getattr(_config, "eager_constant_folding", None)
    mesh = jax.sharding.get_abstract_mesh()
    manual = any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ()) or ())
    return state(True) if state is not None and axis_name is None and not manual else contextlib.nullcontext()


def trace_example(
    fun: Callable,
    leaves: list,
    treedef: Any,
    axes: list,
    n: int,
    *,
    axis_name: Hashable | None,
    chunk_size: int,
    remat: Any,
    where: str,
    axis_env_size: int | None = None,
) -> Traced:
    """Trace ``fun`` on one example of the mapped leaves; hoist what it closes over.

    Args:
        fun: the user's function of ``*args, **kwargs``.
        leaves: the leaves of ``(args, kwargs)``.
        treedef: their tree structure.
        axes: the mapped axis of each leaf (None: unmapped).
        n: the size of the mapped axis.
        axis_name: the mapped axis' name (or None).
        chunk_size: the chunk size (for messages).
        remat: the remat setting (``jax_custom_vjp3`` cannot differentiate it around a custom_vjp).
        where: the public name, for messages.
        axis_env_size: what axis-size queries over ``axis_name`` give (default ``n``; the whole
            axis' size when ``n`` is one device's shard of it).

    Returns:
        The :class:`Traced` function.
    """
    mapped = [i for i, a in enumerate(axes) if a is not None]

    def one(*examples: Any) -> Any:
        args, kwargs = jax.tree_util.tree_unflatten(treedef, replace_at(leaves, mapped, examples))
        return fun(*args, **kwargs)

    # JAX's messages (a non-array output, a tracer leaked ...) name the traced function: the user's
    one.__name__ = one.__qualname__ = getattr(fun, "__qualname__", getattr(fun, "__name__", type(fun).__name__))
    code = getattr(inspect.unwrap(fun), "__code__", None) if callable(fun) else None
    if code is not None:
        one.__code__ = one.__code__.replace(co_filename=code.co_filename, co_firstlineno=code.co_firstlineno)

    structs = [_example_struct(leaves[i], axes[i]) for i in mapped]
    n_env = n if axis_env_size is None else axis_env_size
    env = [(axis_name, n_env)] if axis_name is not None else []
    try:
        with _fold_concrete(axis_name):
            closed, out_shapes = jax.make_jaxpr(one, axis_env=env, return_shape=True)(*structs)
    except jax.errors.UnexpectedTracerError:
        # Folding ran a custom_vjp/custom_jvp on concrete arguments eagerly while it closes over
        # a value of this trace (jax.vmap never stages it, so it works there): trace again,
        # without folding (fun's trace-time side effects then run twice, in this case only).
        closed, out_shapes = jax.make_jaxpr(one, axis_env=env, return_shape=True)(*structs)
    if any(_jit_with_consts(eqn) for eqn in closed.jaxpr.eqns):
        # An inner jax.jit closing over arrays (built afresh per step over new parameters, say):
        # trace once more with it inlined, so those arrays are hoisted (passed to the compiled
        # loop as arguments, not baked into it) and the loop is reused across steps.
        inner = closed
        closed = jax.make_jaxpr(lambda *ex: _eval_inlining_jits(inner.jaxpr, inner.consts, *ex), axis_env=env)(*structs)
    if axis_name is not None:
        _check_collectives(closed, axis_name, n_env, chunk_size, where)
    refusal = None
    if jax.config.jax_custom_vjp3 and remat is not False and _has_eqn(closed.jaxpr, _is_custom_vjp):
        refusal = (
            f"{where}: `fun` calls a jax.custom_vjp function while jax_custom_vjp3 is enabled; under "
            f"that flag JAX cannot differentiate jax.checkpoint around jax.vmap of a custom_vjp "
            f"function (in any order), which chunking with remat needs to differentiate. Pass "
            f"remat=False (reverse mode then stores every chunk's residuals), or disable the flag "
            f'with jax.config.update("jax_custom_vjp3", False). (Without derivatives it runs.)'
        )
    try:
        key: Hashable | None = (jaxpr_key(closed.jaxpr), jax.tree_util.tree_structure(out_shapes))
    except ClosesOverTracer:
        return Traced(closed.jaxpr, list(closed.consts), out_shapes, None, False, refusal)
    except Uncacheable:
        key = None
    return Traced(closed.jaxpr, list(closed.consts), out_shapes, key, True, refusal)
