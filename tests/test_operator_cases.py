"""Every problem of the shared registry (``operator_registry.CASES``) against its references.

For each case: ``mv`` against ``jax.vmap`` of ``row_fn``, ``T.mv`` against its
``jax.linear_transpose``, ``as_matrix`` against the dense Jacobian, and derivatives of losses
through ``mv`` and ``T.mv`` w.r.t. the vector and the parameter ``p`` (which enters through
``rows`` or through ``row_fn``'s closure) under ``grad``, ``jit``, ``jvp`` and ``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose
from jax.flatten_util import ravel_pytree
from operator_registry import CASES

IDS = list(CASES)


def _loss(out, w):
    """A real, non-linear scalar loss of a (possibly complex, pytree) output."""
    terms = [
        jnp.sum(jnp.real(jnp.conj(b) * a)) + 0.3 * jnp.sum(jnp.sin(jnp.real(a)) + jnp.abs(a) ** 2)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(w))
    ]
    return sum(terms)


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("chunk", [3, 100])
def test_values(name, chunk):
    case = CASES[name]
    A, x, y = case.op(chunk=chunk), case.x(), case.y()
    assert_tree_allclose(A.mv(x), case.ref_mv(case.p, x), rtol=1e-5, atol=1e-5)
    assert_tree_allclose(A.T.mv(y), case.ref_T(case.p, y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(A.as_matrix(), case.dense(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("kind", ["mv", "T"])
def test_grad_wrt_parameter_and_vector(name, kind):
    """d/dp and d/dv of a loss of ``A(p) v`` (or ``A(p)^T v``), under jit, against jax.vmap's."""
    case = CASES[name]
    v = case.x() if kind == "mv" else case.y()
    w = case.y(5) if kind == "mv" else case.x(5)

    def chunked(p, v):
        A = case.op(p)
        return _loss(A.mv(v) if kind == "mv" else A.T.mv(v), w)

    def reference(p, v):
        return _loss(case.ref_mv(p, v) if kind == "mv" else case.ref_T(p, v), w)

    expected = jax.grad(reference, argnums=(0, 1))(case.p, v)
    assert_tree_allclose(jax.jit(jax.grad(chunked, argnums=(0, 1)))(case.p, v), expected, rtol=2e-4, atol=2e-4)
    # forward mode along a random direction of (p, v)
    dp = jax.tree_util.tree_map(lambda a: 0.01 * jnp.ones_like(a), case.p)
    dv = jax.tree_util.tree_map(lambda a: 0.5 * jnp.ones_like(a), v)
    _, t = jax.jvp(chunked, (case.p, v), (dp, dv))
    _, t_ref = jax.jvp(reference, (case.p, v), (dp, dv))
    np.testing.assert_allclose(t, t_ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", IDS)
def test_vmap_over_parameter(name):
    """A batch of operators (the closed-over or row parameter is a vmap tracer)."""
    case = CASES[name]
    ps = jax.tree_util.tree_map(lambda a: jnp.stack([a, 1.1 * a]), case.p)
    x, y = case.x(), case.y()
    got = jax.vmap(lambda p: (case.op(p).mv(x), case.op(p).T.mv(y)))(ps)
    want = jax.vmap(lambda p: (case.ref_mv(p, x), case.ref_T(p, y)))(ps)
    assert_tree_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["closed_arrays", "closed_scalar", "pytree"])
def test_hessian_vector_product_wrt_parameter(name):
    case = CASES[name]
    x, w = case.x(), case.y(5)
    flat_p, unravel = ravel_pytree(case.p)

    def make(use_ref):
        def f(fp):
            p = unravel(fp)
            return _loss(case.ref_mv(p, x) if use_ref else case.op(p).mv(x), w)

        return f

    t = jnp.linspace(0.1, 0.2, flat_p.size, dtype=flat_p.dtype)
    hvp = lambda f: jax.jvp(jax.grad(f), (flat_p,), (t,))[1]
    np.testing.assert_allclose(jax.jit(lambda: hvp(make(False)))(), hvp(make(True)), rtol=2e-4, atol=2e-4)
