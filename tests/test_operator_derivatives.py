"""Transforms of ``A.mv`` and ``A.T.mv`` equal the same transforms of the unchunked reference.

The reference of ``A.mv`` is ``jax.vmap(row_fn, (0, None))(rows, x)`` and that of ``A.T.mv`` is
``jax.linear_transpose`` of it; both are differentiated w.r.t. the vector (``x`` / ``y``) and
the float leaves of ``rows`` (``d``, ``s``): ``jit``, ``grad``, ``jvp`` (with and without
symbolic-zero tangents), ``vjp``, Hessian-vector products, full Hessians, ``jacfwd``/``jacrev``,
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
from operator_registry import los_row, make_los_rows

import chunkop

NPIX, K, N = 5, 3, 10
CHUNK = 4  # two full chunks and a remainder of 2


def _rand(*shape, seed=0, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=dtype)


def make_rows(n=N, seed=0, dtype=np.float32):
    return make_los_rows(n, NPIX, seed, dtype)


ROWS = make_rows()
IDX, D, S = ROWS["idx"], ROWS["d"], ROWS["s"]
X = _rand(NPIX, K, seed=1)
Y = _rand(N, seed=2)
STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)


def op(d, s, chunk=CHUNK, idx=IDX):
    return chunkop.RowOperator(
        los_row, {"idx": idx, "d": d, "s": s}, jax.ShapeDtypeStruct((NPIX, K), d.dtype), chunk_size=chunk
    )


def ref_mv(d, s, x, idx=IDX):
    return jax.vmap(los_row, (0, None))({"idx": idx, "d": d, "s": s}, x)


def ref_T(d, s, y, idx=IDX):
    x_like = jax.ShapeDtypeStruct((NPIX, K), d.dtype)
    return jax.linear_transpose(lambda v: ref_mv(d, s, v, idx), x_like)(y)[0]


# kind -> (chunked f(d, s, v, chunk), reference f(d, s, v), the vector v, its cotangent-like)
KINDS = {
    "mv": (lambda d, s, v, chunk=CHUNK: op(d, s, chunk).mv(v), ref_mv, X, Y),
    "T": (lambda d, s, v, chunk=CHUNK: op(d, s, chunk).T.mv(v), ref_T, Y, X),
}
W_OUT = {"mv": _rand(N, seed=3), "T": _rand(NPIX, K, seed=3)}


def _loss(f, kind):
    """A non-quadratic scalar of the output, so second derivatives are not trivially constant."""
    w = W_OUT[kind]
    return lambda d, s, v: jnp.sum(jnp.sin(f(d, s, v)) * w) + 0.5 * jnp.sum(f(d, s, v) ** 2)


def both(chunked, reference):
    """``(chunked(), reference())`` computed in one jitted call (one compilation)."""
    return jax.jit(lambda: (chunked(), reference()))()


# relative scales of the directions in (d, s, v) so each term of the derivative matters
TANGENTS = (_rand(N, seed=11) * 100.0, _rand(N, seed=12) * 0.01)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [4])
def test_jit(kind, chunk):
    f, ref, v, _ = KINDS[kind]
    out = jax.jit(lambda d, s, v: f(d, s, v, chunk))(D, S, v)
    assert_tree_allclose(out, ref(D, S, v))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [4, 16])
def test_grad_wrt_vector_and_rows(kind, chunk):
    f, ref, v, _ = KINDS[kind]
    loss = _loss(lambda d, s, v: f(d, s, v, chunk), kind)
    (val, g), (val_ref, g_ref) = both(
        lambda: jax.value_and_grad(loss, argnums=(0, 1, 2))(D, S, v),
        lambda: jax.value_and_grad(_loss(ref, kind), argnums=(0, 1, 2))(D, S, v),
    )
    assert_tree_allclose(val, val_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        assert_tree_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_grad_eager():
    """Outside ``jit`` (each primitive dispatched on its own)."""
    A = op(D, S)
    g = jax.grad(lambda x: jnp.sum(A.mv(x) ** 2))(X)
    g_ref = jax.grad(lambda x: jnp.sum(ref_mv(D, S, x) ** 2))(X)
    assert_tree_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_grad_wrt_whole_rows_with_int_leaves(kind):
    _, ref, v, _ = KINDS[kind]

    def loss(rows, v, use_ref):
        if use_ref:
            out = ref(rows["d"], rows["s"], v, rows["idx"])
        else:
            A = chunkop.RowOperator(los_row, rows, STRUCT, chunk_size=CHUNK)
            out = A.mv(v) if kind == "mv" else A.T.mv(v)
        return jnp.sum(jnp.cos(out))

    g, g_ref = both(
        lambda: jax.grad(loss, allow_int=True)(ROWS, v, False), lambda: jax.grad(loss, allow_int=True)(ROWS, v, True)
    )
    assert g["idx"].dtype == jax.dtypes.float0
    for name in ("d", "s"):
        assert_tree_allclose(g[name], g_ref[name], rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(g_ref[name]))))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("which", ["all", "vector", "s_only"])
def test_jvp(kind, which):
    """Tangents on every input, and with symbolic zeros on some of them."""
    f, ref, v, _ = KINDS[kind]
    dd, ds = TANGENTS
    dv = _rand(*v.shape, seed=13)
    argnums = {"all": (0, 1, 2), "vector": (2,), "s_only": (1,)}[which]
    primals = (D, S, v)
    tangents = (dd, ds, dv)

    def restrict(fn):
        def g(*args):
            full = list(primals)
            for i, a in zip(argnums, args):
                full[i] = a
            return fn(*full)

        return g

    p_args = tuple(primals[i] for i in argnums)
    t_args = tuple(tangents[i] for i in argnums)
    (out, tan), (out_ref, tan_ref) = both(
        lambda: jax.jvp(restrict(f), p_args, t_args), lambda: jax.jvp(restrict(ref), p_args, t_args)
    )
    assert_tree_allclose(out, out_ref)
    assert_tree_allclose(tan, tan_ref, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(tan_ref))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_vjp(kind):
    f, ref, v, ct = KINDS[kind]

    def run(fn):
        out, pull = jax.vjp(fn, D, S, v)
        return out, pull(ct)

    (out, cts), (out_ref, cts_ref) = both(lambda: run(f), lambda: run(ref))
    assert_tree_allclose(out, out_ref)
    for a, b in zip(cts, cts_ref):
        assert_tree_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_hessian_vector_products(kind):
    """Forward-over-reverse and reverse-over-reverse HVPs w.r.t. ``(s, v)`` jointly."""
    f, ref, v, _ = KINDS[kind]
    ds = TANGENTS[1]
    dv = _rand(*v.shape, seed=14)

    def hvp_fwd(fn):
        loss = _loss(fn, kind)
        g = jax.grad(lambda s, v: loss(D, s, v), argnums=(0, 1))
        return jax.jvp(g, (S, v), (ds, dv))[1]

    def hvp_rev(fn):
        loss = _loss(fn, kind)
        gdot = lambda s, v: sum(
            jnp.vdot(a, b) for a, b in zip(jax.grad(lambda s, v: loss(D, s, v), argnums=(0, 1))(s, v), (ds, dv))
        )
        return jax.grad(gdot, argnums=(0, 1))(S, v)

    fwd, rev, expected = jax.jit(lambda: (hvp_fwd(f), hvp_rev(f), hvp_fwd(ref)))()
    for got in (fwd, rev):
        for a, b in zip(got, expected):
            assert_tree_allclose(a, b, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(b))))


# a smaller problem for full Hessians
NS = 6
SMALL = make_rows(NS, seed=20)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("wrt", ["vector", "s"])
def test_full_hessian(kind, wrt):
    v = X if kind == "mv" else Y[:NS]
    w = W_OUT[kind][:NS] if kind == "mv" else W_OUT[kind]

    def make_loss(use_ref):
        def loss(s, v):
            if use_ref:
                out = (ref_mv if kind == "mv" else ref_T)(SMALL["d"], s, v, SMALL["idx"])
            else:
                A = op(SMALL["d"], s, chunk=4, idx=SMALL["idx"])
                out = A.mv(v) if kind == "mv" else A.T.mv(v)
            return jnp.sum(jnp.sin(out) * w)

        return loss

    argnum = 1 if wrt == "vector" else 0
    H, H_ref = both(
        lambda: jax.hessian(make_loss(False), argnums=argnum)(SMALL["s"], v),
        lambda: jax.hessian(make_loss(True), argnums=argnum)(SMALL["s"], v),
    )
    size = v.size if wrt == "vector" else NS
    assert H.reshape(size, size).shape == (size, size)
    assert_tree_allclose(H, H_ref, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(H_ref))))
    np.testing.assert_allclose(
        H.reshape(size, size), H.reshape(size, size).T, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(H_ref)))
    )


@pytest.mark.parametrize("kind, mode", [("mv", "jacfwd"), ("T", "jacfwd"), ("T", "jacrev")])
def test_jacobian_wrt_rows(kind, mode):
    f, ref, v, _ = KINDS[kind]
    jac = getattr(jax, mode)
    J, J_ref = both(lambda: jac(f, argnums=(0, 1))(D, S, v), lambda: jax.jacfwd(ref, argnums=(0, 1))(D, S, v))
    for a, b in zip(J, J_ref):
        assert_tree_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_vmap_over_vectors(kind):
    """``vmap`` over a batch of vectors: a matmat."""
    f, ref, v, _ = KINDS[kind]
    V = jnp.stack([v, 2.0 * v + 1.0, -v])
    Vt = jnp.moveaxis(V, 0, -1)
    out, out_t, expected = jax.jit(
        lambda: (
            jax.vmap(f, (None, None, 0))(D, S, V),
            jax.vmap(f, (None, None, -1), out_axes=-1)(D, S, Vt),  # batch on a non-leading axis
            jax.vmap(ref, (None, None, 0))(D, S, V),
        )
    )()
    assert_tree_allclose(out, expected)
    assert_tree_allclose(out_t, jnp.moveaxis(expected, 0, -1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_vmap_over_batch_of_operators(kind):
    """Batched rows: operators built inside ``vmap``, and ``eqx.filter_vmap`` over operators."""
    f, ref, v, _ = KINDS[kind]
    B = 3
    Ds = jnp.stack([D, D * 1.1, D * 0.9])
    Ss = jnp.stack([S, S * 2.0, S * 0.5])
    Vs = jnp.stack([v, -v, 2.0 * v])
    apply = (lambda A, v: A.mv(v)) if kind == "mv" else (lambda A, v: A.T.mv(v))

    def chunked():
        ops = eqx.filter_vmap(lambda d, s: op(d, s))(Ds, Ss)  # a batch of operators, as a pytree
        assert isinstance(ops, chunkop.RowOperator)
        return (
            jax.vmap(f)(Ds, Ss, Vs),  # operators built inside vmap
            jax.vmap(f, (0, 0, None))(Ds, Ss, v),  # rows batched, vector shared
            eqx.filter_vmap(apply)(ops, Vs),
            jax.grad(lambda s: jnp.sum(jax.vmap(f)(Ds, s, Vs) ** 2))(Ss),
        )

    def reference():
        out = jax.vmap(ref)(Ds, Ss, Vs)
        return (
            out,
            jax.vmap(ref, (0, 0, None))(Ds, Ss, v),
            out,
            jax.grad(lambda s: jnp.sum(jax.vmap(ref)(Ds, s, Vs) ** 2))(Ss),
        )

    got, expected = both(chunked, reference)
    assert expected[0].shape[0] == B
    for a, b in zip(got, expected):
        assert_tree_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_linear_transpose_of_mv_and_T():
    A = op(D, S)
    (t1,) = jax.linear_transpose(A.mv, X)(Y)  # eager
    assert_tree_allclose(t1, ref_T(D, S, Y), rtol=1e-5, atol=1e-6)
    t2, tt = jax.jit(
        lambda: (
            jax.linear_transpose(A.T.mv, Y)(X)[0],
            # twice transposed is the matvec again
            jax.linear_transpose(lambda y: jax.linear_transpose(A.mv, X)(y)[0], Y)(X)[0],
        )
    )()
    assert_tree_allclose(t2, ref_mv(D, S, X), rtol=1e-5, atol=1e-6)
    assert_tree_allclose(tt, ref_mv(D, S, X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_inside_scan_and_checkpoint(kind):
    """A few damped iterations ``v <- v - 0.1 * A^T (A v - b)`` inside ``lax.scan``, differentiated."""
    b = Y

    def make(use_ref):
        def mv(s, v):
            return ref_mv(D, s, v) if use_ref else op(D, s).mv(v)

        def rmv(s, y):
            return ref_T(D, s, y) if use_ref else op(D, s).T.mv(y)

        def loss(s, v0):
            def step(v, _):
                return v - 0.5 * rmv(s, mv(s, v) - b), jnp.sum(v)

            wrapped = jax.checkpoint(step) if kind == "T" else step
            v, trace = jax.lax.scan(wrapped, v0, None, length=3)
            return jnp.sum(jnp.sin(v)) + jnp.sum(trace)

        return loss

    # and the whole loss under checkpoint, with a policy
    ck = jax.checkpoint(make(False), policy=jax.checkpoint_policies.dots_saveable)
    g, g_ck, g_ref = jax.jit(
        lambda: (
            jax.grad(make(False), argnums=(0, 1))(S, X),
            jax.grad(ck)(S, X),
            jax.grad(make(True), argnums=(0, 1))(S, X),
        )
    )()
    for a, r in zip(g, g_ref):
        assert_tree_allclose(a, r, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(r))))
    assert_tree_allclose(g_ck, g_ref[0], rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(g_ref[0]))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_derivatives_with_pytree_input_and_output(kind):
    rng = np.random.default_rng(30)
    rows = {"idx": IDX, "w": jnp.asarray(rng.normal(size=(N, K)), dtype=jnp.float32), "v": S * 10.0}
    struct = {"a": STRUCT, "b": jax.ShapeDtypeStruct((NPIX,), jnp.float32)}
    x = {"a": X, "b": _rand(NPIX, seed=31)}

    def row_fn(r, x):
        xa = x["a"][r["idx"]]
        return {
            "p": jnp.tanh(r["w"]) @ xa + r["v"] ** 2 * x["b"][r["idx"]],
            "q": jnp.stack([r["v"] * x["b"][0], jnp.sum(xa)]),
        }

    A0 = chunkop.RowOperator(row_fn, rows, struct, chunk_size=CHUNK)
    y = jax.tree_util.tree_map(lambda s: _rand(*s.shape, seed=32), A0.out_structure())

    def apply(w, vec, use_ref):
        r = {**rows, "w": w}
        if use_ref:
            ref = lambda u: jax.vmap(row_fn, (0, None))(r, u)
            return ref(vec) if kind == "mv" else jax.linear_transpose(ref, x)(vec)[0]
        A = chunkop.RowOperator(row_fn, r, struct, chunk_size=CHUNK)
        return A.mv(vec) if kind == "mv" else A.T.mv(vec)

    vec = x if kind == "mv" else y
    loss = lambda w, vec, use_ref: sum(jnp.sum(jnp.sin(a)) for a in jax.tree_util.tree_leaves(apply(w, vec, use_ref)))
    dw = _rand(N, K, seed=33)

    def run(use_ref):
        g = jax.grad(loss, argnums=(0, 1))(rows["w"], vec, use_ref)
        return g, jax.jvp(lambda w: apply(w, vec, use_ref), (rows["w"],), (dw,))[1]

    got, expected = both(lambda: run(False), lambda: run(True))
    assert_tree_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_directional_derivative_finite_difference_float64(kind):
    if not hasattr(jax, "enable_x64"):
        pytest.skip("jax.enable_x64 context manager not available")
    with jax.enable_x64(True):
        rows = make_rows(seed=40, dtype=np.float64)
        d, s = rows["d"], rows["s"]
        v = _rand(NPIX, K, seed=41, dtype=np.float64) if kind == "mv" else _rand(N, seed=41, dtype=np.float64)
        dd = _rand(N, seed=42, dtype=np.float64) * 10.0
        ds = _rand(N, seed=43, dtype=np.float64) * 1e-3
        dv = _rand(*v.shape, seed=44, dtype=np.float64)

        def f(d, s, v):
            A = chunkop.RowOperator(
                los_row,
                {"idx": rows["idx"], "d": d, "s": s},
                jax.ShapeDtypeStruct((NPIX, K), jnp.float64),
                chunk_size=CHUNK,
            )
            out = A.mv(v) if kind == "mv" else A.T.mv(v)
            return jnp.sum(jnp.sin(out * 3.0))

        h = 1e-6

        @jax.jit
        def run():
            _, tan = jax.jvp(f, (d, s, v), (dd, ds, dv))
            g = jax.grad(f, argnums=(0, 1, 2))(d, s, v)
            fd = (f(d + h * dd, s + h * ds, v + h * dv) - f(d - h * dd, s - h * ds, v - h * dv)) / (2 * h)
            return f(d, s, v), tan, g, fd

        value, tan, g, fd = run()
        assert value.dtype == jnp.float64
        np.testing.assert_allclose(float(tan), float(fd), rtol=1e-6)
        by_grad = sum(jnp.vdot(a, b) for a, b in zip(g, (dd, ds, dv)))
        np.testing.assert_allclose(float(by_grad), float(fd), rtol=1e-6)
