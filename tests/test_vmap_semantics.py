"""``chunkop.vmap`` / ``chunkop.map`` give the same values as ``jax.vmap`` / ``jax.lax.map``.

The mapped axis has N = 8 elements; the chunk sizes cover: no chunking (None), a chunk that
does not divide N (3: two full chunks plus a remainder of 2), one that does (4), and
chunk_size == N and > N (both exactly ``jax.vmap``).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _params import grid
from conftest import assert_tree_allclose, primitive_names
from transform_registry import CASES, XT, W, X  # the shared cases

import chunkop

N = 8
CHUNKS = [None, 3, 4, N]  # chunk_size > N: see test_chunking_engages_only_below_n
CHUNKED = [3, 4]  # chunk sizes that really chunk (scan + maybe remainder)


def _rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


# The longest sum in one example of the cases below (x @ w, x.sum() over X's 5 columns);
# collectives sum over the N examples.
INNER = 5


def check(fun, args, kwargs=None, *, chunk_size, n_terms=INNER, **vmap_kw):
    kwargs = kwargs or {}
    expected = jax.vmap(fun, **vmap_kw)(*args, **kwargs)
    actual = chunkop.vmap(fun, chunk_size=chunk_size, **vmap_kw)(*args, **kwargs)
    assert_tree_allclose(actual, expected, n_terms=n_terms)
    return actual


# ----------------------------------------------------------------------------------------------
# in_axes / out_axes / kwargs / axis_size against jax.vmap.


# every case at a chunk that leaves a remainder; None, 4 (divides) and N (> N: unchunked) once each
@pytest.mark.parametrize(
    ("case", "chunk_size"), grid(sorted(CASES), CHUNKS, strength=1, keep=lambda case, c: c == 3, ids=str)
)
def test_matches_jax_vmap(case, chunk_size):
    fun, args, kwargs, vmap_kw = CASES[case]
    check(fun, args, kwargs, chunk_size=chunk_size, **vmap_kw)


@pytest.mark.parametrize("chunk_size", [1, 2, 6, 7])
def test_more_chunk_sizes(chunk_size):
    """Chunk sizes 1 (every element its own chunk), and more remainders (8 % 6, 8 % 7)."""
    fun, args, _, vmap_kw = CASES["dict_prefix_with_none"]
    check(fun, args, chunk_size=chunk_size, **vmap_kw)
    fun, args, _, vmap_kw = CASES["out_axes_tree"]
    check(fun, args, chunk_size=chunk_size, **vmap_kw)


def test_numpy_integer_chunk_size():
    check(lambda x: x * 2, (X,), chunk_size=np.int64(3))


@pytest.mark.parametrize("chunk_size", [None, 3, N, N + 3])
def test_chunking_engages_only_below_n(chunk_size):
    """chunk_size < N runs a scan; chunk_size None or >= N is a plain vmap (no scan)."""
    fun, args, _, vmap_kw = CASES["dict_prefix_with_none"]
    f = chunkop.vmap(fun, chunk_size=chunk_size, **vmap_kw)
    prims = primitive_names(jax.make_jaxpr(f)(*args))
    assert ("scan" in prims) == (chunk_size is not None and chunk_size < N)
    assert_tree_allclose(f(*args), jax.vmap(fun, **vmap_kw)(*args), n_terms=INNER)


def test_identity_map_is_exact_with_remainder():
    """No row is dropped, duplicated or re-read: the identity map returns its input bit for bit."""
    x = np.arange(N * 5 * 2, dtype=np.float32).reshape(2, N, 5)
    for cs in [1, 3, 6, 7]:  # remainders of 2, 2, 1
        np.testing.assert_array_equal(chunkop.vmap(lambda r: r, in_axes=1, out_axes=1, chunk_size=cs)(x), x)
        np.testing.assert_array_equal(
            chunkop.vmap(lambda r: r, in_axes=1, out_axes=0, chunk_size=cs)(x), np.moveaxis(x, 1, 0)
        )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_out_axes_none_for_varying_output_errors_like_jax(chunk_size):
    fun = lambda x, w: (x @ w, x.sum())
    with pytest.raises(ValueError, match="got axis spec None but output was batched") as ref:
        jax.vmap(fun, in_axes=(0, None), out_axes=(0, None))(X, W)
    with pytest.raises(ValueError, match="got axis spec None but output was batched") as got:
        chunkop.vmap(fun, in_axes=(0, None), out_axes=(0, None), chunk_size=chunk_size)(X, W)
    assert str(got.value) == str(ref.value)


# ----------------------------------------------------------------------------------------------
# PRNG keys in and out.


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_raw_uint32_keys_mapped(chunk_size):
    keys = jax.random.split(jax.random.PRNGKey(0), N)  # (N, 2) uint32
    check(lambda k: (jax.random.normal(k, (3,)), jax.random.split(k)), (keys,), chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_typed_keys_mapped(chunk_size):
    keys = jax.random.split(jax.random.key(0), N)  # (N,) key<fry>
    fun = lambda k, s: (jax.random.normal(k, (3,)) * s, jax.random.split(k, 3), jax.random.key_data(k))
    out = check(fun, (keys, 2.0), chunk_size=chunk_size, in_axes=(0, None))
    assert jnp.issubdtype(out[1].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_typed_keys_mapped_along_axis_1_and_out_axes(chunk_size):
    keys = jax.random.split(jax.random.key(1), (2, N))
    fun = lambda k: (jax.random.uniform(k[0], (4,)) + jax.random.uniform(k[1]), jax.random.split(k[1], 3))
    check(fun, (keys,), chunk_size=chunk_size, in_axes=1, out_axes=(1, -1))


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_unmapped_key_output(chunk_size):
    fun = lambda x, k: (x * jax.random.normal(k), jax.random.fold_in(k, 1))
    check(fun, (X, jax.random.key(3)), chunk_size=chunk_size, in_axes=(0, None), out_axes=(0, None))


# ----------------------------------------------------------------------------------------------
# Axis size 0.


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_axis_size_zero_mapped(chunk_size):
    check(lambda x, w: (x @ w, x.sum()), (np.zeros((0, 5), np.float32), W), chunk_size=chunk_size, in_axes=(0, None))
    check(lambda x: x.sum(), (np.zeros((3, 0), np.float32),), chunk_size=chunk_size, in_axes=1)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_axis_size_zero_unmapped(chunk_size):
    check(lambda w: w * 2, (W,), chunk_size=chunk_size, in_axes=None, axis_size=0)


# ----------------------------------------------------------------------------------------------
# Non-array arguments that are not mapped.


class _Scale:
    """An unhashable non-array argument (``__eq__`` without ``__hash__``)."""

    def __init__(self, s):
        self.s = s

    def __eq__(self, other):
        return isinstance(other, _Scale) and other.s == self.s

    __hash__ = None


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_static_non_array_arguments(chunk_size):
    fun = lambda x, name, obj: x * len(name) * obj.s
    expected = jax.vmap(fun, in_axes=(0, None, None))(X, "abc", _Scale(2.0))
    f = chunkop.vmap(fun, in_axes=(0, None, None), chunk_size=chunk_size)
    assert_tree_allclose(f(X, "abc", _Scale(2.0)), expected)
    # A different static value must not hit a stale cache entry.
    assert_tree_allclose(f(X, "abcd", _Scale(2.0)), expected * 4 / 3)


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_cache_distinguishes_signatures(chunk_size):
    """One wrapper called with different shapes / dtypes / in-axis sizes gives fresh results."""
    f = chunkop.vmap(lambda x: x * 2, chunk_size=chunk_size)
    for x in [X, X[:7], X[:, :2], X.astype(np.int32), _rand(N + 5, 5)]:
        assert_tree_allclose(f(x), jax.vmap(lambda x: x * 2)(x))


# ----------------------------------------------------------------------------------------------
# Nesting.


@pytest.mark.parametrize("outer_cs", [None, 2, 3])
@pytest.mark.parametrize("inner_cs", [None, 2, 4])
def test_nested_chunked_in_chunked(outer_cs, inner_cs):
    a = _rand(N, 5, seed=10)
    b = _rand(6, N, seed=11)
    fun = lambda x, y: jnp.sin(x) * y
    ref = jax.vmap(jax.vmap(fun, in_axes=(None, 0), out_axes=1), in_axes=(0, 1), out_axes=-1)(a, b)
    inner = chunkop.vmap(fun, in_axes=(None, 0), out_axes=1, chunk_size=inner_cs)
    got = chunkop.vmap(inner, in_axes=(0, 1), out_axes=-1, chunk_size=outer_cs)(a, b)
    assert_tree_allclose(got, ref)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_nested_with_jax_vmap_both_orders(chunk_size):
    a = _rand(N, 5, seed=12)
    b = _rand(6, 5, seed=13)
    fun = lambda x, y: jnp.dot(jnp.tanh(x), y)
    ref = jax.vmap(jax.vmap(fun, in_axes=(None, 0)), in_axes=(0, None))(a, b)
    got = chunkop.vmap(jax.vmap(fun, in_axes=(None, 0)), in_axes=(0, None), chunk_size=chunk_size)(a, b)
    assert_tree_allclose(got, ref, n_terms=INNER)
    ref_t = jax.vmap(jax.vmap(fun, in_axes=(0, None)), in_axes=(None, 0))(a, b)
    got_t = jax.vmap(chunkop.vmap(fun, in_axes=(0, None), chunk_size=chunk_size), in_axes=(None, 0))(a, b)
    assert_tree_allclose(got_t, ref_t, n_terms=INNER)


def test_nested_wrapper_keeps_its_own_settings():
    """Regression: ``functools.wraps`` copied the inner wrapper's ``__dict__`` (its ``fun``,
    ``in_axes``, ``chunk_size`` ...) onto the outer wrapper, so the outer one ran the inner."""
    inner = chunkop.vmap(lambda r: r.sum(), chunk_size=2)
    outer = chunkop.vmap(inner, in_axes=1, chunk_size=2)
    x = _rand(10, 6)
    assert_tree_allclose(outer(x), jax.vmap(jax.vmap(lambda r: r.sum()), in_axes=1)(x))
    assert outer.chunk_size == 2 and outer.in_axes == 1 and outer.__wrapped__ is inner


# ----------------------------------------------------------------------------------------------
# Wrapping, decorators, functools.partial.


def test_wraps_name_doc_and_signature():
    def energy(x, w):
        """Per-example energy."""
        return (x @ w) ** 2

    f = chunkop.vmap(energy, in_axes=(0, None), chunk_size=3)
    assert f.__name__ == "energy"
    assert f.__doc__ == "Per-example energy."
    assert f.__wrapped__ is energy
    assert list(inspect.signature(f).parameters) == ["x", "w"]
    assert_tree_allclose(f(X, W), jax.vmap(energy, in_axes=(0, None))(X, W), n_terms=INNER)


def test_callable_object_with_clashing_attributes():
    """A callable whose attributes are named like the wrapper's (``fun``, ``in_axes`` ...)."""

    class Model:
        def __init__(self):
            self.fun = None
            self.in_axes = 5
            self.chunk_size = "big"
            self.w = W

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    model = Model()
    f = chunkop.vmap(model, chunk_size=3)
    assert_tree_allclose(f(X), jax.vmap(model)(X), n_terms=INNER)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_decorator_with_functools_partial(chunk_size):
    @functools.partial(chunkop.vmap, in_axes=(0, None), chunk_size=chunk_size)
    def f(x, w):
        return jnp.sin(x @ w)

    assert f.__name__ == "f"
    assert_tree_allclose(f(X, W), jax.vmap(lambda x, w: jnp.sin(x @ w), in_axes=(0, None))(X, W), n_terms=INNER)


def test_bare_decorator_and_partial_function():
    @chunkop.vmap
    def g(x):
        return x**2

    assert_tree_allclose(g(X), jax.vmap(lambda x: x**2)(X))
    p = functools.partial(lambda x, w: x @ w, w=W)
    assert_tree_allclose(chunkop.vmap(p, chunk_size=3)(X), jax.vmap(p)(X), n_terms=INNER)


# ----------------------------------------------------------------------------------------------
# Collectives over axis_name.

COLLECTIVES = {
    "psum": lambda x: x - jax.lax.psum(x, "i"),
    "pmean": lambda x: x - jax.lax.pmean(x, "i"),
    "pmax": lambda x: jax.lax.pmax(x, "i"),
    "axis_index": lambda x: x * jax.lax.axis_index("i"),
    "all_gather": lambda x: jax.lax.all_gather(x, "i").sum(0),
    "ppermute": lambda x: jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)]),
    "psum_in_jit": lambda x: jax.jit(lambda t: jax.lax.psum(t, "i"))(x),
    "psum_in_cond": lambda x: jax.lax.cond(x.sum() > 0, lambda: jax.lax.psum(x, "i"), lambda: x),
    "axis_index_in_scan": lambda x: jax.lax.scan(lambda c, _: (c + jax.lax.axis_index("i"), None), x, None, 2)[0],
    "ppermute_in_checkpoint": lambda x: jax.checkpoint(
        lambda t: jax.lax.ppermute(t, "i", [(j, (j + 3) % N) for j in range(N)])
    )(x),
}
EXPECTED_PRIM = {
    "psum": "psum", "pmean": "psum", "pmax": "pmax", "axis_index": "axis_index",
    "all_gather": "all_gather", "ppermute": "ppermute", "psum_in_jit": "psum",
    "psum_in_cond": "psum", "axis_index_in_scan": "axis_index", "ppermute_in_checkpoint": "ppermute",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_collective_with_chunking_raises(name):
    f = chunkop.vmap(COLLECTIVES[name], axis_name="i", chunk_size=3)
    with pytest.raises(
        ValueError, match=rf"collective `{EXPECTED_PRIM[name]}` over axis_name='i'.*chunk_size=3 < axis size 8"
    ):
        f(X)


@pytest.mark.parametrize("chunk_size", [None, N, N + 1])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_collective_without_chunking_matches_jax_vmap(name, chunk_size):
    check(COLLECTIVES[name], (X,), chunk_size=chunk_size, axis_name="i", n_terms=N)


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_collective_detection_has_no_false_positives(chunk_size):
    @jax.jit
    def i(t):  # a jit whose `name` parameter equals the axis name
        return t * 2

    check(lambda x: i(x).sum(0), (X,), chunk_size=chunk_size, axis_name="i")
    # axis_name=0 must not match reduce_sum's axes=(0,)
    check(lambda x: jnp.sum(jnp.outer(x, x), axis=0), (X,), chunk_size=chunk_size, axis_name=0)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_collective_over_outer_axis_inside_chunked_inner(chunk_size):
    """The inner map is chunked over 'i' but reduces over the *outer* axis 'j': legitimate."""
    a = _rand(4, N, seed=20)
    fun = lambda x: x - jax.lax.psum(x, "j")
    ref = jax.vmap(jax.vmap(fun, axis_name="i"), axis_name="j")(a)
    got = jax.vmap(chunkop.vmap(fun, axis_name="i", chunk_size=chunk_size), axis_name="j")(a)
    assert_tree_allclose(got, ref, n_terms=a.shape[0])  # psum over 'j'


def test_collective_over_outer_chunked_axis_raises():
    """... but a reduction over an outer axis that is itself chunked is caught by the outer map."""
    a = _rand(N, 4, seed=21)
    inner = chunkop.vmap(lambda x: x - jax.lax.psum(x, "j"), axis_name="i", chunk_size=None)
    outer = chunkop.vmap(inner, axis_name="j", chunk_size=3)
    with pytest.raises(ValueError, match="collective `psum` over axis_name='j'"):
        outer(a)
    ref = jax.vmap(jax.vmap(lambda x: x - jax.lax.psum(x, "j"), axis_name="i"), axis_name="j")(a)
    assert_tree_allclose(chunkop.vmap(inner, axis_name="j", chunk_size=N)(a), ref, n_terms=N)


# ----------------------------------------------------------------------------------------------
# chunkop.map against jax.lax.map.


@pytest.mark.parametrize("chunk_size", [1, 3, 4, N, 20])
def test_map_matches_lax_map(chunk_size):
    xs = {"a": X, "b": (XT.T, np.arange(N, dtype=np.int32))}
    f = lambda t: {"y": jnp.tanh(t["a"]).sum() * t["b"][0], "i": t["b"][1] * 2, "m": t["a"] > 0}
    assert_tree_allclose(chunkop.map(f, xs, chunk_size=chunk_size), jax.lax.map(f, xs), n_terms=INNER)
    assert_tree_allclose(
        chunkop.map(f, xs, chunk_size=chunk_size), jax.lax.map(f, xs, batch_size=chunk_size), n_terms=INNER
    )


def test_registered_vmappable_types_run_as_jax_vmap():
    """A type registered with JAX's experimental ``batching.register_vmappable`` (mapped by its own
    ``to_elt``/``from_elt``), or its spec type in ``in_axes``/``out_axes``: chunkop.vmap runs the
    call as ``jax.vmap`` (unchunked: the type's rules define how a chunk of it would look)."""
    from jax._src.interpreters import batching

    class Scaled:  # data with a scale applied when an element is taken out
        def __init__(self, data, scale):
            self.data, self.scale = data, scale

    class Along:  # the spec type: map along this axis of the data
        def __init__(self, axis):
            self.axis = axis

    def to_elt(cont, _, val, spec):
        return cont(val.data * val.scale, spec.axis if isinstance(spec, Along) else spec)

    def from_elt(cont, size, elt, spec):  # (outputs here are arrays: never called)
        raise AssertionError("from_elt")

    batching.register_vmappable(Scaled, Along, int, to_elt, from_elt, None)
    try:
        x = Scaled(jnp.arange(12.0).reshape(3, 4), 2.0)
        f = lambda e: jnp.sin(e) * e.sum()
        for kw in ({"in_axes": Along(1), "axis_size": 4}, {"in_axes": 0, "axis_size": 3}):
            expected = jax.vmap(f, **kw)(x)
            assert expected.shape == (kw["axis_size"], 7 - kw["axis_size"])
            g = chunkop.vmap(f, chunk_size=2, **kw)
            np.testing.assert_array_equal(g(x), expected)
            in_jit = jax.jit(lambda d, g=g: g(Scaled(d, 2.0)))  # (a Scaled is not a jit argument)
            np.testing.assert_array_equal(in_jit(x.data), expected)
            np.testing.assert_array_equal(chunkop.sum(f, chunk_size=2, **kw)(x), expected.sum(0))
    finally:
        batching.unregister_vmappable(Scaled)
