"""JAX transforms of ``chunkop.vmap`` equal the same transforms of ``jax.vmap``.

Also: remainder chunks (exact values and gradients, no NaN from padding, no double counting),
compile-time that does not grow with N, and no retracing of ``fun`` on repeated eager calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transform_registry as registry
from _params import grid
from _tolerance import rtol_for
from conftest import CompileCounter, assert_tree_allclose, count_eqns, primitive_names

import chunkop

N = 6
CHUNKS = [None, 3, 5]  # 3 divides 6; 5 leaves a remainder of 1 (chunk_size >= N: semantics tests)
REMATS = {"remat": True, "no_remat": False, "dots_saveable": jax.checkpoint_policies.dots_saveable}


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


P = {"W": _rand(5, 4, seed=1), "b": _rand(4, seed=2)}
X = _rand(N, 5, seed=3)
Y = _rand(N, 4, seed=4)
CT = _rand(N, 4, seed=5)  # a cotangent / weighting of the (N, 4) output


def per_example(p, x, y):
    h = jnp.tanh(x @ p["W"] + p["b"])
    return h * y + jnp.sin(h).sum()


def batched(chunk_size, remat=True):
    if chunk_size == "jax":
        return jax.vmap(per_example, in_axes=(None, 0, 0))
    return chunkop.vmap(per_example, in_axes=(None, 0, 0), chunk_size=chunk_size, remat=remat)


def _scalar(F):
    return lambda p, x, y: jnp.sum(F(p, x, y) * CT)


TRANSFORMS = {
    "jit": lambda F: jax.jit(F)(P, X, Y),
    "grad": lambda F: jax.grad(_scalar(F), argnums=(0, 1, 2))(P, X, Y),
    "jit_grad": lambda F: jax.jit(jax.grad(_scalar(F), argnums=(0, 1)))(P, X, Y),
    "value_and_grad": lambda F: jax.value_and_grad(_scalar(F))(P, X, Y),
    "vjp": lambda F: (lambda out_fn: (out_fn[0], out_fn[1](CT)))(jax.vjp(F, P, X, Y)),
    "jvp": lambda F: jax.jvp(F, (P, X, Y), (jax.tree.map(jnp.cos, P), jnp.cos(X), jnp.sin(Y))),
    "linearize": lambda F: jax.linearize(lambda x: F(P, x, Y), X)[1](jnp.cos(X)),
    "jacfwd": lambda F: jax.jacfwd(F)(P, X, Y),
    "jacrev": lambda F: jax.jacrev(F, argnums=1)(P, X, Y),
    "hessian": lambda F: jax.hessian(lambda p: jnp.sum(F(p, X, Y) ** 2))(P),
    "hvp": lambda F: jax.jvp(jax.grad(_scalar(F)), (P, X, Y), (P, jnp.cos(X), jnp.zeros_like(Y)))[1],
    "vmap_over_params": lambda F: jax.vmap(F, in_axes=(0, None, None))(
        jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), P), X, Y
    ),
    "vmap_over_data": lambda F: jax.vmap(F, in_axes=(None, 1, 0))(P, jnp.stack([X, -X], 1), jnp.stack([Y, Y * 3])),
    "grad_of_vmap": lambda F: jax.grad(
        lambda p: jax.vmap(_scalar(F), in_axes=(0, None, None))(
            jax.tree.map(lambda a: jnp.stack([a, -a]), p), X, Y
        ).sum()
    )(P),
    "checkpoint_grad": lambda F: jax.grad(jax.checkpoint(_scalar(F)), argnums=(0, 1))(P, X, Y),
}


# Transforms evaluated eagerly; the others (heavy, e.g. hessian) are evaluated under an outer
# jax.jit, which only saves the op-by-op dispatch of the reference.
EAGER = {"jit", "grad", "value_and_grad", "vjp", "jvp", "linearize", "jacrev"}


def _apply(name, F):
    if name in EAGER:
        return TRANSFORMS[name](F)
    return jax.jit(lambda: TRANSFORMS[name](F))()


# The longest sums that chunkop and jax.vmap may order differently: one example's (x @ W: 5
# terms, sin(h).sum(): 4), and a gradient w.r.t. the shared P's over the N examples on top.
INNER = X.shape[1] + Y.shape[1]
N_TERMS = N + INNER
# Second-order terms sum many O(1) products: reduction order differs by chunk (float32).
TOL = {"hessian": 2e-4, "hvp": 1e-4}


def _grad_of_vmap_terms():
    """The two summands of grad_of_vmap's gradient: those of the losses at p and at -p, which
    cancel (the loss is odd in p): its tolerance is set by their size, not by the ~0 sum."""
    loss = _scalar(batched("jax"))
    return jax.vmap(lambda s: jax.grad(lambda p: loss(jax.tree.map(lambda a: s * a, p), X, Y))(P))(
        jnp.array([1.0, -1.0])
    )


def _close(name, actual, expected):
    if name in TOL:
        assert_tree_allclose(actual, expected, rtol=TOL[name], atol=TOL[name])
    elif name == "grad_of_vmap":
        terms = jax.tree.leaves(_grad_of_vmap_terms())
        for a, e, t in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), terms, strict=True):
            rtol = rtol_for(t.dtype, N_TERMS + len(t))
            assert_tree_allclose(a, e, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(t).sum(0))))
    else:
        assert_tree_allclose(actual, expected, n_terms=N_TERMS)


@functools.cache
def _expected(name):
    return _apply(name, batched("jax"))


# every transform at the chunk that leaves a remainder; None (unchunked) and 3 (divides) once each
@pytest.mark.parametrize(
    ("name", "chunk_size"), grid(sorted(TRANSFORMS), CHUNKS, strength=1, keep=lambda n, c: c == 5, ids=str)
)
def test_transform_matches_jax_vmap(name, chunk_size):
    expected = _expected(name)
    actual = _apply(name, batched(chunk_size))
    _close(name, actual, expected)


@pytest.mark.parametrize("remat", sorted(REMATS))
@pytest.mark.parametrize("name", ["grad", "hessian", "jvp", "vmap_over_params"])
def test_remat_options_do_not_change_results(name, remat):
    expected = _expected(name)
    actual = _apply(name, batched(4, REMATS[remat]))
    _close(name, actual, expected)


@pytest.mark.parametrize("chunk_size", [None, 2, 4])
def test_chunked_of_vmap_and_its_grad(chunk_size):
    """chunkop.vmap of a jax.vmap-ed function (and its gradient) vs jax.vmap of jax.vmap."""
    ps = jax.tree.map(lambda a: jnp.stack([a, a * 0.5, -a]), P)  # 3 parameter sets
    inner = jax.vmap(per_example, in_axes=(0, None, None))
    ref_f = jax.vmap(inner, in_axes=(None, 0, 0), out_axes=1)
    got_f = chunkop.vmap(inner, in_axes=(None, 0, 0), out_axes=1, chunk_size=chunk_size)
    assert_tree_allclose(got_f(ps, X, Y), ref_f(ps, X, Y), n_terms=INNER)
    loss = lambda f: lambda p, x: jnp.sum(f(p, x, Y) ** 2)
    assert_tree_allclose(
        jax.grad(loss(got_f), argnums=(0, 1))(ps, X), jax.grad(loss(ref_f), argnums=(0, 1))(ps, X), n_terms=N_TERMS
    )


@pytest.mark.parametrize("chunk_size", [2, 4])
def test_grad_through_out_axes_none_output_counted_once(chunk_size):
    """An unmapped output (out_axes=None) is carried, not stacked: its gradient is not
    multiplied by the number of chunks."""

    def fun(x, w):
        return x * w, jnp.sum(w**2)

    def loss(f):
        def objective(x, w):
            ys, c = f(x, w)
            return jnp.sum(ys * CT[:, :3]) + 10 * c

        return objective

    w = _rand(3, seed=9)
    x = X[:, :3]
    ref = jax.grad(loss(jax.vmap(fun, in_axes=(0, None), out_axes=(0, None))), argnums=(0, 1))(x, w)
    got = jax.grad(
        loss(chunkop.vmap(fun, in_axes=(0, None), out_axes=(0, None), chunk_size=chunk_size)), argnums=(0, 1)
    )(x, w)
    assert_tree_allclose(got[0], ref[0])  # elementwise: CT * w
    # d/dw: the sum over the N examples of x * CT (cancelling) and 20 w
    terms = np.concatenate([x * CT[:, :3], 20 * w[None]]).astype(np.float64)
    cancel = float(np.max(np.abs(terms).sum(0)) / np.max(np.abs(terms.sum(0))))
    assert_tree_allclose(got[1], ref[1], n_terms=len(terms), condition=cancel)


# ----------------------------------------------------------------------------------------------
# Remainders: no padding artefacts, no double counting.


@pytest.mark.parametrize("chunk_size", [None, 3, 4, 5])
def test_log_with_broadcast_weight_has_finite_exact_grad(chunk_size):
    """Padding the remainder with zeros would give log(0) = -inf and NaN gradients for w."""
    x = np.abs(_rand(7, 3, seed=11)) + 0.5
    w = np.abs(_rand(3, seed=12)) + 0.5

    def loss(vm):
        return lambda x, w: jnp.sum(vm(lambda x, w: jnp.log(x * w), in_axes=(0, None))(x, w))

    ref = jax.grad(loss(jax.vmap), argnums=(0, 1))(x, w)
    got = jax.grad(loss(lambda f, **kw: chunkop.vmap(f, chunk_size=chunk_size, **kw)), argnums=(0, 1))(x, w)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    assert_tree_allclose(got[0], ref[0])  # elementwise: 1 / x
    # d/dw sum_i sum_j log(x_ij w_j) = N / w_j: a sum over the 7 examples
    assert_tree_allclose(got[1], ref[1], n_terms=7)
    assert_tree_allclose(got[1], 7 / w, n_terms=7)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 6, 7])
def test_no_double_counting(chunk_size):
    """With integer-valued data every gradient is exact: each element is counted exactly once."""
    n = 7
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    w = np.array([1.0, -2.0], np.float32)
    f = chunkop.vmap(lambda x, w: x * w, in_axes=(0, None), chunk_size=chunk_size)
    gx, gw = jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(gx, np.broadcast_to(w, (n, 2)))
    np.testing.assert_array_equal(gw, x.sum(0))
    np.testing.assert_array_equal(f(x, w), x * w)
    # forward mode: one tangent per element, no element seen twice
    _, t = jax.jvp(lambda x: f(x, w), (x,), (np.ones_like(x),))
    np.testing.assert_array_equal(t, np.broadcast_to(w, (n, 2)))


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_grad_wrt_mapped_input_along_inner_axis(chunk_size):
    x = _rand(3, N, 2, seed=14)
    fun = lambda x: jnp.sum(jnp.exp(x) * jnp.arange(3.0)[:, None])
    ref = jax.grad(lambda x: jnp.sum(jax.vmap(fun, in_axes=1)(x) ** 2))(x)
    got = jax.grad(lambda x: jnp.sum(chunkop.vmap(fun, in_axes=1, chunk_size=chunk_size)(x) ** 2))(x)
    assert_tree_allclose(got, ref, n_terms=6)  # each example's fun sums 3 x 2 positive values


def test_grad_matches_finite_differences():
    f = batched(4)
    loss = lambda x: jnp.sum(f(P, x, Y) * CT)
    g = jax.grad(loss)(X)
    v = _rand(*X.shape, seed=15)
    eps = 1e-2
    fd = (loss(X + eps * v) - loss(X - eps * v)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, v), fd, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------------------------
# Compile time does not grow with N; repeated calls do not retrace.


def _jaxpr_and_hlo(F, n, chunk_size):
    x = jax.ShapeDtypeStruct((n, 5), jnp.float32)
    y = jax.ShapeDtypeStruct((n, 4), jnp.float32)
    jaxpr = jax.make_jaxpr(F)(P, x, y)
    hlo = jax.jit(F).lower(P, x, y).as_text()
    return jaxpr, hlo


@pytest.mark.parametrize("what", ["forward", "grad"])
def test_program_size_flat_in_n(what):
    """N=1001 and N=100003 (both leaving a remainder with chunk 64) give programs of the same
    size: the chunk loop is a scan, not unrolled."""
    sizes = {}
    for n in (1001, 100003):
        F = batched(64)
        if what == "grad":
            F = jax.grad(lambda p, x, y, F=F: jnp.sum(F(p, x, y) ** 2), argnums=(0, 1))
        jaxpr, hlo = _jaxpr_and_hlo(F, n, 64)
        assert "scan" in primitive_names(jaxpr)
        sizes[n] = (count_eqns(jaxpr), len(hlo))
    (e1, h1), (e2, h2) = sizes[1001], sizes[100003]
    assert e1 == e2, sizes
    assert h2 <= 1.05 * h1, sizes  # only the digits of the shapes differ


def test_repeated_eager_calls_trace_once_and_compile_once():
    """Each call traces `fun` once on one example (as jax.vmap traces it once); the compiled
    chunk loop is reused by what was traced, so a second call with new values compiles nothing."""
    calls = []

    def fun(x, w):
        calls.append(1)
        return jnp.tanh(x @ w)

    w = _rand(5, 3, seed=16)
    f = chunkop.vmap(fun, in_axes=(0, None), chunk_size=5)  # 6 = 5 + 1: full chunk and remainder
    first = f(X, w)
    assert len(calls) == 1
    with CompileCounter() as compiles:
        second = f(X * 2, w + 1)  # same shapes, new values
    assert len(calls) == 2 and compiles.count == 0, (len(calls), compiles.count)
    assert_tree_allclose(first, jax.vmap(fun, in_axes=(0, None))(X, w), n_terms=X.shape[1])
    assert_tree_allclose(second, jax.vmap(fun, in_axes=(0, None))(X * 2, w + 1), n_terms=X.shape[1])
    # a new wrapper of the same function (built in a loop, say) reuses the compiled loop too
    with CompileCounter() as compiles:
        chunkop.vmap(fun, in_axes=(0, None), chunk_size=5)(X, w)
    assert compiles.count == 0
    # grad twice: the second compiles nothing either
    g = lambda x: jax.grad(lambda x: f(x, w).sum())(x)
    g(X)
    with CompileCounter() as compiles:
        g(X + 1)
    assert compiles.count == 0
    # a new shape compiles (so the counter above can see a compilation)
    with CompileCounter() as compiles:
        f(X[:5], w)
    assert compiles.count > 0


def _float_loss(fun, vmap_fn, kwargs, options):
    """``sum(sin(out))`` over the float (real) output leaves of the mapped ``fun``."""

    def loss(*args):
        out = vmap_fn(fun, **options)(*args, **kwargs)
        leaves = [o for o in jax.tree_util.tree_leaves(out) if jnp.issubdtype(jnp.result_type(o), jnp.floating)]
        return sum((jnp.sum(jnp.sin(jnp.asarray(o, jnp.float32))) for o in leaves), jnp.float32(0))

    return loss


def _float_argnums(args: tuple) -> tuple:
    """The positional arguments whose leaves (at least one) are all real floats."""
    floats = lambda a: (
        jax.tree_util.tree_leaves(a)
        and all(np.issubdtype(np.asarray(leaf).dtype, np.floating) for leaf in jax.tree_util.tree_leaves(a))
    )
    return tuple(i for i, a in enumerate(args) if floats(a))


@pytest.mark.parametrize("case", [c for c in sorted(registry.CASES) if _float_argnums(registry.CASES[c][1])])
def test_grad_of_every_registry_case_matches_jax_vmap(case):
    """The shared registry (``transform_registry.py``): the gradient of a loss of each case's
    float outputs w.r.t. its float arguments, chunked (3: two chunks and a remainder of 2)
    against ``jax.vmap``."""
    fun, args, kwargs, options = registry.CASES[case]
    floats = _float_argnums(args)
    kwargs = kwargs or {}
    ref = jax.grad(_float_loss(fun, jax.vmap, kwargs, options), argnums=floats)(*args)
    chunked = lambda f, **o: chunkop.vmap(f, chunk_size=3, **o)
    got = jax.grad(_float_loss(fun, chunked, kwargs, options), argnums=floats)(*args)
    assert_tree_allclose(got, ref, n_terms=registry.N * 5)
