"""Transforms of ``A.mv`` and ``A.T.mv`` equal the same transforms of the unchunked reference.

The reference of ``A.mv`` is ``jax.vmap(row_fn, (0, None))(rows, x)`` and that of ``A.T.mv`` is
``jax.linear_transpose`` of it. For every operator of the registry (``make_operators``), whose
parameter ``p`` enters through the rows, the closure or both: ``grad`` and ``jvp`` of a loss
w.r.t. ``p`` and the vector under ``jit``, and ``vmap`` over a batch of parameters (a batch of
operators). For the line-of-sight problem (``p`` = the rows' distances ``d`` and scales ``s``)
the rest: ``grad`` outside ``jit``, w.r.t. whole rows with int leaves, ``jvp`` with
symbolic-zero tangents, ``vjp``, Hessian-vector products, full Hessians, ``jacfwd``/``jacrev``,
``vmap`` over vectors and over batches of operators, ``linear_transpose``, use inside
``lax.scan`` and ``jax.checkpoint``, and a float64 finite-difference check.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose
from jax.flatten_util import ravel_pytree
from operator_registry import (
    OPERATOR_IDS,
    longest_sum,
    make_closed_arrays,
    make_closed_scalar,
    make_los,
    make_operators,
)
from operator_registry import make_pytree as make_pytree_case

import chunkop


def both(chunked, reference):
    """``(chunked(), reference())`` computed in one jitted call (one compilation)."""
    return jax.jit(lambda: (chunked(), reference()))()


def _loss(out, w):
    """A real, non-linear scalar loss of a (possibly complex, pytree) output."""
    terms = [
        jnp.sum(jnp.real(jnp.conj(b) * a)) + 0.3 * jnp.sum(jnp.sin(jnp.real(a)) + jnp.abs(a) ** 2)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(w))
    ]
    return sum(terms)


def _scaled_close(got, expected, rtol=1e-4, atol_scale=1e-5):
    """Leaf by leaf, to ``rtol`` and an absolute tolerance relative to the leaf's largest value."""
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        assert_tree_allclose(a, b, rtol=rtol, atol=atol_scale * float(jnp.max(jnp.abs(b))))


# -- the operators of the registry ----------------------------------------------------------------

# Derivatives w.r.t. p and the vector on every operator but three whose derivatives take the
# paths of others: ``well_conditioned`` is ``los`` with one more float row leaf (per-bin gains,
# 2-D like ``array_rows``' weights), ``tuple_rows`` is ``los`` with its rows in a tuple (the
# kernels see the same flattened leaves), and ``square`` differentiates through 2-D row
# weights and gathers, like ``array_rows`` and ``vector_out``.
SKIPPED = {"well_conditioned", "square", "tuple_rows"}
DERIVATIVE_CASES = [
    pytest.param(make, id=name) for make, name in zip(make_operators, OPERATOR_IDS) if name not in SKIPPED
]
# A batch of parameters (a batch of operators), for each way p enters: through the rows (los),
# the closure as arrays, as a scalar, into a complex operator or into int-only rows, and both
# the rows and the closure (pytree)
VMAP_CASES = ["los", "pytree", "complex", "closed_arrays", "closed_scalar", "int_rows"]


@pytest.mark.parametrize("make_operator", DERIVATIVE_CASES)
def test_grad_and_jvp_wrt_parameter_and_vector(make_operator):
    """d/dp and d/dv of a loss of ``A(p) v`` and of ``A(p)^T v`` (reverse mode, and forward mode
    along a direction of ``(p, v)``), under jit, against jax.vmap's."""
    case = make_operator()

    def run(use_ref):
        out = {}
        for kind in ("mv", "T"):
            v = case.x() if kind == "mv" else case.y()
            w = case.y(5) if kind == "mv" else case.x(5)

            def loss(p, v, kind=kind, w=w):
                if use_ref:
                    return _loss(case.ref_mv(v, p) if kind == "mv" else case.ref_T(v, p), w)
                A = case.op(p)
                return _loss(A.mv(v) if kind == "mv" else A.T.mv(v), w)

            dp = jax.tree_util.tree_map(lambda a: 0.01 * jnp.ones_like(a), case.p)
            dv = jax.tree_util.tree_map(lambda a: 0.5 * jnp.ones_like(a), v)
            out[kind] = (jax.value_and_grad(loss, argnums=(0, 1))(case.p, v), jax.jvp(loss, (case.p, v), (dp, dv)))
        return out

    got, expected = both(lambda: run(False), lambda: run(True))
    assert_tree_allclose(got, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "make_operator", [pytest.param(make_operators[OPERATOR_IDS.index(name)], id=name) for name in VMAP_CASES]
)
def test_vmap_over_parameter(make_operator):
    """A batch of operators (the closed-over or row parameter is a vmap tracer)."""
    case = make_operator()
    ps = jax.tree_util.tree_map(lambda a: jnp.stack([a, 1.1 * a]), case.p)
    x, y = case.x(), case.y()
    got, want = both(
        lambda: jax.vmap(lambda p: (case.op(p).mv(x), case.op(p).T.mv(y)))(ps),
        lambda: jax.vmap(lambda p: (case.ref_mv(x, p), case.ref_T(y, p)))(ps),
    )
    assert_tree_allclose(got, want, n_terms=longest_sum(case.dense()))


@pytest.mark.parametrize(
    "make_operator",
    [make_closed_arrays, make_closed_scalar, make_pytree_case],
    ids=["closed_arrays", "closed_scalar", "pytree"],
)
def test_hessian_vector_product_wrt_parameter(make_operator):
    """Closed-over parameters (and, for ``pytree``, a row parameter) twice differentiated."""
    case = make_operator()
    x, w = case.x(), case.y(5)
    flat_p, unravel = ravel_pytree(case.p)

    def make(use_ref):
        def f(fp):
            p = unravel(fp)
            return _loss(case.ref_mv(x, p) if use_ref else case.op(p).mv(x), w)

        return f

    t = jnp.linspace(0.1, 0.2, flat_p.size, dtype=flat_p.dtype)
    hvp = lambda f: jax.jvp(jax.grad(f), (flat_p,), (t,))[1]
    got, expected = both(lambda: hvp(make(False)), lambda: hvp(make(True)))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


# -- the line-of-sight problem: p = {"d": distances, "s": scales} ---------------------------------

LOS = make_los()
LOS_SUM = longest_sum(LOS.dense())  # A v: a row's K bins; A^T v: the rows through one pixel
P = LOS.p
X, Y = LOS.x(), LOS.y()


def chunked(kind, chunk=None):
    """``(p, v) -> A(p) v`` or ``A(p)^T v``."""
    return lambda p, v: LOS.op(p, chunk=chunk).mv(v) if kind == "mv" else LOS.op(p, chunk=chunk).T.mv(v)


def reference(kind):
    return lambda p, v: LOS.ref_mv(v, p) if kind == "mv" else LOS.ref_T(v, p)


VEC = {"mv": X, "T": Y}  # the vector each kind applies to
COT = {"mv": Y, "T": X}  # and a cotangent of its output
W_OUT = {"mv": LOS.y(3), "T": LOS.x(3)}
KINDS = ["mv", "T"]

# relative scales of the directions in (d, s, v) so each term of the derivative matters
DP = {"d": LOS.y(11) * 100.0, "s": LOS.y(12) * 0.01}


def _los_loss(f, kind):
    """A non-quadratic scalar of the output, so second derivatives are not trivially constant."""
    w = W_OUT[kind]
    return lambda p, v: jnp.sum(jnp.sin(f(p, v)) * w) + 0.5 * jnp.sum(f(p, v) ** 2)


def test_grad_eager():
    """Outside ``jit`` (each primitive dispatched on its own)."""
    A = LOS.op()
    g = jax.grad(lambda x: jnp.sum(A.mv(x) ** 2))(X)
    g_ref = jax.grad(lambda x: jnp.sum(LOS.ref_mv(x) ** 2))(X)
    assert_tree_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_wrt_whole_rows_with_int_leaves(kind):
    def loss(rows, v, use_ref):
        if use_ref:
            out = reference(kind)({"d": rows["d"], "s": rows["s"]}, v)
        else:
            A = LOS.op(rows=rows)
            out = A.mv(v) if kind == "mv" else A.T.mv(v)
        return jnp.sum(jnp.cos(out))

    rows = LOS.rows
    g, g_ref = both(
        lambda: jax.grad(loss, allow_int=True)(rows, VEC[kind], False),
        lambda: jax.grad(loss, allow_int=True)(rows, VEC[kind], True),
    )
    assert g["idx"].dtype == jax.dtypes.float0
    _scaled_close((g["d"], g["s"]), (g_ref["d"], g_ref["s"]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["vector", "s_only"])
def test_jvp_with_symbolic_zero_tangents(kind, which):
    """Tangents on some inputs only (the others are symbolic zeros); tangents on all of them are
    in ``test_grad_and_jvp_wrt_parameter_and_vector``."""
    v = VEC[kind]
    dv = LOS.x(13) if kind == "mv" else LOS.y(13)
    if which == "vector":
        run = lambda f: jax.jvp(lambda v: f(P, v), (v,), (dv,))
    else:
        run = lambda f: jax.jvp(lambda s: f({"d": P["d"], "s": s}, v), (P["s"],), (DP["s"],))
    (out, tan), (out_ref, tan_ref) = both(lambda: run(chunked(kind)), lambda: run(reference(kind)))
    assert_tree_allclose(out, out_ref, n_terms=LOS_SUM)  # the primal output under jit, the operator built inside
    _scaled_close(tan, tan_ref)


@pytest.mark.parametrize("kind", KINDS)
def test_vjp(kind):
    def run(fn):
        out, pull = jax.vjp(fn, P, VEC[kind])
        return out, pull(COT[kind])

    (out, cts), (out_ref, cts_ref) = both(lambda: run(chunked(kind)), lambda: run(reference(kind)))
    assert_tree_allclose(out, out_ref, n_terms=LOS_SUM)
    _scaled_close(cts, cts_ref)


@pytest.mark.parametrize("kind", KINDS)
def test_hessian_vector_products(kind):
    """Forward-over-reverse and reverse-over-reverse HVPs w.r.t. ``(s, v)`` jointly."""
    v = VEC[kind]
    ds, dv = DP["s"], jax.tree_util.tree_map(lambda a: 0.7 * a + 0.1, v)

    def grad_sv(fn):
        loss = _los_loss(fn, kind)
        return jax.grad(lambda s, v: loss({"d": P["d"], "s": s}, v), argnums=(0, 1))

    def hvp_fwd(fn):
        return jax.jvp(grad_sv(fn), (P["s"], v), (ds, dv))[1]

    def hvp_rev(fn):
        gdot = lambda s, v: sum(jnp.vdot(a, b) for a, b in zip(grad_sv(fn)(s, v), (ds, dv)))
        return jax.grad(gdot, argnums=(0, 1))(P["s"], v)

    fwd, rev, expected = jax.jit(lambda: (hvp_fwd(chunked(kind)), hvp_rev(chunked(kind)), hvp_fwd(reference(kind))))()
    for got in (fwd, rev):
        _scaled_close(got, expected, rtol=1e-3, atol_scale=1e-4)


# a smaller problem for full Hessians
NS = 6
SMALL = make_los(n=NS, seed=20)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrt", ["vector", "s"])
def test_full_hessian(kind, wrt):
    v = X if kind == "mv" else Y[:NS]
    w = W_OUT[kind][:NS] if kind == "mv" else W_OUT[kind]

    def make_loss(use_ref):
        def loss(s, v):
            p = {"d": SMALL.p["d"], "s": s}
            if use_ref:
                out = SMALL.ref_mv(v, p) if kind == "mv" else SMALL.ref_T(v, p)
            else:
                A = SMALL.op(p)
                out = A.mv(v) if kind == "mv" else A.T.mv(v)
            return jnp.sum(jnp.sin(out) * w)

        return loss

    argnum = 1 if wrt == "vector" else 0
    H, H_ref = both(
        lambda: jax.hessian(make_loss(False), argnums=argnum)(SMALL.p["s"], v),
        lambda: jax.hessian(make_loss(True), argnums=argnum)(SMALL.p["s"], v),
    )
    size = v.size if wrt == "vector" else NS
    atol = 1e-4 * float(jnp.max(jnp.abs(H_ref)))
    assert H.reshape(size, size).shape == (size, size)
    assert_tree_allclose(H, H_ref, rtol=1e-3, atol=atol)
    np.testing.assert_allclose(H.reshape(size, size), H.reshape(size, size).T, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("kind, mode", [("mv", "jacfwd"), ("T", "jacfwd"), ("T", "jacrev")])
def test_jacobian_wrt_rows(kind, mode):
    jac = getattr(jax, mode)
    J, J_ref = both(lambda: jac(chunked(kind))(P, VEC[kind]), lambda: jax.jacfwd(reference(kind))(P, VEC[kind]))
    _scaled_close(J, J_ref)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_over_vectors(kind):
    """``vmap`` over a batch of vectors: a matmat."""
    f, ref, v = chunked(kind), reference(kind), VEC[kind]
    V = jnp.stack([v, 2.0 * v + 1.0, -v])
    Vt = jnp.moveaxis(V, 0, -1)
    out, out_t, expected = jax.jit(
        lambda: (
            jax.vmap(f, (None, 0))(P, V),
            jax.vmap(f, (None, -1), out_axes=-1)(P, Vt),  # batch on a non-leading axis
            jax.vmap(ref, (None, 0))(P, V),
        )
    )()
    assert_tree_allclose(out, expected, n_terms=LOS_SUM)
    assert_tree_allclose(out_t, jnp.moveaxis(expected, 0, -1), n_terms=LOS_SUM)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_over_batch_of_operators(kind):
    """Batched rows: operators built inside ``vmap``, and ``eqx.filter_vmap`` over operators."""
    f, ref, v = chunked(kind), reference(kind), VEC[kind]
    B = 3
    Ps = {"d": jnp.stack([P["d"], P["d"] * 1.1, P["d"] * 0.9]), "s": jnp.stack([P["s"], P["s"] * 2.0, P["s"] * 0.5])}
    Vs = jnp.stack([v, -v, 2.0 * v])
    apply = (lambda A, v: A.mv(v)) if kind == "mv" else (lambda A, v: A.T.mv(v))

    def chunked_results():
        ops = eqx.filter_vmap(lambda p: LOS.op(p))(Ps)  # a batch of operators, as a pytree
        assert isinstance(ops, chunkop.RowOperator)
        return (
            jax.vmap(f)(Ps, Vs),  # operators built inside vmap
            jax.vmap(f, (0, None))(Ps, v),  # rows batched, vector shared
            eqx.filter_vmap(apply)(ops, Vs),
            jax.grad(lambda s: jnp.sum(jax.vmap(f)({"d": Ps["d"], "s": s}, Vs) ** 2))(Ps["s"]),
        )

    def reference_results():
        out = jax.vmap(ref)(Ps, Vs)
        return (
            out,
            jax.vmap(ref, (0, None))(Ps, v),
            out,
            jax.grad(lambda s: jnp.sum(jax.vmap(ref)({"d": Ps["d"], "s": s}, Vs) ** 2))(Ps["s"]),
        )

    got, expected = both(chunked_results, reference_results)
    assert expected[0].shape[0] == B
    _scaled_close(got, expected)


def test_linear_transpose_of_mv_and_T():
    A = LOS.op()
    (t1,) = jax.linear_transpose(A.mv, X)(Y)  # eager
    assert_tree_allclose(t1, LOS.ref_T(Y), n_terms=LOS_SUM)
    t2, tt = jax.jit(
        lambda: (
            jax.linear_transpose(A.T.mv, Y)(X)[0],
            # twice transposed is the matvec again
            jax.linear_transpose(lambda y: jax.linear_transpose(A.mv, X)(y)[0], Y)(X)[0],
        )
    )()
    assert_tree_allclose(t2, LOS.ref_mv(X), n_terms=LOS_SUM)
    assert_tree_allclose(tt, LOS.ref_mv(X), n_terms=LOS_SUM)


@pytest.mark.parametrize("kind", KINDS)
def test_inside_scan_and_checkpoint(kind):
    """A few damped iterations ``v <- v - 0.5 * A^T (A v - b)`` inside ``lax.scan``, differentiated;
    the step under ``jax.checkpoint`` for ``T``, and the whole loss under a checkpoint policy."""

    def make(use_ref):
        mv, rmv = (reference("mv"), reference("T")) if use_ref else (chunked("mv"), chunked("T"))

        def loss(s, v0):
            p = {"d": P["d"], "s": s}

            def step(v, _):
                return v - 0.5 * rmv(p, mv(p, v) - Y), jnp.sum(v)

            wrapped = jax.checkpoint(step) if kind == "T" else step
            v, trace = jax.lax.scan(wrapped, v0, None, length=3)
            return jnp.sum(jnp.sin(v)) + jnp.sum(trace)

        return loss

    ck = jax.checkpoint(make(False), policy=jax.checkpoint_policies.dots_saveable)
    g, g_ck, g_ref = jax.jit(
        lambda: (
            jax.grad(make(False), argnums=(0, 1))(P["s"], X),
            jax.grad(ck)(P["s"], X),
            jax.grad(make(True), argnums=(0, 1))(P["s"], X),
        )
    )()
    _scaled_close(g, g_ref)
    _scaled_close(g_ck, g_ref[0])


@pytest.mark.parametrize("kind", KINDS)
def test_directional_derivative_finite_difference_float64(kind):
    with jax.enable_x64(True):
        case = make_los(seed=40, dtype=np.float64)
        v = case.x(41) if kind == "mv" else case.y(41)
        dp = {"d": case.y(42) * 10.0, "s": case.y(43) * 1e-3}
        dv = case.x(44) if kind == "mv" else case.y(44)

        def f(p, v):
            A = case.op(p)
            return jnp.sum(jnp.sin((A.mv(v) if kind == "mv" else A.T.mv(v)) * 3.0))

        h = 1e-6
        shift = lambda t: (jax.tree_util.tree_map(lambda a, b: a + t * b, case.p, dp), v + t * dv)

        @jax.jit
        def run():
            _, tan = jax.jvp(f, (case.p, v), (dp, dv))
            g = jax.grad(f, argnums=(0, 1))(case.p, v)
            fd = (f(*shift(h)) - f(*shift(-h))) / (2 * h)
            return f(case.p, v), tan, g, fd

        value, tan, g, fd = run()
        assert value.dtype == jnp.float64
        np.testing.assert_allclose(float(tan), float(fd), rtol=1e-6)
        by_grad = jnp.vdot(g[0]["d"], dp["d"]) + jnp.vdot(g[0]["s"], dp["s"]) + jnp.vdot(g[1], dv)
        np.testing.assert_allclose(float(by_grad), float(fd), rtol=1e-6)
