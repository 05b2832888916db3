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


def _is_complex(tree: Any) -> bool:
    return any(jnp.iscomplexobj(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _aligned(ax: Any, y: Any, complex_x: bool) -> Any:
    """``y`` aligned with ``A x``: ``y_i = conj(sign((A x)_i)) |y_i|`` (times ``1j`` for a complex
    leaf when ``x`` is complex), so that every term of ``<A x, y> = sum_i |(A x)_i| |y_i|``
    (times ``1j``) has one sign (one phase) and the pairing does not cancel. The ``1j`` keeps an
    antilinear ``row_fn`` visible: it turns ``<A x, y>`` into the conjugate of ``<x, A^T y>``,
    which differs from it only when the pairing is not real. (A real ``x`` has no antilinear
    map, and its pairing is the real part: there the ``1j`` would pair to zero.)"""

    def one(a: jax.Array, z: jax.Array) -> jax.Array:
        v = jnp.conj(jnp.sign(a)) * jnp.abs(z)
        return (1j * v if complex_x and jnp.iscomplexobj(z) else v).astype(z.dtype)

    return jax.tree_util.tree_map(one, ax, y)


def _adjoint_error(x: Any, ax: Any, y: Any, aty: Any) -> tuple[float, float, jax.Array, jax.Array]:
    """The relative difference of ``<A x, y>`` and ``<x, A^T y>``, their cancellation
    ``sum |terms| / |sum terms|`` (at least 1), and the two pairings. For a real ``x`` and a
    complex ``A x`` the identity is ``Re <A x, y> = <x, A^T y>`` (``A^T y`` is real: the
    transpose of a map into the complex numbers viewed as a real space): the real part is
    compared."""
    (lhs, lhs_abs), (rhs, rhs_abs) = _pairing(ax, y), _pairing(x, aty)
    if not _is_complex(x) and jnp.iscomplexobj(lhs):
        lhs = jnp.real(lhs)
    size = jnp.abs(lhs) + jnp.abs(rhs)
    tiny = jnp.finfo(jnp.result_type(size)).tiny
    error = float(jnp.abs(lhs - rhs) / (size + tiny))
    return error, max(float((lhs_abs + rhs_abs) / (size + tiny)), 1.0), lhs, rhs


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
    so they cancel, by ``kappa = sum |terms| / |sum terms|`` (about ``sqrt(n_rows)``: ~300 for
    a CT projector with 10^5 rays, and far more for an unlucky draw), while rounding errors
    grow with ``sum |terms|``. The relative difference of the pairings is allowed
    ``rtol * kappa``, at most 1% (or ``rtol`` if larger): a transpose that is wrong by a
    factor, a wrong kernel or an antilinear ``row_fn`` (``conj(x)``) differ at O(1); an error
    confined to a few rows (out-of-range indices) is caught when it exceeds the tolerance.

    A difference past 1% but within ``rtol * kappa`` (within ``rtol`` of the terms' absolute
    sum, as rounding gives: float32 sums in ``row_fn`` that cancel, or weights that ``mv`` and
    ``T.mv`` compute with different rounding) is decided by a second pairing that does not
    cancel: ``y`` aligned with ``A x1``, ``y_i = conj(sign((A x1)_i)) |y_i|`` (times ``1j`` for
    a complex output, so that an antilinear ``row_fn`` still differs at O(1)), whose relative
    difference must be within ``rtol`` times its own cancellation (of ``<x1, A^T y>``, ~2),
    at most 1%. A wrong transpose differs there at O(1) (or, for an error confined to a few
    rows, by about their share of ``A x1``) whatever the first draw's cancellation.

    Args:
        operator: a :class:`chunkop.RowOperator` (or any :class:`chunkop.AbstractRowOperator`),
            or its transpose.
        key: PRNG key for the random vectors (default ``jax.random.key(0)``).
        rtol: relative tolerance. The default is ``min(1000 eps, sqrt(eps))``, where ``eps`` is
            the machine epsilon of the operator's input dtype (the promoted dtype of the leaves
            of ``A.in_structure()``, also for ``A.T``; for a complex dtype, the epsilon of its
            real part): 1.2e-4 in float32, 2.2e-13 in float64, 0.031 in float16 and 0.088 in
            bfloat16. ``sqrt(eps)`` is the smaller in the half-precision types, where
            ``1000 eps`` would accept a non-linear ``row_fn`` such as ``x ** 2`` or ``exp(x)``.

    Returns:
        A dict of the relative errors measured (``"zero"``, ``"superposition"``, ``"matvec"``,
        ``"adjoint"``); the first three are at most ``rtol``, ``"adjoint"`` at most its
        tolerance above, unless the second pairing decided: then ``"adjoint"`` is within
        ``rtol * kappa`` and ``"adjoint_aligned"`` (its relative difference) within its
        tolerance.

    Raises:
        ValueError: naming the failed test and its error, e.g. when ``row_fn`` is not linear in
            ``x``. A failed adjoint test names its cause: a transpose kernel that does not
            transpose ``row_fn`` (a subclass's ``apply_transpose``); or, when the kernel agrees
            with ``jax.linear_transpose`` of ``row_fn``: rounding (when the difference is below
            ``sqrt(eps)`` of the pairings' absolute terms in both pairings; the message names
            the dtype's rounding and the ``rtol=`` that would pass),
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
    errors["adjoint"], cancellation, lhs, rhs = _adjoint_error(x1, ax1, y, aty)
    tolerance = _adjoint_tolerance(rtol, cancellation)
    if errors["adjoint"] <= tolerance:  # NaN fails
        return errors
    # Past the tolerance. Within rtol of the pairings' absolute terms (rtol * cancellation), the
    # difference is what rounding gives; the cap is there because this draw's y may cancel so
    # much that a wrong transpose hides in it too. Decide on a y that does not cancel.
    y_aligned = _aligned(ax1, y, _is_complex(x1))
    aty_aligned = _rmv(operator, y_aligned)
    aligned, aligned_cancellation, _, _ = _adjoint_error(x1, ax1, y_aligned, aty_aligned)
    aligned_tolerance = _adjoint_tolerance(rtol, aligned_cancellation)
    if errors["adjoint"] <= rtol * cancellation and aligned <= aligned_tolerance:
        errors["adjoint_aligned"] = aligned
        return errors
    of_terms = max(errors["adjoint"] / cancellation, aligned / aligned_cancellation)
    least = max(_least_rtol(errors["adjoint"], cancellation, gate=True), _least_rtol(aligned, aligned_cancellation))
    raise ValueError(
        f"check_linear: <A x, y> = {_num(lhs)} but <x, A^T y> = {_num(rhs)} (relative error "
        f"{errors['adjoint']:.3g}, tolerance {tolerance:.3g}: rtol {rtol:.3g} times the pairings' "
        f"cancellation sum|terms|/|sum| = {cancellation:.3g}, at most {max(rtol, _MAX_ADJOINT_RTOL):.3g}). "
        f"With y aligned with A x (y_i = |y_i| sign((A x)_i): a pairing that does not cancel) the "
        f"relative error is {aligned:.3g} (tolerance {aligned_tolerance:.3g}). "
        f"{_adjoint_cause(operator, y, aty, rtol, of_terms, least, dtype)}"
    )


#: The most the adjoint test's tolerance grows to with cancellation (when ``rtol`` is smaller):
#: a wrong transpose differs at O(1), two orders of magnitude above.
_MAX_ADJOINT_RTOL = 0.01


def _adjoint_tolerance(rtol: float, cancellation: float) -> float:
    """The adjoint test's relative tolerance: ``rtol * cancellation``, at most
    ``max(rtol, _MAX_ADJOINT_RTOL)``."""
    return min(rtol * cancellation, max(rtol, _MAX_ADJOINT_RTOL))


def _least_rtol(error: float, cancellation: float, gate: bool = False) -> float:
    """The least ``rtol`` under which a relative adjoint ``error`` with this ``cancellation``
    passes (``gate``: under which it is within ``rtol`` of the pairings' absolute terms, the
    condition for the aligned pairing to decide)."""
    return error / cancellation if gate or error <= _MAX_ADJOINT_RTOL else error


def _passing_rtol(least: float) -> float:
    """Twice the ``least`` rtol, rounded up to two digits."""
    unit = 10.0 ** (math.floor(math.log10(2 * least)) - 1)
    return math.ceil(2 * least / unit) * unit


def _adjoint_cause(operator: Any, y: Any, aty: Any, rtol: float, of_terms: float, least: float, dtype: Any) -> str:
    """Why the adjoint test failed: ``aty = A.T.mv(y)`` against ``jax.linear_transpose`` of
    ``row_fn`` applied row by row (unchunked) tells a wrong transpose kernel from a ``row_fn``
    whose own transpose does not match its values; of the latter, a difference below
    ``sqrt(eps)`` of the pairings' absolute terms (``of_terms``, the larger of the two pairings')
    is likely rounding (``least``: the least rtol that accepts it), a larger one out-of-range indices
    or (complex ``x``) a ``row_fn`` that is not complex-linear."""
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
    if of_terms <= eps**0.5:
        return (
            f"Likely {name} rounding, not a bug: the difference is {of_terms:.2g} ({of_terms / eps:.0f} eps) "
            f"of the pairings' absolute terms, as {name} gives when sums in row_fn cancel, or when A x and "
            f"A^T y compute row_fn's weights with different rounding (XLA may recompute them in each use, "
            f"so a floor() of a coordinate that lands on a grid line can differ between uses). Pass "
            f"rtol={_passing_rtol(least):.2g} to accept it (which loosens every test), or check the operator "
            f"in float64 (jax.config.update('jax_enable_x64', True), a float64 in_structure and float64 rows). "
            + causes.format(likely="If it persists in float64, look for")
        )
    return causes.format(likely="A likely cause:")
