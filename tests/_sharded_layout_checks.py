"""``fun`` on inputs sharded along the mapped axis, against ``jax.vmap`` (issue #24, finding 1).

Run in a subprocess with 4 CPU devices by ``tests/test_sharded_layout.py`` (JAX fixes the device
count when it starts). Usage::

    python tests/_sharded_layout_checks.py [NAME ...]

prints one JSON object (check name -> "ok" or the failure's traceback) as its last line.

Each check runs one kind of ``fun`` that ``jax.vmap`` runs on the same sharded input, on an
Explicit 1-D mesh (``d``), an Explicit 2-D mesh (``a`` x ``b``, the mapped axis over both) and an
Auto mesh, and compares ``chunkop.vmap`` / ``sum`` with ``jax.vmap`` of the same ``fun`` on the
unsharded input: values eagerly, under ``jit``, the gradient and under an enclosing
``jax.vmap``; with chunk 3 (16 rows a device on every mesh: 5 chunks and a remainder of 1). On
the Explicit 1-D mesh also ``chunkop.mean`` (the sum's loop) and ``"auto"`` (a small budget).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _device_checks import run_checks
from _tolerance import rtol_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkop

N = 64  # 16 rows a device
CHECKS = {}
MESHES = ("explicit", "2d", "auto")
CHUNKS = (3, "auto")  # 3: 16 = 5 x 3 + 1, a remainder chunk on every device
BUDGET = 4096  # bytes: "auto" chunks a device's shard at this size


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def close(actual, expected, rtol=1e-5, atol=1e-5):
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def mesh_and_spec(kind):
    if kind == "2d":
        return jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2), P(("a", "b"))
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((4,), ("d",), axis_types=types), P("d")


def data():
    return jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def transforms(chunk):
    kw = {"chunk_size": chunk, "memory_budget": BUDGET if chunk == "auto" else None}
    return {
        "vmap": (lambda f: chunkop.vmap(f, **kw), lambda f, x: jax.vmap(f)(x)),
        "sum": (lambda f: chunkop.sum(f, **kw), lambda f, x: jax.vmap(f)(x).sum(0)),
        "mean": (lambda f: chunkop.mean(f, **kw), lambda f, x: jax.vmap(f)(x).mean(0)),
    }


def against_jax_vmap(make_fun, kinds=MESHES, grad=True, under_vmap=True):
    """``make_fun()`` (called inside the mesh context) through every transform, eagerly, under
    ``jit``, its gradient w.r.t. the mapped input and under an enclosing ``jax.vmap``, against
    ``jax.vmap`` on the unsharded input."""
    xs = data()
    for kind in kinds:
        mesh, spec = mesh_and_spec(kind)
        with jax.set_mesh(mesh):
            fun = make_fun()
            x = jax.device_put(xs, NamedSharding(mesh, spec))
            for chunk in CHUNKS if kind == "explicit" else CHUNKS[:1]:  # ("auto": one mesh)
                for name, (chunked, reference) in transforms(chunk).items():
                    if name == "mean" and kind != "explicit":  # (sum's loop; one mesh)
                        continue
                    where = f"{kind} chunk={chunk} {name}"
                    g = chunked(fun)
                    expected = reference(fun, xs)
                    close(g(x), expected)
                    close(jax.jit(g)(x), expected)
                    if name == "vmap":
                        y = g(x)
                        assert (*y.sharding.spec, None)[0] == spec[0], (where, y.sharding)
                    if grad and chunk == 3:
                        loss = lambda x, g=g: jnp.sum(jnp.sin(g(x)))
                        ref_loss = lambda x, reference=reference: jnp.sum(jnp.sin(reference(fun, x)))
                        # A sum's rounding (its order differs) moves sin's argument by up to
                        # dS = rtol_for(N) |S|: the gradient by dS |dS/dx| (|sin''| <= 1).
                        atol = 1e-5
                        if name != "vmap":
                            total = lambda x, reference=reference: jnp.sum(reference(fun, x))
                            ds = rtol_for(np.float32, N) * float(jnp.max(jnp.abs(reference(fun, xs))))
                            atol = max(atol, ds * float(jnp.max(jnp.abs(jax.grad(total)(xs)))))
                        close(jax.jit(jax.grad(loss))(x), jax.grad(ref_loss)(xs), rtol=1e-4, atol=atol)
                    if under_vmap and chunk == 3 and name != "mean":
                        scales = jnp.arange(1.0, 3.0)
                        got = jax.vmap(lambda s, g=g: g(x * s))(scales)
                        want = jax.vmap(lambda s, reference=reference: reference(fun, xs * s))(scales)
                        close(got, want)


@check
def closure_over_mesh_array_indexed():
    """``w[1]``, ``w[2:]`` of an array closed over, created under ``jax.set_mesh`` (typed on the
    mesh). Before: "Context mesh ... (Manual) should match the mesh of sharding ..."."""

    def make():
        w = jnp.asarray([1.0, -2.0, 0.5, 3.0])
        return lambda r: jnp.sin(r) * w[1] + w[2:].sum()

    against_jax_vmap(make)


@check
def closure_over_prng_key_folded_with_data():
    """A PRNG key closed over, folded with mapped data. Before, on an Explicit mesh: a ValueError
    saying ``fun`` "uses the mesh (a reshard, a sharding constraint, a collective)"."""

    def make():
        key = jax.random.key(1)
        return lambda r: r * jax.random.normal(jax.random.fold_in(key, (r[0] * 100).astype(jnp.int32)), ())

    against_jax_vmap(make)


@check
def sharding_constraint_inside_fun():
    """``jax.lax.with_sharding_constraint`` inside ``fun``. Before: "P(UNCONSTRAINED, ...) ...
    (Manual,)" on Auto and Explicit meshes."""

    def make():
        return lambda r: jax.lax.with_sharding_constraint(jnp.sin(r), P()) * 2.0

    against_jax_vmap(make)


@check
def concrete_unmapped_values_in_python():
    """Concrete unmapped values in Python control flow and shapes, as under ``jax.vmap``: a
    closed-over array in ``float(w.sum())``, a NumPy table in ``jnp.zeros(int(t[0]))`` (an
    unmapped argument). Before: ConcretizationTypeError (eagerly; on Explicit meshes also under
    jit)."""

    def make():
        w = jnp.asarray([1.0, 2.0, 3.0])
        return lambda r: r * (1.0 if float(w.sum()) > 0 else 2.0)

    against_jax_vmap(make, grad=False, under_vmap=False)
    table = np.array([3, 1])
    xs = data()
    for kind in MESHES:
        mesh, spec = mesh_and_spec(kind)
        with jax.set_mesh(mesh):
            x = jax.device_put(xs, NamedSharding(mesh, spec))
            fun = lambda t, r: jnp.zeros(int(t[0])) + r.sum()
            for chunk in CHUNKS:
                g = chunkop.vmap(
                    fun, in_axes=(None, 0), chunk_size=chunk, memory_budget=BUDGET if chunk == "auto" else None
                )
                close(g(table, x), jax.vmap(fun, in_axes=(None, 0))(table, xs))


@check
def jacobians_on_explicit_mesh():
    """``chunkop.jacrev`` / ``jacfwd`` of a function of an array sharded on an Explicit mesh. Before:
    "expected float32[8@d]" (the basis vectors had no sharding)."""
    v = jnp.linspace(0.1, 1.0, 8)
    f = lambda v: jnp.sin(v) * v.sum()
    for kind in ("explicit", "2d"):
        mesh, spec = mesh_and_spec(kind)
        with jax.set_mesh(mesh):
            x = jax.device_put(v, NamedSharding(mesh, spec))
            for chunk in (3, 2):
                close(chunkop.jacrev(f, chunk_size=chunk)(x), jax.jacrev(f)(v))
                close(chunkop.jacfwd(f, chunk_size=chunk)(x), jax.jacfwd(f)(v))
                close(jax.jit(chunkop.jacrev(f, chunk_size=chunk))(x), jax.jacrev(f)(v))
    # chunk_size="auto" with a budget that makes it chunk: the planner compiles its probes on
    # the constants' mesh types (before: "Expected cotangent type float32[64] but got
    # float32[64@d]" for jacrev, an aval mismatch for jacfwd)
    v = jnp.linspace(0.1, 1.0, 64)
    g = lambda v: jnp.tanh(3.0 * v) * jnp.sum(v**2)
    mesh, spec = mesh_and_spec("explicit")
    with jax.set_mesh(mesh):
        x = jax.device_put(v, NamedSharding(mesh, spec))
        for name in ("jacrev", "jacfwd"):
            jac = getattr(chunkop, name)(g, chunk_size="auto", memory_budget=2**11)
            close(jac(x), getattr(jax, name)(g)(v))
            assert jac.last_plan.chunk is not None and jac.last_plan.chunk < 64, jac.last_plan


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
