"""``spmd_axis_name`` without a ``jax.set_mesh`` context: the mesh from the mapped inputs.

Run in a subprocess with 4 CPU devices by ``tests/test_mesh_from_inputs.py`` (JAX fixes the
device count when it starts). Usage::

    python tests/_mesh_from_inputs_checks.py [NAME ...]

prints one JSON object (check name -> "ok" or the failure's traceback) as its last line.

Under ``jax.jit`` on an Auto mesh a traced input's type names its mesh but not its sharding.
``jax.jit(jax.vmap(f, spmd_axis_name='d'))`` of an input placed ``P('d')`` by ``jax.device_put``
keeps the output ``P('d')`` with no collective; ``chunkop.vmap`` with the same
``spmd_axis_name`` found no mesh without a context and all-gathered. Each check compares
``chunkop`` with ``jax.vmap`` of the same ``fun`` on the same inputs: values, the output's
sharding and the compiled program's collectives; and where ``jax.vmap``'s result does not split
the mapped axis over the named mesh axes (an axis they do not divide, Explicit axes whose types
say the input is not split), ``chunkop`` must not either (nor raise).
"""

from __future__ import annotations

import contextlib
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _device_checks import run_checks
from _tolerance import assert_tree_allclose
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkop
from chunkop import _sharding

N = 64  # 16 rows a device
CHUNK = 3  # 16 = 5 x 3 + 1: a remainder chunk on every device
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def f(w, x):
    return jnp.tanh(x @ w)


def loss(w, x):
    return jnp.sum(f(w, x) ** 2)


def data(n=N):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(4, 5)) * 0.5, jnp.float32), jnp.asarray(rng.normal(size=(n, 4)), jnp.float32)


def mesh_of(kind):
    if kind == "2d":
        return jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((4,), ("d",), axis_types=types)


def collectives(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= [^ ]+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo)


def specs(tree):
    return [tuple(leaf.sharding.spec) for leaf in jax.tree_util.tree_leaves(tree)]


def same_as_jax_vmap(chunked, reference, *args, n_terms=N, no_collectives=False, jit=True):
    """``chunked(*args)`` as ``reference(*args)`` (``jax.vmap``'s program): values, the outputs'
    shardings, and (under ``jit``) the kinds of collective in the compiled program (a loop over
    chunks may run one per chunk that ``jax.vmap`` runs once: an input split along the
    contracted axis is summed over the devices in each chunk)."""
    run = jax.jit if jit else (lambda g: g)
    out, ref = run(chunked)(*args), run(reference)(*args)
    assert_tree_allclose(out, ref, n_terms=n_terms)
    assert specs(out) == specs(ref), (specs(out), specs(ref))
    if jit:
        got, want = collectives(chunked, *args), collectives(reference, *args)
        assert set(got) == set(want), (got, want)
        if no_collectives:
            assert got == [], got


def vmap_as_jax_vmap(w, x, n_terms=N):
    """``chunkop.vmap(f, spmd_axis_name="d")`` as ``jax.vmap``'s (:func:`same_as_jax_vmap`), under
    ``jax.jit`` and eagerly; returns the chunked function."""
    chunked = chunkop.vmap(f, (None, 0), chunk_size=CHUNK, spmd_axis_name="d")
    vmapped = jax.vmap(f, (None, 0), spmd_axis_name="d")
    for jit in (True, False):
        same_as_jax_vmap(chunked, vmapped, w, x, n_terms=n_terms, jit=jit)
    return chunked


def grads_as_jax_vmap(kind, w, x, spmd):
    """The gradient (w and x) of a loss through ``chunkop.vmap`` / ``sum`` / ``mean`` as through
    ``jax.vmap``: values, shardings and collectives (``jax.vmap``'s: one all-reduce of w's)."""
    chunked = getattr(chunkop, kind)(loss, (None, 0), chunk_size=CHUNK, spmd_axis_name=spmd)
    vmapped = jax.vmap(loss, (None, 0), spmd_axis_name=spmd)
    total = {"vmap": jnp.sum, "sum": lambda v: v, "mean": lambda v: v}[kind]
    reduce = {"vmap": jnp.sum, "sum": jnp.sum, "mean": jnp.mean}[kind]
    g = jax.grad(lambda w, x: total(chunked(w, x)), (0, 1))
    ref = jax.grad(lambda w, x: reduce(vmapped(w, x)), (0, 1))
    same_as_jax_vmap(g, ref, w, x)


@check
def auto_mesh_jit_without_set_mesh():
    """The gap: ``jax.device_put`` on an Auto mesh, ``jax.jit``, no ``jax.set_mesh``. Each device
    chunks its own shard: the output stays ``P('d')`` with no collective (the sums: one
    all-reduce, as ``jax.vmap``'s), values and gradients as ``jax.vmap``'s; eagerly as well."""
    mesh = mesh_of("auto")
    w, xs = data()
    x = jax.device_put(xs, NamedSharding(mesh, P("d")))
    chunked = chunkop.vmap(f, (None, 0), chunk_size=CHUNK, spmd_axis_name="d")
    vmapped = jax.vmap(f, (None, 0), spmd_axis_name="d")
    same_as_jax_vmap(chunked, vmapped, w, x, no_collectives=True)
    assert specs(jax.jit(chunked)(w, x)) == [("d",)]
    same_as_jax_vmap(chunked, vmapped, w, x, jit=False)
    for kind in ("sum", "mean"):
        chunked = getattr(chunkop, kind)(loss, (None, 0), chunk_size=CHUNK, spmd_axis_name="d")
        reduce = {"sum": jnp.sum, "mean": jnp.mean}[kind]
        same_as_jax_vmap(chunked, lambda w, x: reduce(jax.vmap(loss, (None, 0), spmd_axis_name="d")(w, x)), w, x)
        assert collectives(chunked, w, x) == ["all-reduce"], collectives(chunked, w, x)
    for kind in ("vmap", "sum", "mean"):
        grads_as_jax_vmap(kind, w, x, "d")


@check
def auto_mesh_replicated_input_stays_replicated():
    """A replicated input on the same Auto mesh (the same trace under ``jax.jit``: the type does
    not say how it is sharded) comes back replicated, as from ``jax.vmap``; eagerly too."""
    mesh = mesh_of("auto")
    w, xs = data()
    x = jax.device_put(xs, NamedSharding(mesh, P()))
    chunked = chunkop.vmap(f, (None, 0), chunk_size=CHUNK, spmd_axis_name="d")
    vmapped = jax.vmap(f, (None, 0), spmd_axis_name="d")
    for jit in (True, False):
        same_as_jax_vmap(chunked, vmapped, w, x, jit=jit)
    assert specs(jax.jit(chunked)(w, x)) == [()]


@check
def uneven_split_as_jax_vmap():
    """A mapped axis the named mesh axes do not divide (10 rows, 4 devices: the input replicated,
    or sharded along another axis) is not split over them: as on one device, as ``jax.vmap``
    (which runs), inside a ``jax.set_mesh`` context or not; ``chunkop.sum`` too. (Inside the
    context this raised "does not divide it evenly".)"""
    for kind in ("auto", "explicit"):
        mesh = mesh_of(kind)
        for spec in (P(), P(None, "d")):
            w, xs = data(10)
            x = jax.device_put(xs, NamedSharding(mesh, spec))
            for inside in (False, True):
                with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
                    vmap_as_jax_vmap(w, x, n_terms=10)
                    total = chunkop.sum(loss, (None, 0), chunk_size=CHUNK, spmd_axis_name="d")
                    ref = lambda w, x: jnp.sum(jax.vmap(loss, (None, 0), spmd_axis_name="d")(w, x))
                    assert_tree_allclose(jax.jit(total)(w, x), jax.jit(ref)(w, x), n_terms=10)


@check
def explicit_mesh_replicated_input():
    """On an Explicit mesh the input's type says how it is sharded: replicated (or split along
    another axis), ``jax.vmap``'s output is not split along the mapped axis, and ``chunkop``'s
    must not be either (it came back ``P('d', None)``), inside ``jax.set_mesh`` or not."""
    mesh = mesh_of("explicit")
    w, xs = data()
    for spec in (P(), P(None, "d")):
        x = jax.device_put(xs, NamedSharding(mesh, spec))
        for inside in (False, True):
            with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
                chunked = vmap_as_jax_vmap(w, x)
                assert specs(jax.jit(chunked)(w, x)) == [(None, None)]


@check
def two_d_auto_mesh_without_set_mesh():
    """A 2-D Auto mesh: the mapped axis over both mesh axes, or over one of them (the other
    splitting nothing), named by ``spmd_axis_name``: as ``jax.vmap``, with no collective."""
    mesh = mesh_of("2d")
    w, xs = data()
    for spmd in (("a", "b"), "a", "b"):
        x = jax.device_put(xs, NamedSharding(mesh, P(spmd)))
        chunked = chunkop.vmap(f, (None, 0), chunk_size=CHUNK, spmd_axis_name=spmd)
        vmapped = jax.vmap(f, (None, 0), spmd_axis_name=spmd)
        same_as_jax_vmap(chunked, vmapped, w, x, no_collectives=True)
        assert specs(jax.jit(chunked)(w, x)) == [(spmd,)]
    x = jax.device_put(xs, NamedSharding(mesh, P(("a", "b"))))
    for kind in ("vmap", "sum"):
        grads_as_jax_vmap(kind, w, x, ("a", "b"))


@check
def the_mesh_only_where_the_mapped_inputs_agree():
    """The mesh is taken from the mapped inputs only when those on a mesh are all on one (others
    on none are fine); inputs on two meshes, or on none, name no mesh axes."""
    one = mesh_of("auto")
    two = jax.make_mesh((2, 2), ("d", "e"), axis_types=(AxisType.Auto,) * 2)
    on = lambda mesh, n=16: jax.ShapeDtypeStruct((n, 3), jnp.float32, sharding=NamedSharding(mesh, P()))
    plain = jax.ShapeDtypeStruct((16, 3), jnp.float32)
    found = []

    def probe(*xs):
        found.append(_sharding.mapped_mesh_axes(list(xs), [0] * len(xs), "test", "d"))
        return xs

    for args in ((on(one), on(one)), (on(one), plain), (on(one), on(two)), (plain,), (on(one, 10),)):
        jax.make_jaxpr(probe)(*args)
    assert [None if m is None else (dict(m.mesh.shape), m.names) for m in found] == [
        ({"d": 4}, ("d",)),
        ({"d": 4}, ("d",)),
        None,
        None,
        None,  # 10 rows do not split over 4 devices
    ], found


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
