"""Temp memory of chunked programs does not grow with the mapped axis.

Measured with ``jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes``,
which is deterministic on CPU. Arguments are ``jax.ShapeDtypeStruct``s: nothing big is ever
allocated or executed. The model is a per-example 4-layer MLP loss (128 -> 512 -> 512 -> 512
-> 10); from N = 4096 to N = 65536 (16x) the chunked programs' temp memory grows by at most
10% (the only O(N) temporaries are the (N,) per-example loss vector and its cotangent), while
``jax.vmap`` and ``remat=False`` grow roughly 16x, so the bounds are not vacuous.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_tree_allclose

import chunkop

SMALL, LARGE = 4096, 65536
CHUNK = 256
SIZES = [128, 512, 512, 512, 10]
PARAMS = [
    (jax.ShapeDtypeStruct((a, b), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32))
    for a, b in zip(SIZES[:-1], SIZES[1:])
]


def loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return -jax.nn.log_softmax(h @ w + b)[y]


def data(n):
    return jax.ShapeDtypeStruct((n, SIZES[0]), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32)


@functools.cache
def temp_bytes(program: str, mapper: str, n: int) -> int:
    if mapper == "jax":
        per_example = jax.vmap(loss, (None, 0, 0))
    elif mapper == "no_remat":
        per_example = chunkop.vmap(loss, (None, 0, 0), chunk_size=CHUNK, remat=False)
    else:
        per_example = chunkop.vmap(loss, (None, 0, 0), chunk_size=CHUNK)
    total = lambda p, x, y: per_example(p, x, y).sum()
    if program == "grad":
        f = jax.grad(total)
        args = (PARAMS, *data(n))
    elif program == "jvp":
        f = lambda p, t, x, y: jax.jvp(lambda p: per_example(p, x, y), (p,), (t,))
        args = (PARAMS, PARAMS, *data(n))
    elif program == "hvp":
        f = lambda p, t, x, y: jax.jvp(jax.grad(lambda p: total(p, x, y)), (p,), (t,))[1]
        args = (PARAMS, PARAMS, *data(n))
    elif program == "sum_grad":
        assert mapper == "chunkop"
        f = jax.grad(chunkop.sum(loss, (None, 0, 0), chunk_size=CHUNK))
        args = (PARAMS, *data(n))
    else:  # pragma: no cover
        raise ValueError(program)
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def growth(program, mapper):
    return temp_bytes(program, mapper, LARGE) / temp_bytes(program, mapper, SMALL)


@pytest.mark.parametrize("program", ["grad", "jvp", "hvp"])
def test_chunked_temp_memory_is_flat_in_n(program):
    small, large = temp_bytes(program, "chunkop", SMALL), temp_bytes(program, "chunkop", LARGE)
    assert large <= 1.1 * small, (program, small / 2**20, large / 2**20)
    # the 10% slack is (at most) the O(N) per-example outputs and their cotangents
    assert large - small <= 4 * 4 * (LARGE - SMALL), (program, small, large)


def test_chunkop_sum_grad_temp_memory_is_flat_in_n():
    small, large = temp_bytes("sum_grad", "chunkop", SMALL), temp_bytes("sum_grad", "chunkop", LARGE)
    assert large <= 1.02 * small, (small / 2**20, large / 2**20)


@pytest.mark.parametrize("mapper", ["jax", "no_remat"])
def test_unbounded_baselines_grow(mapper):
    """Without rematerialisation the residuals of every chunk are stored: ~16x growth."""
    assert growth("grad", mapper) > 8, (mapper, growth("grad", mapper))
    assert temp_bytes("grad", mapper, LARGE) > 50 * temp_bytes("grad", "chunkop", LARGE)


def test_remainder_does_not_copy_the_mapped_inputs():
    """With n % chunk_size != 0 the full chunks are read by index inside the checkpoint: no copy
    of the inputs (one would be LARGE * 129 * 4 bytes, about 32 MiB); only the remainder's own chunk
    and the (n,) loss vector are added."""
    n = LARGE + 100
    x, y = data(n)
    f = jax.grad(lambda p, x, y: chunkop.vmap(loss, (None, 0, 0), chunk_size=CHUNK)(p, x, y).sum())
    with_rem = jax.jit(f).lower(PARAMS, x, y).compile().memory_analysis().temp_size_in_bytes
    copy = LARGE * (SIZES[0] * 4 + 4)  # what x[:cut] and y[:cut] would cost
    base = temp_bytes("grad", "chunkop", LARGE)
    assert with_rem <= base + 0.1 * copy, (base / 2**20, with_rem / 2**20)


@pytest.mark.parametrize("chunk", [256, 240])  # divides 4096; leaves a remainder of 16
def test_enclosing_vmap_does_not_copy_the_batched_inputs(chunk):
    """Under an enclosing ``jax.vmap`` over 8 sets of (4096, 64) inputs (8 MiB), the chunks are
    read by index: no copy of the batched inputs, whether or not the chunk divides the axis (a
    scan over a reshape would cost 16 MiB there, the scan's batching rule moving the batch axis).
    Values: ``jax.vmap`` of the unchunked sum."""
    w = jnp.linspace(-0.05, 0.05, 64 * 64).reshape(64, 64)
    xs = jnp.linspace(-1.0, 1.0, 8 * 4096 * 64).reshape(8, 4096, 64)
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    s = chunkop.sum(f, in_axes=(None, 0), chunk_size=chunk)
    batched = jax.vmap(lambda x: s(w, x))
    grad_batched = jax.vmap(jax.grad(lambda x: s(w, x)))
    inputs = xs.size * 4
    for program in (batched, grad_batched):
        temp = jax.jit(program).lower(xs).compile().memory_analysis().temp_size_in_bytes
        assert temp <= inputs // 4, (program, temp / 2**20)
    ref = jax.vmap(lambda x: jnp.sum(jax.vmap(f, (None, 0))(w, x)))(xs)
    terms = jnp.tanh(xs @ w).reshape(8, -1).T  # every summand of each set's sum, along axis 0
    assert_tree_allclose(batched(xs), ref, terms=terms, depth=64)  # (each a tanh of a 64-term dot)
