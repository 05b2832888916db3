"""``chunkop.to_scipy``: a ``scipy.sparse.linalg.LinearOperator`` view of a chunkop operator.

The view acts as the operator's matrix ``M`` (``operator.as_matrix()``) would under
``scipy.sparse.linalg.aslinearoperator``: ``matvec`` is ``M v`` and ``rmatvec`` the adjoint
``M^H u``, for real and complex vectors alike. The operator's kernels are real-linear where a
space is real: ``operator.mv`` takes only real vectors on a real input space, and a map from
complex values to real ones (the transpose of a real-input, complex-output operator) returns
the real part of the complex product (JAX's transpose convention). The view splits complex
vectors on a real space into real and imaginary parts, and recovers a real part's missing
imaginary part from a second application to ``-i v``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import scipy.sparse.linalg as spla

__all__ = ["to_scipy"]


@dataclasses.dataclass(frozen=True)
class _Space:
    """One side of the operator (its input or output structure), flattened as
    ``jax.flatten_util.ravel_pytree`` flattens it: the leaves raveled and concatenated in
    ``tree_leaves`` order, in the leaves' common dtype."""

    treedef: Any
    leaves: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, structure: Any) -> _Space:
        leaves, treedef = jax.tree_util.tree_flatten(structure)
        return cls(treedef, tuple(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves))

    @property
    def size(self) -> int:
        return sum(math.prod(leaf.shape) for leaf in self.leaves)

    @property
    def dtype(self) -> np.dtype:
        """The flat vector's dtype (that of ``ravel_pytree``)."""
        return np.dtype(jnp.result_type(*(leaf.dtype for leaf in self.leaves))) if self.leaves else np.dtype("float32")

    @property
    def has_real(self) -> bool:
        """Whether some leaf is real, i.e. the operator's kernels take only real values there."""
        return any(not jnp.issubdtype(leaf.dtype, jnp.complexfloating) for leaf in self.leaves)

    @property
    def has_complex(self) -> bool:
        return any(jnp.issubdtype(leaf.dtype, jnp.complexfloating) for leaf in self.leaves)

    def unflatten(self, flat: jax.Array) -> Any:
        """The pytree of ``flat`` (its real part on the real leaves)."""
        out, start = [], 0
        for leaf in self.leaves:
            size = math.prod(leaf.shape)
            piece = flat[start : start + size].reshape(leaf.shape)
            if not jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                piece = jnp.real(piece)
            out.append(piece.astype(leaf.dtype))
            start += size
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def flatten(self, tree: Any, dtype: Any) -> jax.Array:
        """``tree`` (in this structure) as one flat vector of ``dtype``."""
        leaves = jax.tree_util.tree_leaves(tree)
        if not leaves:
            return jnp.zeros((0,), dtype)
        return jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])


def _view_dtype(dtype: Any, operator_dtype: np.dtype) -> np.dtype:
    """The view's dtype: ``dtype`` if given (checked), else the operator's."""
    if dtype is None:
        return operator_dtype
    try:
        view = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"to_scipy: `dtype` must be a NumPy float or complex dtype, got {dtype!r}.") from err
    if view.kind not in "fc":
        raise TypeError(f"to_scipy: `dtype` must be a float or complex dtype, got {view}.")
    if view.kind == "f" and jnp.issubdtype(operator_dtype, jnp.complexfloating):
        raise ValueError(
            f"to_scipy: `dtype` {view} is real but the operator is complex ({operator_dtype}): its "
            f"products would lose their imaginary parts. Pass a complex dtype (e.g. np.complex128)."
        )
    return view


def _complex_linear(
    apply: Callable[[Any], Any], source: _Space, target: _Space, dtype: np.dtype
) -> Callable[[jax.Array], jax.Array]:
    """``apply`` (a linear map of pytrees from ``source`` to ``target``) as a map of flat
    vectors that gives the complex matrix's product.

    Where ``source`` has complex leaves and ``target`` real ones, ``apply`` is JAX's real-linear
    map there: it returns the real part of the complex product (as the transpose of a
    real-input, complex-output operator does). The imaginary part is then
    ``Im(M v) = Re(M (-i v))``, a second application.
    """
    split = source.has_complex and target.has_real

    def run(v: jax.Array) -> jax.Array:
        out = jax.tree_util.tree_leaves(apply(source.unflatten(v)))
        if split:
            imag = jax.tree_util.tree_leaves(apply(source.unflatten(-1j * v)))
            out = [p if jnp.iscomplexobj(p) else p + 1j * q for p, q in zip(out, imag)]
        return target.flatten(jax.tree_util.tree_unflatten(target.treedef, out), dtype)

    return run


def _apply(kernel: Callable[[jax.Array], jax.Array], v: np.ndarray, space: _Space) -> np.ndarray:
    """``kernel`` (a real-or-complex-linear map of flat vectors of ``space``) applied to ``v``,
    extended complex-linearly: a complex ``v`` on a space with real leaves is applied as
    ``kernel(Re v) + i kernel(Im v)``, since the kernel takes only real values there."""
    if np.iscomplexobj(v) and space.has_real:
        return _apply(kernel, v.real, space) + 1j * _apply(kernel, v.imag, space)
    return np.asarray(kernel(jnp.asarray(v, space.dtype)))


def to_scipy(operator: lx.AbstractLinearOperator, *, dtype: Any = None) -> spla.LinearOperator:
    """Wrap a lineax operator (e.g. :class:`chunkop.RowOperator`) for SciPy's iterative solvers.

    The view acts as the operator's matrix ``M`` (``operator.as_matrix()``) under
    ``scipy.sparse.linalg.aslinearoperator``: ``matvec``/``matmat`` give ``M v``, and, as SciPy's
    contract requires, ``rmatvec``/``rmatmat`` the *adjoint* ``M^H u`` (for complex operators
    it differs from the transpose ``operator.T``). Real and complex vectors are accepted on
    every operator: real->real, real->complex (``M`` complex on a real input), its transpose
    complex->real, and complex->complex. Each product runs jitted kernels (``operator.mv``, ``operator.T.mv`` and
    vmaps of them over columns), compiled once per input shape; a complex vector on a real
    space costs two kernel calls (its real and imaginary parts), and so do ``rmatvec`` of a
    real-input, complex-output operator and ``matvec`` of its transpose. Vectors are flat NumPy arrays in
    ``jax.flatten_util.ravel_pytree`` order.

    Args:
        operator: any ``lineax.AbstractLinearOperator`` with float or complex structures.
        dtype: the view's dtype, which SciPy's solvers compute in (default: the operator's,
            the common dtype of its input and output structures). Vectors are cast to the
            operator's own dtype at the boundary and its results back to ``dtype``, so
            ``dtype=np.float64`` on a float32 operator runs ``lsmr``/``lsqr``'s recurrences in
            float64 while the chunked kernels stay in float32. A real ``dtype`` for a complex
            operator is refused.

    Returns:
        A ``scipy.sparse.linalg.LinearOperator`` of shape ``(out_size, in_size)`` and dtype
        ``dtype``. Products are returned in ``dtype`` (complex when the result is complex).

    Raises:
        TypeError: if ``operator`` is not a ``lineax.AbstractLinearOperator``, or ``dtype`` is
            not a float or complex dtype.
        ValueError: if ``dtype`` is real and the operator complex; from a product, if the
            vector's length does not match the operator.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, chunkop, scipy.sparse.linalg as spla
        >>> rows = {"i": jnp.array([0, 1, 2, 2]), "w": jnp.array([1.0, 2.0, 1.0, -1.0])}
        >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
        ...                         jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
        >>> S = chunkop.to_scipy(A)
        >>> S.shape, S.matvec(np.ones(3))
        ((4, 3), array([ 1.,  2.,  1., -1.], dtype=float32))
        >>> S64 = chunkop.to_scipy(A, dtype=np.float64)  # SciPy computes in float64
        >>> S64.dtype, S64.rmatvec(np.ones(4)).dtype
        (dtype('float64'), dtype('float64'))
        >>> x = spla.lsmr(S64, np.array([1.0, 2.0, 1.0, -1.0]), damp=1e-3)[0]  # damped least squares
        >>> np.round(x, 3)
        array([1., 1., 1.])
    """
    if not isinstance(operator, lx.AbstractLinearOperator):
        raise TypeError(
            "to_scipy: `operator` must be a lineax.AbstractLinearOperator (e.g. a "
            f"chunkop.RowOperator), got {type(operator).__name__}."
        )
    space_in, space_out = _Space.of(operator.in_structure()), _Space.of(operator.out_structure())
    operator_dtype = np.dtype(jnp.result_type(space_in.dtype, space_out.dtype))
    view = _view_dtype(dtype, operator_dtype)
    forward = _complex_linear(operator.mv, space_in, space_out, operator_dtype)
    adjoint = _complex_linear(  # A^H u = conj(A^T conj(u))
        lambda u: jax.tree_util.tree_map(jnp.conj, operator.T.mv(jax.tree_util.tree_map(jnp.conj, u))),
        space_out,
        space_in,
        operator_dtype,
    )

    kernels = {
        "matvec": (jax.jit(forward), space_in),
        "rmatvec": (jax.jit(adjoint), space_out),
        "matmat": (jax.jit(jax.vmap(forward, in_axes=1, out_axes=1)), space_in),
        "rmatmat": (jax.jit(jax.vmap(adjoint, in_axes=1, out_axes=1)), space_out),
    }

    def product(name: str) -> Callable[[Any], np.ndarray]:
        kernel, space = kernels[name]

        def run(v: Any) -> np.ndarray:
            v = np.asarray(v)
            if v.shape[0] != space.size:
                raise ValueError(f"to_scipy: {name} expects {space.size} rows, got an array of shape {v.shape}.")
            if name in ("matvec", "rmatvec"):
                v = v.reshape(-1)
            out = _apply(kernel, v, space)
            return out.astype(np.result_type(view, np.complex64) if np.iscomplexobj(out) else view, copy=False)

        return run

    return spla.LinearOperator(
        shape=(space_out.size, space_in.size),
        dtype=view,
        matvec=product("matvec"),
        rmatvec=product("rmatvec"),
        matmat=product("matmat"),
        rmatmat=product("rmatmat"),
    )
