"""``chunkop.sum`` / ``chunkop.mean`` equal ``jax.vmap(fun)(...).sum(0)`` / ``.mean(0)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CompileCounter, assert_tree_allclose, primitive_names

import chunkop

N = 8
CHUNKS = [None, 3, 4, N, N + 3]


# the sums inside one example (x @ W: 5 terms; the loss: 3), on top of the sum over the N examples
INNER = 5 + 3


def _close_to_sum(got, ref, terms, n_inner=0):
    """``got`` and ``ref`` are sums (or means) over axis 0 of ``terms`` (the per-example values):
    leaf by leaf, to the tolerance of that sum (its length, plus ``n_inner`` for each term's own
    sums, and its worst cancellation)."""
    for g, r, t in zip(*(jax.tree.leaves(a) for a in (got, ref, terms)), strict=True):
        t = np.asarray(t)
        if not np.issubdtype(t.dtype, np.floating):
            assert_tree_allclose(g, r)  # exact
            continue
        t = t.astype(np.float64)
        total = np.max(np.abs(t.sum(0)))
        condition = np.max(np.abs(t).sum(0)) / total if total > 0 else 1.0
        assert_tree_allclose(g, r, n_terms=t.shape[0] + n_inner, condition=condition)


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


P = {"W": _rand(5, 3, seed=1), "b": _rand(3, seed=2)}
X = _rand(N, 5, seed=3)
Y = _rand(N, 3, seed=4)


def per_example(p, x, y):
    h = jnp.tanh(x @ p["W"] + p["b"])
    return {"loss": jnp.sum((h - y) ** 2), "h": h, "pair": (h.max(), jnp.outer(h, y))}


def reference(kind, fun, in_axes=0, axis_size=None):
    reduce = {"sum": jnp.sum, "mean": jnp.mean}[kind]

    def f(*args, **kwargs):
        outs = jax.vmap(fun, in_axes, axis_size=axis_size)(*args, **kwargs)
        return jax.tree.map(lambda o: reduce(o, axis=0), outs)

    return f


def chunked(kind, fun, in_axes=0, **kw):
    return {"sum": chunkop.sum, "mean": chunkop.mean}[kind](fun, in_axes, **kw)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_pytree_outputs_match(kind, chunk_size):
    ref = reference(kind, per_example, (None, 0, 0))(P, X, Y)
    got = chunked(kind, per_example, (None, 0, 0), chunk_size=chunk_size)(P, X, Y)
    _close_to_sum(got, ref, jax.vmap(per_example, (None, 0, 0))(P, X, Y), n_inner=INNER)


@pytest.mark.parametrize("chunk_size", [None, 3, 4])
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_int_bool_complex_outputs(kind, chunk_size):
    xi = np.arange(N * 3, dtype=np.int32).reshape(N, 3) - 7

    def fun(x):
        return {
            "i": x * 3,
            "b": x > 0,
            "u8": (x % 7).astype(jnp.uint8),
            "c": x.astype(jnp.complex64) * (1 - 2j),
            "f16": x.astype(jnp.float16),
        }

    ref = reference(kind, fun)(xi)
    got = chunked(kind, fun, chunk_size=chunk_size)(xi)
    assert_tree_allclose(got, ref, rtol=1e-3, atol=1e-3)
    assert got["i"].dtype == ref["i"].dtype == (jnp.int32 if kind == "sum" else jnp.float32)
    assert got["u8"].dtype == ref["u8"].dtype


@pytest.mark.parametrize("chunk_size", [1, 3, 6, 7])  # 8 = 1 * 8, 3 + 3 + 2, 6 + 2, 7 + 1
def test_remainders_exact(chunk_size):
    """Integer-valued data: every element is counted exactly once, whatever the remainder."""
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    np.testing.assert_array_equal(chunkop.sum(lambda r: r, chunk_size=chunk_size)(x), x.sum(0))
    np.testing.assert_array_equal(chunkop.mean(lambda r: r, chunk_size=chunk_size)(x), x.mean(0))
    gx = jax.grad(lambda x: chunkop.sum(lambda r: (r * r).sum(), chunk_size=chunk_size)(x))(x)
    np.testing.assert_array_equal(gx, 2 * x)


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_chunked_path_is_a_scan(chunk_size):
    prims = primitive_names(jax.make_jaxpr(chunkop.sum(per_example, (None, 0, 0), chunk_size=chunk_size))(P, X, Y))
    assert "scan" in prims


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_grads_match(kind, chunk_size):
    def scalar(F):
        return lambda p, x, y: F(p, x, y)["loss"] + jnp.sum(F(p, x, y)["pair"][1] ** 2)

    ref = jax.grad(scalar(reference(kind, per_example, (None, 0, 0))), argnums=(0, 1, 2))(P, X, Y)
    got = jax.grad(scalar(chunked(kind, per_example, (None, 0, 0), chunk_size=chunk_size)), argnums=(0, 1, 2))(P, X, Y)
    assert_tree_allclose(got, ref, n_terms=N + INNER)  # d/dp: over the N examples


@pytest.mark.parametrize("remat", [True, False, jax.checkpoint_policies.dots_saveable])
def test_remat_options(remat):
    loss = lambda p, x, y: per_example(p, x, y)["loss"]
    ref = jax.grad(reference("mean", loss, (None, 0, 0)))(P, X, Y)
    got = jax.grad(chunkop.mean(loss, (None, 0, 0), chunk_size=3, remat=remat))(P, X, Y)
    _close_to_sum(got, ref, jax.vmap(jax.grad(loss), (None, 0, 0))(P, X, Y), n_inner=INNER)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_jvp_jit_and_hessian_match(chunk_size):
    loss = lambda p, x, y: per_example(p, x, y)["loss"]
    ref_f = reference("sum", loss, (None, 0, 0))
    got_f = chunkop.sum(loss, (None, 0, 0), chunk_size=chunk_size)
    tangent = jax.tree.map(jnp.cos, P)
    per_example_jvps = jax.vmap(lambda x, y: jax.jvp(lambda p: loss(p, x, y), (P,), (tangent,)))(X, Y)
    _close_to_sum(
        jax.jvp(lambda p: got_f(p, X, Y), (P,), (tangent,)),
        jax.jvp(lambda p: ref_f(p, X, Y), (P,), (tangent,)),
        per_example_jvps,
        n_inner=INNER,
    )
    assert_tree_allclose(jax.jit(got_f)(P, X, Y), ref_f(P, X, Y), n_terms=N + INNER)  # a sum of squares
    assert_tree_allclose(
        jax.jit(jax.hessian(got_f))(P, X, Y), jax.jit(jax.hessian(ref_f))(P, X, Y), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_vmap_of_sum(chunk_size):
    loss = lambda p, x, y: per_example(p, x, y)["loss"]
    ps = jax.tree.map(lambda a: jnp.stack([a, -a, 2 * a]), P)
    ref = jax.vmap(reference("sum", loss, (None, 0, 0)), in_axes=(0, None, None))(ps, X, Y)
    got = jax.vmap(chunkop.sum(loss, (None, 0, 0), chunk_size=chunk_size), in_axes=(0, None, None))(ps, X, Y)
    assert_tree_allclose(got, ref, n_terms=N + INNER)  # sums of squares


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_kwargs_negative_axes_and_unmapped_outputs(kind, chunk_size):
    fun = lambda x, w, *, s: (x @ w * s, w.sum(), jnp.float32(2.0))
    xt = X.T  # mapped along -1
    s = _rand(N, seed=8)
    ref = reference(kind, fun, (-1, None))(xt, P["W"], s=s)
    got = chunked(kind, fun, (-1, None), chunk_size=chunk_size)(xt, P["W"], s=s)
    _close_to_sum(got, ref, jax.vmap(lambda x, s: fun(x, P["W"], s=s), (-1, 0))(xt, s), n_inner=INNER)


@pytest.mark.parametrize("chunk_size", [None, 3, 4])
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_axis_size_without_mapped_arguments(kind, chunk_size):
    fun = lambda w: jnp.tanh(w)
    ref = reference(kind, fun, None, axis_size=N)(P["W"])
    got = chunked(kind, fun, None, chunk_size=chunk_size, axis_size=N)(P["W"])
    assert_tree_allclose(got, ref, n_terms=N)  # N copies of tanh(W)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_axis_size_zero(chunk_size):
    x = np.zeros((0, 3), np.float32)
    assert_tree_allclose(chunkop.sum(jnp.sin, chunk_size=chunk_size)(x), reference("sum", jnp.sin)(x))
    with np.errstate(invalid="ignore"):
        ref = reference("mean", jnp.sin)(x)  # nan, as jnp.mean of an empty axis
    assert_tree_allclose(chunkop.mean(jnp.sin, chunk_size=chunk_size)(x), ref)


def test_nested_sum_of_chunked_vmap():
    inner = chunkop.vmap(lambda a, b: a * b, in_axes=(None, 0), chunk_size=2)
    x = _rand(N, 5, seed=9)
    b = _rand(7, seed=10)
    got = chunkop.sum(inner, in_axes=(0, None), chunk_size=3)(x, b)
    products = jax.vmap(jax.vmap(lambda a, b: a * b, in_axes=(None, 0)), in_axes=(0, None))(x, b)
    _close_to_sum(got, products.sum(0), products)


def test_wraps_and_trace_count():
    calls = []

    def energy(x):
        """Energy of one sample."""
        calls.append(1)
        return jnp.sum(x**2)

    f = chunkop.sum(energy, chunk_size=3)
    g = chunkop.mean(energy, chunk_size=3)
    assert f.__name__ == g.__name__ == "energy" and f.__doc__ == "Energy of one sample."
    assert_tree_allclose(f(X), jnp.sum(X**2), n_terms=X.size)  # a sum of 8 x 5 squares
    assert len(calls) == 1  # traced once per call, on one example
    with CompileCounter() as compiles:
        assert_tree_allclose(f(X + 1), jnp.sum((X + 1) ** 2), n_terms=X.size)
    assert len(calls) == 2 and compiles.count == 0
    assert_tree_allclose(g(X), jnp.sum(X**2) / N, n_terms=X.size)


def test_partial_and_static_argument():
    f = functools.partial(chunkop.sum, in_axes=(0, None), chunk_size=3)(lambda x, name: x * len(name))
    _close_to_sum(f(X, "abc"), X.sum(0) * 3, X * 3)
    _close_to_sum(f(X, "ab"), X.sum(0) * 2, X * 2)
