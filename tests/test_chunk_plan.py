"""The chunk plan: chunks never exceed ``chunk_size``, cover the axis exactly, and are made equal
(no remainder chunk to trace and compile) when a divisor of the axis lies in ``[3/4 chunk, chunk]``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_tree_allclose

import chunkop
from chunkop._chunking import make_plan


def _count_primitive(jaxpr, name: str) -> int:
    """How many equations of primitive ``name`` the (closed) jaxpr holds, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(item, "eqns") or (hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns")):
                    count += _count_primitive(item, name)
    return count


@pytest.mark.parametrize("size", [0, 1, 2, 7, 23, 30, 64, 97, 100, 1000, 20000, 132400])
@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 64, 4096])
def test_plan_covers_the_axis_with_chunks_no_larger_than_asked(size, chunk):
    plan = make_plan(size, chunk)
    assert plan.size == size
    assert 1 <= plan.chunk <= max(1, min(chunk, size))
    assert plan.n_full * plan.chunk + plan.rem == size
    assert 0 <= plan.rem < plan.chunk
    asked = max(1, min(chunk, size))
    divisors = [d for d in range(1, asked + 1) if size % d == 0 and 4 * d >= 3 * asked]
    if divisors:  # equal chunks, as large as possible
        assert (plan.rem, plan.chunk) == (0, max(divisors))
    else:  # the asked chunk and a remainder
        assert plan.chunk == asked


@pytest.mark.parametrize(
    ("n", "chunk", "bodies"),
    [
        (30, 8, 1),  # 5 chunks of 6: one body
        (31, 8, 2),  # 31 is prime: 3 chunks of 8 and a remainder of 7: two bodies
        (32, 8, 1),
    ],
)
def test_equal_chunks_trace_the_body_once(n, chunk, bodies):
    x = jnp.linspace(0.0, 1.0, n)
    f = chunkop.vmap(jnp.sin, chunk_size=chunk)
    assert _count_primitive(jax.make_jaxpr(f)(x), "sin") == bodies
    assert_tree_allclose(f(x), jnp.sin(x))
    g = jax.grad(lambda x: chunkop.sum(lambda v: jnp.sin(v) ** 2, chunk_size=chunk)(x))
    assert_tree_allclose(g(x), jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x))  # elementwise


def test_row_operator_uses_equal_chunks():
    rows = jnp.arange(30) % 7
    x_struct = jax.ShapeDtypeStruct((7,), jnp.float32)
    op = chunkop.RowOperator(lambda r, x: jnp.sin(1.0 + r) * x[r], rows, x_struct, chunk_size=8)
    x = jnp.arange(7.0)
    assert _count_primitive(jax.make_jaxpr(op.mv)(x), "sin") == 1
    assert_tree_allclose(op.mv(x), jnp.sin(1.0 + rows) * x[rows])
    assert_tree_allclose(op.as_matrix() @ x, op.mv(x), n_terms=7)  # a row of the matrix: 7 columns
