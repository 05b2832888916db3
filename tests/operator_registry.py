"""One shared registry of ``RowOperator`` test problems (as lineax's tests do for its operators).

Each :class:`Case` builds a chunked operator from a parameter ``p`` (a pytree of float arrays)
that its ``row_fn`` depends on, either through ``rows`` or by *closing over* it, and gives the
references the tests compare with: ``jax.vmap`` of the same ``row_fn`` (``ref_mv``), its
``jax.linear_transpose`` (``ref_T``) and its dense matrix (``dense``). Tests parametrize over
``CASES`` (``ids=list(CASES)``) and check values, transposes and derivatives w.r.t. ``x``, ``y``
and ``p`` against those references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import chunkop

NPIX, K, N = 7, 4, 10
CHUNK = 4  # two full chunks and a remainder of 2


def edges(k: int = K) -> jax.Array:
    """The ``k + 1`` distance-bin edges ``geomspace(40, 1700)``."""
    return jnp.geomspace(40.0, 1700.0, k + 1).astype(jnp.float32)


BOUNDS = edges(K)


def los_weights(r: dict, bounds: jax.Array = BOUNDS) -> jax.Array:
    """Extinction-like weights of one line of sight: differences of a profile at the bin edges."""
    bounds = bounds.astype(r["d"].dtype)
    return -jnp.diff(jnp.exp(-(r["d"] - bounds) / (r["d"] * r["s"] * bounds)))


def los_row(r: dict, x: jax.Array) -> jax.Array:
    """The canonical row: the weighted distance bins (``x.shape[-1]`` of them) of pixel ``idx``."""
    bounds = BOUNDS if x.shape[-1] == K else edges(x.shape[-1])
    return jnp.dot(los_weights(r, bounds), x[r["idx"]])


def make_los_rows(n: int = N, npix: int = NPIX, seed: int = 0, dtype: Any = np.float32) -> dict:
    """Line-of-sight rows: pixel index, distance ``d``, uncertainty ``s``."""
    rng = np.random.default_rng(seed)
    return {
        "idx": jnp.asarray(rng.integers(0, npix, n), dtype=jnp.int32),
        "d": jnp.asarray(rng.uniform(200.0, 1500.0, n), dtype=dtype),
        "s": jnp.asarray(rng.uniform(0.01, 0.05, n), dtype=dtype),
    }


def rand(*shape: int, seed: int = 0, dtype: Any = np.float32) -> jax.Array:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.complexfloating):
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), dtype=dtype)
    return jnp.asarray(rng.normal(size=shape), dtype=dtype)


def rand_like(structure: Any, seed: int) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(structure)
    return jax.tree_util.tree_unflatten(
        tree, [rand(*s.shape, seed=seed + i, dtype=s.dtype) for i, s in enumerate(leaves)]
    )


class Case(NamedTuple):
    """A test problem: ``make_row_fn(p)`` is the ``row_fn`` (closing over ``p`` or not)."""

    make_row_fn: Callable[[Any], Callable]
    make_rows: Callable[[Any], Any]  # rows for parameter p (p may enter through rows)
    in_structure: Any
    p: Any  # the parameter's value
    chunk: int = CHUNK

    def op(self, p: Any = None, chunk: int | None = None) -> chunkop.RowOperator:
        p = self.p if p is None else p
        return chunkop.RowOperator(
            self.make_row_fn(p), self.make_rows(p), self.in_structure, chunk_size=chunk or self.chunk
        )

    def ref_mv(self, p: Any, x: Any) -> Any:
        return jax.vmap(self.make_row_fn(p), (0, None))(self.make_rows(p), x)

    def ref_T(self, p: Any, y: Any) -> Any:
        return jax.linear_transpose(lambda v: self.ref_mv(p, v), self.in_structure)(y)[0]

    def x(self, seed: int = 1) -> Any:
        return rand_like(self.in_structure, seed)

    def y(self, seed: int = 2) -> Any:
        return rand_like(jax.eval_shape(lambda v: self.ref_mv(self.p, v), self.in_structure), seed)

    def dense(self, p: Any = None) -> jax.Array:
        """The reference matrix in ``ravel_pytree`` order (outputs rows, inputs columns)."""
        p = self.p if p is None else p
        flat, unravel = ravel_pytree(self.x())
        columns = jax.vmap(lambda e: ravel_pytree(self.ref_mv(p, unravel(e)))[0])(jnp.eye(flat.size, dtype=flat.dtype))
        return columns.T


ROWS = make_los_rows()
STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)
PSTRUCT = {"a": STRUCT, "b": jax.ShapeDtypeStruct((NPIX,), jnp.float32)}
CSTRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.complex64)
GAIN = jnp.linspace(0.5, 2.0, NPIX, dtype=jnp.float32)


def _los_through_rows(p: dict) -> Callable:
    return los_row


def _pytree_row_fn(p: dict) -> Callable:
    def row_fn(r: dict, x: dict) -> dict:
        w = los_weights(r)
        return {"p": jnp.dot(w, x["a"][r["idx"]]) + p["c"] * x["b"][r["idx"]], "q": w[:3] * x["b"][r["idx"]]}

    return row_fn


def _complex_row_fn(p: dict) -> Callable:
    def row_fn(r: dict, x: jax.Array) -> jax.Array:
        w = los_weights(r) * jnp.exp(1j * p["phase"])
        return jnp.dot(w, x[r["idx"]])

    return row_fn


def _closed_array_row_fn(p: dict) -> Callable:
    def row_fn(r: dict, x: jax.Array) -> jax.Array:  # closes over an array indexed per row
        return p["gain"][r["idx"]] * jnp.dot(los_weights(r, p["bounds"]), x[r["idx"]])

    return row_fn


def _closed_scalar_row_fn(p: dict) -> Callable:
    scale = p["scale"]

    def row_fn(r: dict, x: jax.Array) -> jax.Array:
        return scale * los_row(r, x) + scale**2 * x[r["idx"], 0]

    return row_fn


def _int_rows_closure_row_fn(p: dict) -> Callable:
    def row_fn(r: dict, x: jax.Array) -> jax.Array:  # int-only rows, weights from the closure
        return p["w"][r["k"]] * x[r["idx"], r["k"]]

    return row_fn


CASES: dict[str, Case] = {
    # the canonical problem; p enters through rows (d and s)
    "los": Case(
        _los_through_rows, lambda p: {**ROWS, "d": p["d"], "s": p["s"]}, STRUCT, {"d": ROWS["d"], "s": ROWS["s"]}
    ),
    # pytree x and pytree per-row output, closing over a scalar parameter
    "pytree": Case(_pytree_row_fn, lambda p: ROWS, PSTRUCT, {"c": jnp.float32(0.7)}),
    # complex x and weights (phase closed over)
    "complex": Case(_complex_row_fn, lambda p: ROWS, CSTRUCT, {"phase": jnp.linspace(0.0, 1.0, K, dtype=jnp.float32)}),
    # closes over arrays (a per-pixel gain and the bin edges)
    "closed_arrays": Case(_closed_array_row_fn, lambda p: ROWS, STRUCT, {"gain": GAIN, "bounds": BOUNDS}),
    # closes over a scalar (traced when differentiated) used non-linearly
    "closed_scalar": Case(_closed_scalar_row_fn, lambda p: ROWS, STRUCT, {"scale": jnp.float32(1.5)}),
    # int-only rows: every float comes from the closure
    "int_rows": Case(
        _int_rows_closure_row_fn,
        lambda p: {"idx": ROWS["idx"], "k": jnp.arange(N, dtype=jnp.int32) % K},
        STRUCT,
        {"w": jnp.asarray([1.0, -2.0, 0.5, 3.0], jnp.float32)},
        chunk=3,
    ),
}
