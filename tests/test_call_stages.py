"""A call's stages: checks -> ``fun`` traced once -> plan -> one compiled loop.

``chunk_size="auto"`` plans on the program the call runs (the loop built from the one trace of
``fun``), so unmapped Python numbers, NumPy tables and shapes reach ``fun`` as under
``jax.vmap``; enclosing ``jax.vmap``s count against the budget; unmapped concrete arrays may
steer Python control flow; ``chunk_size=None`` is exactly ``jax.vmap``. Each test compares with
``jax.vmap`` on the same arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose, temp_bytes

import chunkop

X = jnp.linspace(-1.0, 1.0, 64)


def _control_flow(xi, scale, table, w):
    """Python control flow on every kind of unmapped argument (as jax.vmap allows)."""
    if scale > 0 and table.shape[0] == 3 and float(w.sum()) > 0:
        return xi * scale + table[0] + w[0]
    return -xi


ARGS = (X, 2.0, np.arange(3.0), jnp.ones(2))
IN_AXES = (0, None, None, None)


@pytest.mark.parametrize("chunk_size", ["auto", 5])
def test_unmapped_python_values_in_control_flow(chunk_size):
    budget = 1 << 12 if chunk_size == "auto" else None
    ours = chunkop.vmap(_control_flow, in_axes=IN_AXES, chunk_size=chunk_size, memory_budget=budget)(*ARGS)
    assert_tree_allclose(ours, jax.vmap(_control_flow, in_axes=IN_AXES)(*ARGS))


def test_unmapped_concrete_array_in_control_flow_under_grad():
    def loss(x):
        return chunkop.sum(_control_flow, in_axes=IN_AXES, chunk_size=5)(x, *ARGS[1:])

    ref = jax.grad(lambda x: jax.vmap(_control_flow, in_axes=IN_AXES)(x, *ARGS[1:]).sum())(X)
    assert_tree_allclose(jax.grad(loss)(X), ref)  # elementwise: d/dx_i is example i's alone


@pytest.mark.parametrize(("chunk_size", "budget"), [("auto", 1 << 17), ("auto", 1 << 30), (8, None)])
def test_fun_is_traced_once_per_call(chunk_size, budget):
    traces = []

    def fun(xi):
        traces.append(1)
        return jnp.tanh(jnp.outer(xi, xi)).sum(0)  # a (32, 32) intermediate per example

    xs = jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32)
    f = chunkop.vmap(fun, chunk_size=chunk_size, memory_budget=budget)
    assert_tree_allclose(f(xs), jax.vmap(fun)(xs), n_terms=32)  # each output sums 32 values
    assert len(traces) == 2, f"fun traced {len(traces) - 1} times in one call"  # one by jax.vmap here
    if budget == 1 << 17:
        assert f.last_plan.chunk is not None and f.last_plan.chunk < 64  # planned to chunk
    elif budget == 1 << 30:
        assert f.last_plan.chunk is None  # the whole axis fits: one chunk, fun not traced again


@pytest.mark.parametrize("budget", [1 << 12, 1 << 30])
def test_row_fn_is_traced_once_per_build(budget):
    """A ``RowOperator`` built with ``chunk_size="auto"`` plans on its one trace of ``row_fn``
    (every candidate chunk evaluates it); the operator is the dense matrix."""
    traces = []
    n, npix = 200, 64
    idx = (jnp.arange(n * 4, dtype=jnp.int32) * 7 % npix).reshape(n, 4)
    w = jnp.linspace(0.5, 1.5, n * 4).reshape(n, 4)

    def row_fn(r, x):
        traces.append(1)
        return jnp.dot(jnp.exp(-r["w"]), x[r["idx"]])

    rows = {"idx": idx, "w": w}
    A = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((npix,), jnp.float32), memory_budget=budget)
    assert len(traces) == 1, f"row_fn traced {len(traces)} times in one build"
    chunkop.clear_caches()
    traces.clear()
    chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((npix,), jnp.float32), memory_budget=budget)
    assert len(traces) == 1, f"row_fn traced {len(traces)} times in one build that planned again"
    if budget == 1 << 12:
        assert A.chunk_size < n, A.chunk_size  # planned to chunk
    M = np.zeros((n, npix), np.float32)
    np.add.at(M, (np.repeat(np.arange(n), 4), np.asarray(idx).ravel()), np.exp(-np.asarray(w)).ravel())
    x = jnp.linspace(-1.0, 1.0, npix)
    assert_tree_allclose(A.mv(x), M @ np.asarray(x), n_terms=4)
    assert_tree_allclose(A.T.mv(jnp.ones(n)), M.T @ np.ones(n, np.float32), terms=M)  # column sums


def test_auto_counts_an_enclosing_vmap_against_the_budget():
    """NIFTy.re vmaps the response over samples: 16 samples share one budget."""
    budget = 1 << 22
    g = chunkop.sum(
        lambda xi, w: jnp.sin(jnp.outer(w, xi)).sum(), in_axes=(0, None), chunk_size="auto", memory_budget=budget
    )
    xs, ws = jnp.ones((4096, 8)), jnp.ones((16, 64))
    batched = jax.vmap(g, in_axes=(None, 0))
    temp = temp_bytes(batched, xs, ws)
    assert temp <= budget, f"{temp / 2**20:.1f} MiB under a 16-sample vmap, budget {budget / 2**20:.0f} MiB"
    np.testing.assert_allclose(
        batched(xs, ws), jax.vmap(lambda w: jnp.sin(jnp.einsum("i,nj->nij", w, xs)).sum())(ws), rtol=1e-4
    )
    assert g.last_plan.budget == budget // 16


def test_chunk_none_is_jax_vmap_with_collectives():
    f = lambda v: v / jax.lax.psum(v, "i") * jax.lax.axis_size("i")
    assert_tree_allclose(chunkop.vmap(f, axis_name="i")(X + 2.0), jax.vmap(f, axis_name="i")(X + 2.0), n_terms=X.size)


def test_plan_of_auto_transform_equals_what_the_call_uses():
    f = chunkop.mean(lambda xi, s: jnp.tanh(xi * s) ** 2, in_axes=(0, None), chunk_size="auto", memory_budget=1 << 12)
    planned = chunkop.plan(f, X, 3.0)
    assert_tree_allclose(f(X, 3.0), jnp.mean(jnp.tanh(X * 3.0) ** 2), n_terms=X.size)
    assert f.last_plan == planned


# -- arguments (issue #15, items 11 and 14) -------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: chunkop.vmap(jnp.sin, chunk_size=4, memory_budget=1 << 20),
        lambda: chunkop.sum(jnp.sin, chunk_size=None, memory_budget=1 << 20),
        lambda: chunkop.RowOperator(
            lambda r, x: r * x[0], jnp.ones(3), jax.ShapeDtypeStruct((2,), jnp.float32), chunk_size=2, memory_budget=64
        ),
    ],
)
def test_memory_budget_without_auto_is_refused(make):
    with pytest.raises(ValueError, match=r"memory_budget.*only with chunk_size=\"auto\""):
        make()


def test_fractional_budget_below_one_byte_is_refused():
    with pytest.raises(ValueError, match=r"memory_budget.*at least 1.*0\.5"):
        chunkop.vmap(jnp.sin, chunk_size="auto", memory_budget=0.5)


@pytest.mark.parametrize("jac", ["jacrev", "jacfwd"])
def test_plan_of_auto_jacobians_is_the_call_plan(jac):
    f = lambda x: jnp.tanh(jnp.outer(x, x)).sum(0)
    x = jnp.linspace(0.0, 1.0, 128)
    J = getattr(chunkop, jac)(f, chunk_size="auto", memory_budget=1 << 21)
    planned = chunkop.plan(J, x)
    assert planned.chunk is not None and planned.chunk < 128
    ours, ref = J(x), getattr(jax, jac)(f)(x)
    diag = np.eye(x.size, dtype=bool)  # J[j, j] sums 128 terms (the matmul's transpose); the rest one
    assert_tree_allclose(ours[diag], ref[diag], n_terms=x.size)
    assert_tree_allclose(ours[~diag], ref[~diag])
    assert J.last_plan == planned


@pytest.mark.parametrize("jac", ["jacrev", "jacfwd"])
def test_holomorphic_jacobians(jac):
    f = lambda z: jnp.sin(z) * z[::-1] ** 2
    z = jnp.array([1 + 2j, 0.5 - 1j, 2 + 0.1j], jnp.complex64)
    ours = getattr(chunkop, jac)(f, chunk_size=2, holomorphic=True)(z)
    assert_tree_allclose(ours, getattr(jax, jac)(f, holomorphic=True)(z), n_terms=2)  # z[1]: two terms
    with pytest.raises(TypeError, match="holomorphic=True requires complex arguments"):
        getattr(chunkop, jac)(f, chunk_size=2, holomorphic=True)(jnp.ones(3))


def test_row_operator_with_no_rows_under_auto():
    rows = {"idx": jnp.zeros((0,), jnp.int32), "w": jnp.zeros((0,))}
    A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["idx"]], rows, jax.ShapeDtypeStruct((4,), jnp.float32))
    assert A.mv(jnp.ones(4)).shape == (0,)
    np.testing.assert_array_equal(A.T.mv(jnp.ones(0)), jnp.zeros(4))
    np.testing.assert_array_equal(jax.grad(lambda x: A.mv(x).sum())(jnp.ones(4)), jnp.zeros(4))


def test_custom_vjp_closing_over_the_mapped_value_on_concrete_arguments():
    """A custom_vjp defined in ``fun`` closing over the mapped value and called on a concrete
    argument: folding concrete values while tracing would run it eagerly with this trace's
    tracer in its closure (UnexpectedTracerError); the trace is redone without folding, and the
    result is ``jax.vmap``'s (from JAX's api_test with chunkop.vmap swapped in)."""

    def g(x):
        @jax.custom_vjp
        def f(y):
            return x * y

        f.defvjp(lambda y: (f(y), None), lambda r, ct: (ct,))
        return f(3.0)

    xs = jnp.arange(5.0)
    try:
        jax.vmap(g)(xs)
    except jax.errors.UnexpectedTracerError:  # jax 0.10's jax_custom_vjp3 refuses a custom_vjp
        # closing over a tracer (jax 0.12's does not): then chunkop.vmap refuses alike
        assert jax.config.jax_custom_vjp3
        with pytest.raises(jax.errors.UnexpectedTracerError, match="custom_vjp"):
            chunkop.vmap(g, chunk_size=2)(xs)
        return
    np.testing.assert_array_equal(chunkop.vmap(g, chunk_size=2)(xs), jax.vmap(g)(xs))  # x * 3.0: exact
    np.testing.assert_array_equal(jax.jit(chunkop.vmap(g, chunk_size=2))(xs), jax.vmap(g)(xs))


def test_unmapped_input_passed_through_is_returned_itself():
    """``out_axes=None`` for an unmapped input returned unchanged: ``jax.vmap`` returns that very
    array; the loop returned a copy (from JAX's lax_control_flow_test with chunkop.vmap swapped in)."""
    y = jnp.arange(4.0)
    f = chunkop.vmap(lambda x, y: (x * 2, y), in_axes=(0, None), out_axes=(0, None), chunk_size=2)
    out = f(jnp.arange(5.0), y)
    assert out[1] is y
    np.testing.assert_array_equal(out[0], 2 * jnp.arange(5.0))
    g = jax.grad(lambda y: f(jnp.arange(5.0), y)[1].sum() + f(jnp.arange(5.0), y)[0].sum())(y)
    np.testing.assert_array_equal(g, jnp.ones(4))
