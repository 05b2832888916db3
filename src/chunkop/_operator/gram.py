"""``chunkop.gram_diagonal``: the diagonal of ``A^T A`` (squared column norms), chunk by chunk.

The diagonal of the normal-equations operator is the usual Jacobi preconditioner for CG on
``A^T A + lam I``. For a :class:`chunkop.RowOperator` it is ``sum_i c_i ** 2`` where ``c_i`` is
row ``i``'s coefficient vector (``row_fn(row_i, .)`` as a vector in the ``x`` space).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .._reduce import sum as chunked_sum
from .._tree import zeros_of
from . import row_sharding
from .row_operator import AbstractRowOperator, RowOperator, linear_jacobian, row_form

__all__ = ["gram_diagonal"]


def gram_diagonal(
    operator: AbstractRowOperator,
    *,
    squared_row_fn: Callable[[Any, Any], Any] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """``diag(A^T A)`` as a pytree shaped like ``x``.

    Two ways, both exact:

    - with ``squared_row_fn`` (``row_fn`` with every weight squared, e.g.
      ``lambda r, x: w(r) ** 2 @ x[r["idx"]]``): ``(A o A)^T 1`` with the fast chunked
      transpose; cost: one transposed matvec. Exact only when every coefficient ``A[i, j]``
      comes from a single weight, i.e. each output element of a row uses each entry of ``x``
      at most once (true for the line-of-sight integrals ``w . x[idx, :]``; false when two
      samples of a row fall in the same cell, as in a bilinear-interpolated line integral).
    - otherwise, generically: each row's coefficient vector is built densely (``jax.jacrev``
      of ``row_fn`` at ``x = 0``), squared and summed, ``chunk_size`` rows at a time. Cost
      ``O(n_rows * in_size)`` time and ``O(chunk_size * in_size)`` memory: for small operators.

    Args:
        operator: a :class:`chunkop.RowOperator` (or any :class:`chunkop.AbstractRowOperator`).
        squared_row_fn: optional ``row_fn`` of the element-wise squared operator (see above).
        chunk_size: rows per chunk for the generic path (default: the operator's, capped so a
            chunk holds at most ``2**22`` coefficients).

    Returns:
        A pytree like ``operator.in_structure()``: entry ``j`` is ``sum_i A[i, j] ** 2``.

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> rows = {"i": jnp.array([0, 1, 1]), "w": jnp.array([2.0, 1.0, 3.0])}
        >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
        ...                         jax.ShapeDtypeStruct((2,), jnp.float32), chunk_size=2)
        >>> chunkop.gram_diagonal(A)
        Array([ 4., 10.], dtype=float32)
        >>> chunkop.gram_diagonal(A, squared_row_fn=lambda r, x: r["w"] ** 2 * x[r["i"]])
        Array([ 4., 10.], dtype=float32)
    """
    operator, transposed = row_form(operator, "gram_diagonal")
    if transposed:
        raise TypeError(
            "gram_diagonal: expected a RowOperator (an AbstractRowOperator), got the transpose of one (A.T)."
        )
    if squared_row_fn is not None:
        squared = RowOperator(squared_row_fn, operator.rows, operator.in_structure(), chunk_size=operator.chunk_size)
        ones = jax.tree_util.tree_map(lambda s: jnp.ones(s.shape, s.dtype), squared.out_structure())
        return squared.T.mv(ones)
    x0 = zeros_of(operator.in_structure())
    flat_x, unravel = ravel_pytree(x0)
    if chunk_size is None:
        chunk_size = max(1, min(operator.chunk_size, 2**22 // max(flat_x.size, 1)))

    def squared_coefficients(row: Any, at: jax.Array) -> jax.Array:
        f = lambda v: ravel_pytree(operator.row_fn(row, unravel(v)))[0]
        return jnp.sum(jnp.abs(linear_jacobian(f, at)) ** 2, axis=0)

    # where the kernels run row_fn: with rows sharded over devices, each device sums its own rows
    # (their mesh axes automatic, as row_fn was traced), then one all-reduce; `flat_x` an
    # argument, not a closure, so that it is retyped there too
    summed = chunked_sum(squared_coefficients, in_axes=(0, None), chunk_size=chunk_size)
    return unravel(row_sharding.map_rows(summed, operator.rows, flat_x, reduce=True))
