"""``RowOperator`` in the lineax and SciPy ecosystems, and ``chunkop.gram_diagonal``.

Solvers are checked against dense NumPy solutions (``lstsq``, ``solve``) of the operator's
dense matrix, on a well-conditioned line-of-sight problem: each row's extinction weights are
multiplied by a per-row random gain, so that rows through the same pixel are not nearly
parallel and the weights are O(1) (lineax's CG declares a breakdown when the operator's scale
is tiny).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.sparse.linalg as spla
from conftest import assert_tree_allclose
from jax.flatten_util import ravel_pytree
from operator_registry import edges, make_los_rows
from operator_registry import los_weights as registry_los_weights

import chunkop

NPIX, K, N = 5, 3, 60
CHUNK = 9  # 6 full chunks and a remainder of 6
STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)


def los_weights(r):
    return registry_los_weights(r, edges(K))


def los_row(r, x):
    return jnp.dot(los_weights(r) * r["g"], x[r["idx"]])


def los_row_squared(r, x):
    return jnp.dot((los_weights(r) * r["g"]) ** 2, x[r["idx"]])


def make_rows(n=N, seed=0):
    rows = make_los_rows(n, NPIX, seed)
    rng = np.random.default_rng(seed)
    rng.integers(0, NPIX, n), rng.uniform(size=n), rng.uniform(size=n)  # skip make_los_rows' draws
    # per-row gains, drawn after them: keeps this well-conditioned problem exactly as it was
    return {**rows, "g": jnp.asarray(rng.normal(size=(n, K)) * 5.0, dtype=jnp.float32)}


ROWS = make_rows()


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=jnp.float32)


def make_op(rows=ROWS, chunk=CHUNK, row_fn=los_row, struct=STRUCT, **kw):
    return chunkop.RowOperator(row_fn, rows, struct, chunk_size=chunk, **kw)


def dense(row_fn, rows, struct):
    x0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    flat, unravel = ravel_pytree(x0)
    return jax.jacfwd(lambda f: ravel_pytree(jax.vmap(row_fn, (0, None))(rows, unravel(f)))[0])(flat)


A = make_op()
M = np.asarray(dense(los_row, ROWS, STRUCT), dtype=np.float64)
X_TRUE = _rand(NPIX, K, seed=1)
B = jnp.asarray(
    M @ np.asarray(X_TRUE, np.float64).reshape(-1) + 0.05 * np.random.default_rng(2).normal(size=N), dtype=jnp.float32
)
X_LSTSQ = np.linalg.lstsq(M, np.asarray(B, np.float64), rcond=None)[0].reshape(NPIX, K)
LAM = 0.5


def test_problem_is_well_conditioned():
    assert M.shape == (N, NPIX * K)
    assert np.linalg.cond(M) < 100
    assert 0.1 < np.abs(M).max() < 10


# -- solvers ------------------------------------------------------------------------------------


def test_lsmr_matches_lstsq():
    solve = jax.jit(lambda A, b: lx.linear_solve(A, b, lx.LSMR(rtol=1e-6, atol=1e-6), throw=False))
    sol = solve(A, B)
    assert sol.result == lx.RESULTS.successful
    np.testing.assert_allclose(sol.value, X_LSTSQ, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("tags", [lx.positive_semidefinite_tag, (lx.symmetric_tag, lx.positive_semidefinite_tag)])
def test_cg_on_regularised_normal_equations(tags):
    def solve(A, b):
        normal = lx.TaggedLinearOperator(A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure()), tags)
        return lx.linear_solve(normal, A.T.mv(b), lx.CG(rtol=1e-6, atol=1e-6), throw=False)

    sol = jax.jit(solve)(A, B)
    assert sol.result == lx.RESULTS.successful
    expected = np.linalg.solve(M.T @ M + LAM * np.eye(NPIX * K), M.T @ np.asarray(B, np.float64))
    np.testing.assert_allclose(sol.value, expected.reshape(NPIX, K), rtol=1e-3, atol=1e-4)


def test_normal_cg_matches_lstsq():
    solve = jax.jit(lambda A, b: lx.linear_solve(A, b, lx.Normal(lx.CG(rtol=1e-6, atol=1e-6)), throw=False))
    sol = solve(A, B)
    assert sol.result == lx.RESULTS.successful
    np.testing.assert_allclose(sol.value, X_LSTSQ, rtol=1e-3, atol=1e-4)


def test_normal_operator_matches_numpy():
    """``A.normal(damping)``: ``A^T A + damping I``, tagged for CG; its solves match NumPy's."""
    Mt = M.T @ M
    for damping in (0.0, LAM):
        normal = A.normal(damping)
        assert lx.is_positive_semidefinite(normal) and lx.is_symmetric(normal)
        assert normal.in_structure() == normal.out_structure() == A.in_structure()
        np.testing.assert_allclose(normal.as_matrix(), Mt + damping * np.eye(NPIX * K), rtol=1e-4, atol=1e-4)
    solve = jax.jit(lambda A, b, d: lx.linear_solve(A.normal(d), A.T.mv(b), lx.CG(rtol=1e-6, atol=1e-6)).value)
    np.testing.assert_allclose(solve(A, B, 0.0), X_LSTSQ, rtol=1e-3, atol=1e-4)
    expected = np.linalg.solve(Mt + LAM * np.eye(NPIX * K), M.T @ np.asarray(B, np.float64))
    np.testing.assert_allclose(solve(A, B, LAM), expected.reshape(NPIX, K), rtol=1e-3, atol=1e-4)  # traced damping


def test_normal_operator_wide_gives_the_minimum_norm_solution():
    """Fewer rows than unknowns: CG on ``A.normal()`` from zero, like ``lx.Normal``, gives lstsq's
    minimum-norm solution."""
    rows = make_rows(n=8, seed=3)
    Aw = make_op(rows)
    Mw = np.asarray(dense(los_row, rows, STRUCT), np.float64)
    assert Mw.shape == (8, NPIX * K) and np.linalg.cond(Mw) < 100
    b = np.random.default_rng(4).normal(size=8)
    ref = np.linalg.lstsq(Mw, b, rcond=None)[0].reshape(NPIX, K)
    cg = lx.CG(rtol=1e-6, atol=1e-6, max_steps=200)
    x = lx.linear_solve(Aw.normal(), Aw.T.mv(jnp.asarray(b, jnp.float32)), cg).value
    np.testing.assert_allclose(x, ref, rtol=1e-3, atol=1e-4)
    x = lx.linear_solve(Aw, jnp.asarray(b, jnp.float32), lx.Normal(cg)).value
    np.testing.assert_allclose(x, ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("damping", [-1.0, [1.0, 2.0], 1j, float("nan")])
def test_normal_operator_rejects_bad_damping(damping):
    with pytest.raises(ValueError, match="`damping` must be a non-negative real scalar"):
        A.normal(damping)


def test_structures_compose_with_lineax_without_a_mesh():
    """Structures as lineax normalises them (no sharding without a mesh): operator algebra works."""
    assert lx.IdentityLinearOperator(A.in_structure()).in_structure() == A.in_structure()
    assert lx.IdentityLinearOperator(A.out_structure()).in_structure() == A.out_structure()
    assert all(s.sharding is None for s in jax.tree_util.tree_leaves((A.in_structure(), A.out_structure())))
    x = _rand(NPIX, K, seed=6)
    damped = A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure())
    expected = (M.T @ M + LAM * np.eye(NPIX * K)) @ np.asarray(x, np.float64).reshape(-1)
    np.testing.assert_allclose(damped.mv(x).reshape(-1), expected, rtol=1e-4, atol=1e-4)


def test_out_sharding_argument():
    """``out_sharding`` only matters for rows sharded over an Explicit mesh (see
    tests/test_lineax_mesh.py); here it changes nothing, and other values are refused."""
    R = make_op(out_sharding="replicated")
    x = _rand(NPIX, K, seed=7)
    np.testing.assert_allclose(R.mv(x), A.mv(x), rtol=1e-6)
    assert R.out_structure() == A.out_structure()
    with pytest.raises(ValueError, match="`out_sharding` must be"):
        make_op(out_sharding="sharded")


def test_gradient_of_a_solve_wrt_rows_and_data():
    """Implicit differentiation through lineax's CG: lineax differentiates ``A.mv`` w.r.t. ``rows``."""

    def loss(s, b, use_ref):
        rows = {**ROWS, "s": s}
        if use_ref:
            Md = dense(los_row, rows, STRUCT)
            x = jnp.linalg.solve(Md.T @ Md + LAM * jnp.eye(NPIX * K), Md.T @ b)
        else:
            Ao = make_op(rows)
            normal = lx.TaggedLinearOperator(
                Ao.T @ Ao + LAM * lx.IdentityLinearOperator(STRUCT), lx.positive_semidefinite_tag
            )
            x = lx.linear_solve(normal, Ao.T.mv(b), lx.CG(rtol=1e-7, atol=1e-7, max_steps=200)).value
        return jnp.sum(jnp.sin(x))

    g, g_ref = jax.jit(
        lambda: (
            jax.grad(loss, argnums=(0, 1))(ROWS["s"], B, False),
            jax.grad(loss, argnums=(0, 1))(ROWS["s"], B, True),
        )
    )()
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(b))))


# -- lineax operations and queries --------------------------------------------------------------


def test_materialise():
    @jax.jit
    def run(A, x, y):
        m, mt = lx.materialise(A), lx.materialise(A.T)
        assert isinstance(m, lx.PyTreeLinearOperator)
        assert m.in_structure() == A.in_structure() and m.out_structure() == A.out_structure()
        return m.as_matrix(), m.mv(x), A.mv(x), mt.as_matrix(), mt.mv(y), A.T.mv(y)

    m_mat, m_mv, a_mv, mt_mat, mt_mv, at_mv = run(A, X_TRUE, B)
    np.testing.assert_allclose(m_mat, M, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mt_mat, M.T, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(m_mv, a_mv, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(mt_mv, at_mv, rtol=1e-5, atol=1e-5)
    # 1-D input and output: a plain matrix operator, keeping the tags
    rows1 = {"i": jnp.asarray([0, 2, 1, 2]), "w": jnp.asarray([1.0, 2.0, 3.0, 4.0])}
    A1 = chunkop.RowOperator(
        lambda r, x: r["w"] * x[r["i"]],
        rows1,
        jax.ShapeDtypeStruct((3,), jnp.float32),
        chunk_size=3,
        tags=lx.unit_diagonal_tag,
    )
    m1 = lx.materialise(A1)
    assert isinstance(m1, lx.MatrixLinearOperator) and lx.has_unit_diagonal(m1)
    np.testing.assert_allclose(m1.as_matrix(), [[1, 0, 0], [0, 0, 2], [0, 3, 0], [0, 0, 4]])


def test_materialise_pytree_structures():
    struct = {"a": jax.ShapeDtypeStruct((NPIX, K), jnp.float32), "b": jax.ShapeDtypeStruct((2,), jnp.float32)}

    def row_fn(r, x):
        return {"p": los_row(r, x["a"]) + r["s"] * x["b"][0], "q": jnp.stack([x["b"][1], jnp.sum(x["a"][r["idx"]])])}

    Ap = make_op(row_fn=row_fn, struct=struct, chunk=7)
    x = {"a": X_TRUE, "b": _rand(2, seed=3)}
    y = jax.tree_util.tree_map(lambda s: _rand(*s.shape, seed=4), Ap.out_structure())

    @jax.jit
    def run(Ap, x, y):
        m, mt = lx.materialise(Ap), lx.materialise(Ap.T)
        return (m.mv(x), mt.mv(y), m.as_matrix(), dense(row_fn, Ap.rows, struct)), (Ap.mv(x), Ap.T.mv(y))

    (m_mv, mt_mv, m_mat, expected_mat), (a_mv, at_mv) = run(Ap, x, y)
    assert_tree_allclose(m_mv, a_mv, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(mt_mv, at_mv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m_mat, expected_mat, rtol=1e-5, atol=1e-6)


def _square_op(tags=(), chunk=4, n=6):
    """A square operator on a 1-D sky of ``n`` pixels (``n`` rows), so it may carry symmetric tags."""
    rows = make_rows(n, seed=5)
    rows["idx"] = jnp.arange(n, dtype=jnp.int32)[::-1]
    row_fn = lambda r, x: los_row(r, jnp.stack([x, x[::-1], jnp.roll(x, 1)], axis=1))
    struct = jax.ShapeDtypeStruct((n,), jnp.float32)
    return make_op(rows, chunk=chunk, row_fn=row_fn, struct=struct, tags=tags), np.asarray(dense(row_fn, rows, struct))


def test_diagonal_and_tridiagonal_of_square_operator():
    Asq, Msq = _square_op()
    np.testing.assert_allclose(lx.diagonal(Asq), np.diag(Msq), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lx.diagonal(Asq.T), np.diag(Msq), rtol=1e-5, atol=1e-7)
    lower, diag, upper = lx.tridiagonal(Asq)
    np.testing.assert_allclose(lower, np.diag(Msq, -1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(diag, np.diag(Msq), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(upper, np.diag(Msq, 1), rtol=1e-5, atol=1e-7)


def test_diagonal_of_non_square_operator_raises():
    with pytest.raises(ValueError, match="not square"):
        lx.diagonal(A)
    with pytest.raises(ValueError, match="not square"):
        lx.tridiagonal(A.T)


def test_tag_queries():
    assert not lx.is_symmetric(A)
    for query in (
        lx.is_diagonal,
        lx.is_tridiagonal,
        lx.has_unit_diagonal,
        lx.is_lower_triangular,
        lx.is_upper_triangular,
        lx.is_positive_semidefinite,
        lx.is_negative_semidefinite,
    ):
        assert not query(A) and not query(A.T), query
    sym, _ = _square_op(lx.symmetric_tag)
    assert lx.is_symmetric(sym) and lx.is_symmetric(sym.T)
    assert not lx.is_positive_semidefinite(sym)
    psd, _ = _square_op(lx.positive_semidefinite_tag)
    assert lx.is_symmetric(psd) and lx.is_positive_semidefinite(psd) and not lx.is_negative_semidefinite(psd)
    nsd, _ = _square_op(lx.negative_semidefinite_tag)
    assert lx.is_symmetric(nsd) and lx.is_negative_semidefinite(nsd)
    diag, _ = _square_op(lx.diagonal_tag)
    assert lx.is_diagonal(diag) and lx.is_tridiagonal(diag) and lx.is_symmetric(diag)
    assert lx.is_lower_triangular(diag) and lx.is_upper_triangular(diag)
    low, _ = _square_op((lx.lower_triangular_tag, lx.unit_diagonal_tag))
    assert lx.is_lower_triangular(low) and not lx.is_upper_triangular(low) and lx.has_unit_diagonal(low)
    assert lx.is_upper_triangular(low.T) and not lx.is_lower_triangular(low.T) and lx.has_unit_diagonal(low.T)
    tri, _ = _square_op(lx.tridiagonal_tag)
    assert lx.is_tridiagonal(tri) and not lx.is_diagonal(tri)


def test_linearise_and_conj():
    assert lx.linearise(A) is A
    At = A.T
    assert lx.linearise(At) is At
    assert lx.conj(A) is A
    assert_tree_allclose(lx.conj(A.T).mv(B), A.T.mv(B))


def test_tagged_solve_with_symmetric_operator():
    """A symmetric-tagged square ``RowOperator`` (a symmetric positive definite matrix) solved by CG."""
    n = 6
    rng = np.random.default_rng(6)
    L = rng.normal(size=(n, n))
    Q = L @ L.T / n + np.eye(n)
    rows = jnp.asarray(Q, dtype=jnp.float32)  # row i holds row i of the matrix
    Aq = chunkop.RowOperator(
        lambda q, x: q @ x,
        rows,
        jax.ShapeDtypeStruct((n,), jnp.float32),
        chunk_size=4,
        tags=lx.positive_semidefinite_tag,
    )
    b = _rand(n, seed=7)
    sol = jax.jit(lambda A, b: lx.linear_solve(A, b, lx.CG(rtol=1e-6, atol=1e-6)).value)(Aq, b)
    np.testing.assert_allclose(sol, np.linalg.solve(Q, np.asarray(b, np.float64)), rtol=1e-4, atol=1e-5)
    sol_auto = lx.linear_solve(Aq, b).value  # AutoLinearSolver materialises (Cholesky for PSD)
    np.testing.assert_allclose(sol_auto, np.linalg.solve(Q, np.asarray(b, np.float64)), rtol=1e-4, atol=1e-5)


# -- to_scipy -----------------------------------------------------------------------------------


def test_to_scipy_products():
    S = chunkop.to_scipy(A)
    assert S.shape == (N, NPIX * K) and S.dtype == np.float32
    rng = np.random.default_rng(8)
    v, w, V = rng.normal(size=NPIX * K), rng.normal(size=N), rng.normal(size=(NPIX * K, 3))
    np.testing.assert_allclose(S.matvec(v), M @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.rmatvec(w), M.T @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.matmat(V), M @ V, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S @ v, M @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.T @ w, M.T @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.matvec(v.reshape(-1, 1)).reshape(-1), M @ v, rtol=1e-4, atol=1e-4)
    St = chunkop.to_scipy(A.T)
    assert St.shape == (NPIX * K, N)
    np.testing.assert_allclose(St.matvec(w), M.T @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        S.matvec(np.ones(7))


def test_to_scipy_lsqr_matches_lstsq():
    S = chunkop.to_scipy(A)
    x, istop, *_ = spla.lsqr(S, np.asarray(B), atol=1e-7, btol=1e-7)
    assert istop in (1, 2)
    np.testing.assert_allclose(x.reshape(NPIX, K), X_LSTSQ, rtol=1e-3, atol=1e-4)


def test_to_scipy_pytree_operator():
    struct = {"a": jax.ShapeDtypeStruct((NPIX, K), jnp.float32), "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
    row_fn = lambda r, x: {"p": los_row(r, x["a"]), "q": r["s"] * x["b"]}
    Ap = make_op(row_fn=row_fn, struct=struct, chunk=7)
    Mp = np.asarray(dense(row_fn, ROWS, struct))
    S = chunkop.to_scipy(Ap)
    assert S.shape == Mp.shape == (N + 2 * N, NPIX * K + 2)
    v = np.random.default_rng(9).normal(size=S.shape[1])
    w = np.random.default_rng(10).normal(size=S.shape[0])
    np.testing.assert_allclose(S.matvec(v), Mp @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.rmatvec(w), Mp.T @ w, rtol=1e-4, atol=1e-4)


# -- gram_diagonal ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 60, 100])
def test_gram_diagonal_both_paths(chunk):
    Ac = make_op(chunk=chunk)
    expected = np.sum(M**2, axis=0).reshape(NPIX, K)
    generic = chunkop.gram_diagonal(Ac)
    fast = chunkop.gram_diagonal(Ac, squared_row_fn=los_row_squared)
    assert generic.shape == fast.shape == (NPIX, K) and generic.dtype == fast.dtype == jnp.float32
    np.testing.assert_allclose(generic, expected, rtol=1e-5)
    np.testing.assert_allclose(fast, expected, rtol=1e-5)
    np.testing.assert_allclose(chunkop.gram_diagonal(Ac, chunk_size=9), expected, rtol=1e-5)


def test_gram_diagonal_pytree_and_jit():
    struct = {"a": jax.ShapeDtypeStruct((NPIX, K), jnp.float32), "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
    row_fn = lambda r, x: jnp.stack([los_row(r, x["a"]), r["s"] * 10.0 * x["b"][0] - x["b"][1]])
    Ap = make_op(row_fn=row_fn, struct=struct, chunk=7)
    Mp = np.asarray(dense(row_fn, ROWS, struct))
    _, unravel = ravel_pytree(jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct))
    expected = unravel(jnp.asarray(np.sum(Mp**2, axis=0), dtype=jnp.float32))
    assert_tree_allclose(jax.jit(chunkop.gram_diagonal)(Ap), expected, rtol=1e-5, atol=1e-6)


def test_gram_diagonal_jacobi_preconditioned_cg():
    """The intended use: a Jacobi preconditioner for CG on the normal equations."""
    diag = chunkop.gram_diagonal(A, squared_row_fn=los_row_squared) + LAM
    normal = lx.TaggedLinearOperator(A.T @ A + LAM * lx.IdentityLinearOperator(STRUCT), lx.positive_semidefinite_tag)
    precond = lx.TaggedLinearOperator(lx.DiagonalLinearOperator(1.0 / diag), lx.positive_semidefinite_tag)
    solve = jax.jit(
        lambda op, b, p: lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6), options={"preconditioner": p}).value
    )
    sol = solve(normal, A.T.mv(B), precond)
    expected = np.linalg.solve(M.T @ M + LAM * np.eye(NPIX * K), M.T @ np.asarray(B, np.float64))
    np.testing.assert_allclose(sol, expected.reshape(NPIX, K), rtol=1e-3, atol=1e-4)


def test_gram_diagonal_complex_generic_path():
    rows = {"idx": ROWS["idx"], "ph": ROWS["s"] * 100.0}
    row_fn = lambda r, x: jnp.exp(1j * r["ph"]) * (1.0 + r["ph"]) * x[r["idx"], 0]
    Ac = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((NPIX, K), jnp.complex64), chunk_size=16)
    Mc = np.asarray(Ac.as_matrix())
    g = chunkop.gram_diagonal(Ac)
    np.testing.assert_allclose(g, np.sum(np.abs(Mc) ** 2, axis=0).reshape(NPIX, K), rtol=1e-5)


def test_gram_diagonal_rejects_a_transpose():
    with pytest.raises(TypeError, match="RowOperator"):
        chunkop.gram_diagonal(A.T)
