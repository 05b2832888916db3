"""User state: the chunked transforms give ``jax.vmap``'s result *every* time.

State is mutated between calls (object attributes, module globals, closed-over arrays, bound
methods, callables that compare equal) and every result is compared with ``jax.vmap`` (or
``jax.jacrev``/``jax.jacfwd``) computed on the same state. Also: axis-size queries over a
chunked axis name, low-precision sums, unmapped Python values, what the caches keep alive,
and JAX's own edge cases (custom rules closing over values and tracers, ``jax_custom_vjp3``).
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CompileCounter, assert_tree_allclose
from jax import lax

import chunkop

N = 10
CHUNK = 4  # 2 full chunks + a remainder of 2


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


X = _rand(N, 3, seed=1)


# -- how each transform is computed by chunkop and by its reference ------------------------------


def _vmap(f):
    return chunkop.vmap(f, chunk_size=CHUNK)(X), jax.vmap(f)(X)


def _map(f):
    return chunkop.map(f, X, chunk_size=CHUNK), jax.lax.map(f, X)


def _sum(f):
    return chunkop.sum(f, chunk_size=CHUNK)(X), jax.vmap(f)(X).sum(0)


def _mean(f):
    return chunkop.mean(f, chunk_size=CHUNK)(X), jax.vmap(f)(X).mean(0)


def _jacrev(f):
    g = lambda x: jax.vmap(f)(x).ravel()
    return chunkop.jacrev(g, chunk_size=CHUNK)(X), jax.jacrev(g)(X)


def _jacfwd(f):
    g = lambda x: jax.vmap(f)(x).ravel()
    return chunkop.jacfwd(g, chunk_size=CHUNK)(X), jax.jacfwd(g)(X)


TRANSFORMS = {"vmap": _vmap, "map": _map, "sum": _sum, "mean": _mean, "jacrev": _jacrev, "jacfwd": _jacfwd}


def _sum_tolerance(terms):
    """``assert_tree_allclose``'s ``n_terms`` and ``condition`` for a sum over axis 0 of ``terms``
    (the per-example values): its length and its worst cancellation."""
    t = np.asarray(terms, np.float64)
    return {"n_terms": t.shape[0], "condition": float(np.max(np.abs(t).sum(0)) / np.max(np.abs(t.sum(0))))}


def _same(transform, f):
    got, expected = transform(f)
    # sum and mean reorder a sum over the N examples; the rest are elementwise
    tol = _sum_tolerance(jax.vmap(f)(X)) if transform in (_sum, _mean) else {}
    assert_tree_allclose(got, expected, **tol)
    return got


# -- mutated state ---------------------------------------------------------------------------------


class Layer:
    def __init__(self, w):
        self.w = w

    def apply(self, x):
        return jnp.tanh(x * self.w)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_attribute_mutation(name):
    layer = Layer(jnp.float32(1.0))
    first = _same(TRANSFORMS[name], layer.apply)
    layer.w = jnp.float32(5.0)  # same shape and dtype: the jaxpr is the same, the value is not
    second = _same(TRANSFORMS[name], layer.apply)
    assert not np.allclose(first, second)


@pytest.mark.parametrize("name", ["vmap", "sum"])
def test_attribute_mutation_same_wrapper(name):
    """A wrapper built once and called again after the update (the usual training loop)."""
    layer = Layer(jnp.float32(1.0))
    build = chunkop.vmap if name == "vmap" else chunkop.sum
    f = build(layer.apply, chunk_size=CHUNK)
    ref = (lambda y: y) if name == "vmap" else (lambda y: y.sum(0))
    for w in (1.0, 5.0, -2.0):
        layer.w = jnp.float32(w)
        per_example = jax.vmap(layer.apply)(X)
        assert_tree_allclose(f(X), ref(per_example), **({} if name == "vmap" else _sum_tolerance(per_example)))


PARAMS = {"w": jnp.ones(3)}


def _reads_global(x):
    return jnp.sin(x * PARAMS["w"])


@pytest.mark.parametrize("name", TRANSFORMS)
def test_module_global_after_update(name):
    PARAMS["w"] = jnp.ones(3)
    _same(TRANSFORMS[name], _reads_global)
    PARAMS["w"] = jnp.array([2.0, -1.0, 0.5])  # an optimizer update
    _same(TRANSFORMS[name], _reads_global)


class EqualScale:
    """Callables that all compare (and hash) equal but compute different things."""

    def __init__(self, s):
        self.s = s

    def __call__(self, x):
        return x * self.s

    def __eq__(self, other):
        return isinstance(other, EqualScale)

    def __hash__(self):
        return 0


@pytest.mark.parametrize("name", TRANSFORMS)
def test_equal_comparing_callables(name):
    a, b = EqualScale(jnp.float32(2.0)), EqualScale(jnp.float32(3.0))
    assert a == b and hash(a) == hash(b)
    _same(TRANSFORMS[name], a)
    _same(TRANSFORMS[name], b)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_equal_comparing_callables_with_python_scalars(name):
    """Python-number state is baked into the jaxpr as a literal: a new value is a new program."""
    _same(TRANSFORMS[name], EqualScale(2.0))
    _same(TRANSFORMS[name], EqualScale(3.0))


class EqualLayer(Layer):
    def __eq__(self, other):
        return isinstance(other, EqualLayer)

    def __hash__(self):
        return 0


@pytest.mark.parametrize("name", TRANSFORMS)
def test_bound_methods_of_equal_objects(name):
    a, b = EqualLayer(jnp.float32(1.0)), EqualLayer(jnp.float32(-3.0))
    assert a == b and hash(a) == hash(b)
    _same(TRANSFORMS[name], a.apply)
    _same(TRANSFORMS[name], b.apply)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_replaced_closed_over_array(name):
    w = jnp.ones(3)

    def f(x):
        return jnp.cos(x) * w

    _same(TRANSFORMS[name], f)
    w = jnp.arange(3.0)  # rebinds the cell f closes over
    _same(TRANSFORMS[name], f)


def test_closed_over_numpy_array_mutated_in_place():
    table = np.ones(3, np.float32)
    f = chunkop.vmap(lambda x: x * table, chunk_size=CHUNK)
    assert_tree_allclose(f(X), X)
    table[:] = 7.0
    assert_tree_allclose(f(X), jax.vmap(lambda x: x * table)(X))


# -- closing over traced values -------------------------------------------------------------------


@pytest.mark.parametrize("remat", [True, False])
def test_closure_over_differentiated_parameter(remat):
    def loss(w, V):
        return jnp.sum(V(lambda x: jnp.sin(x * w) ** 2)(X))

    for w in (jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 2.0])):
        got = jax.grad(loss)(w, lambda f: chunkop.vmap(f, chunk_size=CHUNK, remat=remat))
        assert_tree_allclose(got, jax.grad(loss)(w, jax.vmap), rtol=1e-4)
        got = jax.jit(jax.grad(loss), static_argnums=1)(w, lambda f: chunkop.vmap(f, chunk_size=CHUNK))
        assert_tree_allclose(got, jax.grad(loss)(w, jax.vmap), rtol=1e-4)


def test_closure_over_outer_vmap_tracer():
    ws = _rand(5, 3, seed=4)
    got = jax.vmap(lambda w: chunkop.vmap(lambda x: x @ w, chunk_size=CHUNK)(X))(ws)
    assert_tree_allclose(got, jax.vmap(lambda w: jax.vmap(lambda x: x @ w)(X))(ws), n_terms=X.shape[1])


# -- axis-size queries and collectives over a chunked axis name ------------------------------------


AXIS_SIZE_QUERIES = {
    "psum_of_one": lambda x: x * lax.psum(1, "i"),
    "psum_of_unbatched_float": lambda x: x + lax.psum(2.0, "i"),
    "axis_size": lambda x: x * lax.axis_size("i"),
    "pmean_of_unbatched": lambda x: x + lax.pmean(3.0, "i"),
}


@pytest.mark.parametrize("name", AXIS_SIZE_QUERIES)
@pytest.mark.parametrize("chunk_size", [3, 4, None])
def test_axis_size_queries_equal_jax_vmap(name, chunk_size):
    f = AXIS_SIZE_QUERIES[name]
    xs = jnp.arange(float(N))
    expected = jax.vmap(f, axis_name="i")(xs)
    assert_tree_allclose(chunkop.vmap(f, axis_name="i", chunk_size=chunk_size)(xs), expected)
    assert_tree_allclose(jax.jit(chunkop.vmap(f, axis_name="i", chunk_size=chunk_size))(xs), expected)


@pytest.mark.parametrize(
    "f",
    [lambda x: x * lax.axis_index("i"), lambda x: x - lax.pmean(x, "i"), lambda x: lax.psum(x, "i")],
)
def test_collectives_over_chunked_axis_raise(f):
    with pytest.raises(ValueError, match=r"chunkop\.vmap: `fun` uses the collective .* over axis_name='i'"):
        chunkop.vmap(f, axis_name="i", chunk_size=3)(jnp.arange(float(N)))


def test_collective_only_in_custom_jvp_rule_raises_clearly():
    @jax.custom_jvp
    def h(x):
        return jnp.sin(x)

    h.defjvp(lambda p, t: (h(p[0]), lax.psum(t[0], "i")))
    xs = jnp.arange(float(N))
    f = chunkop.vmap(h, axis_name="i", chunk_size=3)
    with pytest.raises(ValueError, match=r"collective `psum` over axis_name='i' \(in a custom_jvp/custom_vjp rule\)"):
        jax.jvp(f, (xs,), (jnp.ones(N),))
    # unchunked, it is jax.vmap's
    got = jax.jvp(chunkop.vmap(h, axis_name="i"), (xs,), (jnp.ones(N),))
    assert_tree_allclose(got, jax.jvp(jax.vmap(h, axis_name="i"), (xs,), (jnp.ones(N),)))


# -- low-precision sums -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_sum_and_mean_accumulate_in_float32(dtype):
    ones = jnp.ones(4096, dtype)
    total = chunkop.sum(lambda x: x, chunk_size=4)(ones)
    assert total.dtype == dtype and float(total) == 4096.0
    mean = chunkop.mean(lambda x: x, chunk_size=4)(ones)
    assert mean.dtype == dtype and float(mean) == 1.0
    assert float(jnp.sum(ones)) == 4096.0  # the reference agrees


def test_float16_sum_of_tenths():
    xs = jnp.full(20000, 0.1, jnp.float16)
    got = chunkop.sum(lambda x: x, chunk_size=4)(xs)
    expected = jnp.sum(xs)
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(float(got), float(expected), rtol=2e-3)
    np.testing.assert_allclose(float(got), 2000.0, rtol=2e-3)  # 2048 before the fix


@pytest.mark.parametrize("how", ["vmap_then_sum", "chunkop_sum"])
def test_gradient_wrt_bf16_parameter_accumulates_in_float32(how):
    w = jnp.ones((), jnp.bfloat16)
    xs = jnp.ones(4096, jnp.bfloat16)
    f = lambda w, x: w * x
    if how == "vmap_then_sum":
        loss = lambda w: chunkop.vmap(f, in_axes=(None, 0), chunk_size=4)(w, xs).sum()
    else:
        loss = lambda w: chunkop.sum(f, in_axes=(None, 0), chunk_size=4)(w, xs)
    ref = jax.grad(lambda w: jax.vmap(f, in_axes=(None, 0))(w, xs).sum())(w)
    g = jax.grad(loss)(w)
    assert g.dtype == jnp.bfloat16
    assert float(g) == float(ref) == 4096.0


# -- unmapped Python values reach fun as jax.vmap passes them -----------------------------------------


class Config:
    def __init__(self, depth):
        self.depth = depth


UNMAPPED = {
    "bool_branch": (lambda x, training: x * 2 if training else x, True),
    "int_shape": (lambda x, k: x.sum() + jnp.zeros(k).sum() + k, 5),
    "numpy_table": (lambda x, table: x * np.sum(table), np.arange(4.0)),
    "big_int": (lambda x, big: x * (big % 7), 2**40),
    "float": (lambda x, s: x * s, 0.25),
    "none": (lambda x, nothing: x if nothing is None else -x, None),
    "string": (lambda x, name: x * len(name), "abcd"),
    "object": (lambda x, cfg: x * cfg.depth, Config(3)),
}


@pytest.mark.parametrize("name", UNMAPPED)
@pytest.mark.parametrize("chunk_size", [3, None])
def test_unmapped_python_values(name, chunk_size):
    f, value = UNMAPPED[name]
    expected = jax.vmap(f, in_axes=(0, None))(X, value)
    got = chunkop.vmap(f, in_axes=(0, None), chunk_size=chunk_size)(X, value)
    assert_tree_allclose(got, expected, n_terms=X.shape[1])  # int_shape: x.sum() over 3 values
    if name in ("int_shape", "numpy_table", "float", "string"):
        total = chunkop.sum(f, in_axes=(0, None), chunk_size=chunk_size)(X, value)
        assert_tree_allclose(total, expected.sum(0), **_sum_tolerance(expected))


# -- what the caches keep alive ---------------------------------------------------------------------


def test_caches_do_not_keep_closures_alive():
    refs = []

    def run(i):
        big = jnp.full((262144,), float(i))  # 1 MiB closed over
        refs.append(weakref.ref(big))
        f = chunkop.vmap(lambda x: x * big[:3], chunk_size=CHUNK)
        return f(X)

    for i in range(20):
        run(i)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of 20 closed-over arrays are still alive"


@pytest.mark.parametrize("jac", [chunkop.jacrev, chunkop.jacfwd])
def test_eager_jacobians_compile_once_and_hold_no_residuals(jac):
    def f(x):
        return jnp.tanh(x @ x.T).ravel()

    x = _rand(16, 32, seed=5)
    J = jac(f, chunk_size=64)
    J(x + 0)
    gc.collect()
    live_before = sum(a.nbytes for a in jax.live_arrays())
    with CompileCounter() as compiles:
        for i in range(10):
            out = J(x + i)  # (x + 0 above compiled the addition)
    del out
    gc.collect()
    live_after = sum(a.nbytes for a in jax.live_arrays())
    assert compiles.count == 0
    assert live_after <= live_before + 2**16, (live_before, live_after)


def test_clear_caches():
    from chunkop import _cache

    f = chunkop.vmap(jnp.sin, chunk_size=CHUNK)
    f(X)
    assert len(_cache._LOOPS) > 0
    chunkop.clear_caches()
    assert len(_cache._LOOPS) == 0
    with CompileCounter() as compiles:
        assert_tree_allclose(f(X), jnp.sin(X))
    assert compiles.count > 0


def test_distinct_checkpoint_policies_are_distinct_keys():
    from chunkop._fingerprint import callable_key

    a = jax.checkpoint_policies.save_only_these_names("a")
    b = jax.checkpoint_policies.save_only_these_names("b")
    a2 = jax.checkpoint_policies.save_only_these_names("a")
    assert callable_key(a) != callable_key(b)
    assert callable_key(a) == callable_key(a2)


# -- custom rules -------------------------------------------------------------------------------


def test_custom_jvp_defined_per_call_uses_its_own_rule():
    """A custom_jvp rebuilt with a new closed-over value: derivatives use the new rule."""

    def make(scale):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)

        f.defjvp(lambda p, t: (f(p[0]), scale * t[0]))  # a deliberately "wrong" derivative
        return f

    xs = jnp.arange(float(N))
    for scale in (1.0, 3.0, jnp.float32(5.0)):
        f = make(scale)
        got = jax.grad(lambda x: chunkop.vmap(f, chunk_size=CHUNK)(x).sum())(xs)
        assert_tree_allclose(got, jax.grad(lambda x: jax.vmap(f)(x).sum())(xs))


def test_custom_jvp_rule_closing_over_enclosing_vmap_tracer():
    xs = jnp.arange(float(N))

    def per(c, V):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x) * c

        f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * c * t[0]))
        return jax.jvp(lambda x: V(f)(x), (xs,), (jnp.ones(N),))[1]

    cs = jnp.arange(2.0) + 1
    expected = jax.vmap(lambda c: per(c, jax.vmap))(cs)
    got = jax.vmap(lambda c: per(c, lambda f: chunkop.vmap(f, chunk_size=3)))(cs)
    assert_tree_allclose(got, expected)


def test_custom_vmap_rule_closing_over_a_value():
    def make(c):
        @jax.custom_batching.custom_vmap
        def g(x):
            return x * c

        @g.def_vmap
        def rule(axis_size, in_batched, x):
            return x * c, in_batched[0]

        return g

    xs = jnp.arange(float(N))
    for c in (jnp.float32(2.0), jnp.ones(()) * 3):
        assert_tree_allclose(chunkop.vmap(make(c), chunk_size=3)(xs), jax.vmap(make(c))(xs))


def _traces(seen):
    """The distinct calls ``seen`` records, in order, after checking that each was traced once
    (twice under ``jax_custom_vjp3``: its rematerialisation of a chunk traces the chunk again)."""
    distinct = list(dict.fromkeys(seen))
    times = 2 if chunkop._jaxpr.custom_vjp3() else 1
    assert seen == [call for call in distinct for _ in range(times)], seen
    return distinct


def _recording_custom_vmap(seen):
    """``sin(x) * w`` as a ``custom_vmap`` whose rule records what it is called with."""

    @jax.custom_batching.custom_vmap
    def g(x, w):
        return jnp.sin(x) * w

    @g.def_vmap
    def rule(axis_size, in_batched, x, w):
        seen.append((axis_size, tuple(in_batched), x.shape, jnp.shape(w)))
        return jnp.sin(x) * w, any(in_batched)

    return g


@pytest.mark.parametrize("w_axis", [None, 0])
def test_custom_vmap_rule_sees_one_chunk(w_axis):
    """The documented contract (docs/design.md, "custom_vmap rules see one chunk"): the rule's
    ``axis_size`` is the chunk's size, its arguments one chunk and its ``in_batched`` flags
    those of ``jax.vmap``. It is traced once per distinct chunk size: once for the full chunks
    (the loop body, however many chunks there are) and once for the remainder; the values are
    ``jax.vmap``'s, also under ``jax.grad`` and ``jax.jvp`` (which batch the same rule)."""
    xs = jnp.arange(float(N))
    w = xs + 1.0 if w_axis == 0 else jnp.float32(1.5)
    w_shape = lambda n: (n,) if w_axis == 0 else ()
    reference_seen = []
    expected = jax.vmap(_recording_custom_vmap(reference_seen), in_axes=(0, w_axis))(xs, w)
    assert reference_seen == [(N, (True, w_axis == 0), (N,), w_shape(N))]  # jax.vmap: the whole axis

    def chunked(seen):
        return chunkop.vmap(_recording_custom_vmap(seen), in_axes=(0, w_axis), chunk_size=CHUNK)

    seen = []
    assert_tree_allclose(chunked(seen)(xs, w), expected)
    # N=10 in chunks of 4: the two full chunks share one trace (axis_size 4), the remainder 2
    assert _traces(seen) == [(size, (True, w_axis == 0), (size,), w_shape(size)) for size in (CHUNK, N % CHUNK)]

    seen = []
    assert_tree_allclose(jax.jit(chunked(seen))(xs, w), expected)
    assert [s[0] for s in _traces(seen)] == [CHUNK, N % CHUNK]

    seen = []
    loss = lambda V: lambda x, w: jnp.sum(V(x, w) ** 2)
    got = jax.grad(loss(chunked(seen)), argnums=(0, 1))(xs, w)
    reference = jax.grad(loss(jax.vmap(_recording_custom_vmap([]), in_axes=(0, w_axis))), argnums=(0, 1))(xs, w)
    assert_tree_allclose(got, reference)
    assert sorted({s[0] for s in seen}) == [N % CHUNK, CHUNK]

    seen = []
    tangents = (jnp.ones(N), jnp.ones_like(w))
    got = jax.jvp(chunked(seen), (xs, w), tangents)
    assert_tree_allclose(got, jax.jvp(jax.vmap(_recording_custom_vmap([]), in_axes=(0, w_axis)), (xs, w), tangents))
    assert sorted({s[0] for s in seen}) == [N % CHUNK, CHUNK]


def test_custom_vmap_rule_sees_the_planned_chunk():
    """The chunk is the planned one (:func:`chunkop._chunking.make_plan`), which can be smaller
    than ``chunk_size``: 9 rows with ``chunk_size=4`` run as 3 chunks of 3 (no remainder), so
    the rule sees ``axis_size`` 3 only; ``chunk_size=None`` is ``jax.vmap`` (the whole axis)."""
    xs = jnp.arange(9.0)
    seen = []
    got = chunkop.vmap(_recording_custom_vmap(seen), in_axes=(0, None), chunk_size=4)(xs, 2.0)
    assert_tree_allclose(got, jnp.sin(xs) * 2.0)
    assert [s[0] for s in _traces(seen)] == [3]
    seen = []
    chunkop.vmap(_recording_custom_vmap(seen), in_axes=(0, None), chunk_size=None)(xs, 2.0)
    assert [s[0] for s in seen] == [9]


def test_custom_vjp3_flag_runs_forward_and_derivatives_with_and_without_remat():
    xs = jnp.arange(float(N))
    old = jax.config.jax_custom_vjp3
    jax.config.update("jax_custom_vjp3", True)
    try:

        @jax.custom_vjp
        def g(x):
            return jnp.sin(x)

        g.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (jnp.cos(x) * ct,))
        assert_tree_allclose(chunkop.vmap(g, chunk_size=3)(xs), jnp.sin(xs))  # forward runs, as jax.vmap
        assert_tree_allclose(jax.jit(chunkop.vmap(g, chunk_size=3))(xs), jnp.sin(xs))
        total = chunkop.sum(g, chunk_size="auto", memory_budget=1 << 20)(xs)
        assert_tree_allclose(total, jnp.sin(xs).sum(), **_sum_tolerance(jnp.sin(xs)))
        got = jax.grad(lambda x: chunkop.vmap(g, chunk_size=3)(x).sum())(xs)  # (tests/test_custom_vjp3.py)
        assert_tree_allclose(got, jnp.cos(xs))
        got = jax.grad(lambda x: chunkop.vmap(g, chunk_size=3, remat=False)(x).sum())(xs)
        assert_tree_allclose(got, jnp.cos(xs))
    finally:
        jax.config.update("jax_custom_vjp3", old)


# -- smaller ------------------------------------------------------------------------------------------


def test_remat_policy_used_when_given():
    """(Callables that are not checkpoint policies are refused: see tests/test_vmap_errors.py.)"""
    for policy in (jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names("h")):
        assert_tree_allclose(chunkop.vmap(jnp.sin, chunk_size=CHUNK, remat=policy)(X), jnp.sin(X))


@pytest.mark.parametrize("chunk_size", [3, None])
def test_numpy_int_axes_on_every_path(chunk_size):
    f = chunkop.vmap(lambda x, w: x * w, in_axes=(np.int64(1), None), out_axes=np.int32(-1), chunk_size=chunk_size)
    got = f(X.T, 2.0)
    assert_tree_allclose(got, jax.vmap(lambda x, w: x * w, in_axes=(1, None), out_axes=-1)(X.T, 2.0))


def test_map_errors_name_only_its_own_arguments():
    with pytest.raises(ValueError, match=r"chunkop\.map: mapped arguments have different sizes.*xs\['s'\]") as e:
        chunkop.map(lambda t: t["x"], {"x": X, "s": jnp.ones(3)}, chunk_size=2)
    assert "args" not in str(e.value) and "in_axes" not in str(e.value)
    with pytest.raises(TypeError, match=r"chunkop\.map: argument xs\['s'\] is mapped") as e:
        chunkop.map(lambda t: t["x"], {"x": X, "s": "str"}, chunk_size=2)
    assert "in_axes" not in str(e.value)


# -- the fingerprint itself ----------------------------------------------------------------------


def _key(f, *args):
    from chunkop._fingerprint import jaxpr_key

    return jaxpr_key(jax.make_jaxpr(f)(*args).jaxpr)


def test_fingerprint_equal_for_equal_traces_and_distinct_otherwise():
    x = jnp.ones(3)
    w1, w2 = jnp.ones(3), jnp.zeros(3)
    assert _key(lambda x: jnp.sin(x) * w1, x) == _key(lambda x: jnp.sin(x) * w2, x)  # consts: by aval
    assert _key(lambda x: x * 2.0, x) != _key(lambda x: x * 3.0, x)  # literals: by value
    assert _key(lambda x: jnp.sin(x), x) != _key(lambda x: jnp.cos(x), x)
    assert _key(lambda x: x[:2], x) != _key(lambda x: x[1:], x)  # parameters
    assert _key(lambda x: x + 1, x) != _key(lambda x: x + 1, x.astype(jnp.int32))  # avals
    # a library custom_jvp (relu) keys equal across traces: eager calls keep their cache hits
    assert _key(jax.nn.relu, x) == _key(jax.nn.relu, x)


def test_functions_with_library_custom_jvp_compile_once():
    f = chunkop.vmap(lambda x: jax.nn.relu(x) + jax.nn.softplus(x), chunk_size=CHUNK)
    f(X)
    x1 = X + 1
    with CompileCounter() as compiles:
        got = f(x1)
    assert compiles.count == 0
    assert_tree_allclose(got, jax.nn.relu(x1) + jax.nn.softplus(x1))
