"""``chunkop.check_linear``: catch a ``row_fn`` that is not linear in ``x``.

``RowOperator`` trusts ``row_fn`` to be linear in ``x`` (its transpose and derivative rules rely
on it). A non-linear ``row_fn`` (an ``exp(x)``, an ``x + 1``, an ``x ** 2``...) would give a
silently wrong transpose, so check new operators once on random vectors.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from .._vmap import vmap as chunked_vmap
from . import row_sharding
from .row_operator import AbstractRowOperator, TransposedRowOperator, row_form

__all__ = ["check_linear", "default_rtol"]


@jax.jit
def _mv(operator: Any, x: Any) -> Any:
    return operator.mv(x)


@jax.jit
def _row_fn_mv(operator: Any, x: Any) -> Any:
    """``A x`` from ``row_fn`` itself (a chunked vmap), independent of the operator's kernels.

    The kernels apply each chunk's linearisation of ``row_fn`` (exact for a linear ``row_fn``,
    but linear whatever ``row_fn`` is), so linearity must be tested on ``row_fn`` directly.
    Rows sharded over devices are evaluated where the kernels run them (``row_sharding.map_rows``).
    """
    values = chunked_vmap(operator.row_fn, in_axes=(0, None), chunk_size=operator.chunk_size)
    return row_sharding.map_rows(values, operator.rows, x)


@jax.jit
def _rmv(operator: Any, y: Any) -> Any:
    return operator.T.mv(y)


def _random_like(key: jax.Array, structure: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(structure)
    keys = jax.random.split(key, max(len(leaves), 1))
    return jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)])


def _wide(a: jax.Array) -> jax.Array:
    """``a`` in at least float32, so that the check's own sums do not lose bfloat16 precision."""
    return a.astype(jnp.promote_types(a.dtype, jnp.float32))


def _pairing(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    """The bilinear pairing ``sum a * b`` (no conjugation: ``A.T`` is the transpose, not the
    adjoint) and the sum of its terms' absolute values ``sum |a * b|``, which rounding errors
    scale with however much the pairing cancels."""
    terms = [_wide(x) * _wide(y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
    return sum(jnp.sum(t) for t in terms), sum(jnp.sum(jnp.abs(t)) for t in terms)


def default_rtol(dtype: Any) -> float:
    """The default tolerance for ``dtype``: ``min(1000 eps, sqrt(eps))``.

    ``1000 eps`` for float32/float64 (1.2e-4, 2.2e-13); ``sqrt(eps)`` for the low-precision
    types (bfloat16: 0.088, float16: 0.031), where ``1000 eps`` (7.8 in bfloat16) would accept
    ``x ** 2``, ``x + 1``, ``exp(x)`` or ``abs(x)``.
    """
    eps = float(jnp.finfo(dtype).eps)
    return min(1000 * eps, eps**0.5)


def _num(v: jax.Array) -> str:
    return f"{complex(v):.6g}" if jnp.iscomplexobj(v) else f"{float(v):.6g}"


def _norm(a: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.abs(_wide(x)) ** 2) for x in jax.tree_util.tree_leaves(a)))


def _diff_norm(a: Any, b: Any) -> jax.Array:
    """``|a - b|`` over the pytrees' leaves, in at least float32."""
    return _norm(jax.tree_util.tree_map(lambda p, q: _wide(p) - _wide(q), a, b))


def check_linear(
    operator: AbstractRowOperator | TransposedRowOperator, *, key: jax.Array | None = None, rtol: float | None = None
) -> dict:
    """Check numerically that ``operator`` is linear and that ``operator.T`` is its transpose.

    Four tests on random vectors ``x1, x2`` (in the input space) and ``y`` (output space), where
    ``A(x)`` is ``row_fn`` evaluated row by row: ``A(0) == 0``; ``A(a x1 + b x2) == a A(x1) +
    b A(x2)``; ``operator.mv(x1) == A(x1)``; ``<A x1, y> == <x1, A^T y>`` (the bilinear pairing,
    no conjugation: ``A^T`` is the transpose). For ``A.T`` the tests are those of ``A``.

    The adjoint test's tolerance scales with the cancellation it sees: the pairings are sums
    whose terms (``(A x1)_i y_i`` and ``x1_j (A^T y)_j``) have random signs for random vectors,
    so they cancel, by ``kappa = sum |terms| / |sum terms|`` (about ``sqrt(n_rows)``: ~100 for
    a CT projector with 10^5 rays), while rounding errors grow with ``sum |terms|``. The
    relative difference of the pairings is allowed ``rtol * kappa``, at most 1% (or ``rtol``
    if larger): a transpose that is wrong by a factor, a wrong kernel or an antilinear
    ``row_fn`` (``conj(x)``) differ at O(1) and fail whatever the cancellation; an error
    confined to a few rows (out-of-range indices) is caught when it exceeds the tolerance.

    Args:
        operator: a :class:`chunkop.RowOperator` (or any :class:`chunkop.AbstractRowOperator`),
            or its transpose.
        key: PRNG key for the random vectors (default ``jax.random.key(0)``).
        rtol: relative tolerance (default :func:`default_rtol` of the operator's dtype:
            ``min(1000 eps, sqrt(eps))``, i.e. 1.2e-4 in float32 and 0.088 in bfloat16).

    Returns:
        A dict of the relative errors measured (``"zero"``, ``"superposition"``, ``"matvec"``,
        ``"adjoint"``); the first three are at most ``rtol``, ``"adjoint"`` at most its
        tolerance above.

    Raises:
        ValueError: naming the failed test and its error, e.g. when ``row_fn`` is not linear in
            ``x``. A failed adjoint test names its cause: a transpose kernel that does not
            transpose ``row_fn`` (a subclass's ``apply_transpose``); or, when the kernel agrees
            with ``jax.linear_transpose`` of ``row_fn``: rounding (when the difference is below
            ``sqrt(eps)`` of the pairings' absolute terms, as sums in ``row_fn`` that cancel
            give; the message names the dtype's rounding and the ``rtol=`` that would pass),
            out-of-range gather indices (the gather clamps them while the transpose drops
            their contributions), or, for a complex ``x``, a ``row_fn`` that is not
            complex-linear.
        TypeError: if ``operator`` is not a RowOperator (or its transpose).

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> rows = {"i": jnp.arange(4) % 3}
        >>> bad = chunkop.RowOperator(lambda r, x: jnp.exp(x[r["i"]]), rows,
        ...                           jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
        >>> chunkop.check_linear(bad)
        Traceback (most recent call last):
        ...
        ValueError: check_linear: the operator is not linear in x: A(0) = ...
        >>> good = chunkop.RowOperator(lambda r, x: 2.0 * x[r["i"]], rows,
        ...                            jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
        >>> sorted(chunkop.check_linear(good))  # each error within the default 1.2e-4
        ['adjoint', 'matvec', 'superposition', 'zero']
    """
    operator, _ = row_form(operator, "check_linear")  # A^T passes exactly when A does
    key = jax.random.key(0) if key is None else key
    in_struct, out_struct = operator.in_structure(), operator.out_structure()
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(in_struct))
    rtol = default_rtol(dtype) if rtol is None else rtol
    k1, k2, k3 = jax.random.split(key, 3)
    x1, x2, y = _random_like(k1, in_struct), _random_like(k2, in_struct), _random_like(k3, out_struct)
    mv = functools.partial(_row_fn_mv, operator)
    a, b = 0.7, -1.3
    ax1, ax2 = mv(x1), mv(x2)
    if not bool(jnp.isfinite(_norm(ax1) + _norm(ax2))):
        raise ValueError(
            "check_linear: row_fn gives non-finite values (NaN or inf) for finite random x. A likely "
            "cause: out-of-range indices read with a NaN fill (jnp.take's default mode='fill', "
            "x.at[idx].get(mode='fill')). Check the rows' indices."
        )
    tiny = jnp.finfo(dtype).tiny
    scale = _norm(ax1) + _norm(ax2) + tiny
    zero = jax.tree_util.tree_map(jnp.zeros_like, x1)
    errors = {
        "zero": float(_norm(mv(zero)) / scale),
        "superposition": float(
            _norm(
                jax.tree_util.tree_map(
                    lambda m, p, q: _wide(m) - (a * _wide(p) + b * _wide(q)),
                    mv(jax.tree_util.tree_map(lambda p, q: a * p + b * q, x1, x2)),
                    ax1,
                    ax2,
                )
            )
            / scale
        ),
    }
    if not errors["zero"] <= rtol:  # NaN fails too
        raise ValueError(
            f"check_linear: the operator is not linear in x: A(0) = {errors['zero']:.3g} x |A x| "
            f"is not 0 (an affine or non-linear row_fn?)."
        )
    if not errors["superposition"] <= rtol:  # NaN fails too
        raise ValueError(
            f"check_linear: the operator is not linear in x: A(a x1 + b x2) differs from "
            f"a A(x1) + b A(x2) by {errors['superposition']:.3g} (relative; tolerance {rtol:.3g})."
        )
    errors["matvec"] = float(_diff_norm(_mv(operator, x1), ax1) / (_norm(ax1) + tiny))
    if not errors["matvec"] <= rtol:  # NaN fails too
        raise ValueError(
            f"check_linear: operator.mv(x) differs from row_fn applied row by row by "
            f"{errors['matvec']:.3g} (relative; tolerance {rtol:.3g})."
        )
    aty = _rmv(operator, y)
    (lhs, lhs_abs), (rhs, rhs_abs) = _pairing(ax1, y), _pairing(x1, aty)
    size = jnp.abs(lhs) + jnp.abs(rhs)
    errors["adjoint"] = float(jnp.abs(lhs - rhs) / (size + tiny))
    cancellation = max(float((lhs_abs + rhs_abs) / (size + tiny)), 1.0)
    tolerance = _adjoint_tolerance(rtol, cancellation)
    if not errors["adjoint"] <= tolerance:  # NaN fails too
        raise ValueError(
            f"check_linear: <A x, y> = {_num(lhs)} but <x, A^T y> = {_num(rhs)} (relative error "
            f"{errors['adjoint']:.3g}, tolerance {tolerance:.3g}: rtol {rtol:.3g} times the pairings' "
            f"cancellation sum|terms|/|sum| = {cancellation:.3g}, at most {max(rtol, _MAX_ADJOINT_RTOL):.3g}). "
            f"{_adjoint_cause(operator, y, aty, rtol, errors['adjoint'], cancellation, dtype)}"
        )
    return errors


#: The most the adjoint test's tolerance grows to with cancellation (when ``rtol`` is smaller):
#: a wrong transpose differs at O(1), two orders of magnitude above.
_MAX_ADJOINT_RTOL = 0.01


def _adjoint_tolerance(rtol: float, cancellation: float) -> float:
    """The adjoint test's relative tolerance: ``rtol * cancellation``, at most
    ``max(rtol, _MAX_ADJOINT_RTOL)``."""
    return min(rtol * cancellation, max(rtol, _MAX_ADJOINT_RTOL))


def _passing_rtol(error: float, cancellation: float) -> float:
    """An ``rtol`` under which a relative adjoint ``error`` with this ``cancellation`` passes:
    twice the least one, rounded up to two digits."""
    least = error if error > _MAX_ADJOINT_RTOL else error / cancellation
    unit = 10.0 ** (math.floor(math.log10(2 * least)) - 1)
    return math.ceil(2 * least / unit) * unit


def _adjoint_cause(operator: Any, y: Any, aty: Any, rtol: float, error: float, cancellation: float, dtype: Any) -> str:
    """Why the adjoint test failed: ``aty = A.T.mv(y)`` against ``jax.linear_transpose`` of
    ``row_fn`` applied row by row (unchunked) tells a wrong transpose kernel from a ``row_fn``
    whose own transpose does not match its values; of the latter, a difference below
    ``sqrt(eps)`` of the pairings' absolute terms (``error / cancellation``) is likely
    rounding, a larger one out-of-range indices or (complex ``x``) a ``row_fn`` that is not
    complex-linear."""
    in_struct = operator.in_structure()
    try:
        (reference,) = jax.jit(
            lambda op, y: jax.linear_transpose(lambda x: jax.vmap(op.row_fn, (0, None))(op.rows, x), in_struct)(y)
        )(operator, y)
    except Exception as err:  # noqa: BLE001 - a diagnosis only: say what could not be checked
        return f"(The transpose of row_fn could not be computed to tell the cause: {type(err).__name__}.)"
    kernel_error = float(_diff_norm(aty, reference) / (_norm(reference) + _norm(aty) + jnp.finfo(jnp.float32).tiny))
    if not kernel_error <= rtol:
        key = getattr(getattr(operator, "spec", None), "segment_key", None)
        contract = (
            ""
            if key is None
            else f" Built with `segment_key`={key!r}: row_fn must read x only at x[row[{key!r}]] (every"
            " leaf along its leading axis); one that reads more needs segment_key=None."
        )
        return (
            f"A.T.mv differs from jax.linear_transpose of row_fn by {kernel_error:.3g} (relative): "
            f"the transpose kernel ({type(operator).__name__}.apply_transpose) does not transpose row_fn.{contract}"
        )
    complex_x = any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jax.tree_util.tree_leaves(in_struct))
    out_of_range = (
        "gather indices out of range in row_fn (e.g. x[idx] with idx >= the axis size): the gather "
        "clamps them, as JAX's indexing does, while the transpose drops their contributions. Check "
        "the rows' indices."
    )
    if complex_x:
        out_of_range = (
            "a row_fn that is not complex-linear in the complex x (conj(x), jnp.real(x)): it passes "
            "the superposition test, whose coefficients are real, but not this one; or " + out_of_range
        )
    causes = (
        "A.T.mv agrees with jax.linear_transpose of row_fn, so row_fn's own transpose does not match "
        "its values. {likely} " + out_of_range
    )
    name = jnp.finfo(dtype).dtype.name  # float32 for complex64 too
    eps = float(jnp.finfo(dtype).eps)
    of_terms = error / cancellation  # the difference relative to the pairings' absolute terms
    if of_terms <= eps**0.5:
        passing = f"{_passing_rtol(error, cancellation):.2g}"
        if error > max(rtol, _MAX_ADJOINT_RTOL):  # beyond what any cancellation allows
            remedy = (
                f"This draw's pairings cancel {cancellation:.3g}-fold (typically about "
                f"sqrt({operator.out_size()}) = {operator.out_size() ** 0.5:.0f}): try another key=, or "
                f"pass rtol={passing} (which loosens every test)"
            )
        else:
            remedy = f"Pass rtol={passing} to accept it"
        return (
            f"Likely {name} rounding, not a bug: the difference is {of_terms:.2g} ({of_terms / eps:.0f} eps) "
            f"of the pairings' absolute terms, as {name} gives when sums in row_fn cancel (A x and "
            f"A^T y round differently). {remedy}, or check the operator in float64 "
            f"(jax.config.update('jax_enable_x64', True) and a float64 in_structure). "
            + causes.format(likely="If it persists in float64, look for")
        )
    return causes.format(likely="A likely cause:")
