"""``chunkop.jacrev`` / ``chunkop.jacfwd``: Jacobians built a chunk of basis vectors at a time.

``jax.jacrev`` pushes every output basis vector through the VJP at once (an ``m x m`` identity
and ``m`` simultaneous backward passes); here the basis vectors are generated inside a
:func:`chunkop.vmap` from their indices, so only ``chunk_size`` of them (and their backward
passes) are live at a time. The primal is linearised once and shared by every chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from . import _budget
from ._axes import replace_at
from ._transform import Bound, Chunked
from ._vmap import vmap

__all__ = ["jacrev", "jacfwd", "Jacobian"]


def _is_int(a: Any) -> bool:
    return isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))


def _check_argnums(argnums: int | Sequence[int], nargs: int, where: str) -> tuple[int, ...]:
    try:
        nums = (argnums,) if _is_int(argnums) else tuple(argnums)
    except TypeError:
        nums = (argnums,)  # not an int and not iterable: reported below
    if not nums:
        raise ValueError(
            f"{where}: `argnums`={argnums!r} selects no argument; give an int or a non-empty tuple of ints."
        )
    for a in nums:
        if not _is_int(a) or not -nargs <= a < nargs:
            raise ValueError(
                f"{where}: `argnums`={argnums!r} must be int(s) indexing the {nargs} positional "
                f"arguments the function was called with."
            )
    return tuple(int(a) % nargs for a in nums)


def _partial_args(fun: Callable, args: tuple, kwargs: dict, nums: tuple[int, ...]) -> Callable:
    def f(*dyn: Any) -> Any:
        return fun(*replace_at(args, nums, dyn), **kwargs)

    return f


def _differentiated(
    fun: Callable, args: tuple, kwargs: dict, argnums: Any, where: str, real: bool, holomorphic: bool = False
) -> tuple[Callable, tuple]:
    """Check ``argnums`` and the differentiated arguments; ``fun`` as a function of those alone."""
    nums = _check_argnums(argnums, len(args), where)
    dyn = tuple(args[i] for i in nums)
    if holomorphic:
        _check_complex(dyn, where, "arguments")
    else:
        _check_float(dyn, where, "arguments", real=real)
    return _partial_args(fun, args, kwargs, nums), dyn


def _basis(i: jax.Array, size: int, dtype: Any, unravel: Callable, types: Any) -> Any:
    """Basis vector ``i`` as a pytree like ``types`` (the avals of the leaves it pairs with), its
    leaves in their sharding types: on an Explicit mesh a VJP or linearised function refuses a
    cotangent or tangent whose type differs from its primal's (``float32[8]`` for ``float32[8@d]``)."""
    # A comparison rather than `zeros(size).at[i].set(1)`: the latter fails to trace for size 0.
    tree = unravel((jnp.arange(size) == i).astype(dtype))
    return jax.tree_util.tree_map(_typed_like, tree, types)


def _typed_like(x: jax.Array, aval: Any) -> jax.Array:
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or all(p is None for p in sharding.spec):
        return x
    return jax.sharding.reshard(x, sharding)


def _check_complex(tree: Any, where: str, what: str) -> None:
    """With ``holomorphic=True`` inputs and outputs must be complex, as for ``jax.jacrev``/``jacfwd``."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating):
            raise TypeError(
                f"{where}: holomorphic=True requires complex {what}, got dtype {jnp.result_type(leaf)}; "
                f"use holomorphic=False for real functions."
            )


def _check_float(tree: Any, where: str, what: str, *, real: bool = False) -> None:
    """Inputs/outputs must be float (``real``) or float/complex, as for ``jax.jacrev``/``jacfwd``."""
    kind = jnp.floating if real else jnp.inexact
    for leaf in jax.tree_util.tree_leaves(tree):
        if not jnp.issubdtype(jnp.result_type(leaf), kind):
            raise TypeError(
                f"{where}: differentiation requires {'real ' if real else ''}float {what}, got "
                f"dtype {jnp.result_type(leaf)}" + (" (complex differentiation is not supported)." if real else ".")
            )


def jacrev(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: int | str,
    has_aux: bool = False,
    holomorphic: bool = False,
    memory_budget: int | None = None,
) -> Callable:
    """``jax.jacrev`` that pulls back ``chunk_size`` output basis vectors at a time.

    Args:
        fun: function of pytrees of float (or complex) arrays, returning a pytree of real
            float arrays (as for ``jax.jacrev``; complex outputs raise ``TypeError``).
        argnums: which positional argument(s) to differentiate (int or tuple of ints).
        chunk_size: how many rows of the Jacobian are computed at once (a positive int), or
            ``"auto"`` to choose it from ``memory_budget``.
        has_aux: whether ``fun`` returns ``(output, aux)``.
        holomorphic: as in ``jax.jacrev``: ``fun`` is holomorphic (complex inputs and outputs).
        memory_budget: bytes of temp memory for ``chunk_size="auto"`` (as in :func:`chunkop.vmap`).

    Returns:
        A function returning the Jacobian with ``jax.jacrev``'s structure (output tree of
        argument trees, each leaf of shape ``out.shape + arg.shape``), plus ``aux`` if asked.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.jacrev(jnp.sin, chunk_size=2)(jnp.zeros(3))
        Array([[1., 0., 0.],
               [0., 1., 0.],
               [0., 0., 1.]], dtype=float32)
    """
    return Jacobian(fun, argnums, chunk_size, has_aux, holomorphic, memory_budget, forward=False)


def jacfwd(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: int | str,
    has_aux: bool = False,
    holomorphic: bool = False,
    memory_budget: int | None = None,
) -> Callable:
    """``jax.jacfwd`` that pushes ``chunk_size`` input basis vectors forward at a time.

    Args:
        fun: function of pytrees of real float arrays (as for ``jax.jacfwd``; complex inputs
            raise ``TypeError``), returning a pytree of float arrays.
        argnums: which positional argument(s) to differentiate (int or tuple of ints).
        chunk_size: how many columns of the Jacobian are computed at once (a positive int), or
            ``"auto"`` to choose it from ``memory_budget``.
        has_aux: whether ``fun`` returns ``(output, aux)``.
        holomorphic: as in ``jax.jacfwd``: ``fun`` is holomorphic (complex inputs and outputs).
        memory_budget: bytes of temp memory for ``chunk_size="auto"`` (as in :func:`chunkop.vmap`).

    Returns:
        A function returning the Jacobian with ``jax.jacfwd``'s structure, plus ``aux`` if asked.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.jacfwd(lambda x: x ** 2, chunk_size=2)(jnp.arange(3.0))
        Array([[0., 0., 0.],
               [0., 2., 0.],
               [0., 0., 4.]], dtype=float32)
    """
    return Jacobian(fun, argnums, chunk_size, has_aux, holomorphic, memory_budget, forward=True)


_LAST_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WRAPPED = ("__module__", "__name__", "__qualname__", "__doc__")


@dataclasses.dataclass(frozen=True, eq=False)
class Jacobian:
    """``chunkop.jacrev`` (``forward=False``) or ``chunkop.jacfwd`` of ``fun``: an immutable
    transform, like :class:`chunkop._transform.Chunked` (``fun``'s name, docstring and module
    copied, ``__wrapped__`` is ``fun``, none of its other attributes; binds as a method; the plan
    of its last ``"auto"`` call kept beside it, ``last_plan``)."""

    fun: Callable
    argnums: int | Sequence[int]
    chunk_size: int | str
    has_aux: bool
    holomorphic: bool
    memory_budget: int | None
    forward: bool

    def __post_init__(self) -> None:
        chunk_size = _budget.check_chunk_size_or_auto(self.chunk_size, allow_none=False, where=self.where)
        object.__setattr__(self, "chunk_size", chunk_size)
        for name in _WRAPPED:
            if hasattr(self.fun, name):
                object.__setattr__(self, name, getattr(self.fun, name))
        object.__setattr__(self, "__wrapped__", self.fun)

    @property
    def where(self) -> str:
        return "chunkop.jacfwd" if self.forward else "chunkop.jacrev"

    @property
    def last_plan(self) -> _budget.BudgetPlan | None:
        """The :class:`chunkop.BudgetPlan` of the last ``chunk_size="auto"`` call; None before any."""
        return _LAST_PLANS.get(self)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """As a function's: looked up on an instance, the Jacobian bound to it."""
        return self if instance is None else Bound(self, instance)

    def plan_for(self, args: tuple, kwargs: dict) -> _budget.BudgetPlan:
        """The plan a call would make (``chunkop.plan``; cached), running nothing.

        Raises:
            TypeError: when it was not made with ``chunk_size="auto"``.
        """
        if self.chunk_size != "auto":
            raise _budget.not_planned(self)
        jax.eval_shape(functools.partial(self, **kwargs), *args)
        return self.last_plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fwd(args, kwargs) if self.forward else self._rev(args, kwargs)

    def _chunked(self, fn: Callable) -> Chunked:
        return vmap(fn, chunk_size=self.chunk_size, memory_budget=self.memory_budget)

    def _rev(self, args: tuple, kwargs: dict) -> Any:
        f, dyn = _differentiated(
            self.fun, args, kwargs, self.argnums, self.where, real=False, holomorphic=self.holomorphic
        )
        if self.has_aux:
            out, pullback, aux = jax.vjp(f, *dyn, has_aux=True)
        else:
            out, pullback = jax.vjp(f, *dyn)
        if self.holomorphic:
            _check_complex(out, self.where, "outputs")
        else:
            _check_float(out, self.where, "outputs", real=True)
        flat_out, unravel = ravel_pytree(out)
        m = flat_out.size
        types = jax.tree_util.tree_map(jax.typeof, out)
        pull = self._chunked(lambda i: pullback(_basis(i, m, flat_out.dtype, unravel, types)))
        rows = pull(jnp.arange(m))  # tuple over argnums; leaves (m, *arg_leaf_shape)
        if pull.last_plan is not None:
            _LAST_PLANS[self] = pull.last_plan
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        blocks, offset = [], 0
        for o in out_leaves:
            blocks.append(
                jax.tree_util.tree_map(lambda r, o=o, s=offset: r[s : s + o.size].reshape(o.shape + r.shape[1:]), rows)
            )
            offset += o.size
        blocks = [b[0] if _is_int(self.argnums) else b for b in blocks]
        result = jax.tree_util.tree_unflatten(out_tree, blocks)
        return (result, aux) if self.has_aux else result

    def _fwd(self, args: tuple, kwargs: dict) -> Any:
        f, dyn = _differentiated(
            self.fun, args, kwargs, self.argnums, self.where, real=True, holomorphic=self.holomorphic
        )
        if self.has_aux:
            out, pushforward, aux = jax.linearize(f, *dyn, has_aux=True)
        else:
            out, pushforward = jax.linearize(f, *dyn)
        if self.holomorphic:
            _check_complex(out, self.where, "outputs")
        flat_in, unravel = ravel_pytree(dyn)
        n = flat_in.size
        types = jax.tree_util.tree_map(jax.typeof, dyn)
        push = self._chunked(lambda i: pushforward(*_basis(i, n, flat_in.dtype, unravel, types)))
        cols = push(jnp.arange(n))  # output tree; leaves (n, *out_leaf_shape)
        if push.last_plan is not None:
            _LAST_PLANS[self] = push.last_plan
        in_leaves, in_tree = jax.tree_util.tree_flatten(dyn)

        def split(c: jax.Array) -> Any:
            c = jnp.moveaxis(c, 0, -1)  # (*out_shape, n)
            parts, offset = [], 0
            for leaf in in_leaves:
                size = int(jnp.size(leaf))
                parts.append(c[..., offset : offset + size].reshape(c.shape[:-1] + jnp.shape(leaf)))
                offset += size
            tree = jax.tree_util.tree_unflatten(in_tree, parts)
            return tree[0] if _is_int(self.argnums) else tree

        result = jax.tree_util.tree_map(split, cols)
        return (result, aux) if self.has_aux else result
