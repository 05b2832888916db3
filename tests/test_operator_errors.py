"""Bad input to ``RowOperator`` fails early with a message that says what was expected and got;
``chunkop.check_linear`` passes linear operators and rejects non-linear ``row_fn``s.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from operator_registry import los_row, make_los_rows

import chunkop

NPIX, K, N = 7, 4, 10
STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)


def make_rows(n=N, seed=0):
    return make_los_rows(n, NPIX, seed)


ROWS = make_rows()
A = chunkop.RowOperator(los_row, ROWS, STRUCT, chunk_size=3)


# -- vectors that do not match the operator's structures ----------------------------------------

BAD_X = {
    "shape": (jnp.zeros((NPIX, K + 1)), "float32[7, 5]"),
    "rank": (jnp.zeros((NPIX * K,)), "float32[28]"),
    "dtype_int": (jnp.zeros((NPIX, K), jnp.int32), "int32[7, 4]"),
    "dtype_half": (jnp.zeros((NPIX, K), jnp.float16), "float16[7, 4]"),
    "dtype_complex": (jnp.zeros((NPIX, K), jnp.complex64), "complex64[7, 4]"),
    "tree_dict": ({"x": jnp.zeros((NPIX, K))}, "{'x': 'float32[7, 4]'}"),
    "tree_tuple": ((jnp.zeros((NPIX, K)), jnp.zeros((NPIX, K))), "('float32[7, 4]', 'float32[7, 4]')"),
}


@pytest.mark.parametrize("case", list(BAD_X))
def test_mv_rejects_mismatched_x(case):
    x, got = BAD_X[case]
    with pytest.raises(ValueError, match=r"RowOperator\.mv") as info:
        A.mv(x)
    msg = str(info.value)
    assert "expected float32[7, 4]" in msg, msg
    assert f"got {got}" in msg, msg


def test_mv_rejects_mismatched_x_under_jit_and_vmap():
    with pytest.raises(ValueError, match=re.escape("expected float32[7, 4], got float32[7, 5]")):
        jax.jit(lambda x: A.mv(x))(jnp.zeros((NPIX, K + 1)))
    # vmapping over an unbatched x: each example is a row of it
    with pytest.raises(ValueError, match=re.escape("expected float32[7, 4], got float32[4]")):
        jax.vmap(A.mv)(jnp.zeros((NPIX, K)))
    # and a correct batch passes
    assert jax.vmap(A.mv)(jnp.zeros((2, NPIX, K))).shape == (2, N)


def test_mv_pytree_structure_mismatch_names_both():
    struct = {"a": STRUCT, "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    Ap = chunkop.RowOperator(lambda r, x: los_row(r, x["a"]) + x["b"][0], ROWS, struct, chunk_size=4)
    with pytest.raises(ValueError) as info:
        Ap.mv({"a": jnp.zeros((NPIX, K)), "c": jnp.zeros(3)})
    msg = str(info.value)
    assert "expected {'a': 'float32[7, 4]', 'b': 'float32[3]'}" in msg, msg
    assert "got {'a': 'float32[7, 4]', 'c': 'float32[3]'}" in msg, msg
    with pytest.raises(ValueError, match=re.escape("got {'a': 'float32[7, 4]', 'b': 'float32[2]'}")):
        Ap.mv({"a": jnp.zeros((NPIX, K)), "b": jnp.zeros(2)})


BAD_Y = {
    "shape": (jnp.zeros((N + 1,)), "float32[11]"),
    "rank": (jnp.zeros((N, 1)), "float32[10, 1]"),
    "dtype": (jnp.zeros((N,), jnp.int32), "int32[10]"),
    "tree": ([jnp.zeros((N,))], "['float32[10]']"),
    "x_instead_of_y": (jnp.zeros((NPIX, K)), "float32[7, 4]"),
}


@pytest.mark.parametrize("case", list(BAD_Y))
def test_transpose_mv_rejects_mismatched_y(case):
    y, got = BAD_Y[case]
    with pytest.raises(ValueError, match=r"RowOperator\.T\.mv") as info:
        A.T.mv(y)
    msg = str(info.value)
    assert "expected float32[10]" in msg, msg
    assert f"got {got}" in msg, msg


def test_numpy_and_python_inputs_are_accepted():
    # NumPy float64 arrays are canonicalised to float32 (x64 is off), as jnp.asarray would.
    assert A.mv(np.zeros((NPIX, K))).dtype == jnp.float32
    assert A.T.mv(np.zeros(N)).dtype == jnp.float32


# -- construction -------------------------------------------------------------------------------


def test_rows_with_different_leading_sizes_name_both_leaves():
    rows = {**ROWS, "s": ROWS["s"][:-1]}
    with pytest.raises(ValueError) as info:
        chunkop.RowOperator(los_row, rows, STRUCT, chunk_size=3)
    msg = str(info.value)
    assert "rows['d'] has 10 rows" in msg and "rows['s'] has 9" in msg, msg


def test_rows_nested_leaf_paths_in_message():
    rows = {"a": (jnp.zeros(5), jnp.zeros((5, 2))), "b": [jnp.zeros((4, 3))]}
    with pytest.raises(ValueError, match=re.escape("rows['a'][0] has 5 rows but rows['b'][0] has 4")):
        chunkop.RowOperator(lambda r, x: x[0], rows, STRUCT, chunk_size=3)


def test_rows_scalar_leaf_and_empty_rows():
    with pytest.raises(ValueError, match=re.escape("rows['w'] is")):
        chunkop.RowOperator(lambda r, x: x[0, 0], {"i": jnp.zeros(3), "w": jnp.float32(1.0)}, STRUCT, chunk_size=2)
    with pytest.raises(ValueError, match="leading row axis"):
        chunkop.RowOperator(lambda r, x: x[0, 0], {"i": jnp.zeros(3), "w": 2.0}, STRUCT, chunk_size=2)
    with pytest.raises(ValueError, match="at least one array leaf"):
        chunkop.RowOperator(lambda r, x: x[0, 0], {}, STRUCT, chunk_size=2)


@pytest.mark.parametrize(
    "chunk, exc, pattern",
    [
        (0, ValueError, "positive int, got 0"),
        (-1, ValueError, "positive int, got -1"),
        (2.5, TypeError, "got 2.5 of type float"),
        (True, TypeError, "got True of type bool"),
        (None, TypeError, "required and must be a positive int, got None"),
        ("4", TypeError, "got '4' of type str"),
        (np.float32(4.0), TypeError, "of type float32"),
    ],
)
def test_invalid_chunk_size(chunk, exc, pattern):
    with pytest.raises(exc, match=re.escape(pattern)) as info:
        chunkop.RowOperator(los_row, ROWS, STRUCT, chunk_size=chunk)
    assert "RowOperator" in str(info.value) and "chunk_size" in str(info.value)


def test_chunk_size_is_keyword_only_and_auto_by_default():
    with pytest.raises(TypeError):
        chunkop.RowOperator(los_row, ROWS, STRUCT, 3)
    A = chunkop.RowOperator(los_row, ROWS, STRUCT)
    assert A.budget_plan is not None and chunkop.plan(A) is A.budget_plan
    B = chunkop.RowOperator(los_row, ROWS, STRUCT, chunk_size=3)
    x = jnp.linspace(0.5, 1.5, NPIX * K).reshape(NPIX, K)
    np.testing.assert_allclose(A.mv(x), B.mv(x), rtol=1e-5, atol=1e-6)


def test_bad_row_fn_and_in_structure():
    with pytest.raises(TypeError, match="must be callable"):
        chunkop.RowOperator("not a function", ROWS, STRUCT, chunk_size=3)
    with pytest.raises(TypeError, match="float arrays, got dtype int32"):
        chunkop.RowOperator(los_row, ROWS, jax.ShapeDtypeStruct((NPIX, K), jnp.int32), chunk_size=3)
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        chunkop.RowOperator(los_row, ROWS, (NPIX, K), chunk_size=3)


def test_symmetric_tags_need_matching_structures():
    """lineax itself rejects a symmetric/PSD tag on an operator whose in/out structures differ."""
    with pytest.raises(ValueError, match="matching input and output"):
        chunkop.RowOperator(los_row, ROWS, STRUCT, chunk_size=3, tags=lx.symmetric_tag)


def test_row_fn_errors_surface_at_construction():
    """``row_fn`` is traced when the operator is built: one that does not fit the rows fails there."""
    with pytest.raises(KeyError):
        chunkop.RowOperator(lambda r, x: r["missing"] * x[0, 0], ROWS, STRUCT, chunk_size=3)


# -- check_linear -------------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
def test_check_linear_passes_for_linear_operators(transposed):
    errors = chunkop.check_linear(A.T if transposed else A)
    assert set(errors) == {"zero", "superposition", "matvec", "adjoint"}
    assert all(0.0 <= e < 1e-5 for e in errors.values()), errors
    # pytree input and output, another key, a tolerance
    struct = {"a": STRUCT, "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
    Ap = chunkop.RowOperator(lambda r, x: {"p": los_row(r, x["a"]), "q": r["s"] * x["b"]}, ROWS, struct, chunk_size=4)
    errors = chunkop.check_linear(Ap, key=jax.random.key(3), rtol=1e-4)
    assert max(errors.values()) < 1e-5


@pytest.mark.parametrize(
    "name, row_fn, pattern",
    [
        ("exp", lambda r, x: jnp.exp(los_row(r, x)), r"not linear in x: A\(0\) = .* is not 0"),
        ("affine", lambda r, x: los_row(r, x) + 1.0, r"not linear in x: A\(0\) = .* is not 0"),
        (
            "square",
            lambda r, x: los_row(r, x) ** 2,
            r"not linear in x: A\(a x1 \+ b x2\) differs from a A\(x1\) \+ b A\(x2\)",
        ),
        ("abs", lambda r, x: jnp.abs(los_row(r, x)), r"not linear in x: A\(a x1 \+ b x2\) differs"),
        ("weights_from_x", lambda r, x: los_row(r, x) * jnp.sum(x), r"A\(a x1 \+ b x2\) differs"),
    ],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_check_linear_rejects_non_linear_row_fn(name, row_fn, pattern, transposed):
    bad = chunkop.RowOperator(row_fn, ROWS, STRUCT, chunk_size=3)
    with pytest.raises(ValueError, match=pattern) as info:
        chunkop.check_linear(bad.T if transposed else bad)
    assert str(info.value).startswith("check_linear:")


def test_row_fn_stopping_the_gradient_of_x_is_refused_at_construction():
    """``stop_gradient(x)`` is linear in value, but has no derivative: the operator's kernels
    (built from ``row_fn``'s linearisation) would give ``mv = 0``; it is refused when built,
    also inside an inner jit. ``stop_gradient`` of the row's own weights is fine."""
    for row_fn in (
        lambda r, x: jax.lax.stop_gradient(los_row(r, x)),
        lambda r, x: jax.jit(lambda r, x: los_row(r, jax.lax.stop_gradient(x)))(r, x),
    ):
        with pytest.raises(ValueError, match=r"RowOperator: `row_fn` applies `jax.lax.stop_gradient` to `x`"):
            chunkop.RowOperator(row_fn, ROWS, STRUCT, chunk_size=3)
    A = chunkop.RowOperator(lambda r, x: los_row(jax.lax.stop_gradient(r), x), ROWS, STRUCT, chunk_size=3)
    ref = chunkop.RowOperator(los_row, ROWS, STRUCT, chunk_size=3)
    x = jnp.linspace(0.0, 1.0, int(np.prod(STRUCT.shape))).reshape(STRUCT.shape)
    np.testing.assert_allclose(A.mv(x), ref.mv(x), rtol=1e-6)


def test_check_linear_names_out_of_range_indices_that_fill_nan():
    """``jnp.take``'s default ``mode='fill'`` reads NaN out of range: every measured error would
    be NaN, which must fail (a NaN compares False with any tolerance), naming the likely cause."""
    n = int(STRUCT.shape[0])
    bad = chunkop.RowOperator(
        lambda r, x: jnp.take(x, r["i"] + n, axis=0), {"i": jnp.arange(4) % n}, STRUCT, chunk_size=3
    )
    with pytest.raises(ValueError, match=r"check_linear: row_fn gives non-finite values.*out-of-range indices"):
        chunkop.check_linear(bad)
