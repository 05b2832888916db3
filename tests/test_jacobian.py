"""``chunkop.jacrev`` / ``chunkop.jacfwd`` equal ``jax.jacrev`` / ``jax.jacfwd``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _params import grid
from conftest import assert_tree_allclose

import chunkop

# 12 outputs and 12 (argnums=0), 1 (-1), 13 or 17 inputs: chunk 4 divides 12, 10 leaves a
# remainder (12 = 10 + 2; 13 and 17 with any chunk), 100 > size (plain jax.vmap of the basis).
# Each eager call of chunkop.jacrev/jacfwd compiles its chunk loop afresh (~1 s), so the matrix
# is kept small.
CHUNKS = [4, 10, 100]
PAIRS = {"rev": (chunkop.jacrev, jax.jacrev), "fwd": (chunkop.jacfwd, jax.jacfwd)}


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


D = {"u": _rand(3, 2, seed=1), "v": _rand(6, seed=2)}
S = _rand(4, seed=3)
T = np.float32(0.7)


# The longest sum in f_tree or its derivatives: s.sum() has 4 terms, the gradient w.r.t. s
# sums over b's 6 entries. chunkop's jacobians batch the same rows as jax's, in other widths.
F_TREE_TERMS = 6


def f_tree(d, s, t):
    """Pytree in (12 + 4 + 1 inputs), pytree out (6 + 6 = 12 outputs)."""
    a = jnp.tanh(d["u"] @ d["u"].T[:, :2] * t) + s[:2]  # (3, 2)
    b = jnp.sin(d["v"] * s.sum()) * t**2  # (6,)
    return {"a": a, "b": (b[:3], b[3:] * d["u"][:, 0])}


# every pair of (mode, argnums, chunk) values
@pytest.mark.parametrize(
    ("mode", "argnums", "chunk_size"), grid(sorted(PAIRS), [0, -1, (0, 2), (2, 0, 1)], CHUNKS, ids=str)
)
def test_matches_jax(mode, argnums, chunk_size):
    ours, theirs = PAIRS[mode]
    expected = jax.jit(theirs(f_tree, argnums=argnums))(D, S, T)  # one compile, not one per operation
    actual = ours(f_tree, argnums=argnums, chunk_size=chunk_size)(D, S, T)
    assert_tree_allclose(actual, expected, n_terms=F_TREE_TERMS)


@pytest.mark.parametrize("chunk_size", [3])
@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_array_in_array_out_and_scalars(mode, chunk_size):
    ours, theirs = PAIRS[mode]
    x = _rand(7, seed=4)
    for fun, arg in [
        (lambda x: jnp.sin(x) * x.sum(), x),  # (7,) -> (7,)
        (lambda x: jnp.sum(x**3), x),  # (7,) -> ()
        (lambda s: jnp.sin(s * x), np.float32(2.0)),  # () -> (7,)
        (lambda m: m @ m.T, _rand(3, 4, seed=5)),  # (3, 4) -> (3, 3)
    ]:
        assert_tree_allclose(ours(fun, chunk_size=chunk_size)(arg), theirs(fun)(arg), n_terms=x.size)


@pytest.mark.parametrize("chunk_size", [5])
@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_has_aux_and_kwargs(mode, chunk_size):
    ours, theirs = PAIRS[mode]

    def fun(d, s, *, scale):
        out = f_tree(d, s, T)
        return jax.tree.map(lambda o: o * scale, out), {"norm": jnp.sum(d["v"] ** 2), "s": s}

    expected = theirs(fun, argnums=(0, 1), has_aux=True)(D, S, scale=2.5)
    actual = ours(fun, argnums=(0, 1), has_aux=True, chunk_size=chunk_size)(D, S, scale=2.5)
    assert_tree_allclose(actual, expected, n_terms=F_TREE_TERMS)


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_numpy_integer_argnums(mode):
    ours, theirs = PAIRS[mode]
    expected = theirs(f_tree, argnums=1)(D, S, T)
    assert_tree_allclose(ours(f_tree, argnums=np.int64(1), chunk_size=5)(D, S, T), expected, n_terms=F_TREE_TERMS)


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_under_jit_and_vmap(mode):
    ours, theirs = PAIRS[mode]
    ss = np.stack([S, 2 * S, -S])
    expected = jax.vmap(theirs(f_tree, argnums=(0, 1)), in_axes=(None, 0, None))(D, ss, T)
    actual = jax.jit(jax.vmap(ours(f_tree, argnums=(0, 1), chunk_size=5), in_axes=(None, 0, None)))(D, ss, T)
    assert_tree_allclose(actual, expected, n_terms=F_TREE_TERMS)


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_grad_of_jacobian(mode):
    ours, theirs = PAIRS[mode]

    def loss(jac):
        return lambda d, s: sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(jac(f_tree, argnums=(0, 1))(d, s, T)))

    expected = jax.jit(jax.grad(loss(theirs), argnums=(0, 1)))(D, S)
    actual = jax.jit(jax.grad(loss(lambda f, argnums: ours(f, argnums=argnums, chunk_size=5)), argnums=(0, 1)))(D, S)
    assert_tree_allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_hessian_from_chunked_jacobians():
    fun = lambda x: jnp.sum(jnp.sin(x) * jnp.roll(x, 1) ** 2)
    x = _rand(9, seed=6)
    expected = jax.hessian(fun)(x)
    # x_i enters two terms of the sum: a Hessian entry sums at most a few products
    assert_tree_allclose(chunkop.jacfwd(chunkop.jacrev(fun, chunk_size=4), chunk_size=2)(x), expected, n_terms=3)
    assert_tree_allclose(chunkop.jacrev(chunkop.jacfwd(fun, chunk_size=5), chunk_size=3)(x), expected, n_terms=3)


def test_finite_differences():
    x = _rand(5, seed=7)
    fun = lambda x: jnp.tanh(jnp.outer(x, x)).sum(1)
    eps = 1e-2
    fd = np.stack([(fun(x + eps * e) - fun(x - eps * e)) / (2 * eps) for e in np.eye(5, dtype=np.float32)], 1)
    np.testing.assert_allclose(chunkop.jacrev(fun, chunk_size=2)(x), fd, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(chunkop.jacfwd(fun, chunk_size=2)(x), fd, rtol=2e-3, atol=2e-3)


def test_complex_inputs_to_jacrev_and_outputs_of_jacfwd():
    z = (_rand(4, seed=8) + 1j * _rand(4, seed=9)).astype(np.complex64)
    assert_tree_allclose(
        chunkop.jacrev(lambda z: jnp.abs(z) ** 2, chunk_size=3)(z), jax.jacrev(lambda z: jnp.abs(z) ** 2)(z)
    )
    x = _rand(4, seed=10)
    g = lambda x: x * (1 + 2j)
    assert_tree_allclose(chunkop.jacfwd(g, chunk_size=3)(x), jax.jacfwd(g)(x))


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_empty_jacobians(mode):
    """Zero outputs (jacrev) or zero inputs (jacfwd): an empty Jacobian, not an IndexError."""
    ours, theirs = PAIRS[mode]
    x = _rand(5, seed=11)
    for fun, arg in [(lambda x: x[:0] * 2, x), (lambda x: jnp.ones(3) * x.sum(), x[:0])]:
        assert_tree_allclose(ours(fun, chunk_size=2)(arg), theirs(fun)(arg))


def test_wraps():
    def energy(x):
        """Energy."""
        return jnp.sum(x**2)

    for jac in (chunkop.jacrev, chunkop.jacfwd):
        j = jac(energy, chunk_size=2)
        assert j.__name__ == "energy" and j.__doc__ == "Energy." and j.__wrapped__ is energy
