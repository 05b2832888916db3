"""The one trace of a user's function (``fun`` of the transforms, ``row_fn`` of an operator).

:func:`trace` traces a function with ``jax.make_jaxpr`` and closure-converts it: every array the
trace reads that is not an argument (closed-over arrays, unmapped array arguments, tracers of
enclosing transforms, and the arrays an inner ``jax.jit`` closes over, at any depth) becomes a
*constant* of the jaxpr. The constants are handed to the compiled program as arguments (the
chunk loop) or stored as leaves (a ``RowOperator``'s ``consts``), never baked into it. So the
result always reflects the state at call time, and one compiled program serves every call (or
operator) that traces to the same jaxpr (see :mod:`chunkop._cache`).

:func:`trace_example` is the transforms' use of it: ``fun`` on one example of the mapped
arguments (abstract, the mapped axis removed); unmapped arguments reach it exactly as
``jax.vmap`` passes them (Python numbers, strings, ``None``, NumPy arrays and arbitrary objects
as themselves, arrays concretely). The trace runs under ``axis_env=[(axis_name, n)]``: queries
of the axis size (``lax.axis_size``, ``lax.psum`` of an unbatched value) fold to the full size
``n`` exactly as under ``jax.vmap``. Collectives whose value depends on the other elements
(``psum`` of batched values, ``axis_index``, ``all_gather`` ...) cannot be computed chunk by
chunk and raise ``ValueError``, also when they appear only in a ``custom_jvp``/``custom_vjp``
rule.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _jaxpr
from ._axes import replace_at
from ._fingerprint import ClosesOverTracer, Uncacheable, jaxpr_key
from ._sharding import per_dim
from ._tree import is_float as _is_float

__all__ = [
    "CollectiveError",
    "Traced",
    "trace",
    "trace_program",
    "trace_example",
    "eval_traced",
    "evaluate",
    "clamped_start",
]


class Traced(NamedTuple):
    """A user's function traced once, closure-converted (:func:`trace_program`): ``fun`` of the
    transforms on one example, ``row_fn`` of an operator on one row and ``x``.

    Attributes:
        jaxpr: the jaxpr; its ``constvars`` are the hoisted constants, its ``invars`` the
            mapped arguments' leaves (one example each), its ``outvars`` the output leaves.
        consts: the values of ``jaxpr.constvars`` for this call (arrays or tracers).
        out_shapes: ``fun``'s per-example output, as a pytree of ``jax.ShapeDtypeStruct``.
        key: a hashable fingerprint of ``jaxpr`` and the output tree, or None when the jaxpr
            holds something that cannot be keyed safely (the call then runs uncached).
        stageable: False when a custom rule in the jaxpr closes over a tracer of an enclosing
            transform: then the chunks must run without a staging boundary (see
            :class:`chunkop._fingerprint.ClosesOverTracer`).
    """

    jaxpr: Any
    consts: list
    out_shapes: Any
    key: Hashable | None
    stageable: bool = True


def _example_struct(x: Any, axis: int) -> jax.ShapeDtypeStruct:
    """The abstract value of one example of ``x`` mapped along ``axis``: on a mesh (``x``'s type
    names one: an Explicit mesh) typed there, sharded as ``x`` is along its other axes, as
    ``jax.vmap`` shows it (a value typed on no mesh would carry that into every equation of the
    trace, which ``jax.vmap`` along a mesh axis then fails on)."""
    aval = jax.typeof(x)
    shape = tuple(d for k, d in enumerate(aval.shape) if k != axis)
    weak = getattr(aval, "weak_type", False)
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty:
        return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=weak)
    spec = per_dim(sharding.spec, len(aval.shape))
    example = jax.sharding.NamedSharding(sharding.mesh, P(*(e for k, e in enumerate(spec) if k != axis)))
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=weak, sharding=example)


def eval_traced(
    jaxpr: Any, consts: list, *args: Any, take_rows: bool = True, reads: dict[int, Callable] | None = None
) -> list:
    """Evaluate a traced jaxpr (its flat outputs) on the current trace: the one evaluation of
    ``fun`` and ``row_fn`` in the chunk loops and the operator kernels.

    Every equation is bound as ``jax.core.eval_jaxpr`` binds it but one kind, a read of whole
    rows (:func:`_reads_whole_rows`: ``x[i]`` of an array of two or more axes, a
    ``dynamic_slice`` along the leading axis only), which is evaluated as the gather of those
    rows by a 1-D index (``jnp.take``), with the same values (``dynamic_slice`` clamps its start
    as ``mode="clip"`` does). Batched over the chunk, that gather takes one index per example,
    and its transpose (reverse mode; ``A.T.mv``) is a scatter-add of whole rows. The batched
    ``dynamic_slice`` indexes by ``(i, 0, ...)`` instead, whose scatter-add XLA:TPU runs far
    slower (figures: ``benchmarks/RESULTS.md``, "Accelerators"). ``take_rows=False`` binds
    every equation (the segment transpose, whose rows each read their own one-slice ``x``).
    ``reads`` maps positions in ``jaxpr.eqns`` of reads of ``x`` (``dynamic_slice`` equations) to
    ``fn(operand, start)``, which gives the rows read instead (the windowed layout of an
    operator: ``operand`` is a window of ``x``, :mod:`chunkop._operator.row_layout`).
    """
    meshless = not jax.sharding.get_abstract_mesh().empty and any(_traced_without_mesh(e) for e in jaxpr.eqns)
    by_eqn = {id(jaxpr.eqns[i]): fn for i, fn in (reads or {}).items()}

    def rule(eqn: Any, invals: list) -> list | None:
        if id(eqn) in by_eqn:
            return [by_eqn[id(eqn)](invals[0], invals[1])]
        if eqn.primitive.name == "closed_call":  # inline: re-bound, JAX's checker refuses its params
            inner = eqn.params["call_jaxpr"]
            return evaluate(inner.jaxpr, inner.consts, invals, rule)
        if take_rows and _reads_whole_rows(eqn):
            return [_take_rows(invals[0], invals[1], eqn.params["slice_sizes"][0])]
        if meshless and _traced_without_mesh(eqn):  # run in this context, not in its empty mesh
            inner = eqn.params["jaxpr"]
            return evaluate(inner.jaxpr, inner.consts, invals, rule)
        return None

    return evaluate(jaxpr, consts, args, rule)


def _traced_without_mesh(eqn: Any) -> bool:
    """Whether ``eqn`` is an inner ``jax.jit`` traced outside any mesh context (a ``row_fn``
    traced so, :func:`chunkop._operator.row_sharding.traced_for_rows`): bound in a mesh
    context, it would run its body in its own empty mesh, where the ``jax.vmap`` of the
    device layout cannot name the mesh axes; :func:`eval_traced` evaluates its body inline."""
    if eqn.primitive.name not in _JITS:
        return False
    mesh = eqn.params.get("ctx_mesh")
    return mesh is not None and getattr(mesh, "empty", False)


def evaluate(jaxpr: Any, consts: Any, args: Any, rule: Callable[[Any, list], list | None]) -> list:
    """Evaluate ``jaxpr`` on the current trace as ``jax.core.eval_jaxpr`` does, except that an
    equation for which ``rule(eqn, input values)`` returns outputs (not None) gives those: the
    one equation-by-equation evaluator of :func:`eval_traced` and the inliner."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jaxpr.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _jaxpr.eqn_context(eqn):
            outs = rule(eqn, invals)
            if outs is None:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, _jaxpr.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _reads_whole_rows(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``dynamic_slice`` of an array of two or more axes that takes every
    axis but the leading one whole (``x[i]``, ``x[i:i + k]`` with ``i`` traced): its starts
    along those axes are clamped to 0 whatever they are."""
    if eqn.primitive.name != "dynamic_slice":
        return False
    shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
    return len(shape) >= 2 and tuple(sizes[1:]) == tuple(shape[1:])


def clamped_start(start: Any, hi: int) -> jax.Array:
    """``start`` clamped to ``[0, hi]``, as ``lax.dynamic_slice`` clamps a start index, in int32.

    Exact for every integer dtype: the bounds are applied in ``start``'s own dtype only where
    they fit it (a ``uint8`` start into 300 rows needs no upper clamp; ``hi`` itself, 299, would
    wrap to 43 as a ``uint8``), and the result, in ``[0, hi]`` with ``hi < 2**31``, is then cast.

    Example:
        >>> clamped_start(jnp.array([5, 200, 255], jnp.uint8), 298).tolist()
        [5, 200, 255]
        >>> clamped_start(jnp.array([-3, 7, 2**31 - 1], jnp.int32), 6).tolist()
        [0, 6, 6]
    """
    start = jnp.asarray(start)
    info = jnp.iinfo(start.dtype)
    if info.min < 0:
        start = jnp.maximum(start, 0)
    if hi < info.max:  # (a Python int that fits the dtype: no array typed on the context's mesh)
        start = jnp.minimum(start, hi)
    return start.astype(jnp.int32)


def _take_rows(operand: Any, start: Any, size: int) -> Any:
    """``size`` rows of ``operand`` from ``start`` (clamped so that they fit, as
    ``lax.dynamic_slice`` clamps it), gathered by a 1-D index."""
    first = clamped_start(start, operand.shape[0] - size)
    return jnp.take(operand, first + jnp.arange(size, dtype=first.dtype), axis=0, mode="clip")


# -- collectives over the mapped axis -------------------------------------------------------------


def _mentions(value: Any, name: Hashable) -> bool:
    items = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
    for item in items:
        try:
            if type(item) is type(name) and item == name:
                return True
        except (TypeError, ValueError):  # an array-valued param (ambiguous truth value): not an axis name
            continue
    return False


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
    eqn = _jaxpr.find_eqn(jaxpr, lambda e: _refers_to_axis(e, name))
    return None if eqn is None else eqn.primitive.name


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


class CollectiveError(ValueError):
    """``fun`` uses a collective over the chunked ``axis_name``: each chunk would see only part of
    the axis. ``used`` names it (``"the collective `psum` over axis_name='i'"``, and where)."""

    def __init__(self, message: str, used: str):
        super().__init__(message)
        self.used = used


def _check_collectives(closed: Any, axis_name: Hashable, n: int, chunk_size: int, where: str) -> None:
    jaxprs = [closed.jaxpr]
    if _jaxpr.has_eqn(closed.jaxpr, _jaxpr.is_custom_rule):
        jaxprs += _derivative_jaxprs(closed, [(axis_name, n)])
    for jaxpr in jaxprs:
        prim = _uses_axis(jaxpr, axis_name)
        if prim is not None:
            used = f"the collective `{prim}` over axis_name={axis_name!r}" + (
                " (in a custom_jvp/custom_vjp rule)" if jaxpr is not closed.jaxpr else ""
            )
            raise CollectiveError(
                f"{where}: `fun` uses {used}, but with chunk_size={chunk_size} < axis size {n} each "
                f"chunk would see only part of the axis, giving a silently wrong result. Use "
                f"chunk_size=None (or >= {n}) for collectives, or compute the reduction outside the "
                f"chunked function (e.g. with chunkop.sum). (Axis-size queries, `lax.axis_size` or "
                f"`lax.psum` of an unbatched value, are fine.)",
                used,
            )


# -- constants baked into inner jits, at every depth -----------------------------------------------
#
# A jax.jit called inside `fun` keeps the arrays it closes over as constants of its own closed
# sub-jaxpr (jax.lax.cond, scan, while_loop and jax.checkpoint pass what their bodies close over
# as operands instead). Left there, they would be baked into the compiled loop and key it by
# value: one compile per new parameter, each kept alive by the cache. The jaxpr is evaluated once
# more with every such jit inlined, wherever it sits (inside other jits, cond branches, scan and
# while bodies, checkpointed functions), so its constants become constants of the whole trace.
# A control-flow equation on the way is re-bound with the constants its bodies now read added as
# leading operands (its parameters otherwise unchanged). Not entered: the rules and primal of a
# custom_jvp/custom_vjp function (their traced rules would still read the old values; they are
# keyed by value, see chunkop._cache), shard_map bodies, and jits with explicit shardings or
# compiler options (inlining would drop them): constants there stay baked, keyed by value.

_JITS = ("jit", "pjit")
_CHECKPOINTS = ("checkpoint", "remat2")


class _KeepEquation(Exception):
    """A re-bound equation would not be exact: bind the original one (its constants stay baked)."""


def _holds_consts(jaxpr: Any, memo: dict) -> bool:
    """Whether ``jaxpr`` (closed or open) holds constants that inlining can hoist: its own (a
    closed sub-jaxpr's), or an inner jit's at any depth the inliner enters."""
    found = memo.get(id(jaxpr))
    if found is None:
        own = bool(jaxpr.consts) if isinstance(jaxpr, _jaxpr.ClosedJaxpr) else False
        open_ = jaxpr.jaxpr if isinstance(jaxpr, _jaxpr.ClosedJaxpr) else jaxpr
        found = own or any(_eqn_holds_consts(eqn, memo) for eqn in open_.eqns)
        memo[id(jaxpr)] = found
    return found


def _eqn_holds_consts(eqn: Any, memo: dict) -> bool:
    return any(_holds_consts(sub, memo) for sub in _bodies(eqn))


def _eval_hoisting(jaxpr: Any, consts: Any, *args: Any, memo: dict) -> list:
    """Evaluate ``jaxpr`` on the current trace like ``jax.core.eval_jaxpr``, inlining inner jits
    and re-binding control flow so that no constant stays inside a sub-jaxpr (see above)."""

    def rule(eqn: Any, invals: list) -> list | None:
        if _eqn_holds_consts(eqn, memo):
            try:
                return _rebind(eqn, invals, memo)
            except _KeepEquation:
                return None
        return None

    return evaluate(jaxpr, consts, args, rule)


def _retrace(body: Any, memo: dict) -> Any:
    """``body`` (closed or open) traced again with inner jits inlined: a closed jaxpr on the same
    inputs whose constants are everything hoisted out of it."""
    open_, consts = (body.jaxpr, body.consts) if isinstance(body, _jaxpr.ClosedJaxpr) else (body, ())
    return jax.make_jaxpr(lambda *a: _eval_hoisting(open_, consts, *a, memo=memo))(*[v.aval for v in open_.invars])


def _taking_consts(bodies: list, memo: dict) -> tuple[list, list]:
    """The ``bodies`` re-traced (:func:`_retrace`), each as a closed jaxpr without constants
    taking ``(*hoisted, *its own inputs)``, where ``hoisted`` are the constants of all of them
    (so cond branches share one operand list); and ``hoisted``."""
    firsts = [_retrace(body, memo) for body in bodies]
    hoisted = [c for f in firsts for c in f.consts]
    const_avals = [v.aval for f in firsts for v in f.jaxpr.constvars]
    taking, start = [], 0
    for f in firsts:
        k = len(f.consts)

        def call(*a: Any, f: Any = f, lo: int = start, hi: int = start + k) -> list:
            return jax.core.eval_jaxpr(f.jaxpr, a[lo:hi], *a[len(hoisted) :])

        closed = jax.make_jaxpr(call)(*const_avals, *[v.aval for v in f.jaxpr.invars])
        if closed.consts:
            raise _KeepEquation
        taking.append(closed)
        start += k
    return taking, hoisted


def _rebind_jit(eqn: Any, invals: list, memo: dict) -> list:
    """An inner ``jit``: its body evaluated inline (its constants become the trace's)."""
    body = eqn.params["jaxpr"]
    return _eval_hoisting(body.jaxpr, body.consts, *invals, memo=memo)


def _rebind_cond(eqn: Any, invals: list, memo: dict) -> list:
    """``cond``: the branches' constants, shared, as leading operands after the index."""
    branches, hoisted = _taking_consts(list(eqn.params["branches"]), memo)
    index, *ops = invals
    return eqn.primitive.bind(index, *hoisted, *ops, **dict(eqn.params, branches=tuple(branches)))


def _rebind_scan(eqn: Any, invals: list, memo: dict) -> list:
    """``scan``: the body's constants as more scan constants (before the others)."""
    (body,), hoisted = _taking_consts([eqn.params["jaxpr"]], memo)
    return eqn.primitive.bind(*hoisted, *invals, **_jaxpr.scan_params_with_consts(eqn.params, body, len(hoisted)))


def _rebind_while(eqn: Any, invals: list, memo: dict) -> list:
    """``while``: the condition's and the body's constants as more of their constants."""
    p = eqn.params
    (cond,), cond_hoisted = _taking_consts([p["cond_jaxpr"]], memo)
    (body,), body_hoisted = _taking_consts([p["body_jaxpr"]], memo)
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    params = dict(
        p, cond_jaxpr=cond, body_jaxpr=body, cond_nconsts=nc + len(cond_hoisted), body_nconsts=nb + len(body_hoisted)
    )
    return eqn.primitive.bind(*cond_hoisted, *cond_consts, *body_hoisted, *body_consts, *carry, **params)


def _rebind_checkpoint(eqn: Any, invals: list, memo: dict) -> list:
    """``checkpoint``: the body's constants as leading operands (its policy and other
    parameters kept; ``prevent_cse``, per operand where JAX sets it so, False for them)."""
    (body,), hoisted = _taking_consts([eqn.params["jaxpr"]], memo)
    cse = eqn.params["prevent_cse"]
    if isinstance(cse, tuple):  # per operand, as jax.checkpoint sets it: none for constants
        cse = (False,) * len(hoisted) + cse
    return eqn.primitive.bind(*hoisted, *invals, **dict(eqn.params, jaxpr=body.jaxpr, prevent_cse=cse))


class _Hoisting(NamedTuple):
    """How the inliner treats one primitive: the sub-jaxprs it enters (from the equation's
    parameters; ``[]``: none) and how it re-binds the equation with their constants hoisted."""

    bodies: Callable[[dict], list]
    rebind: Callable[[Any, list, dict], list]


def _jit_bodies(p: dict) -> list:
    """An inner ``jit`` with a closed sub-jaxpr, no explicit sharding and no compiler option (an
    inlined jit would drop them)."""
    inlinable = (
        isinstance(p.get("jaxpr"), _jaxpr.ClosedJaxpr)
        and all(_jaxpr.is_unspecified_sharding(s) for s in (*p.get("in_shardings", ()), *p.get("out_shardings", ())))
        and not p.get("compiler_options_kvs")
    )
    return [p["jaxpr"]] if inlinable else []


def _checkpoint_bodies(p: dict) -> list:
    return [p["jaxpr"]] if isinstance(p.get("jaxpr"), _jaxpr.Jaxpr) else []


# The inliner's rules, one entry a primitive (as JAX keeps its own per-primitive rules); any
# other equation is bound as it is, its constants left baked.
_HOISTING: dict[str, _Hoisting] = {
    **{name: _Hoisting(_jit_bodies, _rebind_jit) for name in _JITS},
    "cond": _Hoisting(lambda p: list(p["branches"]), _rebind_cond),
    "scan": _Hoisting(lambda p: [p["jaxpr"]], _rebind_scan),
    "while": _Hoisting(lambda p: [p["cond_jaxpr"], p["body_jaxpr"]], _rebind_while),
    **{name: _Hoisting(_checkpoint_bodies, _rebind_checkpoint) for name in _CHECKPOINTS},
}


def _bodies(eqn: Any) -> list:
    """The sub-jaxprs the inliner enters for this equation (``ClosedJaxpr`` or open ``Jaxpr``)."""
    rule = _HOISTING.get(eqn.primitive.name)
    return [] if rule is None else rule.bodies(eqn.params)


def _rebind(eqn: Any, invals: list, memo: dict) -> list:
    """One equation whose bodies hold constants, on the current trace with those hoisted."""
    return _HOISTING[eqn.primitive.name].rebind(eqn, invals, memo)


def _hoist_inner_consts(closed: Any, axis_env: list) -> Any:
    """``closed`` with the constants of inner jits (at any depth the inliner enters) hoisted into
    its own constants; ``closed`` itself when it has none."""
    memo: dict = {}
    if not any(_eqn_holds_consts(eqn, memo) for eqn in closed.jaxpr.eqns):
        return closed
    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _eval_hoisting(closed.jaxpr, closed.consts, *a, memo=memo), axis_env=axis_env)(
        *avals
    )


# -- tracing ---------------------------------------------------------------------------------------


def _fold_concrete(enabled: bool) -> Any:
    """While tracing ``fun``: operations on concrete (unmapped, eager) values only are computed
    then, as under ``jax.vmap``, so ``fun`` may use them in Python control flow
    (``if float(w.sum()) > 0``); their results are hoisted like any other constant.

    Not with an ``axis_name`` (``enabled`` False): a collective without operands
    (``lax.axis_index``) would be computed outside the axis' scope. Not inside a ``shard_map``
    body (a mesh axis is Manual): a value computed eagerly there would carry the enclosing mesh's
    type, not the body's.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ()) or ())
    return _jaxpr.eager_constant_folding(enabled and not manual)


def _named_after(fn: Callable, like: Any) -> Callable:
    """A fresh function calling ``fn``, named after ``like`` (and pointing at its source), so
    JAX's messages (a non-array output, a leaked tracer ...) name the user's function. Fresh:
    ``jax.make_jaxpr`` caches traces by function identity, which would return the arrays a
    previous trace closed over."""

    def traced(*args: Any) -> Any:
        return fn(*args)

    traced.__name__ = traced.__qualname__ = getattr(
        like, "__qualname__", getattr(like, "__name__", type(like).__name__)
    )
    code = getattr(inspect.unwrap(like), "__code__", None) if callable(like) else None
    if code is not None:
        traced.__code__ = traced.__code__.replace(co_filename=code.co_filename, co_firstlineno=code.co_firstlineno)
    return traced


def trace(
    fn: Callable, *args: Any, named_after: Any = None, axis_env: Sequence = (), fold: bool = False
) -> tuple[Any, Any]:
    """Trace ``fn(*args)`` once: the one trace of a user's function (``fun``, ``row_fn``).

    Every array the trace reads that is not an argument (closed over, an enclosing transform's
    tracer, a constant of an inner ``jax.jit`` at any depth) is a constant of the returned jaxpr,
    never baked into a sub-jaxpr, so a compiled program keyed by the jaxpr's structure
    (:func:`chunkop._fingerprint.jaxpr_key`) is reused across new values of those arrays and keeps none
    of them alive.

    Args:
        fn: the function, of ``args``.
        *args: pytrees of ``jax.ShapeDtypeStruct`` (or values) to trace it on.
        named_after: whose name and source location JAX's messages show (default ``fn``).
        axis_env: ``(axis_name, size)`` pairs the trace runs under (``jax.make_jaxpr``'s).
        fold: compute operations on concrete values while tracing (see :func:`_fold_concrete`).

    Returns:
        ``(closed_jaxpr, out_shapes)``: the invars are the leaves of ``args``, ``out_shapes``
        ``fn``'s output as a pytree of ``jax.ShapeDtypeStruct``.
    """
    traced = _named_after(fn, fn if named_after is None else named_after)
    env = list(axis_env)
    try:
        with _fold_concrete(fold):
            closed, out_shapes = jax.make_jaxpr(traced, axis_env=env, return_shape=True)(*args)
    except (jax.errors.UnexpectedTracerError, NotImplementedError):
        if not fold:
            raise
        # What folding computed eagerly, jax.vmap stages (so it works there): a custom_vjp or
        # custom_jvp run on concrete arguments while it closes over a value of this trace
        # (UnexpectedTracerError), or the value of a symbolic dimension under jax.export (no
        # eager rule: NotImplementedError). Trace again without folding (fun's trace-time side
        # effects then run twice, in these cases only).
        closed, out_shapes = jax.make_jaxpr(traced, axis_env=env, return_shape=True)(*args)
    return _hoist_inner_consts(closed, env), out_shapes


def trace_program(
    fn: Callable,
    *args: Any,
    named_after: Any = None,
    axis_env: Sequence = (),
    fold: str = "always",
    key_with: Hashable = (),
    check: Callable[[Any], None] | None = None,
) -> Traced:
    """``fn(*args)`` traced once (:func:`trace`) and keyed: the one traced program of both layers.

    Args:
        fn, args, named_after, axis_env: as :func:`trace`.
        fold: ``"always"``: operations on concrete values computed while tracing (the transforms,
            as ``jax.vmap`` does); ``"needed"``: only when the plain trace needs a concrete value
            (``row_fn``: folding would make the scalars of its indexing constants, leaves of the
            operator typed on the mesh of the context they ran in); ``"never"``.
        key_with: what else the program's key holds (the meshes its values are typed on).
        check: called on the closed jaxpr before it is keyed (raises what the caller refuses).

    Returns:
        The :class:`Traced` program: its key the jaxpr's structural fingerprint
        (:func:`chunkop._fingerprint.jaxpr_key`), the output's tree structure and ``key_with``;
        None (and not stageable, for a custom rule closing over an enclosing tracer) when the
        jaxpr cannot be keyed.
    """
    if fold not in ("always", "needed", "never"):
        raise ValueError(f"trace_program: `fold` must be 'always', 'needed' or 'never', got {fold!r}.")
    try:
        closed, out_shapes = trace(fn, *args, named_after=named_after, axis_env=axis_env, fold=fold == "always")
    except jax.errors.ConcretizationTypeError:
        if fold != "needed":
            raise
        closed, out_shapes = trace(fn, *args, named_after=named_after, axis_env=axis_env, fold=True)
    if check is not None:
        check(closed)
    jaxpr = _jaxpr.open_jaxpr(closed)
    try:
        key: Hashable | None = (jaxpr_key(closed.jaxpr), jax.tree_util.tree_structure(out_shapes), key_with)
    except ClosesOverTracer:
        return Traced(jaxpr, list(closed.consts), out_shapes, None, False)
    except Uncacheable:
        key = None
    return Traced(jaxpr, list(closed.consts), out_shapes, key, True)


def trace_example(
    fun: Callable,
    leaves: list,
    treedef: Any,
    axes: list,
    n: int,
    *,
    axis_name: Hashable | None,
    chunk_size: int,
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

    structs = [_example_struct(leaves[i], axes[i]) for i in mapped]
    n_env = n if axis_env_size is None else axis_env_size
    env = [(axis_name, n_env)] if axis_name is not None else []
    # (the mesh the examples are typed on, and the context's: the jaxpr's values carry them)
    meshes = (tuple(s.sharding for s in structs), jax.sharding.get_abstract_mesh())
    if axis_name is None:
        return trace_program(one, *structs, named_after=fun, fold="always", key_with=meshes)
    check = lambda closed: _check_collectives(closed, axis_name, n_env, chunk_size, where)
    return trace_program(one, *structs, named_after=fun, axis_env=env, fold="never", key_with=meshes, check=check)
