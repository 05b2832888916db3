"""Feature-interaction checks with sharded inputs, run in one subprocess by tests/test_interactions.py.

The CPU device count (``--xla_force_host_platform_device_count=4``) must be set before JAX starts,
so these checks run in their own interpreter. Usage::

    python tests/_interaction_checks.py [--list] [NAME ...]

``--list`` prints the check names (a JSON object, without importing JAX: ``"default"``, the
checks run by default, and ``"slow"``, those run by ``pytest -m slow``); otherwise the named (or
the default) checks run and the last line printed is a JSON object: name -> "ok" or the failure.

Each check runs ``chunkop.vmap(f, (None, 0), ...)`` on an input sharded along its mapped axis and
compares with ``jax.vmap`` of the same ``f`` on the *unsharded* input, under one transform
(eager / jit / grad / vmap-of / hessian), over meshes

- ``auto``: 1-D (4,) Auto mesh ``d``; ``explicit``: 1-D (4,) Explicit mesh ``d``;
- ``2d``: a (2, 2) Explicit mesh ``(a, b)``, the mapped axis sharded over ``a`` only,

and chunk sizes None / 3 (a remainder in each device's shard: 16 / 4 = 4 = 3 + 1, 16 / 2 = 8 =
3 + 3 + 2) / 2 (divides every shard) / ``"auto"`` (a small budget). Stacked outputs must keep
the mapped axis sharded over the mesh axis (eagerly; under ``jit`` on Explicit meshes).

Two more families (issue #24, "one engine"), the standalone checks of
``tests/_sharded_layout_checks.py`` combined with the axes above:

- ``closure-{closure}-{mesh}-{chunk}-{body}-{transform}``: ``fun`` (the model's, with its body)
  closing over a mesh-replicated array that it indexes (``index``: ``w[1]``, ``w[2:]``), a PRNG
  key folded with mapped data (``key``), ``jax.lax.with_sharding_constraint`` (``constraint``),
  or concrete values in Python control flow and shapes (``concrete``: ``float(c.sum())`` of a
  closed-over array, a NumPy table, an unmapped argument, in ``jnp.zeros(int(t[0]))``), on the
  Auto and Explicit meshes; the closed-over arrays are made in the mesh context, and the
  reference is ``jax.vmap`` of the same ``fun`` there, on the unsharded input;
- ``jac-{jacrev|jacfwd}-{chunk}-{body}-{transform}``: ``chunkop.jacrev`` / ``jacfwd`` of a
  function of a vector sharded on the Explicit mesh (64 entries, 16 a device), chunk 3 (21 x 3 +
  1 basis vectors) or ``"auto"``, against ``jax.jacrev`` / ``jax.jacfwd`` of the unsharded vector
  (and their output sharding on the sharded one).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

MESHES = ["auto", "explicit", "2d"]
CHUNKS = [None, 3, 2, "auto"]
MODES = ["eager", "jit", "grad", "vmap", "hessian"]
BODIES = ["plain", "custom_jvp", "custom_vjp"]


def _names() -> tuple[list[str], list[str]]:
    """The checks: those run by default (about 80 CPU-seconds, 120 before the ``slow`` split),
    and the ``slow`` ones (``pytest -m slow``), variants that repeat a code path a default check
    already runs.

    Where the mesh reaches chunkop (read ``_transform.Chunked.__call__`` / ``_call_sharded``):
    ``chunk_size=None`` calls ``jax.vmap`` before any sharding is looked at, so the mesh is
    jax.vmap's business (the default checks keep None on every mesh, through the axis-size,
    psum, progress and spmd checks, and every transform but the Hessian on the Explicit mesh;
    its Hessian is ``jax.vmap``'s own, skipped in process too); a chunk is planned and looped on
    one device's shard, so a dividing chunk (2) runs the same loop on every mesh (kept on the
    Explicit mesh); on an Auto mesh under ``grad`` the sharding is not visible, so a custom rule
    there runs the unsharded loop (``tests/test_interactions.py``). Hessians (the slowest
    checks): two, which between them run a chunk with axis-size queries and "auto" with
    progress; the other Hessians are their subsets."""

    def keep(m, c, t):
        # Hessians on the Explicit mesh only; a dividing chunk: eager and jit
        return not ((t == "hessian" and m != "explicit") or (c == 2 and t not in ("eager", "jit")))

    values = [f"values-{m}-{c}-plain-{t}" for m, c, t in itertools.product(MESHES, CHUNKS, MODES) if keep(m, c, t)]
    values += [f"values-{m}-3-{b}-{t}" for m in MESHES for b in ("custom_jvp", "custom_vjp") for t in ("eager", "grad")]
    # chunk None and the dividing chunk 2 on the Auto and 2-D meshes
    slow = {n for n in values if n.startswith(tuple(f"values-{m}-{c}-" for m in ("auto", "2d") for c in (None, 2)))}
    # the Hessians of a chunk and of "auto": size-explicit-3-hessian (the same plus axis-size
    # queries) and progress-explicit-auto-hessian (the same plus progress) run them
    slow |= {"values-explicit-3-plain-hessian", "values-explicit-auto-plain-hessian"}
    slow |= {"values-explicit-None-plain-hessian", "values-2d-auto-plain-grad"}
    slow |= {"values-auto-3-custom_jvp-grad", "values-auto-3-custom_vjp-grad", "values-2d-3-custom_jvp-grad"}
    names = values
    # progress: every transform on the Explicit mesh; eager (and grad) on the others
    names += [f"progress-explicit-{c}-{t}" for c in (3, "auto") for t in MODES]
    names += [f"progress-{m}-{c}-eager" for m in ("auto", "2d") for c in (3, "auto")]
    names += [f"progress-{m}-3-grad" for m in ("auto", "2d")]
    names += [f"progress-{m}-None-eager" for m in MESHES]  # not chunking: no report
    # progress-2d-3-grad: spmd-2d-3-grad runs the same (the 2-D mesh's types name its axis);
    # progress-explicit-3-grad: spmd-auto-3-grad (the same shard_map over "d", progress, grad)
    slow |= {"progress-explicit-3-hessian", "progress-2d-3-grad", "progress-explicit-3-grad"}
    # axis-size queries and psum: every chunk kind eagerly on every mesh; the transforms on the
    # Explicit and 2-D meshes (on an Auto mesh under jit / grad the sharding is not visible)
    names += [f"size-{m}-{c}-eager" for m in MESHES for c in (None, 3, "auto")]
    names += [f"size-{m}-{c}-{t}" for m in ("explicit", "2d") for c in (3, "auto") for t in ("jit", "grad")]
    names += [f"size-explicit-3-{t}" for t in ("vmap", "hessian")]
    slow |= {"size-2d-3-grad", "size-2d-auto-grad"}
    names += [f"psum-{m}-{c}-eager" for m in MESHES for c in (None, 3, "auto")]
    names += [f"psum-explicit-{c}-jit" for c in (None, 3, "auto")]
    # spmd_axis_name names the mesh axis: device-local chunking also where the types carry no
    # sharding (an Auto mesh under jit / grad); with a progress callable
    names += [f"spmd-{m}-{c}-jit" for m in ("auto", "2d") for c in (None, 3, "auto")]
    names += [f"spmd-{m}-3-grad" for m in ("auto", "2d")]
    closures, closures_slow = _closure_names()
    jacs, jacs_slow = _jac_names()
    names += closures + jacs
    slow |= closures_slow | jacs_slow
    assert slow <= set(names), slow - set(names)
    return [n for n in names if n not in slow], [n for n in names if n in slow]


CLOSURES = ["index", "key", "constraint", "concrete"]


def _closure_names() -> tuple[list[str], set[str]]:
    """``fun`` closing over mesh values (``closure-...``): every name, and the ``slow`` ones.

    Left out: ``concrete`` under ``jit`` (``jax.vmap`` itself fails there: ``float()`` of a
    value computed in the traced function), Hessians off the Explicit mesh, a custom_vjp's
    Hessian (no forward mode); chunk None (``jax.vmap`` itself) and the dividing chunk 2 run
    eager and jit with the plain body only, "auto" with a custom rule eager and under grad.

    Default (about 10 CPU-seconds): every closure with chunk 3 eagerly on both meshes and under
    jit on the Explicit mesh (on the Auto mesh jit hides the sharding: the unsharded loop, which
    grad runs too); under grad once each, the meshes and bodies spread over them; under an
    enclosing vmap twice; with "auto" for the mesh-typed array and the sharding constraint (what
    the planner's probes compile: the others are constants there as under chunk 3); the Hessian
    with the sharding constraint. The rest (their other meshes, bodies
    and transforms) repeat those paths: ``slow``."""
    names = []
    for cl, m, c, b, t in itertools.product(CLOSURES, ("auto", "explicit"), CHUNKS, BODIES, MODES):
        if (cl == "concrete" and t == "jit") or (t == "hessian" and (m != "explicit" or b == "custom_vjp")):
            continue
        if c in (None, 2) and (b != "plain" or t not in ("eager", "jit")):
            continue
        if c == "auto" and b != "plain" and t not in ("eager", "grad"):
            continue
        names.append(f"closure-{cl}-{m}-{c}-{b}-{t}")
    default = {f"closure-{cl}-{m}-3-plain-eager" for cl in CLOSURES for m in ("auto", "explicit")}
    default |= {f"closure-{cl}-explicit-3-plain-jit" for cl in CLOSURES[:3]}
    default |= {
        "closure-index-explicit-3-custom_vjp-grad",
        "closure-key-auto-3-plain-grad",
        "closure-constraint-explicit-3-custom_jvp-grad",
        "closure-concrete-explicit-3-plain-grad",
        "closure-index-auto-3-plain-vmap",
        "closure-constraint-explicit-3-plain-vmap",
        "closure-index-explicit-auto-plain-eager",
        "closure-constraint-explicit-auto-plain-eager",
        "closure-constraint-explicit-3-plain-hessian",
    }
    assert default <= set(names), default - set(names)
    return names, set(names) - default


def _jac_names() -> tuple[list[str], set[str]]:
    """``chunkop.jacrev`` / ``jacfwd`` on the Explicit mesh (``jac-...``): every name, the ``slow`` ones.

    Left out: ``jacfwd`` of a custom_vjp (no forward mode in JAX). Default (about 5
    CPU-seconds): each Jacobian under jit, grad (second order) and an enclosing vmap, and each
    custom rule once, with chunk 3; ``jacrev``'s "auto" under an enclosing vmap (the planner on
    the batched pullback of a sharded vector; ``jacfwd`` plans its pushforward the same way).
    Eager calls with the plain body repeat ``jacobians_on_explicit_mesh``
    (``tests/_sharded_layout_checks.py``); the rest repeat a default path with another rule or
    chunk: ``slow``."""
    names = [
        f"jac-{j}-{c}-{b}-{t}"
        for j, c, b, t in itertools.product(("jacrev", "jacfwd"), (3, "auto"), BODIES, MODES[:4])
        if not (j == "jacfwd" and b == "custom_vjp")
    ]
    default = {
        "jac-jacrev-3-plain-jit",
        "jac-jacrev-3-plain-grad",
        "jac-jacrev-auto-plain-vmap",
        "jac-jacrev-3-custom_vjp-grad",
        "jac-jacfwd-3-plain-vmap",
        "jac-jacfwd-3-custom_jvp-jit",
    }
    assert default <= set(names), default - set(names)
    return names, set(names) - default


if __name__ == "__main__" and "--list" in sys.argv:
    print(json.dumps(dict(zip(("default", "slow"), _names()))))
    sys.exit(0)

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import time  # noqa: E402
import traceback  # noqa: E402

import _interaction_model as _model  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import chunkop  # noqa: E402

N = 16  # mapped axis (D and the function: tests/_interaction_model.py)
BUDGET = 3072  # bytes per enclosing-vmap example: "auto" chunks a device's shard at this size

make_fun = functools.partial(_model.make_fun, n=N)
data = functools.partial(_model.data, N)


def mesh_and_axis(kind):
    if kind == "2d":
        return jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2), "a"
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((4,), ("d",), axis_types=types), "d"


run = _model.run


@functools.cache
def reference(body, coll, mode):
    """jax.vmap on the unsharded inputs (computed once per combination, under one ``jit``: the
    same values as eagerly, without compiling every operation of a Hessian on its own)."""
    kw = {"axis_name": "i"} if coll else {}
    return jax.jit(functools.partial(run, mode, jax.vmap(make_fun(body, coll), in_axes=(None, 0), **kw)))(*data())


def close(actual, expected, rtol=1e-4, atol=1e-4):
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves, strict=True):
        assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def spec_at(y, axis):
    spec = tuple(y.sharding.spec) + (None,) * y.ndim
    entry = spec[axis]
    return entry if not isinstance(entry, tuple) or len(entry) != 1 else entry[0]


def budget_for(mode):
    """Per example of the enclosing jax.vmap batch (2 for vmap, 2 tangents for hessian's jacfwd);
    the Hessian-vector program needs a little more (its least temp memory is 2.6-3 KiB)."""
    return {"vmap": 2 * BUDGET, "hessian": 2 * 4096}.get(mode, BUDGET)


def local_n(kind, mode, spmd=False):
    """The mapped size each chunk loop sees: a device's shard, or all of N where the sharding is
    not visible (an Auto mesh under jit, or under grad w.r.t. the mapped input: traced values)
    and no ``spmd_axis_name`` names the mesh axis."""
    if kind == "auto" and mode in ("jit", "grad") and not spmd:
        return N
    return N // (2 if kind == "2d" else 4)


def _fails_as_jax_vmap(err, mode, f, kw, w, xs, ws):
    """Whether ``jax.vmap`` on the same (sharded) inputs in the same ``mode`` fails with the same
    error: then chunkop, which runs ``fun`` as ``jax.vmap`` would, may fail alike (jax 0.12's
    ``jax.jit`` of ``jax.vmap`` with a ``psum`` on an Explicit mesh: "Length of sharding.spec")."""
    try:
        run(mode, jax.vmap(f, in_axes=(None, 0), **kw), w, xs, ws)
    except Exception as ref:  # noqa: BLE001 - any error: compared with chunkop's below
        return type(ref) is type(err) and str(ref).splitlines()[-1] == str(err).splitlines()[-1]
    return False


def _check(kind, chunk, body, mode, coll=None, progress=False, spmd=False):
    mesh, axis = mesh_and_axis(kind)
    w, x, ws = data()
    f = make_fun(body, coll)
    kw = {"axis_name": "i"} if coll else {}
    expected = reference(body, coll, mode)
    calls = []
    g = chunkop.vmap(
        f,
        in_axes=(None, 0),
        chunk_size=chunk,
        memory_budget=budget_for(mode) if chunk == "auto" else None,
        progress=(lambda k, n: calls.append((int(k), int(n)))) if progress else None,
        spmd_axis_name=axis if spmd else None,
        **kw,
    )
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(axis)))
        if coll == "psum" and isinstance(chunk, int):
            try:
                run(mode, g, w, xs, ws)
            except ValueError as e:
                assert "psum" in str(e), f"refused without naming the collective `psum`: {e}"
                return
            raise AssertionError("psum of a mapped value with chunk_size < n was not refused")
        try:
            actual = run(mode, g, w, xs, ws)
        except Exception as err:
            if not _fails_as_jax_vmap(err, mode, f, kw, w, xs, ws):
                raise
            return
        jax.effects_barrier()
    close(actual, expected)
    # stacked outputs keep the mapped axis sharded (eagerly; under jit where types carry it)
    if mode == "eager" or mode == "vmap" or (mode == "jit" and (kind != "auto" or spmd)):
        where = 1 if mode == "vmap" else 0
        assert spec_at(actual, where) == axis, (actual.sharding, axis)
    if chunk == "auto" and coll != "psum":
        plan = g.last_plan
        assert plan is not None and plan.chunk is not None and plan.chunk < local_n(kind, mode, spmd), plan
    if progress:
        c = g.last_plan.chunk if chunk == "auto" else chunk
        m = local_n(kind, mode, spmd)
        if c is None or c >= m:
            assert calls == [], calls
        else:
            total = -(-m // c)
            assert calls, "no progress report"
            assert {n for _, n in calls} == {total}, (total, calls)
            assert max(k for k, _ in calls) == total, (total, calls)


# -- fun closing over mesh values ----------------------------------------------------------------

TABLE = np.array([3, 1])  # a NumPy table: an unmapped argument read as Python ints


def closure_mapped(closure, body, vmap):
    """``vmap(fun, in_axes)`` (``chunkop.vmap`` with its options, or ``jax.vmap``) of the model's
    ``fun`` with ``body``, extended by ``closure``, as ``mapped(w, x)``. Called in the mesh
    context: the arrays it closes over are made there (typed on the mesh, replicated)."""
    f = make_fun(body)
    if closure == "index":
        c = jnp.asarray([1.0, -0.5, 0.25, 2.0])
        return vmap(lambda w, x: f(w * c[1], x) + c[2:].sum(), (None, 0))
    if closure == "key":
        key = jax.random.key(1)

        def folded(w, x):
            k = jax.random.fold_in(key, (x[0] * 100).astype(jnp.int32))  # a key per example
            return f(w, x) * jax.random.normal(k, ())

        return vmap(folded, (None, 0))
    if closure == "constraint":
        return vmap(lambda w, x: jax.lax.with_sharding_constraint(f(w, x), P()) * 2.0, (None, 0))
    if closure == "concrete":
        c = jnp.asarray([1.0, 2.0, 3.0])

        def concrete(t, w, x):
            scale = 1.0 if float(c.sum()) > 0 else 2.0  # Python control flow on a closed-over array
            return jnp.concatenate([f(w, x) * scale, jnp.zeros(int(t[0]))])  # a shape from the table

        mapped = vmap(concrete, (None, None, 0))
        return lambda w, x: mapped(TABLE, w, x)
    raise AssertionError(closure)


def _check_closure(closure, kind, chunk, body, mode):
    mesh, axis = mesh_and_axis(kind)
    w, x, ws = data()
    made = []

    def chunked(f, in_axes):
        made.append(
            chunkop.vmap(f, in_axes, chunk_size=chunk, memory_budget=budget_for(mode) if chunk == "auto" else None)
        )
        return made[-1]

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(axis)))
        actual = run(mode, closure_mapped(closure, body, chunked), w, xs, ws)
        # under one jit (compiled once, not operation by operation), but for ``concrete``: its
        # float() needs the closed-over array concrete, which it is not inside jax.vmap's jit
        reference = functools.partial(run, mode, closure_mapped(closure, body, jax.vmap))
        expected = (reference if closure == "concrete" else jax.jit(reference))(w, x, ws)
    close(actual, expected)
    if mode == "eager" or mode == "vmap" or (mode == "jit" and kind != "auto"):
        where = 1 if mode == "vmap" else 0
        assert spec_at(actual, where) == axis, (actual.sharding, axis)
    if chunk == "auto":
        plan = made[0].last_plan
        assert plan is not None and plan.chunk is not None and plan.chunk < local_n(kind, mode), plan


# -- chunkop.jacrev / jacfwd on the Explicit mesh -------------------------------------------------

JAC_N = 64  # 16 entries a device; chunk 3: 21 chunks and a remainder of 1 basis vector
JAC_BUDGET = 8192  # bytes per enclosing-vmap example: "auto" chunks the 64 basis vectors (jax 0.12.1 needs
# 6040 at the least for jacrev under vmap, jax 0.10.2 under 2048: room for both, and it still chunks)


def jac_fun(body):
    """A function of a (sharded) vector: elementwise work and full reductions (legal on an
    Explicit mesh, where ``jnp.outer`` of a sharded vector is not)."""
    act = _model.BODY[body]
    return lambda v: act(v * jnp.sum(jnp.sin(v))) + jnp.cos(v) * v.sum()


def run_jac(mode, jac, v, vs):
    if mode == "eager":
        return jac(v)
    if mode == "jit":
        return jax.jit(jac)(v)
    if mode == "grad":  # second order: the gradient of a function of the Jacobian
        return jax.grad(lambda v: jnp.sum(jnp.sin(jac(v))))(v)
    if mode == "vmap":
        return jax.vmap(jac)(vs)
    raise AssertionError(mode)


def _check_jac(name, chunk, body, mode):
    mesh, axis = mesh_and_axis("explicit")
    rng = np.random.default_rng(3)
    v = jnp.asarray(rng.normal(size=JAC_N), jnp.float32)
    vs = jnp.asarray(rng.normal(size=(2, JAC_N)), jnp.float32)
    f = jac_fun(body)
    reference = functools.partial(run_jac, mode, getattr(jax, name)(f))
    expected = jax.jit(reference)(v, vs)
    budget = JAC_BUDGET * (2 if mode == "vmap" else 1) if chunk == "auto" else None
    jac = getattr(chunkop, name)(f, chunk_size=chunk, memory_budget=budget)
    with jax.set_mesh(mesh):
        v_s = jax.device_put(v, NamedSharding(mesh, P(axis)))
        vs_s = jax.device_put(vs, NamedSharding(mesh, P(None, axis)))
        actual = run_jac(mode, jac, v_s, vs_s)
        want = jax.eval_shape(reference, v_s, vs_s)  # jax's own Jacobian of the sharded vector
    close(actual, expected)
    assert actual.sharding.spec == want.sharding.spec, (actual.sharding, want.sharding)  # laid out alike
    if chunk == "auto":
        plan = jac.last_plan
        assert plan is not None and plan.chunk is not None and plan.chunk < JAC_N, plan


def _chunk(text):
    return None if text == "None" else text if text == "auto" else int(text)


def run_named(name):
    kind, rest = name.split("-", 1)
    parts = rest.split("-")
    if kind == "closure":  # closure-{closure}-{mesh}-{chunk}-{body}-{transform}
        _check_closure(parts[0], parts[1], _chunk(parts[2]), parts[3], parts[4])
        return
    if kind == "jac":  # jac-{jacrev|jacfwd}-{chunk}-{body}-{transform}
        _check_jac(parts[0], _chunk(parts[1]), parts[2], parts[3])
        return
    chunk = None if parts[1] == "None" else parts[1] if parts[1] == "auto" else int(parts[1])
    if kind == "values":
        _check(parts[0], chunk, parts[2], parts[3])
    elif kind == "progress":
        _check(parts[0], chunk, "plain", parts[2], progress=True)
    elif kind in ("size", "psum"):
        _check(parts[0], chunk, "plain", parts[2], coll=kind)
    elif kind == "spmd":
        _check(parts[0], chunk, "plain", parts[2], progress=True, spmd=True)
    else:
        raise AssertionError(name)


def main(names):
    results = {}
    for name in names or _names()[0]:
        start = time.perf_counter()
        try:
            run_named(name)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc(limit=6)[-2500:]
        print(f"{time.perf_counter() - start:6.2f}s {name}", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
