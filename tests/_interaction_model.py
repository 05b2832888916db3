"""The function, data and transforms of the feature-interaction matrix, shared by
``tests/test_interactions.py`` (in process) and ``tests/_interaction_checks.py`` (the 4-device
subprocess, which imports this after setting its ``XLA_FLAGS``).

``make_fun(body, coll, n)`` is one example's ``f(w, x)`` with a ``(D, D)`` intermediate: its
activation plain, a ``custom_jvp`` or a ``custom_vjp``, optionally with a collective over the
mapped axis ``"i"`` of size ``n``; ``make_linear_fun(body)`` its linear counterpart;
``run`` applies one transform to a mapped ``f``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

D = 8  # feature size


@jax.custom_jvp
def _cj(z):
    return jnp.sin(z)


@_cj.defjvp
def _cj_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    return jnp.sin(z), jnp.cos(z) * t


@jax.custom_vjp
def _cv(z):
    return jnp.tanh(z)


def _cv_fwd(z):
    y = jnp.tanh(z)
    return y, y


def _cv_bwd(y, g):
    return (g * (1.0 - y**2),)


_cv.defvjp(_cv_fwd, _cv_bwd)

BODY = {"plain": jnp.tanh, "custom_jvp": _cj, "custom_vjp": _cv}


def make_fun(body: str, coll: str | None = None, *, n: int):
    """``f(w, x)`` of one example ``x`` (D,) with a (D, D) intermediate, optionally a collective."""
    act = BODY[body]

    def f(w, x):
        h = act(jnp.outer(x, x) @ w).sum(0)  # (D,)
        if coll == "size":  # axis-size queries: the full axis size n in every case
            h = h * (jax.lax.axis_size("i") / n) + jax.lax.psum(1.0, "i") / n
        elif coll == "psum":  # a collective over mapped values
            h = h - jax.lax.psum(h, "i") / n
        return h

    return f


@jax.custom_jvp
def _lin_cj(z):
    return 2.0 * z


@_lin_cj.defjvp
def _lin_cj_jvp(primals, tangents):
    return _lin_cj(primals[0]), 2.0 * tangents[0]


#: Linear bodies for ``make_linear_fun`` (a linear ``custom_vjp`` is left out: JAX has no
#: transpose rule for ``custom_vjp_call``, so ``jax.linear_transpose`` of ``jax.vmap`` fails).
LINEAR_BODY = {"plain": lambda z: 2.0 * z, "custom_jvp": _lin_cj}


def make_linear_fun(body: str):
    """``f(w, x)`` linear in one example ``x`` (D,), with a (D, D) intermediate (``w`` scaled by
    ``x`` row by row) through a linear ``body``, for ``jax.linear_transpose``."""
    act = LINEAR_BODY[body]
    return lambda w, x: (act(w * x[:, None]) @ w).sum(0) + x[::-1]


def data(n: int):
    """``w`` (D, D), ``x`` (n, D) and two ``w`` for the enclosing-vmap mode."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(D, D)) / D, jnp.float32)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    ws = jnp.asarray(rng.normal(size=(2, D, D)) / D, jnp.float32)
    return w, x, ws


def run(mode: str, mapped, w, x, ws):
    """``mapped(w, x)`` (a vmap over x's axis 0) under the transform ``mode``."""
    if mode == "eager":
        return mapped(w, x)
    if mode == "jit":
        return jax.jit(mapped)(w, x)
    if mode == "grad":
        return jax.grad(lambda w, x: jnp.sum(mapped(w, x) ** 2), argnums=(0, 1))(w, x)
    if mode == "vmap":
        return jax.vmap(mapped, in_axes=(0, None))(ws, x)
    if mode == "hessian":  # w.r.t. two scalars scaling and shifting w (a small Hessian)
        return jax.hessian(lambda a: jnp.sum(mapped(w * a[0] + a[1], x) ** 2))(jnp.array([1.0, 0.1]))
    raise AssertionError(mode)
