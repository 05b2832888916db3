"""``chunkop.to_scipy`` acts as the operator's dense matrix does under SciPy (issues #24, #25).

The reference is ``scipy.sparse.linalg.aslinearoperator(M)`` of ``M = A.as_matrix()``, computed
in float64/complex128: for every operator of the registry (real->real, real->complex,
complex->complex, pytrees) and its transpose, real and complex vectors, ``matvec``/``rmatvec``/``matmat``/
``rmatmat`` and the ``.H``/``.T`` views, in the operator's dtype and in a wider view
(``dtype=np.float64``/``np.complex128``). Then the damped LSMR route in float64 the cookbook
documents, and the ``dtype`` argument's errors. (The registry's lsqr and pytree checks of
``to_scipy`` are in ``test_operator_lineax.py``; the complex adjoint in
``test_operator_user_state.py``.)

Tolerances follow from the computation: an element of ``M v`` is a sum of ``n`` products
computed in the operator's dtype, so it may differ from the float64 reference by
``rtol_for(dtype, n) * (|M| |v|)`` elementwise (``tests/_tolerance.py``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.sparse.linalg as spla
from _tolerance import rtol_for
from operator_registry import OPERATOR_IDS, make_complex_out, make_operators, make_well_conditioned

import chunkop


def _wide(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64)


def _vectors(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    real = rng.normal(size=shape)
    return {"real": real, "complex": real + 1j * rng.normal(size=shape)}


def _assert_product(got: np.ndarray, matrix: np.ndarray, v: np.ndarray, dtype: np.dtype, what: str) -> None:
    """``got == matrix @ v`` to the rounding of ``n``-term sums in ``dtype``, elementwise."""
    expected = matrix @ v
    bound = rtol_for(dtype, n_terms=matrix.shape[1]) * (np.abs(matrix) @ np.abs(v))
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert np.iscomplexobj(got) or not np.iscomplexobj(expected), f"{what}: the imaginary part was dropped"
    excess = np.abs(got - expected) - bound
    assert np.all(excess <= 0), f"{what}: off by {np.max(excess):.3g} beyond the rounding bound"


# Every registry operator in its own dtype; the wide view and the transpose (the same code path
# per operator kind) on one operator of each kind by default, on all of them under ``-m slow``.
_KINDS = {"los", "complex", "complex_out", "pytree", "vector_out"}


def _operator_variants() -> list:
    params = []
    for variant in ("own_dtype", "wide_view", "transposed"):
        for make, name in zip(make_operators, OPERATOR_IDS):
            slow = variant != "own_dtype" and name not in _KINDS
            params.append(pytest.param(make, variant, id=f"{name}-{variant}", marks=[pytest.mark.slow] * slow))
    return params


@pytest.mark.parametrize(("make_operator", "variant"), _operator_variants())
def test_every_operator_acts_as_its_dense_matrix(make_operator, variant):
    """``A`` in its own dtype and in a wide view, and ``A.T`` (whose matrix is ``M^T``; for a
    real-input, complex-output ``A`` a complex-to-real operator)."""
    A = make_operator().op()
    A = A.T if variant == "transposed" else A
    wide_view = variant == "wide_view"
    M = np.asarray(A.as_matrix())
    op_dtype = M.dtype
    view = _wide(op_dtype) if wide_view else None
    S = chunkop.to_scipy(A, dtype=view) if wide_view else chunkop.to_scipy(A)
    assert S.shape == M.shape
    assert S.dtype == (view if wide_view else op_dtype)
    dense = spla.aslinearoperator(M.astype(_wide(op_dtype)))
    m, n = M.shape
    for kind, v in _vectors((n,), seed=1).items():
        u = _vectors((m,), seed=2)[kind]
        V, U = _vectors((n, 3), seed=3)[kind], _vectors((m, 3), seed=4)[kind]
        results = {
            "matvec": (S.matvec(v), dense.matvec(v), M, v),
            "rmatvec": (S.rmatvec(u), dense.rmatvec(u), M.conj().T, u),
            "matmat": (S.matmat(V), dense.matmat(V), M, V),
            "rmatmat": (S.rmatmat(U), dense.rmatmat(U), M.conj().T, U),
            "H.matvec": (S.H.matvec(u), dense.H.matvec(u), M.conj().T, u),
            "T.matvec": (S.T.matvec(u), dense.T.matvec(u), M.T, u),
            "@": (S @ v, dense @ v, M, v),
            "matvec(n, 1)": (S.matvec(v[:, None]), dense.matvec(v[:, None]), M, v[:, None]),
        }
        for name, (got, reference, matrix, vector) in results.items():
            what = f"{kind} {name}"
            _assert_product(got, matrix.astype(_wide(op_dtype)), vector, op_dtype, what)
            assert got.shape == reference.shape, what
            # the result's dtype: the view's, complex where the product is
            expected_dtype = S.dtype if not np.iscomplexobj(reference) else np.result_type(S.dtype, np.complex64)
            assert got.dtype == expected_dtype, (what, got.dtype, expected_dtype)


def test_real_input_complex_output_is_its_complex_matrix():
    """Issue #24, finding 5: ``matvec`` takes a real vector (it refused one), and ``rmatvec`` is
    the whole ``M^H u``, its imaginary part included (it returned ``Re(M^H u)``)."""
    A = make_complex_out().op()
    assert A.in_structure().dtype == jnp.float32 and A.out_structure().dtype == jnp.complex64
    M = np.asarray(A.as_matrix()).astype(np.complex128)
    S = chunkop.to_scipy(A)
    assert S.dtype == np.complex64
    v = np.random.default_rng(5).normal(size=M.shape[1])
    u = _vectors((M.shape[0],), seed=6)["complex"]
    _assert_product(S.matvec(v), M, v, np.float32, "matvec")
    adjoint = S.rmatvec(u)
    assert np.abs((M.conj().T @ u).imag).max() > 0.1  # the part that was dropped
    _assert_product(adjoint, M.conj().T, u, np.float32, "rmatvec")
    # and SciPy's least squares converges to the complex solution
    b = M @ v + 0.1 * u
    expected = np.linalg.lstsq(M, b, rcond=None)[0]
    got, istop = spla.lsqr(S, b, atol=1e-10, btol=1e-10, iter_lim=2000)[:2]
    # the minimum-norm least-squares solution: M is 10 x 28, so compare the fits and the norms
    assert istop in (1, 2), istop
    np.testing.assert_allclose(M.conj().T @ (M @ got - b), 0, atol=1e-4 * np.linalg.norm(M.conj().T @ b))
    np.testing.assert_allclose(np.linalg.norm(got), np.linalg.norm(expected), rtol=1e-3)


def test_a_lineax_function_operator_from_real_to_complex():
    """Any lineax operator, not only a RowOperator: a real-to-complex matrix written as a function."""
    rng = np.random.default_rng(7)
    C = (rng.normal(size=(5, 4)) + 1j * rng.normal(size=(5, 4))).astype(np.complex64)
    op = lx.FunctionLinearOperator(
        lambda x: jnp.asarray(C) @ x.astype(jnp.complex64), jax.ShapeDtypeStruct((4,), jnp.float32)
    )
    S = chunkop.to_scipy(op, dtype=np.complex128)
    assert S.dtype == np.complex128
    M = C.astype(np.complex128)
    v, u = rng.normal(size=4), _vectors((5,), seed=8)["complex"]
    _assert_product(S.matvec(v), M, v, np.float32, "matvec")
    _assert_product(S.rmatvec(u), M.conj().T, u, np.float32, "rmatvec")
    assert S.matvec(v).dtype == np.complex128


# -- dtype=: SciPy's solvers in float64 over a float32 operator -------------------------------------


def test_float64_view_runs_damped_lsmr_in_float64():
    """``lsmr(to_scipy(A, dtype=np.float64), b, damp=)`` solves ``min |A x - b|^2 + damp^2 |x|^2``
    (the dense float64 solution of the stacked system ``[M; damp I]``), with none of the float32
    view's overflow in lsmr's condition estimate (it starts at 1e100)."""
    A = make_well_conditioned().op()
    M = np.asarray(A.as_matrix(), np.float64)
    m, n = M.shape
    b = np.random.default_rng(9).normal(size=m)
    damp = 0.3
    S64 = chunkop.to_scipy(A, dtype=np.float64)
    assert S64.dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        x, istop = spla.lsmr(S64, b, damp=damp, atol=1e-12, btol=1e-12, maxiter=10 * n)[:2]
    assert x.dtype == np.float64
    stacked = np.vstack([M, damp * np.eye(n)])
    expected = np.linalg.lstsq(stacked, np.concatenate([b, np.zeros(n)]), rcond=None)[0]
    # istop 1/2: atol/btol met; 4/5: met as far as float64 allows; either way the products are
    # those of the float32 operator, so the solution is that of a matrix within rounding of M:
    # relative error up to cond(stacked) * rtol_for(float32, m) (a perturbation bound)
    assert istop in (1, 2, 4, 5), istop
    singular = np.linalg.svd(stacked, compute_uv=False)
    bound = (singular[0] / singular[-1]) * rtol_for(np.float32, n_terms=m)
    assert np.linalg.norm(x - expected) <= bound * np.linalg.norm(expected), (np.linalg.norm(x - expected), bound)


def test_float32_view_keeps_float32():
    """The default view keeps the operator's dtype (what the cookbook's float64 recipe avoids)."""
    A = make_well_conditioned().op()
    S = chunkop.to_scipy(A)
    assert S.dtype == np.float32 and S.matvec(np.ones(S.shape[1])).dtype == np.float32
    assert chunkop.to_scipy(A, dtype=np.complex128).dtype == np.complex128


@pytest.mark.parametrize(
    "dtype, exc, match",
    [
        (np.int32, TypeError, "float or complex dtype"),
        ("not a dtype", TypeError, "NumPy float or complex dtype"),
        (np.float64, ValueError, "is real but the operator is complex"),
    ],
)
def test_dtype_errors(dtype, exc, match):
    A = make_complex_out().op() if exc is ValueError else make_well_conditioned().op()
    with pytest.raises(exc, match=match):
        chunkop.to_scipy(A, dtype=dtype)
