"""``chunkop.vmap``/``sum``/``mean`` of ``jax.custom_vjp`` functions under JAX's ``jax_custom_vjp3``.

With that flag on (and ``jax_remat3`` off), JAX 0.10 cannot differentiate ``jax.checkpoint``
around ``jax.vmap`` of a ``custom_vjp`` function, so such chunks are rematerialised by a
``custom_vjp`` of chunkop's own that saves only the chunk's inputs and recomputes the chunk in
its backward rule (``chunkop._chunking._recomputed``). Every derivative is compared with the
same derivative of ``jax.vmap`` (gradient clipping, a straight-through estimator, a rule with
residuals), with chunks that divide the axis and chunks that leave a remainder; the compiled
temp memory of ``jit(grad)`` grows with the chunk, not the axis, and equals the checkpoint's
with the flag off. The flag is restored after each test.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose

import chunkop

N = 10
CHUNKS = [3, 4, 5]  # 3 and 4 leave remainders of 1 and 2; 5 divides N
TOL = {"n_terms": 4 * N}  # float32 sums over the examples and a dot of 5, ordered differently
TOL2 = {"n_terms": 4 * N, "condition": 10.0}  # second derivatives


@contextlib.contextmanager
def _vjp3_flag(on: bool):
    """``jax_custom_vjp3`` set to ``on`` and ``jax_remat3`` off, both restored afterwards."""
    old = (jax.config.jax_custom_vjp3, jax.config.jax_remat3)
    jax.config.update("jax_custom_vjp3", on)
    jax.config.update("jax_remat3", False)
    try:
        yield
    finally:
        jax.config.update("jax_custom_vjp3", old[0])
        jax.config.update("jax_remat3", old[1])


@pytest.fixture
def custom_vjp3():
    """``jax_custom_vjp3`` on and ``jax_remat3`` off for the test (``custom_vjp`` functions must be
    defined inside it: the flag is read when one is decorated); both restored afterwards."""
    with _vjp3_flag(True):
        yield


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


P = {"W": _rand(5, 4, seed=1), "b": _rand(4, seed=2)}
X = _rand(N, 5, seed=3)


def clip_gradient(lo, hi):
    """The identity, whose cotangent is clipped to ``[lo, hi]`` (a custom_vjp without residuals)."""

    @jax.custom_vjp
    def clip(x):
        return x

    clip.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, lo, hi),))
    return clip


def straight_through_round():
    """``round(x)`` with the identity's gradient (a straight-through estimator)."""

    @jax.custom_vjp
    def ste(x):
        return jnp.round(x)

    ste.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
    return ste


def softplus_with_residuals():
    """``log(1 + exp(x))`` with a hand-written rule that saves ``sigmoid(x)`` (residuals)."""

    @jax.custom_vjp
    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    softplus.defvjp(lambda x: (jnp.logaddexp(x, 0.0), jax.nn.sigmoid(x)), lambda s, g: (s * g,))
    return softplus


def make_example(name):
    """``f(p, x)`` for one example ``x`` (shape (5,)), calling the ``custom_vjp`` function ``name``."""
    rule = {
        "clip": lambda: clip_gradient(-0.1, 0.1),
        "ste": straight_through_round,
        "softplus": softplus_with_residuals,
    }
    g = rule[name]()

    def f(p, x):
        h = jnp.tanh(g(x @ p["W"] * 2.0) + p["b"])
        return h * jnp.sin(x[:4]) + jnp.sum(h**2)

    return f


RULES = ["clip", "ste", "softplus"]


def _loss(F):
    return lambda p, x: jnp.sum(jnp.cos(F(p, x)))


def _both(f, chunk, kind="vmap"):
    """The chunked transform and its ``jax.vmap`` reference, as losses of ``(p, x)``."""
    if kind == "vmap":
        return _loss(chunkop.vmap(f, in_axes=(None, 0), chunk_size=chunk)), _loss(jax.vmap(f, in_axes=(None, 0)))
    g = lambda p, x: jnp.cos(f(p, x))
    reduce = jnp.sum if kind == "sum" else jnp.mean
    return (
        getattr(chunkop, kind)(g, in_axes=(None, 0), chunk_size=chunk),
        lambda p, x: reduce(jax.vmap(g, in_axes=(None, 0))(p, x), axis=0),
    )


def _cross(first: list, second: list, default: set) -> list:
    """The ``(a, b)`` pairs of ``first x second``: those in ``default`` by default, the rest (the
    same code paths with another rule or chunk) under ``-m slow``."""
    return [
        pytest.param(a, b, id=f"{a}-{b}", marks=[pytest.mark.slow] * ((a, b) not in default))
        for a in first
        for b in second
    ]


# every rule with a chunk that leaves a remainder; every chunk with the clipping rule
@pytest.mark.parametrize(
    ("rule", "chunk"), _cross(RULES, CHUNKS, {(r, CHUNKS[0]) for r in RULES} | {("clip", c) for c in CHUNKS})
)
def test_grad_and_value_and_grad_match_jax_vmap(custom_vjp3, rule, chunk):
    chunked, reference = _both(make_example(rule), chunk)
    assert_tree_allclose(jax.grad(chunked, (0, 1))(P, X), jax.grad(reference, (0, 1))(P, X), **TOL)
    got, want = jax.value_and_grad(chunked)(P, X), jax.value_and_grad(reference)(P, X)
    assert_tree_allclose(got, want, **TOL)


@pytest.mark.parametrize("rule", RULES)
def test_jit_grad_and_vmap_of_grad_match_jax_vmap(custom_vjp3, rule):
    chunked, reference = _both(make_example(rule), 3)
    grad = lambda F: jax.jit(jax.grad(F, (0, 1)))
    assert_tree_allclose(grad(chunked)(P, X), grad(reference)(P, X), **TOL)
    ps = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.5 * a, -a]), P)  # per-parameter-set gradients
    batched = lambda F: jax.vmap(jax.grad(F), in_axes=(0, None))(ps, X)
    assert_tree_allclose(batched(chunked), batched(reference), **TOL)


def test_grad_of_grad_and_hessian_match_jax_vmap_grad_of_grad(custom_vjp3):
    chunked, reference = _both(make_example("softplus"), 3)
    b = P["b"]

    def second(F, d2):
        return d2(lambda b: F({"W": P["W"], "b": b}, X))(b)

    grad_of_grad = lambda f: jax.jacrev(jax.grad(f))
    want = second(reference, grad_of_grad)
    assert_tree_allclose(second(chunked, grad_of_grad), want, **TOL2)
    # (jax.hessian, forward over reverse, of the jax.vmap reference fails under the flag in jax
    # 0.10.2: "pytree structure error" in the batched custom_vjp; chunkop's works)
    assert_tree_allclose(second(chunked, jax.hessian), want, **TOL2)


@pytest.mark.parametrize(("chunk", "kind"), _cross([3, 5], ["sum", "mean"], {(3, "sum"), (5, "mean")}))
def test_sum_and_mean(custom_vjp3, kind, chunk):
    chunked, reference = _both(make_example("clip"), chunk, kind)
    assert_tree_allclose(chunked(P, X), reference(P, X), **TOL)
    total = lambda F: lambda p, x: jnp.sum(F(p, x) * jnp.arange(1.0, 5.0))
    got, want = jax.grad(total(chunked), (0, 1))(P, X), jax.grad(total(reference), (0, 1))(P, X)
    assert_tree_allclose(got, want, **TOL)
    assert_tree_allclose(jax.jit(jax.grad(total(chunked)))(P, X), jax.grad(total(reference))(P, X), **TOL)


@pytest.mark.parametrize("remat", [False, jax.checkpoint_policies.dots_saveable], ids=["no_remat", "dots_saveable"])
def test_other_remat_settings(custom_vjp3, remat):
    f = make_example("clip")
    chunked = _loss(chunkop.vmap(f, in_axes=(None, 0), chunk_size=3, remat=remat))
    reference = _loss(jax.vmap(f, in_axes=(None, 0)))
    assert_tree_allclose(jax.grad(chunked, (0, 1))(P, X), jax.grad(reference, (0, 1))(P, X), **TOL)


def test_map_auto_chunk_progress_and_nesting(custom_vjp3):
    clip = clip_gradient(-0.2, 0.2)
    per_row = lambda r: jnp.sin(clip(3.0 * r))
    f = lambda x: jnp.sum(per_row(x) ** 2)
    want = jax.grad(lambda x: jnp.sum(jax.vmap(f)(x)))(X)
    for chunked in (
        lambda x: chunkop.map(f, x, chunk_size=3),
        chunkop.vmap(f),  # chunk_size="auto"
        chunkop.vmap(f, chunk_size=3, progress=lambda k, n: None),
        chunkop.vmap(lambda x: jnp.sum(chunkop.vmap(per_row, chunk_size=2)(x) ** 2), chunk_size=3),
        jax.vmap(lambda x: jnp.sum(chunkop.vmap(per_row, chunk_size=2)(x) ** 2)),  # under vmap, then grad
    ):
        assert_tree_allclose(jax.grad(lambda x: jnp.sum(chunked(x)))(X), want, **TOL)


def test_integer_and_key_inputs(custom_vjp3):
    clip = clip_gradient(-0.3, 0.3)
    f = lambda x, i, k: jnp.sum(clip(x * i) + jax.random.normal(k, x.shape))
    ints, keys = jnp.arange(N), jax.random.split(jax.random.key(0), N)
    loss = lambda vmap: lambda x: jnp.sum(vmap(f)(x, ints, keys))
    assert_tree_allclose(jax.grad(loss(lambda f: chunkop.vmap(f, chunk_size=4)))(X), jax.grad(loss(jax.vmap))(X))


def test_forward_mode_of_a_differentiated_custom_vjp_fails_as_in_jax_vmap(custom_vjp3):
    f = make_example("clip")
    for vmap in (jax.vmap, lambda f, **kw: chunkop.vmap(f, chunk_size=3, **kw)):
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            jax.jvp(lambda x: vmap(f, in_axes=(None, 0))(P, x), (X,), (X,))


def test_forward_mode_with_remat_false_where_jax_vmap_has_it(custom_vjp3):
    """A tangent only of values the custom_vjp does not read: ``jax.vmap`` differentiates it in
    forward mode, the recomputing chunk (a custom_vjp) cannot; ``remat=False`` can (documented)."""
    clip = clip_gradient(-0.1, 0.1)
    g = lambda x, c: jnp.sin(x) * clip(c)

    def jvp(vmap, x, c):
        return jax.jvp(lambda x: vmap(g, in_axes=(0, None))(x, c), (x,), (x,))[1]

    c = jnp.float32(0.7)
    want = jvp(jax.vmap, X, c)
    got = jax.jit(lambda x, c: jvp(lambda f, **kw: chunkop.vmap(f, chunk_size=3, remat=False, **kw), x, c))(X, c)
    assert_tree_allclose(got, want)
    with pytest.raises(TypeError, match="forward-mode autodiff"):  # (c traced: it reaches the custom_vjp)
        jax.jit(lambda x, c: jvp(lambda f, **kw: chunkop.vmap(f, chunk_size=3, **kw), x, c))(X, c)


def test_with_remat3_too_the_checkpoint_is_used_and_differentiates(custom_vjp3):
    jax.config.update("jax_remat3", True)  # (restored by the fixture)
    chunked, reference = _both(make_example("ste"), 3)
    assert_tree_allclose(jax.grad(chunked, (0, 1))(P, X), jax.grad(reference, (0, 1))(P, X), **TOL)


def test_row_operator_x_derivatives(custom_vjp3):
    """RowOperator kernels keep ``jax.checkpoint`` (their chunks must stay linearly transposable):
    derivatives w.r.t. ``x`` and ``y`` work with a custom_vjp on the row data."""
    clip = clip_gradient(-0.5, 0.5)
    n, npix = 23, 7
    rng = np.random.default_rng(0)
    rows = {
        "idx": jnp.asarray(rng.integers(0, npix, n), jnp.int32),
        "s": jnp.asarray(rng.uniform(0.5, 2, n), jnp.float32),
    }
    row_fn = lambda r, x: jnp.sum(jnp.sin(clip(r["s"] * jnp.arange(3.0))) * x[r["idx"]])
    A = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((npix, 3), jnp.float32), chunk_size=5)
    mv = lambda x: jax.vmap(row_fn, (0, None))(rows, x)
    x, y = _rand(npix, 3, seed=5), _rand(n, seed=6)
    assert_tree_allclose(jax.grad(lambda x: jnp.sum(A.mv(x) ** 2))(x), jax.grad(lambda x: jnp.sum(mv(x) ** 2))(x))
    mvT = lambda y: jax.linear_transpose(mv, x)(y)[0]
    assert_tree_allclose(jax.grad(lambda y: jnp.sum(A.T.mv(y) ** 2))(y), jax.grad(lambda y: jnp.sum(mvT(y) ** 2))(y))


def test_row_operator_rows_and_consts_derivatives(custom_vjp3):
    """Derivatives w.r.t. the rows and the closed-over arrays, where row_fn's weights go through a
    custom_vjp with residuals (its backward rule is linear in the cotangent): grad of ``mv`` and
    ``T.mv``, forward mode, a second derivative and vmap over row sets, against jax.vmap (which
    RowOperator transposes the backward rule for: kernels._jvp)."""
    softplus = softplus_with_residuals()
    n, npix = 11, 6
    rng = np.random.default_rng(1)
    idx = jnp.asarray(rng.integers(0, npix, n), jnp.int32)
    s, x, y = _rand(n, seed=9), _rand(npix, 3, seed=10), _rand(n, seed=11)
    struct = jax.ShapeDtypeStruct((npix, 3), jnp.float32)

    def row_fn_and_rows(s, p):
        row_fn = lambda r, x: jnp.sum(softplus(r["s"] * p * jnp.arange(3.0)) * x[r["idx"]])
        return row_fn, {"idx": idx, "s": s}

    def chunked(s, p):
        A = chunkop.RowOperator(*row_fn_and_rows(s, p), struct, chunk_size=4)  # chunks 4+4+3
        return jnp.sum(jnp.cos(A.mv(x))) + jnp.sum(A.T.mv(y) ** 2)

    def plain(s, p):
        row_fn, rows = row_fn_and_rows(s, p)
        ref = lambda x: jax.vmap(row_fn, (0, None))(rows, x)
        return jnp.sum(jnp.cos(ref(x))) + jnp.sum(jax.linear_transpose(ref, x)(y)[0] ** 2)

    p = jnp.float32(0.7)
    ds, S = _rand(n, seed=12), jnp.stack([s, 2 * s])

    @functools.partial(jax.jit, static_argnums=0)
    def derivatives(loss):  # forward mode: JAX refuses it through a custom_vjp (see below)
        fwd = jax.jvp(lambda s: loss(s, p), (s,), (ds,)) if loss is chunked else None
        return (
            jax.grad(loss, (0, 1))(s, p),
            jax.jacrev(jax.grad(loss, 1), 0)(s, p),
            jax.vmap(jax.grad(loss), (0, None))(S, p),
            fwd,
        )

    (g, h, gv, fwd), (g_ref, h_ref, gv_ref, _) = derivatives(chunked), derivatives(plain)
    assert_tree_allclose((g, gv), (g_ref, gv_ref), **TOL)
    assert_tree_allclose(h, h_ref, **TOL2)
    assert_tree_allclose(fwd, (plain(s, p), jnp.vdot(g_ref[0], ds)), **TOL)  # value and grad . ds


def test_row_operator_rows_derivative_with_a_non_linear_backward_rule_is_a_clear_error(custom_vjp3):
    """A backward rule that clips the cotangent cannot be transposed: the error says what is needed."""
    clip = clip_gradient(-0.5, 0.5)
    rows = {"idx": jnp.array([0, 2, 1]), "s": jnp.array([1.0, 2.0, 0.5])}
    row_fn = lambda r, x: jnp.sum(clip(r["s"] * jnp.arange(3.0)) * x[r["idx"]])

    def loss(s):
        A = chunkop.RowOperator(row_fn, {**rows, "s": s}, jax.ShapeDtypeStruct((3, 3), jnp.float32), chunk_size=2)
        return jnp.sum(A.mv(jnp.ones((3, 3))) ** 2)

    with pytest.raises(NotImplementedError, match="backward rule to be linear in its cotangent"):
        jax.grad(loss)(rows["s"])


def _temp_bytes(chunk, flag):
    jax.config.update("jax_custom_vjp3", flag)
    clip = clip_gradient(-1.0, 1.0)

    def f(x, W):
        h = jnp.tanh(W @ clip(x))  # (1024,) per example: 4 MiB per 1024 examples
        return jnp.sum(jnp.tanh(W @ jnp.tanh(W.T @ h)))

    xs, W = _rand(2048, 32, seed=7), 0.01 * _rand(1024, 32, seed=8)
    loss = lambda xs, W: chunkop.sum(f, in_axes=(0, None), chunk_size=chunk)(xs, W)
    return jax.jit(jax.grad(loss, (0, 1))).lower(xs, W).compile().memory_analysis().temp_size_in_bytes


def test_memory_bounded_by_the_chunk(custom_vjp3):
    small, large = _temp_bytes(32, True), _temp_bytes(512, True)
    assert small < 2 << 20 < large  # (measured: 0.51 MiB at 32, 4.38 MiB at 512; jax.vmap 16.4 MiB)
    assert small == _temp_bytes(32, False)  # the same as jax.checkpoint's with the flag off


def test_collective_inside_a_custom_vjp_is_seen(custom_vjp3):
    """The flag's ``custom_vjp`` is a "hi" primitive whose primal sits in its parameters, not in a
    sub-jaxpr JAX lists: the collectives check walks into it (JAX's ``CustomVJP3Test``'s
    ``test_initial_style_vmap_with_collective`` got JAX's unbound-axis ``NameError`` before)."""

    @jax.custom_vjp
    def total(x):
        return jax.lax.psum(x, "i")

    total.defvjp(lambda x: (total(x), None), lambda _, g: (g,))
    xs = jnp.arange(4.0)
    with pytest.raises(ValueError, match=r"collective `psum` over axis_name='i'.*chunk_size=2 < axis size 4"):
        chunkop.vmap(total, axis_name="i", chunk_size=2)(xs)
    np.testing.assert_array_equal(
        chunkop.vmap(total, axis_name="i", chunk_size=4)(xs), jax.vmap(total, axis_name="i")(xs)
    )


@pytest.fixture(params=[False, True], ids=["plain", "vjp3"])
def either_custom_vjp(request):
    """``jax_custom_vjp3`` off, then on (``jax_remat3`` off), restored afterwards."""
    with _vjp3_flag(request.param):
        yield


def strict_symbolic_zeros():
    """``(sin(x) * y, y)`` with ``symbolic_zeros=True`` rules that fail unless, as under
    ``jax.vmap``, ``y`` (data, never differentiated) is unperturbed and the cotangent of the
    second output (never read) is a ``SymbolicZero``."""

    @jax.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y, y

    def fwd(x, y):
        if y.perturbed:
            raise AssertionError("y is perturbed: it does not depend on what is differentiated")
        return f(x.value, y.value), (x.value, y.value)

    def bwd(res, g):
        x, y = res
        g_out, g_y = g
        if type(g_y) is not jax.custom_derivatives.SymbolicZero:
            raise AssertionError(f"the unread output's cotangent is {type(g_y).__name__}, not a SymbolicZero")
        if type(g_out) is jax.custom_derivatives.SymbolicZero:
            return None, None
        return jnp.cos(x) * y * g_out, None

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def test_symbolic_zeros_reach_the_rules_as_under_jax_vmap(either_custom_vjp):
    """JAX's ``CustomVJP3Test.test_symbolic_zero_custom_vjp_vmap_output``: under the flag the
    chunk's rematerialisation (``_recomputed``) differentiated every input of the chunk, so the
    rule saw ``y.perturbed`` and a zero array for the unread output's cotangent; it now
    differentiates what is perturbed and passes symbolic zeros through. Also with a remainder,
    ``chunkop.sum``, ``jit``, and grad of grad (jacrev of grad, which the flag's first fix broke),
    each compared with ``jax.vmap``; and with the flag off (``jax.checkpoint``)."""

    @jax.custom_vjp
    def ident(x, y):
        return x, y

    def fwd(x, y):
        assert x.perturbed and not y.perturbed
        return ident(x.value, y.value), None

    def bwd(_, g):
        assert type(g[1]) is jax.custom_derivatives.SymbolicZero
        return g

    ident.defvjp(fwd, bwd, symbolic_zeros=True)
    for size, chunk in [(3, 2), (4, 2)]:  # a remainder; chunks that divide the axis
        got = jax.grad(lambda x, y: chunkop.vmap(ident, chunk_size=chunk)(x, y)[0].sum())(
            jnp.ones(size), jnp.ones(size)
        )
        np.testing.assert_array_equal(got, np.ones(size))

    g = strict_symbolic_zeros()

    def f(p, x):
        return jnp.tanh(g(x @ p["W"] + p["b"], x[:4])[0])

    chunked = _loss(chunkop.vmap(f, in_axes=(None, 0), chunk_size=3))
    reference = _loss(jax.vmap(f, in_axes=(None, 0)))
    summed = lambda p, x: jnp.sum(chunkop.sum(lambda p, x: jnp.cos(f(p, x)), in_axes=(None, 0), chunk_size=4)(p, x))
    want = jax.grad(reference)(P, X)
    for got in (jax.grad(chunked)(P, X), jax.jit(jax.grad(chunked))(P, X), jax.grad(summed)(P, X)):
        assert_tree_allclose(got, want, **TOL)
    second = lambda F: jax.jacrev(jax.grad(lambda b: F({"W": P["W"], "b": b}, X)))(P["b"])
    assert_tree_allclose(second(chunked), second(reference), **TOL2)
