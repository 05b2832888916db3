"""``RowOperator`` gives the dense matrix's results whatever the user's state does.

State changes between builds (globals, attributes, bound methods, equal-comparing callables,
replaced closed-over arrays) are always seen, by ``mv``, ``T.mv`` and derivatives alike; a
``row_fn`` closing over traced values is differentiable; and the regression tests of the
smaller bullets: SciPy's adjoint, wide accumulation in bfloat16, dtype-aware ``check_linear``,
empty rows and inputs, and ``lineax.diagonal`` without the ``n^2`` matrix.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.sparse.linalg as spla
from _params import grid
from conftest import assert_tree_allclose
from operator_registry import (
    NPIX,
    ROWS,
    STRUCT,
    K,
    dense_matrix,
    longest_sum,
    los_row,
    los_weights,
    make_complex,
    make_los_rows,
    make_square,
    rand,
)

import chunkop
from chunkop._operator import kernels as _rows

X = rand(NPIX, K, seed=1)
Y = rand(len(ROWS["idx"]), seed=2)


def check_against_dense(A, row_fn, rows=ROWS):
    """``A.mv``, ``A.T.mv``, the gradient of a loss through each, and ``as_matrix`` vs the matrix
    (eagerly, as users call them)."""
    M = dense_matrix(row_fn, rows, STRUCT)
    x, y, n = X.reshape(-1), Y, longest_sum(M)
    assert_tree_allclose(A.mv(X), M @ x, n_terms=n)
    assert_tree_allclose(A.T.mv(Y).reshape(-1), M.T @ y, n_terms=n)
    g = jax.grad(lambda v: jnp.sum(jnp.sin(A.mv(v))))(X).reshape(-1)
    assert_tree_allclose(g, M.T @ jnp.cos(M @ x), n_terms=2 * n)  # two products in a row
    gT = jax.grad(lambda v: jnp.sum(jnp.sin(A.T.mv(v))))(Y)
    assert_tree_allclose(gT, M @ jnp.cos(M.T @ y), n_terms=2 * n)
    assert_tree_allclose(A.as_matrix(), M, n_terms=n)


# -- state changes between builds ---------------------------------------------------------------

GLOBAL_GAIN = jnp.ones(NPIX, jnp.float32)
GLOBAL_TABLE = {"gain": 1.0}


def global_row(r, x):
    return GLOBAL_GAIN[r["idx"]] * los_row(r, x)


def test_replaced_global_array():
    global GLOBAL_GAIN
    old = GLOBAL_GAIN
    try:
        A1 = chunkop.RowOperator(global_row, ROWS, STRUCT, chunk_size=3)
        check_against_dense(A1, global_row)
        GLOBAL_GAIN = jnp.linspace(1.0, 3.0, NPIX, dtype=jnp.float32)
        A2 = chunkop.RowOperator(global_row, ROWS, STRUCT, chunk_size=3)
        check_against_dense(A2, global_row)  # the new array, in mv, T.mv and gradients
        # the old operator keeps the array it was built with, in mv and T.mv alike
        M_old = dense_matrix(los_row, ROWS, STRUCT)
        assert_tree_allclose(A1.mv(X), M_old @ X.reshape(-1), n_terms=longest_sum(M_old))
        assert_tree_allclose(A1.T.mv(Y).reshape(-1), M_old.T @ Y, n_terms=longest_sum(M_old))
    finally:
        GLOBAL_GAIN = old


def test_updated_module_level_dict():
    def row_fn(r, x):
        return GLOBAL_TABLE["gain"] * los_row(r, x)

    try:
        for gain in [1.0, 4.0, jnp.float32(-2.0)]:
            GLOBAL_TABLE["gain"] = gain
            check_against_dense(chunkop.RowOperator(row_fn, ROWS, STRUCT, chunk_size=4), row_fn)
    finally:
        GLOBAL_TABLE["gain"] = 1.0


class Instrument:
    def __init__(self, gain):
        self.gain = gain

    def row(self, r, x):
        gain = self.gain[r["idx"]] if jnp.ndim(self.gain) else self.gain  # a per-pixel gain array
        return gain * los_row(r, x)


@pytest.mark.parametrize(
    "gain, new_gain",
    [(1.0, 10.0), (jnp.float32(1.0), jnp.float32(10.0)), (jnp.ones(NPIX), jnp.arange(NPIX, dtype=jnp.float32))],
)
def test_mutated_attribute_through_bound_method(gain, new_gain):
    inst = Instrument(gain)
    check_against_dense(chunkop.RowOperator(inst.row, ROWS, STRUCT, chunk_size=3), inst.row)
    inst.gain = new_gain
    A = chunkop.RowOperator(inst.row, ROWS, STRUCT, chunk_size=3)
    check_against_dense(A, inst.row)  # mv and T.mv both at the new gain


class EqualRow:
    """Callables that all compare (and hash) equal, whatever their scale."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, r, x):
        scale = self.scale[r["idx"]] if jnp.ndim(self.scale) else self.scale
        return scale * los_row(r, x)

    def __eq__(self, other):
        return isinstance(other, EqualRow)

    def __hash__(self):
        return 0


def test_equal_comparing_callables():
    for scale in [1.0, 3.0, jnp.float32(0.5), jnp.linspace(2.0, 3.0, NPIX, dtype=jnp.float32)]:
        fn = EqualRow(scale)
        check_against_dense(chunkop.RowOperator(fn, ROWS, STRUCT, chunk_size=4), fn)


def test_replaced_closed_over_array():
    table = [jnp.ones(NPIX, jnp.float32)]

    def row_fn(r, x):
        return table[0][r["idx"]] * los_row(r, x)

    for values in [np.ones(NPIX), np.linspace(-1, 1, NPIX), np.arange(NPIX) ** 2]:
        table[0] = jnp.asarray(values, jnp.float32)
        check_against_dense(chunkop.RowOperator(row_fn, ROWS, STRUCT, chunk_size=3), row_fn)


def test_numpy_closure_is_a_leaf_not_static():
    w = np.linspace(0.5, 1.5, K).astype(np.float32)
    A = chunkop.RowOperator(lambda r, x: jnp.dot(w, x[r["idx"]]) * r["s"], ROWS, STRUCT, chunk_size=3)
    assert len(A.consts) == 1 and np.array_equal(np.asarray(A.consts[0]), w)
    # the static part holds no arrays
    static = jax.tree_util.tree_structure(A)
    assert "ndarray" not in repr(static) and "Array(" not in repr(static)


def test_rebuilt_operators_share_compiled_kernels():
    """Operators whose row_fn traces to the same jaxpr share compiled kernels: new closed-over
    values or rows are arguments, not constants; eager ``mv`` does not retrace."""

    def make(gain, rows=ROWS):
        return chunkop.RowOperator(lambda r, x: gain[r["idx"]] * los_row(r, x), rows, STRUCT, chunk_size=3)

    A = make(jnp.ones(NPIX))
    A.mv(X), A.T.mv(Y)
    before = (_rows.apply._cache_size(), _rows.apply_transpose._cache_size())
    for i in range(3):
        B = make(jnp.full(NPIX, float(i + 2), jnp.float32), make_los_rows(seed=i + 5))
        assert_tree_allclose(B.mv(X), (i + 2) * jax.vmap(los_row, (0, None))(B.rows, X), n_terms=K)
        B.T.mv(Y)
    assert (_rows.apply._cache_size(), _rows.apply_transpose._cache_size()) == before


def test_caches_hold_no_closed_over_arrays():
    big = jnp.ones((NPIX, 1000), jnp.float32)
    ref = weakref.ref(big)
    A = chunkop.RowOperator(
        lambda r, x: jnp.sum(big[r["idx"]]) * los_row(r, x),  # noqa: F821 - `big` is deleted below on purpose
        ROWS,
        STRUCT,
        chunk_size=3,
    )
    A.mv(X), A.T.mv(Y)
    del A, big
    gc.collect()
    assert ref() is None


# -- closures over traced values: differentiable ------------------------------------------------


def _scaled_op(scale):
    return chunkop.RowOperator(
        lambda r, x: scale * los_row(r, x) + scale**2 * x[r["idx"], 0], ROWS, STRUCT, chunk_size=3
    )


def _loss(scale, kind="mv"):
    A = _scaled_op(scale)
    return jnp.sum(jnp.sin(A.mv(X) if kind == "mv" else A.T.mv(Y)))


def _ref_loss(scale, kind="mv"):
    f = lambda r, x: scale * los_row(r, x) + scale**2 * x[r["idx"], 0]
    ref = (
        jax.vmap(f, (0, None))(ROWS, X)
        if kind == "mv"
        else jax.linear_transpose(lambda v: jax.vmap(f, (0, None))(ROWS, v), STRUCT)(Y)[0]
    )
    return jnp.sum(jnp.sin(ref))


_TRANSFORMS = {
    "grad": lambda f: jax.grad(f)(2.0),
    "jit_grad": lambda f: jax.jit(jax.grad(f))(2.0),
    "jvp": lambda f: jax.jvp(f, (2.0,), (1.0,))[1],
    "jacfwd": lambda f: jax.jacfwd(f)(2.0),
    "vmap_grad": lambda f: jax.vmap(jax.grad(f))(jnp.asarray([1.0, 2.0])),
    "hessian": lambda f: jax.hessian(f)(2.0),
    "jit": lambda f: jax.jit(f)(2.0),
    "vmap": lambda f: jax.vmap(f)(jnp.asarray([1.0, 3.0])),
}


# every transform, of mv or of T.mv (both for the second derivatives)
@pytest.mark.parametrize(
    ("name", "kind"), grid(list(_TRANSFORMS), ["mv", "T"], strength=1, keep=lambda n, k: n == "hessian", ids=str)
)
def test_closure_over_traced_value(name, kind):
    """Was UnexpectedTracerError; now the derivative w.r.t. the closed-over value is right."""
    transform = _TRANSFORMS[name]
    got = transform(lambda s: _loss(s, kind))
    want = transform(lambda s: _ref_loss(s, kind))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)


def test_closure_over_traced_value_finite_differences_float64():
    with jax.enable_x64(True):
        rows = make_los_rows(seed=3, dtype=np.float64)
        x = rand(NPIX, K, seed=4, dtype=np.float64)
        y = rand(len(rows["idx"]), seed=5, dtype=np.float64)
        struct = jax.ShapeDtypeStruct((NPIX, K), jnp.float64)

        def f(gain, kind):
            A = chunkop.RowOperator(
                lambda r, v: jnp.exp(gain[r["idx"]]) * jnp.dot(los_weights(r), v[r["idx"]]), rows, struct, chunk_size=4
            )
            return jnp.sum(jnp.sin(3.0 * (A.mv(x) if kind == "mv" else A.T.mv(y))))

        g0 = jnp.linspace(-0.5, 0.5, NPIX, dtype=jnp.float64)
        dg = rand(NPIX, seed=6, dtype=np.float64)
        h = 1e-6

        @jax.jit  # one compilation (eager grads of closed-over tracers are in test_closure_over_traced_value)
        def run():
            out = {}
            for kind in ["mv", "T"]:
                fd = (f(g0 + h * dg, kind) - f(g0 - h * dg, kind)) / (2 * h)
                out[kind] = fd, jnp.vdot(jax.grad(f)(g0, kind), dg), jax.jvp(lambda g: f(g, kind), (g0,), (dg,))[1]
            return out

        for kind, (fd, by_grad, by_jvp) in run().items():
            assert fd.dtype == jnp.float64, kind
            np.testing.assert_allclose(by_grad, fd, rtol=1e-6)
            np.testing.assert_allclose(by_jvp, fd, rtol=1e-6)


# -- SciPy's adjoint ------------------------------------------------------------------------------


def test_to_scipy_rmatvec_is_the_conjugate_transpose():
    case = make_complex()
    A = case.op()
    M = np.asarray(case.dense())
    S = chunkop.to_scipy(A)
    v = np.asarray(rand(M.shape[0], seed=7, dtype=np.complex64))
    n = longest_sum(M)
    assert_tree_allclose(S.rmatvec(v), M.conj().T @ v, n_terms=n)
    V = np.stack([v, 2j * v], axis=1)
    assert_tree_allclose(S.rmatmat(V), M.conj().T @ V, n_terms=n)
    assert_tree_allclose(S.H.matvec(v), M.conj().T @ v, n_terms=n)
    # lsqr converges to the least-squares solution (it uses rmatvec)
    b = M @ np.asarray(rand(M.shape[1], seed=8, dtype=np.complex64)) + 0.1 * v
    expected = np.linalg.lstsq(M.astype(np.complex128), b.astype(np.complex128), rcond=None)[0]
    got = spla.lsqr(S, b, atol=1e-10, btol=1e-10, iter_lim=2000)[0]
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)


# -- bfloat16 / float16: wide accumulation --------------------------------------------------------

N_ONES = 4096


def _ones_op(dtype, c=None, chunk=4):
    rows = {"w": jnp.ones(N_ONES, dtype)}
    struct = jax.ShapeDtypeStruct((2,), dtype)
    if c is None:
        return chunkop.RowOperator(lambda r, x: r["w"] * x[0], rows, struct, chunk_size=chunk)
    return chunkop.RowOperator(lambda r, x: c * r["w"] * x[0], rows, struct, chunk_size=chunk)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_chunk_sums_accumulate_wide(dtype):
    """4096 ones: naive bfloat16 accumulation of chunks of 4 stops at 1024 (float16: 2048)."""
    A = _ones_op(dtype)
    out = A.T.mv(jnp.ones(N_ONES, dtype))
    assert out.dtype == dtype
    assert float(out[0]) == N_ONES and float(out[1]) == 0.0
    # the gradient w.r.t. x through mv (the transpose of the forward scan)
    gx = jax.grad(lambda x: jnp.sum(A.mv(x).astype(jnp.float32)))(jnp.ones(2, dtype))
    assert gx.dtype == dtype and float(gx[0]) == N_ONES
    # derivatives w.r.t. a closed-over scalar: reverse (sum over chunks of its cotangent) ...
    loss = lambda c, kind: jnp.sum(
        (
            _ones_op(dtype, c).mv(jnp.ones(2, dtype))
            if kind == "mv"
            else _ones_op(dtype, c).T.mv(jnp.ones(N_ONES, dtype))
        ).astype(jnp.float32)
    )
    for kind in ["mv", "T"]:
        gc_ = jax.grad(loss)(jnp.asarray(1.0, dtype), kind)
        assert gc_.dtype == dtype and float(gc_) == N_ONES, (kind, gc_)
    # ... and forward (the derivative kernel of the transpose sums over chunks)
    t = jax.jvp(
        lambda c: _ones_op(dtype, c).T.mv(jnp.ones(N_ONES, dtype)),
        (jnp.asarray(1.0, dtype),),
        (jnp.asarray(1.0, dtype),),
    )[1]
    assert t.dtype == dtype and float(t[0]) == N_ONES


# -- check_linear: dtype-aware tolerances, out-of-range indices -----------------------------------


def _typed_los(dtype):
    return lambda r, x: jnp.dot(los_weights(r).astype(dtype), x[r["idx"]])


# float32: tests/test_operator_errors.py's table rejects the same four non-linear row functions
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "name, wrap",
    [("square", lambda v: v**2), ("affine", lambda v: v + 1), ("exp", jnp.exp), ("abs", jnp.abs)],
)
def test_check_linear_catches_non_linear_in_low_precision(dtype, name, wrap):
    los = _typed_los(dtype)
    bad = chunkop.RowOperator(
        lambda r, x: wrap(los(r, x)), make_los_rows(64), jax.ShapeDtypeStruct((NPIX, K), dtype), chunk_size=8
    )
    with pytest.raises(ValueError, match="not linear in x"):
        chunkop.check_linear(bad)


ERROR_NAMES = {"zero", "superposition", "matvec", "adjoint"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64])
def test_check_linear_passes_linear_operators_in_every_dtype(dtype):
    """An array and a pytree output, three random draws each: every measured error within the
    dtype's default tolerance; ``A.T`` passes exactly when ``A`` does."""
    with jax.enable_x64(dtype == jnp.float64):
        rows = make_los_rows(200)
        struct = jax.ShapeDtypeStruct((NPIX, K), dtype)
        for row_fn in [
            _typed_los(dtype),
            lambda r, x: {"a": _typed_los(dtype)(r, x), "b": x[r["idx"], :2] * r["s"].astype(dtype)},
        ]:
            A = chunkop.RowOperator(row_fn, rows, struct, chunk_size=16)
            for k in range(3):
                errors = chunkop.check_linear(A, key=jax.random.key(k))
                assert set(errors) == ERROR_NAMES
                assert all(0.0 <= e <= chunkop._operator.checks.default_rtol(dtype) for e in errors.values()), errors
            assert chunkop.check_linear(A.T, key=jax.random.key(2)) == errors
            if dtype == jnp.float32:  # an explicit tolerance; and far within it
                assert max(chunkop.check_linear(A, key=jax.random.key(3), rtol=1e-4).values()) < 1e-5


def test_check_linear_passes_a_complex_operator():
    A = make_complex().op()
    errors = chunkop.check_linear(A)
    assert set(errors) == ERROR_NAMES and max(errors.values()) < 1e-5
    assert chunkop.check_linear(A.T) == errors


def test_check_linear_names_out_of_range_indices():
    A = make_square(12, 5).op()
    rows = dict(A.rows, i=A.rows["i"].at[3, 1].set(12 + 2))  # one gather index past the end
    A = chunkop.RowOperator(A.row_fn, rows, A.in_structure(), chunk_size=5)
    with pytest.raises(
        ValueError, match=r"agrees with jax.linear_transpose.*out of range.*clamps them.*transpose drops"
    ):
        chunkop.check_linear(A)


# -- empty outputs and inputs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "row_fn, struct",
    [
        (lambda r, x: x[r["idx"], :0] * r["d"], STRUCT),  # empty per-row outputs
        (lambda r, x: jnp.sum(x[r["idx"]]) * r["d"], jax.ShapeDtypeStruct((NPIX, 0), jnp.float32)),  # empty x
    ],
    ids=["empty_rows_out", "empty_x"],
)
def test_empty_outputs_and_inputs(row_fn, struct):
    A = chunkop.RowOperator(row_fn, ROWS, struct, chunk_size=3)
    ref = lambda x: jax.vmap(row_fn, (0, None))(ROWS, x)
    x = jnp.ones(struct.shape, struct.dtype)
    y = jnp.ones(A.out_structure().shape)
    assert_tree_allclose(A.mv(x), ref(x))
    assert_tree_allclose(A.T.mv(y), jax.linear_transpose(ref, struct)(y)[0])
    assert A.as_matrix().shape == (A.out_size(), A.in_size()) and A.T.as_matrix().shape == (A.in_size(), A.out_size())
    chunkop.check_linear(A)
    g = jax.grad(lambda d: jnp.sum(chunkop.RowOperator(row_fn, dict(ROWS, d=d), struct, chunk_size=3).mv(x)))(ROWS["d"])
    assert_tree_allclose(g, jnp.zeros_like(ROWS["d"]))


# -- lineax.diagonal without the n^2 matrix (its values: tests/test_operator_lineax.py) -------------


def test_diagonal_memory_does_not_grow_with_n_squared():
    """Measured: temp 64 MiB at n=4096 and 1 GiB at n=16384 when materialising; now ~16 MiB."""
    temps = []
    for n in [4096, 8192]:
        A = make_square(n, 1024).op()
        temps.append(jax.jit(lx.diagonal).lower(A).compile().memory_analysis().temp_size_in_bytes)
    assert temps[0] < 20 * 2**20 and temps[1] < 20 * 2**20, temps


# -- concrete values while row_fn is traced -------------------------------------------------------


def test_concrete_closed_over_values_in_python_control_flow_and_shapes():
    """``row_fn`` may use a closed-over concrete array in Python control flow (``float(...)``)
    and a NumPy table in a shape, as under ``jax.vmap``: the operator folds operations on
    concrete values when it traces ``row_fn``, as the transforms do for ``fun``."""
    gain = jnp.linspace(0.5, 1.5, NPIX, dtype=jnp.float32)
    table = np.array([K, 2])

    def row_fn(r, x):
        scale = 2.0 if float(gain.sum()) > 0 else -1.0  # concrete: gain is not traced
        pad = jnp.zeros(int(table[1]), x.dtype)
        return scale * gain[r["idx"]] * los_row(r, x) + pad.sum()

    reference = jax.vmap(row_fn, (0, None))(ROWS, X)  # jax.vmap accepts it
    A = chunkop.RowOperator(row_fn, ROWS, STRUCT, chunk_size=3)
    assert_tree_allclose(A.mv(X), reference, n_terms=K)
    check_against_dense(A, row_fn)
