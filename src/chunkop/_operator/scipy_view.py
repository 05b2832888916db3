"""``chunkop.to_scipy``: a ``scipy.sparse.linalg.LinearOperator`` view of a chunkop operator."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import scipy.sparse.linalg as spla
from jax.flatten_util import ravel_pytree

__all__ = ["to_scipy"]


def to_scipy(operator: lx.AbstractLinearOperator) -> spla.LinearOperator:
    """Wrap a lineax operator (e.g. :class:`chunkop.RowOperator`) for SciPy's iterative solvers.

    ``matvec``, ``rmatvec``, ``matmat`` and ``rmatmat`` run through jitted kernels
    (``operator.mv``, ``operator.T.mv`` and vmaps of them over columns), compiled once per input
    shape; vectors are flattened in ``jax.flatten_util.ravel_pytree`` order; NumPy arrays in and
    out. As SciPy's contract requires, ``rmatvec``/``rmatmat`` apply the *adjoint* ``A^H``
    (``conj(A^T conj(v))``), which differs from the transpose ``operator.T`` for complex
    operators.

    Args:
        operator: any ``lineax.AbstractLinearOperator`` with float structures.

    Returns:
        A ``scipy.sparse.linalg.LinearOperator`` of shape ``(out_size, in_size)``.

    Raises:
        TypeError: if ``operator`` is not a ``lineax.AbstractLinearOperator``.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, chunkop, scipy.sparse.linalg as spla
        >>> rows = {"i": jnp.array([0, 1, 2, 2]), "w": jnp.array([1.0, 2.0, 1.0, -1.0])}
        >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
        ...                         jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
        >>> S = chunkop.to_scipy(A)
        >>> S.shape, S.matvec(np.ones(3))
        ((4, 3), array([ 1.,  2.,  1., -1.], dtype=float32))
    """
    if not isinstance(operator, lx.AbstractLinearOperator):
        raise TypeError(
            "to_scipy: `operator` must be a lineax.AbstractLinearOperator (e.g. a "
            f"chunkop.RowOperator), got {type(operator).__name__}."
        )
    in_struct, out_struct = operator.in_structure(), operator.out_structure()
    zeros = lambda s: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), s)
    in_flat, unravel_in = ravel_pytree(zeros(in_struct))
    out_flat, unravel_out = ravel_pytree(zeros(out_struct))
    dtype = np.dtype(jnp.result_type(in_flat.dtype, out_flat.dtype))

    @jax.jit
    def _mv(v: jax.Array) -> jax.Array:
        return ravel_pytree(operator.mv(unravel_in(v)))[0]

    @jax.jit
    def _rmv(v: jax.Array) -> jax.Array:  # the adjoint: conj(A^T conj(v))
        return jnp.conj(ravel_pytree(operator.T.mv(unravel_out(jnp.conj(v))))[0])

    @jax.jit
    def _mm(m: jax.Array) -> jax.Array:
        return jax.vmap(_mv, in_axes=1, out_axes=1)(m)

    @jax.jit
    def _rmm(m: jax.Array) -> jax.Array:
        return jax.vmap(_rmv, in_axes=1, out_axes=1)(m)

    def check(v: Any, size: int, what: str) -> jax.Array:
        v = np.asarray(v)
        if v.shape[0] != size:
            raise ValueError(f"to_scipy: {what} expects {size} rows, got an array of shape {v.shape}.")
        return jnp.asarray(v, dtype)

    return spla.LinearOperator(
        shape=(out_flat.size, in_flat.size),
        dtype=dtype,
        matvec=lambda v: np.asarray(_mv(check(v, in_flat.size, "matvec").reshape(-1))),
        rmatvec=lambda v: np.asarray(_rmv(check(v, out_flat.size, "rmatvec").reshape(-1))),
        matmat=lambda m: np.asarray(_mm(check(m, in_flat.size, "matmat"))),
        rmatmat=lambda m: np.asarray(_rmm(check(m, out_flat.size, "rmatmat"))),
    )
