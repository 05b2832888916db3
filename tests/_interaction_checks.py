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
    assert slow <= set(names), slow - set(names)
    return [n for n in names if n not in slow], [n for n in names if n in slow]


if __name__ == "__main__" and "--list" in sys.argv:
    print(json.dumps(dict(zip(("default", "slow"), _names()))))
    sys.exit(0)

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import time  # noqa: E402
import traceback  # noqa: E402

import _interaction_model as _model  # noqa: E402
import jax  # noqa: E402
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


def run_named(name):
    kind, rest = name.split("-", 1)
    parts = rest.split("-")
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
