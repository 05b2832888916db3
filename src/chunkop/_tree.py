"""Small helpers on leaves and structures, shared by both layers (one definition each).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from chunkop._tree import is_float, struct_of, zeros_of
    >>> is_float(jnp.zeros(2)), is_float(jax.ShapeDtypeStruct((2,), jnp.int32)), is_float(1.0)
    (True, False, True)
    >>> struct_of(jnp.zeros((2, 3)))
    ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    >>> zeros_of({"a": jax.ShapeDtypeStruct((2,), jnp.float32)})["a"]
    Array([0., 0.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jaxpr

__all__ = ["dtype_of", "has_shape", "is_float", "resized", "struct_of", "zeros_of"]


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, tracer, ``ShapeDtypeStruct``, aval (or an ``UndefinedPrimal``'s aval)
    or Python/NumPy scalar (its JAX result type)."""
    x = getattr(x, "aval", x) if _jaxpr.is_undefined_primal(x) else x
    if not hasattr(x, "dtype"):
        return jnp.result_type(x)
    # (a PRNG key's extended dtype, key<fry>, is its own dtype: NumPy cannot interpret it)
    return x.dtype if jnp.issubdtype(x.dtype, jax.dtypes.extended) else jnp.dtype(x.dtype)


def has_shape(x: Any) -> bool:
    """Whether ``x`` is array-like with a shape and dtype (a JAX or NumPy array, a tracer, a NumPy
    scalar), as opposed to a Python number or another object."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def is_float(x: Any) -> bool:
    """Whether ``x`` (anything :func:`dtype_of` takes) has an inexact (float or complex) dtype."""
    return bool(jnp.issubdtype(dtype_of(x), jnp.inexact))


def struct_of(x: Any, *, typed: bool = False) -> jax.ShapeDtypeStruct:
    """``x``'s shape and (canonical) dtype as a ``jax.ShapeDtypeStruct`` (no weak type).

    No sharding, unless ``typed``: then an array typed on a mesh with Explicit axes keeps that
    type (a program traced on it computes with mesh-typed values, and is compiled on them).
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        aval = jax.typeof(x)
        sharding = getattr(aval, "sharding", None) if typed else None
        explicit = sharding is not None and jax.sharding.AxisType.Explicit in (sharding.mesh.axis_types or ())
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding if explicit else None)
    x = np.asarray(x) if not hasattr(x, "dtype") else x
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype))


def resized(x: Any, axis: int, size: int) -> jax.ShapeDtypeStruct:
    """``x``'s :func:`struct_of` with ``size`` elements along ``axis`` (one device's shard of a
    sharded axis, say): the plain shapes a planner compiles its probes on."""
    s = struct_of(x)
    shape = list(s.shape)
    shape[axis] = size
    return jax.ShapeDtypeStruct(tuple(shape), s.dtype)


def zeros_of(structure: Any) -> Any:
    """Zeros shaped like every leaf of ``structure`` (arrays or ``ShapeDtypeStruct``s)."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(np.shape(s), dtype_of(s)), structure)
