"""Property test: random sizes, shapes, in_axes, out_axes and chunk sizes; values and
gradients of ``chunkop.vmap`` equal those of ``jax.vmap``.

Deterministic (``derandomize=True``, no example database) and small (25 examples).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_tree_allclose
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkop


@st.composite
def problems(draw):
    n = draw(st.integers(0, 40))
    nargs = draw(st.integers(1, 3))
    shapes, in_axes, full_shapes = [], [], []
    for _ in range(nargs):
        rank = draw(st.integers(0, 2))
        shape = tuple(draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
        mapped = draw(st.sampled_from([True, True, False]))  # mostly mapped
        axis = draw(st.integers(-(rank + 1), rank)) if mapped else None
        full = list(shape)
        if axis is not None:
            full.insert(axis % (rank + 1), n)
        shapes.append(shape)
        in_axes.append(axis)
        full_shapes.append(tuple(full))
    any_mapped = any(a is not None for a in in_axes)
    # outputs: one per argument (rank of that argument), plus a scalar from unmapped arguments
    out_axes = []
    for shape in shapes:
        r = len(shape) + 1
        out_axes.append(draw(st.integers(-r, r - 1)))
    const_axis = draw(st.sampled_from([None, 0]))
    # mostly chunk_size < n (the chunked path), sometimes None or >= n (plain jax.vmap)
    mode = draw(st.sampled_from(["chunked", "chunked", "chunked", "none", "at_least_n"]))
    if mode == "chunked" and n > 1:
        chunk_size = draw(st.integers(1, n - 1))
    elif mode == "none":
        chunk_size = None
    else:
        chunk_size = draw(st.integers(max(n, 1), n + 5))
    remat = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dict(
        n=n,
        shapes=shapes,
        full_shapes=full_shapes,
        in_axes=tuple(in_axes),
        out_axes=(tuple(out_axes), const_axis),
        axis_size=None if any_mapped else n,
        chunk_size=chunk_size,
        remat=remat,
        seed=seed,
    )


def fun(*args):
    s = sum(jnp.sum(jnp.sin(a)) for a in args)
    per_arg = tuple(jnp.cos(a) * s + a**2 for a in args)
    return per_arg, jnp.float32(1.5)  # the constant may have out_axes None


@settings(
    max_examples=12,  # ~1 s each on one CPU core
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(problems())
def test_values_and_grads_match_jax_vmap(p):
    rng = np.random.default_rng(p["seed"])
    args = tuple(rng.normal(size=s).astype(np.float32) for s in p["full_shapes"])
    kw = dict(in_axes=p["in_axes"], out_axes=p["out_axes"], axis_size=p["axis_size"])
    ref_f = jax.vmap(fun, **kw)
    got_f = chunkop.vmap(fun, chunk_size=p["chunk_size"], remat=p["remat"], **kw)

    # values and gradients of each side in one jitted call (one compile, not one per operation)
    out_shape = jax.eval_shape(ref_f, *args)
    cotangent = jax.tree.map(lambda o: rng.normal(size=o.shape).astype(np.float32), out_shape)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_vjp(f, *a):
        out, vjp = jax.vjp(f, *a)
        return out, vjp(cotangent)

    (ref_out, ref_grads), (got_out, got_grads) = value_and_vjp(ref_f, *args), value_and_vjp(got_f, *args)
    # fun's longest sum: s, over the elements of one example's arguments
    assert_tree_allclose(got_out, ref_out, n_terms=sum(int(np.prod(s)) for s in p["shapes"]))
    assert_tree_allclose(got_grads, ref_grads, rtol=1e-4, atol=1e-4)
