"""Inner ``jax.jit``s over new parameters, at any depth, in ``fun`` and in a ``row_fn`` (issue #24, finding 4).

A training loop builds ``jax.jit(lambda v: f(v, p))`` afresh at every step over new parameters
``p``, and calls it from the chunked function: at the top level of ``fun``/``row_fn``, or one
level down (inside ``jax.checkpoint``, ``lax.cond``, ``lax.scan``, ``lax.while_loop``, another
``jax.jit``), or deeper. The one trace (:func:`chunkop._trace.trace`) inlines those jits so their
parameters are hoisted into the trace's constants: the compiled loop (or operator kernel) is
keyed by structure, so after the first step nothing compiles, and no old parameter is kept
alive. Values and gradients equal ``jax.vmap``'s (resp. the dense matrix's).
"""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CompileCounter, assert_tree_allclose
from jax import lax

import chunkop
from chunkop import _jaxpr, _trace

X = jnp.linspace(-1.0, 1.0, 10)  # chunk 3: three chunks and a remainder of one
STEPS = 4


@pytest.fixture(autouse=True)
def _empty_cache():
    chunkop.clear_caches()
    yield
    chunkop.clear_caches()


def _params(step: int) -> jax.Array:
    return jnp.linspace(0.5, 1.5, 64) * (step + 1)


# -- fun: where the inner jit sits -----------------------------------------------------------------


def _in_fun(where: str, inner):
    """A per-example ``fun`` calling ``inner`` (a jit over the step's parameters) at ``where``."""
    if where == "top":
        return lambda xi: inner(xi).sum()
    if where == "checkpoint":
        return lambda xi: jax.checkpoint(lambda v: inner(v).sum())(xi)
    if where == "cond":
        return lambda xi: lax.cond(xi > 0, lambda v: inner(v).sum(), lambda v: 2.0 * v, xi)
    if where == "scan":
        return lambda xi: lax.scan(lambda c, _: (c + inner(c * xi).sum(), None), xi, None, length=2)[0]
    if where == "jit":
        return lambda xi: jax.jit(lambda v: inner(v).sum() + 1.0)(xi)
    if where == "while":
        return lambda xi: lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] + inner(xi).sum(), c[1] + 1), (xi, 0))[0]
    if where == "checkpoint-cond-scan-jit":  # depth 4

        def deep(v):
            body = lambda c, _: (c + jax.jit(lambda u: inner(u).sum())(c), None)
            return lax.cond(v > -2.0, lambda u: lax.scan(body, u, None, length=2)[0], lambda u: u, v)

        return lambda xi: jax.checkpoint(deep)(xi)
    raise ValueError(where)


FUN_DEPTHS = ["top", "checkpoint", "cond", "scan", "jit", "while", "checkpoint-cond-scan-jit"]
COMPOSED = {"checkpoint", "cond", "scan", "jit"}  # the levels of "checkpoint-cond-scan-jit"


def _released(refs: list) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


def _reference(where: str, differentiable: bool):
    """``jax.vmap``'s value (and gradient of the sum) with the parameter as an argument: one
    compile for every step, so the loop's cost is the chunked calls'. The inner function is a
    plain one: a fresh inner ``jax.jit`` per step would make the reference compile per step."""

    def value(p, x):
        return jax.vmap(_in_fun(where, lambda v: jnp.tanh(v * p)))(x)

    grad = jax.grad(lambda p, x: value(p, x).sum(), argnums=1) if differentiable else None
    return jax.jit(value), grad and jax.jit(grad)


def _eager_step(where: str, step: int, reference) -> tuple[int, weakref.ref]:
    """One step: a new parameter, a new inner jit over it, the chunked call (and its gradient)
    checked against jax.vmap; the compiles it took and a weak reference to the parameter.

    The reference runs on a copy of the parameter: JAX itself keeps the arrays of an inner jit
    alive after an eager ``jax.vmap`` of a scan calling it (jax 0.10.2)."""
    value, grad_ref = reference
    p = _params(step)
    fun = _in_fun(where, jax.jit(lambda v: jnp.tanh(v * p)))
    ours = lambda x: chunkop.vmap(fun, chunk_size=3)(x)
    with CompileCounter() as counter:
        out = ours(X)
        grad = jax.grad(lambda x: ours(x).sum())(X) if grad_ref else None
        jax.block_until_ready((out, grad))
    copy = jnp.array(p, copy=True)
    # per example: sums of 64 tanh terms (twice in a scan), the same order in both
    assert_tree_allclose(out, value(copy, X), n_terms=2 * p.size)
    if grad_ref:
        assert_tree_allclose(grad, grad_ref(copy, X), n_terms=2 * p.size)
    return counter.count, weakref.ref(p)


# "checkpoint-cond-scan-jit" nests the four single-level cases, which run under -m slow
@pytest.mark.parametrize("where", [pytest.param(w, marks=[pytest.mark.slow] * (w in COMPOSED)) for w in FUN_DEPTHS])
def test_eager_training_loop_compiles_once_and_keeps_no_parameter(where):
    reference = _reference(where, differentiable=where != "while")  # no reverse mode through a while_loop
    compiles, refs = zip(*[_eager_step(where, step, reference) for step in range(STEPS)])
    assert compiles[1:] == (0,) * (STEPS - 1), f"compiles per step: {compiles}"
    assert _released(refs), "an old parameter array is kept alive"


@pytest.mark.parametrize("where", ["checkpoint", "cond", "scan"])
def test_sum_in_a_jitted_training_step(where):
    """``jax.jit(step)`` with the parameters as an argument: compiled once, nothing kept."""

    def loss(p, x):
        inner = jax.jit(lambda v: jnp.tanh(v * p))
        return chunkop.sum(_in_fun(where, inner), chunk_size=3)(x)

    step = jax.jit(jax.value_and_grad(loss))
    per_example = lambda p, xi: _in_fun(where, lambda v: jnp.tanh(v * p))(xi)
    # the summands of the value and of the gradient (one per example), jax.vmap's, compiled once
    terms = jax.jit(
        lambda p: (jax.vmap(per_example, (None, 0))(p, X), jax.vmap(jax.grad(per_example), (None, 0))(p, X))
    )

    compiles, refs = [], []
    for i in range(STEPS):
        p = _params(i)
        with CompileCounter() as counter:
            value, grad = step(p, X)
            jax.block_until_ready(grad)
        compiles.append(counter.count)
        values, grads = terms(p)
        # sums over the examples (which cancel to ~0) of sums of 64 tanh terms (twice in a scan)
        assert_tree_allclose(value, values.sum(0), terms=values, depth=2 * p.size)
        assert_tree_allclose(grad, grads.sum(0), terms=grads, depth=2 * p.size)
        refs.append(weakref.ref(p))
        del p
    assert compiles[1:] == [0] * (STEPS - 1), f"compiles per step: {compiles}"
    assert _released(refs)


# -- row_fn: a RowOperator built per step ------------------------------------------------------------

ROWS = {"idx": jnp.arange(10) % 4, "w": jnp.linspace(0.5, 1.0, 10)}
X_STRUCT = jax.ShapeDtypeStruct((4,), jnp.float32)
XV = jnp.arange(4.0) + 1.0
YV = jnp.linspace(-1.0, 2.0, 10)


def _row_fn(where: str, inner):
    """A ``row_fn`` linear in ``x`` calling ``inner`` (linear, over the step's parameters) at ``where``."""
    if where == "top":
        return lambda row, x: row["w"] * inner(x)[row["idx"]]
    if where == "checkpoint":
        return lambda row, x: jax.checkpoint(lambda r, v: r["w"] * inner(v)[r["idx"]])(row, x)
    if where == "cond":
        return lambda row, x: lax.cond(row["w"] > 0.7, lambda v: inner(v)[row["idx"]], lambda v: -v[row["idx"]], x)
    if where == "scan":
        return lambda row, x: row["w"] * lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0][row["idx"]]
    if where == "jit":
        return lambda row, x: jax.jit(lambda r, v: r["w"] * inner(v)[r["idx"]])(row, x)
    raise ValueError(where)


ROW_DEPTHS = ["top", "checkpoint", "cond", "scan", "jit"]


@functools.cache
def _dense(where: str):
    """The dense matrix of ``_row_fn(where, v -> v * p)`` as a jitted function of ``p``: one
    compile for every step (a fresh inner jit per step would compile per step)."""
    return jax.jit(lambda p: jax.jacfwd(lambda v: jax.vmap(_row_fn(where, lambda u: u * p), (0, None))(ROWS, v))(XV))


def _operator_loop(where: str, run) -> tuple[list, list]:
    compiles, refs = [], []
    for step in range(STEPS):
        p = _params(step)[:4]
        inner = jax.jit(lambda v, p=p: v * p)
        row_fn = _row_fn(where, inner)
        with CompileCounter() as counter:
            op = chunkop.RowOperator(row_fn, ROWS, X_STRUCT, chunk_size=3)
            y, xt = run(op)
            jax.block_until_ready((y, xt))
        compiles.append(counter.count)
        copy = jnp.array(p, copy=True)  # the reference's own (see _eager_step)
        dense = np.asarray(_dense(where)(copy))
        assert_tree_allclose(y, (dense @ XV).astype(np.float32), terms=(dense * XV).T)
        assert_tree_allclose(xt, (dense.T @ YV).astype(np.float32), terms=dense * YV[:, None])
        refs.append(weakref.ref(p))
        del p, inner, row_fn, op
    return compiles, refs


@pytest.mark.parametrize("where", ROW_DEPTHS)
def test_operator_rebuilt_per_step_reuses_its_kernels(where):
    compiles, refs = _operator_loop(where, lambda op: (op.mv(XV), op.T.mv(YV)))
    assert compiles[1:] == [0] * (STEPS - 1), f"compiles per step: {compiles}"
    assert _released(refs), "an old parameter array is kept alive"


@pytest.mark.parametrize("where", ["top", "checkpoint", "cond"])
def test_operator_passed_to_a_jitted_step(where):
    """The operator (a pytree whose static part is the traced ``row_fn``) as an argument of
    ``jax.jit(step)``: the step is traced and compiled once, not once per new parameter."""
    step = jax.jit(lambda op, x, y: (op.mv(x), op.T.mv(y)))
    compiles, refs = _operator_loop(where, lambda op: step(op, XV, YV))
    assert compiles[1:] == [0] * (STEPS - 1), f"compiles per step: {compiles}"
    assert _released(refs)


def test_operator_spec_holds_no_parameter():
    p = jnp.arange(4.0) + 2.0
    inner = jax.jit(lambda v: v * p)
    op = chunkop.RowOperator(_row_fn("checkpoint", inner), ROWS, X_STRUCT, chunk_size=3)
    assert any(c is p for c in op.consts), "the inner jit's parameter is one of the operator's consts"
    assert not _baked(op.spec.jaxpr)


# -- the inlined trace itself --------------------------------------------------------------------------


def _baked(jaxpr) -> int:
    """Closed sub-jaxprs holding constants, at any depth."""
    found = 0
    for eqn in jaxpr.eqns:
        prim = _jaxpr.hi_prim(eqn.params.get("_prim"))  # a custom_jvp under jax_custom_jvp3
        values = [*eqn.params.values(), *([] if prim is None else [prim.params["traced"].jaxpr])]
        for value in values:
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, _jaxpr.ClosedJaxpr):
                    found += bool(sub.consts) + _baked(sub.jaxpr)
                elif isinstance(sub, _jaxpr.Jaxpr):
                    found += _baked(sub)
    return found


P = jnp.linspace(0.5, 1.5, 3)
Q = jnp.array(2.0)
_scale = jax.jit(lambda v: v * P)
_shift = jax.jit(lambda v: _scale(v) + Q)

STRUCTURES = {
    "cond-literal-output": lambda x: lax.cond(x[0] > 0, lambda v: (_scale(v), 0.0), lambda v: (v, 1.0), x)[0],
    "switch": lambda x: lax.switch(jnp.int32(x[0] > 0) + 1, [lambda v: v, _scale, lambda v: _shift(v) * Q], x),
    "scan-xs-ys": lambda x: lax.scan(lambda c, y: (_scale(c) + y, _shift(y)), x, jnp.stack([x, 2 * x]))[1].sum(0),
    "while": lambda x: lax.while_loop(lambda c: c[1] < 3, lambda c: (_shift(c[0]), c[1] + 1), (x, 0))[0],
    "fori": lambda x: lax.fori_loop(0, 3, lambda i, c: _scale(c), x),
    "checkpoint-policy": lambda x: jax.checkpoint(
        lambda v: jnp.sin(_scale(v)), policy=jax.checkpoint_policies.dots_saveable, prevent_cse=False
    )(x),
    "grad-of-checkpoint": lambda x: jax.grad(lambda v: jax.checkpoint(lambda u: _shift(u).sum())(v))(x),
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_inlined_trace_computes_the_same_function(name):
    fun = STRUCTURES[name]
    x = jnp.array([0.3, -0.2, 0.7])
    closed, _ = _trace.trace(fun, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert _baked(jax.make_jaxpr(fun)(x).jaxpr) > 0 and _baked(closed.jaxpr) == 0
    assert any(c is P for c in closed.consts)
    evaluated = lambda v: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, v)[0]
    assert_tree_allclose(evaluated(x), fun(x))  # elementwise, or sums of at most 3 terms
    xs = jnp.stack([x, -x, 2 * x])
    assert_tree_allclose(chunkop.vmap(fun, chunk_size=2)(xs), jax.vmap(fun)(xs))
    if name != "while":
        assert_tree_allclose(jax.grad(lambda v: evaluated(v).sum())(x), jax.grad(lambda v: fun(v).sum())(x), n_terms=3)


def test_checkpoint_parameters_are_kept():
    closed, _ = _trace.trace(STRUCTURES["checkpoint-policy"], jax.ShapeDtypeStruct((3,), jnp.float32))
    (remat,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
    assert remat.params["prevent_cse"] is False
    assert remat.params["policy"] is jax.checkpoint_policies.dots_saveable
    closed, _ = _trace.trace(STRUCTURES["grad-of-checkpoint"], jax.ShapeDtypeStruct((3,), jnp.float32))
    assert any(e.params.get("differentiated") for e in closed.jaxpr.eqns)


def test_custom_rule_and_sharded_jit_are_left_as_they_are():
    """Not inlined: a custom_jvp's primal (its rule would still read the old value) and a jit with
    explicit shardings (inlining would drop them). Their constants stay baked, keyed by value:
    correct, and recompiled for a new value."""

    @jax.custom_jvp
    def f(v):
        return _scale(v)

    f.defjvp(lambda primals, tangents: (f(primals[0]), tangents[0] * P))
    # (jax >= 0.12 deprecates the class for this factory; not getattr with a default: reading the
    # class is itself what warns)
    if hasattr(jax.sharding, "make_single_device_sharding"):
        single = jax.sharding.make_single_device_sharding
    else:
        single = jax.sharding.SingleDeviceSharding
    device = single(jax.devices()[0])
    sharded = jax.jit(lambda v: v * P, out_shardings=device)
    x = jnp.array([0.3, -0.2, 0.7])
    for fun in (f, sharded):
        closed, _ = _trace.trace(fun, jax.ShapeDtypeStruct((3,), jnp.float32))
        assert _baked(closed.jaxpr) == 1
        xs = jnp.stack([x, -x])
        assert_tree_allclose(chunkop.vmap(fun, chunk_size=1)(xs), jax.vmap(fun)(xs))
