"""The jaxpr types chunkop reads (from ``jax.extend.core`` where this JAX version exports them),
the two walks over a jaxpr that every module shares (:func:`find_eqn`, equations at any depth;
:func:`dependent_eqns`, data dependencies), the one test for a ``jax.custom_vjp`` call
(:func:`is_custom_vjp`), and the context an equation is re-bound in when a jaxpr is evaluated
(:func:`eqn_context`).

``jax.extend.core`` exports ``DropVar`` and ``jaxprs_in_params`` only in recent versions;
older ones (jax 0.9-0.10.0, the floor in ``pyproject.toml`` is 0.10.0) keep them in
``jax._src.core``. The floor is installed and smoke-tested by ``.ci/run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src import source_info_util as _source_info  # no public form of eval_jaxpr's per-equation context
from jax.extend import core as _ext

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "dependent_eqns",
    "eqn_context",
    "find_eqn",
    "has_eqn",
    "is_custom_vjp",
    "jaxprs_in_params",
]

ClosedJaxpr = _ext.ClosedJaxpr
Jaxpr = _ext.Jaxpr
Literal = _ext.Literal
try:
    DropVar = _ext.DropVar
    jaxprs_in_params = _ext.jaxprs_in_params
except AttributeError:  # jax < 0.10
    from jax._src import core as _core

    DropVar = _core.DropVar
    jaxprs_in_params = _core.jaxprs_in_params


def find_eqn(jaxpr: Any, test: Callable[[Any], bool]) -> Any:
    """The first equation of ``jaxpr``, at any depth, for which ``test(eqn)`` holds, or ``None``.

    Depth first: the equations inside an equation's sub-jaxprs (``jit``, ``cond`` branches,
    ``scan`` and ``while`` bodies, ``checkpoint`` ...) come before the equation itself.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> find_eqn(closed.jaxpr, lambda e: e.primitive.name == "sin").primitive.name
        'sin'
    """
    for eqn in jaxpr.eqns:
        for sub in jaxprs_in_params(eqn.params):
            found = find_eqn(sub, test)
            if found is not None:
                return found
        if test(eqn):
            return eqn
    return None


def has_eqn(jaxpr: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``jaxpr`` has, at any depth, an equation for which ``test(eqn)`` holds."""
    return find_eqn(jaxpr, test) is not None


def custom_vjp3() -> bool:
    """Whether JAX's ``jax_custom_vjp3`` flag (its next ``custom_vjp`` implementation) is on."""
    return bool(getattr(jax.config, "jax_custom_vjp3", False))


def is_custom_vjp(eqn: Any) -> bool:
    """Whether ``eqn`` calls a ``jax.custom_vjp`` function: a ``custom_vjp_call``, or (under
    ``jax_custom_vjp3``) a call of a ``CustomVJP...`` primitive object, possibly wrapped by
    ``jax.vmap`` (``VmapOf``, which keeps the wrapped one in ``params["prim"]``)."""
    if eqn.primitive.name == "custom_vjp_call":
        return True
    for value in eqn.params.values():
        while value is not None:
            if type(value).__name__.startswith("CustomVJP"):
                return True
            inner = getattr(value, "params", None)
            value = inner.get("prim") if isinstance(inner, dict) else None
    return False


def dependent_eqns(jaxpr: Any, inputs: set) -> Iterator[tuple[Any, list[tuple[Any, set]]]]:
    """The equations of ``jaxpr`` that read a value depending on the variables in ``inputs``, in
    order, each with its sub-jaxprs and the sub-jaxpr inputs that depend on them: input by input
    where the sub-jaxpr's inputs line up with the equation's, else all of them.
    """
    depends = set(inputs)
    for eqn in jaxpr.eqns:
        hit = [not isinstance(v, Literal) and v in depends for v in eqn.invars]
        if not any(hit):
            continue
        depends.update(eqn.outvars)
        subs = [
            (sub, {v for v, h in zip(sub.invars, hit) if h} if len(sub.invars) == len(hit) else set(sub.invars))
            for sub in jaxprs_in_params(eqn.params)
        ]
        yield eqn, subs


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """The context ``jax.core.eval_jaxpr`` binds an equation in: its source location and name
    stack (so JAX's messages point at the user's line) and its equation context (compute type,
    PRNG implementation, XLA metadata)."""
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield
