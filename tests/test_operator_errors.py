"""Bad input to ``RowOperator`` and the functions that take one fails early, with a message that
names the argument and says what was expected and what it got.

``ERRORS`` is the table, ``(id, call, exception type, message regex)``, run by one parametrised
test: vectors that do not match the operator's structures (eagerly, under ``jit`` and
``vmap``), bad constructor arguments, ``row_fn``\\s that ``chunkop.check_linear`` rejects, and
bad arguments of ``A.normal``, ``lineax.diagonal``/``tridiagonal``, ``gram_diagonal``,
``to_scipy`` and ``check_linear``. The few behaviours next to those errors (what passes) follow.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from conftest import assert_tree_allclose
from operator_registry import ROWS, STRUCT, los_row, make_los

import chunkop

A = make_los().op(chunk=3)  # the registry's line-of-sight operator: a 7 x 4 sky, 10 rows
NPIX, K = STRUCT.shape
N = A.n_rows
PSTRUCT = {"a": STRUCT, "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
AP = chunkop.RowOperator(lambda r, x: los_row(r, x["a"]) + x["b"][0], ROWS, PSTRUCT, chunk_size=4)


class Error(NamedTuple):
    id: str
    call: Callable[[], Any]
    exc: type[Exception]
    match: str  # a regex searched in the message


def _build(row_fn=los_row, rows=ROWS, struct=STRUCT, **kw):
    return lambda: chunkop.RowOperator(row_fn, rows, struct, **({"chunk_size": 3} | kw))


def _stop_gradient_in_inner_jit(r, x):
    return jax.jit(lambda r, x: los_row(r, jax.lax.stop_gradient(x)))(r, x)


def _nan_fill_op():
    """``jnp.take``'s default ``mode='fill'`` reads NaN out of range: every measured error would
    be NaN, which must fail (a NaN compares False with any tolerance)."""
    return chunkop.RowOperator(
        lambda r, x: jnp.take(x, r["i"] + NPIX, axis=0), {"i": jnp.arange(4) % NPIX}, STRUCT, chunk_size=3
    )


# -- vectors that do not match the operator's structures ---------------------------------------------

BAD_X = {
    "shape": (jnp.zeros((NPIX, K + 1)), "float32[7, 5]"),
    "rank": (jnp.zeros((NPIX * K,)), "float32[28]"),
    "dtype_int": (jnp.zeros((NPIX, K), jnp.int32), "int32[7, 4]"),
    "dtype_half": (jnp.zeros((NPIX, K), jnp.float16), "float16[7, 4]"),
    "dtype_complex": (jnp.zeros((NPIX, K), jnp.complex64), "complex64[7, 4]"),
    "tree_dict": ({"x": jnp.zeros((NPIX, K))}, "{'x': 'float32[7, 4]'}"),
    "tree_tuple": ((jnp.zeros((NPIX, K)), jnp.zeros((NPIX, K))), "('float32[7, 4]', 'float32[7, 4]')"),
}
BAD_Y = {
    "shape": (jnp.zeros((N + 1,)), "float32[11]"),
    "rank": (jnp.zeros((N, 1)), "float32[10, 1]"),
    "dtype": (jnp.zeros((N,), jnp.int32), "int32[10]"),
    "tree": ([jnp.zeros((N,))], "['float32[10]']"),
    "x_instead_of_y": (jnp.zeros((NPIX, K)), "float32[7, 4]"),
}
BAD_CHUNK_SIZES = [
    (0, ValueError, "positive int, got 0"),
    (-1, ValueError, "positive int, got -1"),
    (2.5, TypeError, "got 2.5 of type float"),
    (True, TypeError, "got True of type bool"),
    (None, TypeError, "required and must be a positive int, got None"),
    ("4", TypeError, "got '4' of type str"),
    (np.float32(4.0), TypeError, "of type float32"),
]
NON_LINEAR = [
    ("exp", lambda r, x: jnp.exp(los_row(r, x)), r"not linear in x: A\(0\) = .* is not 0"),
    ("affine", lambda r, x: los_row(r, x) + 1.0, r"not linear in x: A\(0\) = .* is not 0"),
    (
        "square",
        lambda r, x: los_row(r, x) ** 2,
        r"not linear in x: A\(a x1 \+ b x2\) differs from a A\(x1\) \+ b A\(x2\)",
    ),
    ("abs", lambda r, x: jnp.abs(los_row(r, x)), r"not linear in x: A\(a x1 \+ b x2\) differs"),
    ("weights_from_x", lambda r, x: los_row(r, x) * jnp.sum(x), r"A\(a x1 \+ b x2\) differs"),
]
EXPECTED_X = re.escape("expected float32[7, 4], got ")

ERRORS = [
    *(
        Error(f"mv-{name}", lambda x=x: A.mv(x), ValueError, rf"RowOperator\.mv: .*{EXPECTED_X}{re.escape(got)}")
        for name, (x, got) in BAD_X.items()
    ),
    Error(
        "mv-under_jit",
        lambda: jax.jit(lambda x: A.mv(x))(jnp.zeros((NPIX, K + 1))),
        ValueError,
        EXPECTED_X + r"float32\[7, 5\]",
    ),
    # vmapping over an unbatched x: each example is a row of it
    Error("mv-under_vmap", lambda: jax.vmap(A.mv)(jnp.zeros((NPIX, K))), ValueError, EXPECTED_X + r"float32\[4\]"),
    Error(
        "mv-pytree_keys",
        lambda: AP.mv({"a": jnp.zeros((NPIX, K)), "c": jnp.zeros(3)}),
        ValueError,
        re.escape("expected {'a': 'float32[7, 4]', 'b': 'float32[3]'}, got {'a': 'float32[7, 4]', 'c': 'float32[3]'}"),
    ),
    Error(
        "mv-pytree_leaf_shape",
        lambda: AP.mv({"a": jnp.zeros((NPIX, K)), "b": jnp.zeros(2)}),
        ValueError,
        re.escape("got {'a': 'float32[7, 4]', 'b': 'float32[2]'}"),
    ),
    *(
        Error(
            f"T.mv-{name}",
            lambda y=y: A.T.mv(y),
            ValueError,
            rf"RowOperator\.T\.mv: .*{re.escape('expected float32[10], got ')}{re.escape(got)}",
        )
        for name, (y, got) in BAD_Y.items()
    ),
    # -- construction
    Error(
        "rows-leading_sizes_differ",
        _build(rows={**ROWS, "s": ROWS["s"][:-1]}),
        ValueError,
        re.escape("rows['d'] has 10 rows but rows['s'] has 9"),
    ),
    Error(
        "rows-nested_leaf_paths",
        _build(lambda r, x: x[0], {"a": (jnp.zeros(5), jnp.zeros((5, 2))), "b": [jnp.zeros((4, 3))]}),
        ValueError,
        re.escape("rows['a'][0] has 5 rows but rows['b'][0] has 4"),
    ),
    Error(
        "rows-scalar_array_leaf",
        _build(lambda r, x: x[0, 0], {"i": jnp.zeros(3), "w": jnp.float32(1.0)}, chunk_size=2),
        ValueError,
        re.escape("rows['w'] is"),
    ),
    Error(
        "rows-python_scalar_leaf",
        _build(lambda r, x: x[0, 0], {"i": jnp.zeros(3), "w": 2.0}, chunk_size=2),
        ValueError,
        "leading row axis",
    ),
    Error("rows-empty", _build(lambda r, x: x[0, 0], {}, chunk_size=2), ValueError, "at least one array leaf"),
    *(
        Error(f"chunk_size={bad!r}", _build(chunk_size=bad), exc, rf"RowOperator: `chunk_size` .*{re.escape(msg)}")
        for bad, exc, msg in BAD_CHUNK_SIZES
    ),
    Error(
        "chunk_size_keyword_only",
        lambda: chunkop.RowOperator(los_row, ROWS, STRUCT, 3),
        TypeError,
        "positional arguments but 5 were given",
    ),
    Error("row_fn_not_callable", _build("not a function"), TypeError, "must be callable"),
    Error(
        "in_structure_int",
        _build(struct=jax.ShapeDtypeStruct((NPIX, K), jnp.int32)),
        TypeError,
        "float arrays, got dtype int32",
    ),
    Error("in_structure_a_shape", _build(struct=(NPIX, K)), TypeError, "ShapeDtypeStruct"),
    # lineax itself rejects a symmetric/PSD tag on an operator whose in/out structures differ
    Error("symmetric_tag_not_square", _build(tags=lx.symmetric_tag), ValueError, "matching input and output"),
    # row_fn is traced when the operator is built: one that does not fit the rows fails there
    Error("row_fn_does_not_fit_rows", _build(lambda r, x: r["missing"] * x[0, 0]), KeyError, "missing"),
    # stop_gradient(x) is linear in value but has no derivative: the kernels (built from row_fn's
    # linearisation) would give mv = 0; refused when built, also inside an inner jit
    *(
        Error(
            f"row_fn_stops_gradient_of_x{suffix}",
            _build(row_fn),
            ValueError,
            r"RowOperator: `row_fn` applies `jax.lax.stop_gradient` to `x`",
        )
        for suffix, row_fn in [
            ("", lambda r, x: jax.lax.stop_gradient(los_row(r, x))),
            ("_in_jit", _stop_gradient_in_inner_jit),
        ]
    ),
    Error("out_sharding", _build(out_sharding="sharded"), ValueError, "`out_sharding` must be"),
    Error(
        "progress",
        _build(progress="yes"),
        TypeError,
        r"RowOperator: `progress` must be None, True/False or a callable",
    ),
    # -- check_linear
    *(
        Error(
            f"check_linear-{name}{'-T' if transposed else ''}",
            lambda row_fn=row_fn, transposed=transposed: chunkop.check_linear(
                _build(row_fn)().T if transposed else _build(row_fn)()
            ),
            ValueError,
            r"^check_linear: .*" + pattern,
        )
        for name, row_fn, pattern in NON_LINEAR
        for transposed in (False, True)
    ),
    Error(
        "check_linear-nan_fill_out_of_range",
        lambda: chunkop.check_linear(_nan_fill_op()),
        ValueError,
        r"check_linear: row_fn gives non-finite values.*out-of-range indices",
    ),
    *(
        Error(
            f"{name}-operator_type={bad_name}", lambda fn=fn, bad=bad: fn(bad), TypeError, f"{name}: `operator` must be"
        )
        for name, fn in [("to_scipy", chunkop.to_scipy), ("check_linear", chunkop.check_linear)]
        for bad_name, bad in [("array", np.eye(3)), ("function", lambda x: x), ("str", "A")]
    ),
    # -- the other functions on operators
    *(
        Error(
            f"normal-damping={bad!r}",
            lambda bad=bad: A.normal(bad),
            ValueError,
            "`damping` must be a non-negative real scalar",
        )
        for bad in [-1.0, [1.0, 2.0], 1j, float("nan")]
    ),
    Error(
        "lineax.diagonal-not_square",
        lambda: lx.diagonal(A),
        ValueError,
        r"lineax\.diagonal: the operator is not square",
    ),
    Error("lineax.tridiagonal-not_square", lambda: lx.tridiagonal(A.T), ValueError, "not square"),
    Error("gram_diagonal-transpose", lambda: chunkop.gram_diagonal(A.T), TypeError, "RowOperator"),
    # (scipy's own message: "Dimension mismatch" from scipy 1.18 on)
    Error("to_scipy-matvec_size", lambda: chunkop.to_scipy(A).matvec(np.ones(7)), ValueError, "(?i)dimension mismatch"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c.id for c in ERRORS])
def test_error(case):
    with pytest.raises(case.exc, match=case.match):
        case.call()


# -- what passes ----------------------------------------------------------------------------------


def test_a_batch_of_vectors_passes_under_vmap():
    assert jax.vmap(A.mv)(jnp.zeros((2, NPIX, K))).shape == (2, N)


def test_numpy_and_python_inputs_are_accepted():
    # NumPy float64 arrays are canonicalised to float32 (x64 is off), as jnp.asarray would.
    assert A.mv(np.zeros((NPIX, K))).dtype == jnp.float32
    assert A.T.mv(np.zeros(N)).dtype == jnp.float32


def test_chunk_size_is_auto_by_default():
    auto = chunkop.RowOperator(los_row, ROWS, STRUCT)
    assert auto.budget_plan is not None and chunkop.plan(auto) is auto.budget_plan
    x = jnp.linspace(0.5, 1.5, NPIX * K).reshape(NPIX, K)
    assert_tree_allclose(auto.mv(x), A.mv(x), n_terms=K)  # a row: a dot product over K bins


def test_stop_gradient_of_the_rows_is_fine():
    """``stop_gradient`` of the row's own weights (not of ``x``) builds and applies."""
    B = chunkop.RowOperator(lambda r, x: los_row(jax.lax.stop_gradient(r), x), ROWS, STRUCT, chunk_size=3)
    x = jnp.linspace(0.0, 1.0, NPIX * K).reshape(STRUCT.shape)
    assert_tree_allclose(B.mv(x), A.mv(x), n_terms=K)


def test_jit_of_a_bound_method_says_how_to_jit_it():
    """``jax.jit(A.mv)`` hashes the bound method's operator, whose rows are arrays: a
    ``TypeError`` that names the forms that work (issue #42), each of which then works."""
    rows = {"i": jnp.array([0, 1, 2]), "w": jnp.ones(3)}
    A = chunkop.RowOperator(
        lambda r, x: r["w"] * x[r["i"]], rows, jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2
    )
    x = jnp.arange(3.0)
    for method in (A.mv, A.T.mv):
        with pytest.raises(TypeError, match=r"not hashable.*jax\.jit\(lambda x: A\.mv\(x\)\)"):
            jax.jit(method)(x)
    expected = A.mv(x)
    np.testing.assert_array_equal(jax.jit(lambda v: A.mv(v))(x), expected)
    np.testing.assert_array_equal(jax.jit(lambda op, v: op.mv(v))(A, x), expected)
    np.testing.assert_array_equal(eqx.filter_jit(A.mv)(x), expected)
