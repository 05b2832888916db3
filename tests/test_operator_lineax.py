"""``RowOperator`` in the lineax and SciPy ecosystems, and ``chunkop.gram_diagonal``.

For every operator of the registry (``make_operators``): the operator lineax materialises (of
``A`` and ``A.T``), ``linearise`` and ``conj`` (the materialised values and the generic Gram
diagonal are compared with the dense matrix in ``test_operator_core.py``, in the one jitted
program it compiles per operator). Solvers are checked against dense NumPy solutions (``lstsq``, ``solve``) on the
registry's well-conditioned line-of-sight problem (``make_well_conditioned``); tags, the
diagonal and the tridiagonal on its square operator (``make_square``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.sparse.linalg as spla
from conftest import assert_tree_allclose
from operator_registry import (
    OPERATOR_IDS,
    make_operators,
    make_pytree,
    make_square,
    make_well_conditioned,
    rand,
    well_conditioned_squared_row_fn,
)

import chunkop

WC = make_well_conditioned()
A = WC.op()
STRUCT = WC.in_structure
(NPIX, K), N = STRUCT.shape, 60
M = np.asarray(WC.dense(), dtype=np.float64)
X_TRUE = rand(NPIX, K, seed=1)
B = jnp.asarray(
    M @ np.asarray(X_TRUE, np.float64).reshape(-1) + 0.05 * np.random.default_rng(2).normal(size=N), dtype=jnp.float32
)
X_LSTSQ = np.linalg.lstsq(M, np.asarray(B, np.float64), rcond=None)[0].reshape(NPIX, K)
LAM = 0.5


def test_problem_is_well_conditioned():
    assert M.shape == (N, NPIX * K)
    assert np.linalg.cond(M) < 100
    assert 0.1 < np.abs(M).max() < 10


# -- every operator: the lineax views (their values are in test_operator_core.py) -----------------


@pytest.mark.parametrize("make_operator", make_operators, ids=OPERATOR_IDS)
def test_lineax_views_of_every_operator(make_operator):
    """``lineax.materialise`` gives a matrix operator for a single 1-D input and output and a
    pytree one otherwise, on the same structures; ``linearise`` is the identity, and so is
    ``conj`` for a real operator. Traced only (``jax.eval_shape``): the materialised values
    are compared with the dense matrix in ``test_operator_core.py``'s one jitted program per
    operator."""
    Ao = make_operator().op()
    At = Ao.T
    for op in (Ao, At):
        m = jax.eval_shape(lx.materialise, op)
        leaves = jax.tree_util.tree_leaves((op.in_structure(), op.out_structure()))
        one_d = len(leaves) == 2 and all(s.ndim == 1 for s in leaves)
        assert isinstance(m, lx.MatrixLinearOperator if one_d else lx.PyTreeLinearOperator)
        assert m.out_structure() == op.out_structure()
        # lineax's PyTreeLinearOperator takes its input dtype from the matrix: a real input of an
        # operator with complex outputs reads as complex (shapes still match)
        same = lambda a, b: a == b or (a.shape == b.shape and jnp.iscomplexobj(a) and not jnp.iscomplexobj(b))
        assert all(map(same, jax.tree_util.tree_leaves(m.in_structure()), jax.tree_util.tree_leaves(op.in_structure())))
    assert lx.linearise(Ao) is Ao and lx.linearise(At) is At
    real = not any(jnp.iscomplexobj(s) for s in jax.tree_util.tree_leaves((Ao.in_structure(), Ao.out_structure())))
    assert (lx.conj(Ao) is Ao) == real  # a real operator is its own conjugate
    if real:
        assert lx.conj(At).operator is Ao


def test_materialise_keeps_the_tags():
    """A 1-D input and output (here not square): a plain matrix operator, keeping the tags."""
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
    np.testing.assert_array_equal(m1.as_matrix(), [[1, 0, 0], [0, 0, 2], [0, 3, 0], [0, 0, 4]])  # w * 1: exact


# -- solvers --------------------------------------------------------------------------------------


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
    wide = make_well_conditioned(n=8, seed=3)
    Aw = wide.op()
    Mw = np.asarray(wide.dense(), np.float64)
    assert Mw.shape == (8, NPIX * K) and np.linalg.cond(Mw) < 100
    b = np.random.default_rng(4).normal(size=8)
    ref = np.linalg.lstsq(Mw, b, rcond=None)[0].reshape(NPIX, K)
    cg = lx.CG(rtol=1e-6, atol=1e-6, max_steps=200)
    x = lx.linear_solve(Aw.normal(), Aw.T.mv(jnp.asarray(b, jnp.float32)), cg).value
    np.testing.assert_allclose(x, ref, rtol=1e-3, atol=1e-4)
    x = lx.linear_solve(Aw, jnp.asarray(b, jnp.float32), lx.Normal(cg)).value
    np.testing.assert_allclose(x, ref, rtol=1e-3, atol=1e-4)


def test_structures_compose_with_lineax_without_a_mesh():
    """Structures as lineax normalises them (no sharding without a mesh): operator algebra works."""
    assert lx.IdentityLinearOperator(A.in_structure()).in_structure() == A.in_structure()
    assert lx.IdentityLinearOperator(A.out_structure()).in_structure() == A.out_structure()
    assert all(s.sharding is None for s in jax.tree_util.tree_leaves((A.in_structure(), A.out_structure())))
    x = rand(NPIX, K, seed=6)
    damped = A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure())
    expected = (M.T @ M + LAM * np.eye(NPIX * K)) @ np.asarray(x, np.float64).reshape(-1)
    np.testing.assert_allclose(damped.mv(x).reshape(-1), expected, rtol=1e-4, atol=1e-4)


def test_out_sharding_argument():
    """``out_sharding`` only matters for rows sharded over an Explicit mesh (see
    tests/test_lineax_mesh.py); here it changes nothing (other values are refused: see
    tests/test_operator_errors.py)."""
    R = WC.op(out_sharding="replicated")
    x = rand(NPIX, K, seed=7)
    assert_tree_allclose(R.mv(x), A.mv(x), n_terms=K)  # a row: a dot product over K bins
    assert R.out_structure() == A.out_structure()


def test_gradient_of_a_solve_wrt_rows_and_data():
    """Implicit differentiation through lineax's CG: lineax differentiates ``A.mv`` w.r.t. ``rows``."""

    def loss(s, b, use_ref):
        p = {**WC.p, "s": s}
        if use_ref:
            Md = WC.dense(p)
            x = jnp.linalg.solve(Md.T @ Md + LAM * jnp.eye(NPIX * K), Md.T @ b)
        else:
            Ao = WC.op(p)
            normal = lx.TaggedLinearOperator(
                Ao.T @ Ao + LAM * lx.IdentityLinearOperator(STRUCT), lx.positive_semidefinite_tag
            )
            x = lx.linear_solve(normal, Ao.T.mv(b), lx.CG(rtol=1e-7, atol=1e-7, max_steps=200)).value
        return jnp.sum(jnp.sin(x))

    g, g_ref = jax.jit(
        lambda: (
            jax.grad(loss, argnums=(0, 1))(WC.p["s"], B, False),
            jax.grad(loss, argnums=(0, 1))(WC.p["s"], B, True),
        )
    )()
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(b))))


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
    b = rand(n, seed=7)
    sol = jax.jit(lambda A, b: lx.linear_solve(A, b, lx.CG(rtol=1e-6, atol=1e-6)).value)(Aq, b)
    np.testing.assert_allclose(sol, np.linalg.solve(Q, np.asarray(b, np.float64)), rtol=1e-4, atol=1e-5)
    sol_auto = lx.linear_solve(Aq, b).value  # AutoLinearSolver materialises (Cholesky for PSD)
    np.testing.assert_allclose(sol_auto, np.linalg.solve(Q, np.asarray(b, np.float64)), rtol=1e-4, atol=1e-5)


# -- the square operator: diagonal, tridiagonal, tags --------------------------------------------


def test_diagonal_and_tridiagonal_of_square_operator():
    """``lx.diagonal`` (computed without the ``n^2`` matrix) and ``lx.tridiagonal`` of ``A`` and
    ``A.T``; and the diagonal of a square operator with pytree input and output."""
    sq = make_square()
    Asq, Msq = sq.op(), np.asarray(sq.dense())
    # an entry sums a row's three gathered weights and its 2.0 (where they hit the same column)
    assert_tree_allclose(lx.diagonal(Asq), np.diag(Msq), n_terms=4)
    assert_tree_allclose(lx.diagonal(Asq.T), np.diag(Msq), n_terms=4)
    lower, diag, upper = lx.tridiagonal(Asq)
    assert_tree_allclose(lower, np.diag(Msq, -1), n_terms=4)
    assert_tree_allclose(diag, np.diag(Msq), n_terms=4)
    assert_tree_allclose(upper, np.diag(Msq, 1), n_terms=4)
    # pytree input and output (square overall)
    rows = {"r": jnp.arange(9), "w": jnp.linspace(1.0, 2.0, 9)}
    st = {"u": jax.ShapeDtypeStruct((9,), jnp.float32), "v": jax.ShapeDtypeStruct((9, 2), jnp.float32)}
    Bp = chunkop.RowOperator(
        lambda r, x: {"a": r["w"] * x["u"][r["r"]] + x["v"][0, 1], "b": r["w"] * x["v"][r["r"]][::-1]},
        rows,
        st,
        chunk_size=4,
    )
    assert_tree_allclose(lx.diagonal(Bp), jnp.diagonal(Bp.as_matrix()), n_terms=2)


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
    sq = make_square()
    sym = sq.op(tags=lx.symmetric_tag)
    assert lx.is_symmetric(sym) and lx.is_symmetric(sym.T)
    assert not lx.is_positive_semidefinite(sym)
    psd = sq.op(tags=lx.positive_semidefinite_tag)
    assert lx.is_symmetric(psd) and lx.is_positive_semidefinite(psd) and not lx.is_negative_semidefinite(psd)
    nsd = sq.op(tags=lx.negative_semidefinite_tag)
    assert lx.is_symmetric(nsd) and lx.is_negative_semidefinite(nsd)
    diag = sq.op(tags=lx.diagonal_tag)
    assert lx.is_diagonal(diag) and lx.is_tridiagonal(diag) and lx.is_symmetric(diag)
    assert lx.is_lower_triangular(diag) and lx.is_upper_triangular(diag)
    low = sq.op(tags=(lx.lower_triangular_tag, lx.unit_diagonal_tag))
    assert lx.is_lower_triangular(low) and not lx.is_upper_triangular(low) and lx.has_unit_diagonal(low)
    assert lx.is_upper_triangular(low.T) and not lx.is_lower_triangular(low.T) and lx.has_unit_diagonal(low.T)
    tri = sq.op(tags=lx.tridiagonal_tag)
    assert lx.is_tridiagonal(tri) and not lx.is_diagonal(tri)


# -- to_scipy -------------------------------------------------------------------------------------


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


def test_to_scipy_lsqr_matches_lstsq():
    S = chunkop.to_scipy(A)
    x, istop, *_ = spla.lsqr(S, np.asarray(B), atol=1e-7, btol=1e-7)
    assert istop in (1, 2)
    np.testing.assert_allclose(x.reshape(NPIX, K), X_LSTSQ, rtol=1e-3, atol=1e-4)


def test_to_scipy_pytree_operator():
    case = make_pytree()
    Mp = np.asarray(case.dense())
    S = chunkop.to_scipy(case.op())
    assert S.shape == Mp.shape
    v = np.random.default_rng(9).normal(size=S.shape[1])
    w = np.random.default_rng(10).normal(size=S.shape[0])
    np.testing.assert_allclose(S.matvec(v), Mp @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S.rmatvec(w), Mp.T @ w, rtol=1e-4, atol=1e-4)


# -- gram_diagonal --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 60])  # chunks of 6 (the divisor of 60 chosen for 7); one chunk
def test_gram_diagonal_both_paths(chunk):
    """The generic path and the fast one (``squared_row_fn``), and a ``chunk_size`` of its own
    (9: a remainder); the generic path of every registry operator is in
    ``test_materialise_and_gram_diagonal``."""
    Ac = WC.op(chunk=chunk)
    expected = np.sum(M**2, axis=0).reshape(NPIX, K)
    generic = chunkop.gram_diagonal(Ac)
    fast = chunkop.gram_diagonal(Ac, squared_row_fn=well_conditioned_squared_row_fn)
    assert generic.shape == fast.shape == (NPIX, K) and generic.dtype == fast.dtype == jnp.float32
    expected = expected.astype(np.float32)  # M is the float32 dense matrix; a sum of N squares
    assert_tree_allclose(generic, expected, n_terms=N)
    assert_tree_allclose(fast, expected, n_terms=N)
    assert_tree_allclose(chunkop.gram_diagonal(Ac, chunk_size=9), expected, n_terms=N)


def test_gram_diagonal_jacobi_preconditioned_cg():
    """The intended use: a Jacobi preconditioner for CG on the normal equations."""
    diag = chunkop.gram_diagonal(A, squared_row_fn=well_conditioned_squared_row_fn) + LAM
    normal = lx.TaggedLinearOperator(A.T @ A + LAM * lx.IdentityLinearOperator(STRUCT), lx.positive_semidefinite_tag)
    precond = lx.TaggedLinearOperator(lx.DiagonalLinearOperator(1.0 / diag), lx.positive_semidefinite_tag)
    solve = jax.jit(
        lambda op, b, p: lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6), options={"preconditioner": p}).value
    )
    sol = solve(normal, A.T.mv(B), precond)
    expected = np.linalg.solve(M.T @ M + LAM * np.eye(NPIX * K), M.T @ np.asarray(B, np.float64))
    np.testing.assert_allclose(sol, expected.reshape(NPIX, K), rtol=1e-3, atol=1e-4)
