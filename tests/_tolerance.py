"""Float tolerances that follow from the computation, not from one machine's rounding.

A chunked result and its reference (``jax.vmap``, a dense matrix, ``jax.linear_transpose``)
evaluate the same mathematical expression in another order: sums are split over chunks and
reassociated, and XLA fuses, vectorises and contracts (FMA) the elementwise work differently at
each optimisation level and instruction set. Both are correctly rounded only to within a few
units in the last place (ulps) per operation, so two evaluations of a sum of ``n`` terms differ
by at most about ``eps * (n + depth) * sum(|terms|)`` (the classic bound for recursive
summation, plus the elementwise work of ``depth`` operations per term). Relative to the result
that is ``eps * (n + depth) * condition``, where ``condition = sum(|terms|) / |sum(terms)|``
measures the cancellation.

:func:`rtol_for` turns that into a relative tolerance; :func:`sum_atol` gives the elementwise
absolute bound when the terms are at hand (cheap for per-example gradients: ``jax.vmap`` of the
per-example function); :func:`assert_tree_allclose` (``conftest`` re-exports it) compares two
pytrees with them. Exact claims (integer results, pass-through values, chunk-size independence
with the same reduction order) are compared exactly, never through these.

Example:
    >>> import numpy as np
    >>> rtol_for(np.float32, n_terms=10) < 1e-4
    True
    >>> terms = np.array([[1.0, 1e-3], [-1.0, 1e-3]], np.float32)  # column 0 cancels exactly
    >>> bool(sum_atol(terms)[0] > 1000 * sum_atol(terms)[1])  # bounded by |terms|, not |sum|
    True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEPTH", "ULPS", "assert_close", "assert_tree_allclose", "eps", "leaf_tolerances", "rtol_for", "sum_atol"]

#: Rounding errors allowed per operation (a correctly rounded op is within 0.5 ulp; vectorised
#: transcendental functions (exp, tanh, log) are within a few ulps of each other).
ULPS = 8
#: Elementwise operations per term counted on top of the reduction length: the depth of a
#: small per-example function (a matmul, a nonlinearity, its derivative).
DEPTH = 8


def eps(dtype: Any) -> float:
    """Machine epsilon of ``dtype`` (a complex dtype: that of its real part)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        dtype = jnp.finfo(dtype).dtype
    return float(jnp.finfo(dtype).eps)


def rtol_for(dtype: Any, n_terms: int = 1, condition: float = 1.0, depth: int = DEPTH) -> float:
    """Relative tolerance between two evaluations of the same ``dtype`` computation.

    Args:
        dtype: the results' dtype.
        n_terms: the length of the longest sum that the two evaluations order differently (a
            gradient w.r.t. a broadcast parameter: the number of examples; a matvec: the
            length of a row's dot product; 1 for elementwise results).
        condition: ``sum(|terms|) / |sum(terms)|`` where known (the cancellation; >= 1).
        depth: the elementwise operations per term (see :data:`DEPTH`).

    Returns:
        ``ULPS * eps(dtype) * (n_terms + depth) * condition``.
    """
    return ULPS * eps(dtype) * (max(int(n_terms), 1) + depth) * max(float(condition), 1.0)


def sum_atol(terms: Any, axis: int = 0, depth: int = DEPTH) -> np.ndarray:
    """Elementwise absolute bound on the difference of two orderings of ``sum(terms, axis)``.

    Args:
        terms: the summands, stacked along ``axis`` (e.g. per-example gradients).
        axis: the summed axis.
        depth: the elementwise operations per term.

    Returns:
        ``ULPS * eps * (n + depth) * sum(|terms|, axis)``, in float64: it does not shrink where
        the terms cancel, as a relative tolerance would.
    """
    t = np.asarray(terms)
    n = t.shape[axis]
    return (
        ULPS
        * eps(t.dtype)
        * (n + depth)
        * np.sum(np.abs(t.astype(np.complex128 if np.iscomplexobj(t) else np.float64)), axis)
    )


def leaf_tolerances(expected: Any, *, n_terms: int, condition: float, depth: int, terms: Any = None) -> tuple:
    """``(rtol, atol)`` for one float leaf ``expected`` (see :func:`assert_close`)."""
    dtype = jax.dtypes.canonicalize_dtype(np.asarray(expected).dtype)
    rtol = rtol_for(dtype, n_terms, condition, depth)
    if terms is not None:
        return 0.0, sum_atol(terms, 0, depth)
    finite = np.abs(np.asarray(expected))[np.isfinite(expected)]  # (a NaN or inf is compared as itself)
    scale = float(np.max(finite)) if finite.size else 0.0
    return rtol, rtol * scale


def _assert_within(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: Any, err_msg: str) -> None:
    """``|actual - expected| <= atol + rtol |expected|`` elementwise (``atol`` may be an array);
    NaNs and infinities must match exactly. Raises with the worst element."""
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"NaN positions differ {err_msg}")
    inf = np.isinf(expected) | np.isinf(actual)
    np.testing.assert_array_equal(actual[inf], expected[inf], err_msg=f"infinities differ {err_msg}")
    ok = np.isfinite(expected) & np.isfinite(actual)
    diff = np.abs(actual - expected)
    bound = np.broadcast_to(atol + rtol * np.abs(expected), diff.shape)
    bad = ok & (diff > bound)
    if bad.any():
        ratio = np.where(bad, diff / np.where(bound > 0, bound, np.finfo(np.float64).tiny), 0)
        k = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        raise AssertionError(
            f"{int(bad.sum())} of {diff.size} elements differ beyond the tolerance {err_msg}; worst at "
            f"{tuple(int(j) for j in k)}: actual {actual[k]!r}, expected {expected[k]!r}, |diff| {diff[k]:.3g} "
            f"> bound {bound[k]:.3g}"
        )


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _as_numpy(x):
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _canonical_dtype(x):
    if isinstance(x, jax.Array):
        return x.dtype
    return jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)


def assert_tree_allclose(
    actual,
    expected,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    n_terms: int = 1,
    condition: float = 1.0,
    terms=None,
    depth: int = DEPTH,
    check_dtype: bool = True,
    err_msg: str = "",
):
    """``actual`` equals ``expected``: same tree, shapes and dtypes; float values to the tolerance
    of the computation (``_tolerance``: from the dtype, ``n_terms`` (the longest sum the two
    evaluations order differently), ``condition`` (its cancellation), or the summands ``terms``),
    or to an explicit ``rtol``/``atol``; other values exactly."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"tree structure differs:\n  actual:   {a_tree}\n  expected: {e_tree}"
    t_leaves = [None] * len(e_leaves) if terms is None else jax.tree_util.tree_leaves(terms)
    assert len(t_leaves) == len(e_leaves), "`terms` must have one leaf per leaf of `expected`"
    for i, (a, e, t) in enumerate(zip(a_leaves, e_leaves, t_leaves)):
        a_shape, e_shape = np.shape(a), np.shape(e)
        assert a_shape == e_shape, f"leaf {i}: shape {a_shape} != expected {e_shape}"
        if check_dtype:
            # Python scalars / NumPy arrays (which jax.vmap passes through unmapped outputs
            # untouched) are compared by the dtype JAX would give them.
            a_dtype, e_dtype = _canonical_dtype(a), _canonical_dtype(e)
            assert a_dtype == e_dtype, f"leaf {i}: dtype {a_dtype} != expected {e_dtype}"
        assert _is_key(a) == _is_key(e), f"leaf {i}: one is a PRNG key array and the other is not"
        an, en = _as_numpy(a), _as_numpy(e)
        if np.issubdtype(en.dtype, np.inexact):
            r, t_abs = leaf_tolerances(en, n_terms=n_terms, condition=condition, depth=depth, terms=t)
            rt, at = (r if rtol is None else rtol), (t_abs if atol is None else atol)
            if np.ndim(at):  # an elementwise bound (from `terms`)
                _assert_within(an, en, rt, np.asarray(at), f"leaf {i} {err_msg}".strip())
            else:
                np.testing.assert_allclose(an, en, rtol=rt, atol=at, err_msg=f"leaf {i} {err_msg}".strip())
        else:
            np.testing.assert_array_equal(an, en, err_msg=f"leaf {i} {err_msg}".strip())


#: The name the tolerance helper's docs use.
assert_close = assert_tree_allclose
