"""Multi-device checks of sharded inputs and rows, run in a subprocess by tests/test_sharding.py.

JAX fixes its CPU device count when the backend starts, and the rest of the suite runs with one
device, so these checks run in their own interpreter with
``--xla_force_host_platform_device_count=4`` set before ``jax`` is imported. Usage::

    python tests/_multidevice_checks.py [NAME ...]

prints one JSON object (check name -> "ok" or the failure's traceback) as its last line.
Every check compares against a reference computed without sharding (``jax.vmap``, a dense
matrix) and asserts the output's sharding and the compiled program's collectives.
"""

from __future__ import annotations

import contextlib
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import re
import sys

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from _device_checks import run_checks
from _tolerance import rtol_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkop

N = 64  # mapped axis / rows: 16 per device
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def sum_condition(terms) -> float:
    """The worst cancellation of a sum over axis 0 of ``terms``: ``max sum|t| / max |sum t|``
    (NaN columns ignored)."""
    t = np.asarray(terms, np.float64)
    with np.errstate(invalid="ignore"):
        ratio = np.nanmax(np.abs(t).sum(0)) / np.nanmax(np.abs(t.sum(0)))
    return float(ratio) if np.isfinite(ratio) and ratio > 0 else 1.0


def close(actual, expected, n_terms=1, *, sum_of=None, rtol=None, atol=None):
    """Leaf by leaf: the same shapes, and values to the tolerance of the computation
    (tests/_tolerance.py: ``n_terms`` the longest sum the two evaluations order differently;
    ``sum_of``: ``expected`` sums (or averages) these terms over axis 0, which adds their number
    and their cancellation), or to an explicit ``rtol``/``atol``."""
    condition = 1.0
    if sum_of is not None:
        n_terms, condition = n_terms + np.shape(sum_of)[0], sum_condition(sum_of)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
        a, e = np.asarray(a), np.asarray(e)
        r = rtol_for(e.dtype, n_terms, condition) if rtol is None else rtol
        finite = np.abs(e[np.isfinite(e)])  # (a NaN expected is matched by a NaN)
        t = r * float(finite.max(initial=0.0)) if atol is None else atol
        np.testing.assert_allclose(a, e, rtol=r, atol=t)


def mesh_of(kind):
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((4,), ("d",), axis_types=types)


def collectives(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= [^ ]+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo)


def collectives_in_loops(fn, *args):
    """The collectives of ``fn``'s compiled program that run inside a loop (a while body, or a
    computation one calls): one per iteration, where a single one at the end would do."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    comps = {}
    for block in re.split(r"\n(?=(?:ENTRY )?%[^ ]+ \()", hlo):
        m = re.match(r"(?:ENTRY )?%([^ ]+) \(", block)
        if m:
            comps[m.group(1)] = block
    called = lambda text: re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%([\w.\-]+)", text)
    todo = [b for text in comps.values() for b in re.findall(r"body=%([\w.\-]+)", text)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += called(comps[name])
    pattern = r"= [^ ]+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
    return [(name, op) for name in sorted(seen) for op in re.findall(pattern, comps[name])]


def scan_lengths(fn, *args):
    """The ``length`` of every scan in ``fn``'s jaxpr: with the mapped axis sharded, each device
    scans its own shard's chunks (with :func:`collectives`: and reads no other device's rows)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                found.append(eqn.params["length"])
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def mapped_spec(y, axis=0):
    spec = tuple(y.sharding.spec) + (None,) * y.ndim
    return spec[axis]


def data(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)
    return w, xs


def f(w, x):
    return jnp.tanh(x @ w)


F_TERMS = 3  # x @ w: a sum of 3 products


# -- chunkop.vmap / map ------------------------------------------------------------------------


@check
def auto_plan_keyed_by_the_arguments_sharding():
    """A plan is made per argument types, sharding included: the same function planned on a
    plain and on an Explicit-sharded weight (the program compiles to a quarter of the
    activations per device) gets two plans, each measured on its own program, and the sharded
    call gives jax.vmap's values."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(64, 512)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
    g = chunkop.vmap(lambda w, x: jnp.tanh(x @ w), (None, 0), chunk_size="auto", memory_budget=2**18)
    plain = chunkop.plan(g, w, xs)
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "d")))
        sharded = chunkop.plan(g, ws, xs)
        out = g(ws, xs)
    assert plain.chunk is not None and plain.compiled_bytes is not None, plain
    assert sharded is not plain and sharded.compiled_bytes is not None, (plain, sharded)
    # a quarter of the activations per device: a larger chunk (None: the whole axis) or less memory
    assert (sharded.chunk or 256) > plain.chunk or sharded.compiled_bytes < plain.compiled_bytes, (plain, sharded)
    close(out, jax.vmap(lambda w, x: jnp.tanh(x @ w), (None, 0))(w, xs), 64)


def _vmap_values(kind):
    mesh = mesh_of(kind)
    w, xs = data()
    ref = jax.vmap(f, (None, 0))(w, xs)
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        for c in (None, 5, 16):
            g = chunkop.vmap(f, (None, 0), chunk_size=c)
            close(g(w, x), ref, F_TERMS)
            assert mapped_spec(g(w, x)) == "d", (c, g(w, x).sharding)
            close(jax.jit(g)(w, x), ref, F_TERMS)
            if kind == "explicit":
                # the sharding is in the traced types: detected under jit, no collective at all
                assert mapped_spec(jax.jit(g)(w, x)) == "d"
                assert collectives(g, w, x) == [], (c, collectives(g, w, x))
            # (Auto under jit: traced values carry no sharding; spmd_axis_name says it, below)


@check
def vmap_values_explicit():
    _vmap_values("explicit")


@check
def vmap_values_auto():
    _vmap_values("auto")


@check
def vmap_chunks_each_local_shard():
    mesh = mesh_of("explicit")
    w, xs = data()
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        g = chunkop.vmap(f, (None, 0), chunk_size=4)
        # 16 rows per device in chunks of 4: one scan of length 4 (not 16: the whole axis), and
        # no collective (no device reads another's rows)
        assert scan_lengths(jax.jit(g), w, x) == [4], scan_lengths(jax.jit(g), w, x)
        assert collectives(jax.jit(g), w, x) == [], collectives(jax.jit(g), w, x)


@check
def sharded_temp_memory_bounded_by_the_chunk():
    """Each device's compiled temp memory, forward and under grad, is a chunk's, not its shard's
    (the device layout reads each device's chunks by index, on Explicit meshes too; before, a
    dividing chunk on an Explicit mesh scanned a reshape, which under the device axis' vmap is a
    copy of the shard). ``jax.vmap`` of the same function under grad: 4.2 MiB, more than a shard
    (a ``cumsum``: jaxlib 0.12 fuses the whole gradient of two ``tanh`` layers into no temp)."""
    n, f = 4 * 8192, 64
    w = jnp.full((f, f), 0.01)
    fun = lambda r: jnp.sum(jnp.cumsum(jnp.tanh(r @ w) @ w) ** 2)
    temp = lambda g, x: jax.jit(g).lower(x).compile().memory_analysis().temp_size_in_bytes
    shard = n // 4 * f * 4  # bytes of one device's rows
    for kind in ("explicit", "auto"):
        mesh = mesh_of(kind)
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.ones((n, f)), NamedSharding(mesh, P("d")))
            for transform in (chunkop.vmap, chunkop.sum):
                g = transform(fun, chunk_size=256, spmd_axis_name=None if kind == "explicit" else "d")
                loss = lambda x, g=g: jnp.sum(jnp.sin(g(x)))
                sizes = temp(g, x), temp(jax.grad(loss), x)
                assert max(sizes) < shard / 4, (kind, transform.__name__, sizes, shard)
            unchunked = temp(jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(fun)(x)))), x)
            assert unchunked > shard, (kind, unchunked)  # (the bound above is not vacuous)


@check
def vmap_other_axes_and_pytrees():
    mesh = mesh_of("explicit")
    w, xs = data()
    xt = xs.T  # mapped along axis 1

    def h(w, x, b):
        return {"y": jnp.tanh(x @ w) + b["s"], "z": w.sum()}

    b = {"s": jnp.arange(N, dtype=jnp.float32)}
    ref = jax.vmap(h, (None, 1, 0), {"y": 1, "z": None})(w, xt, b)
    with jax.set_mesh(mesh):
        x = jax.device_put(xt, NamedSharding(mesh, P(None, "d")))
        g = chunkop.vmap(h, (None, 1, 0), {"y": 1, "z": None}, chunk_size=3)
        y = jax.jit(g)(w, x, b)
        close(y, ref, w.size)  # w.sum(): 15 terms
        assert mapped_spec(y["y"], 1) == "d", y["y"].sharding
        assert "all-gather" not in collectives(g, w, x, b)


@check
def vmap_grad():
    for kind in ("explicit", "auto"):
        mesh = mesh_of(kind)
        w, xs = data(1)
        ref = jax.grad(lambda w: (jax.vmap(f, (None, 0))(w, xs) ** 2).sum())(w)
        with jax.set_mesh(mesh):
            x = jax.device_put(xs, NamedSharding(mesh, P("d")))
            g = chunkop.vmap(f, (None, 0), chunk_size=5)
            got = jax.jit(jax.grad(lambda w, x: (g(w, x) ** 2).sum()))(w, x)
        close(got, ref, rtol=1e-4, atol=1e-5)


@check
def vmap_spmd_axis_name_auto_under_jit():
    # Under jit on an Auto mesh the traced input carries no sharding; spmd_axis_name names it.
    mesh = mesh_of("auto")
    w, xs = data()
    ref = jax.vmap(f, (None, 0))(w, xs)
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        g = chunkop.vmap(f, (None, 0), chunk_size=5, spmd_axis_name="d")
        y = jax.jit(g)(w, x)
        close(y, ref, F_TERMS)
        assert mapped_spec(y) == "d", y.sharding
        assert collectives(g, w, x) == [], collectives(g, w, x)
        assert scan_lengths(jax.jit(g), w, x) == [4]  # 16 rows a device: 4 chunks of 4 (make_plan)


@check
def vmap_axis_name_collective_on_shards_refused():
    mesh = mesh_of("explicit")
    _, xs = data()
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        ok = chunkop.vmap(lambda v: v * 2, axis_name="i", chunk_size=4)  # no collective: fine
        close(ok(x), xs * 2)
        collective = lambda v: v / jax.lax.psum(v, "i") * jax.lax.axis_size("i")
        # chunk_size=None is exactly jax.vmap, collectives over sharded inputs included
        close(chunkop.vmap(collective, axis_name="i")(x), jax.vmap(collective, axis_name="i")(xs), N)  # a psum
        ten = jax.device_put(np.asarray(xs)[:10], NamedSharding(mesh, P()))  # 10 rows, 4 devices
        close(chunkop.vmap(jnp.sin, spmd_axis_name="d")(ten), jnp.sin(xs[:10]))
        bad = chunkop.vmap(lambda v: v / jax.lax.psum(v, "i"), axis_name="i", chunk_size=4)
        try:
            bad(x)
        except ValueError as e:
            assert "collective" in str(e) and "shard" in str(e), e
        else:
            raise AssertionError("a psum over the sharded mapped axis was not refused")


@check
def vmap_same_function_on_two_meshes():
    """One chunked function on a 1-D mesh, then on a 2-D mesh (the mapped axis on 'a' only)."""
    f = chunkop.vmap(lambda v: jnp.sin(v) * 2, chunk_size=3)
    _, xs = data()
    mesh1 = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    mesh2 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    for mesh, name in ((mesh1, "x"), (mesh2, "a"), (mesh1, "x")):
        y = f(jax.device_put(xs, NamedSharding(mesh, P(name))))
        close(y, jnp.sin(xs) * 2)
        assert y.sharding.spec[0] == name, y.sharding
    # the same shard shape on both meshes (16 rows per device over ('x',) and over ('a', 'b')),
    # and a closed-over constant: the traces print alike, but their types carry the mesh, and
    # a loop traced on one could not run on the other (it raised before)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    for name in ("vmap", "sum"):
        g = getattr(chunkop, name)(lambda v: jnp.sin(v) * w, chunk_size=3)
        ref = jax.vmap(lambda v: jnp.sin(v) * w)(xs)
        for mesh, spec in ((mesh2, P(("a", "b"))), (mesh1, P("x")), (mesh2, P(("a", "b")))):
            with jax.set_mesh(mesh):
                x = jax.device_put(xs, NamedSharding(mesh, spec))
                tol = {} if name == "vmap" else {"sum_of": ref}
                close(g(x), ref if name == "vmap" else ref.sum(0), **tol)
                close(jax.jit(g)(x), ref if name == "vmap" else ref.sum(0), **tol)


@check
def eager_sharded_calls_compile_once_per_key():
    """Eager calls on sharded inputs reuse one compiled program per key (before: the shard_map
    compiled on every call, 0.1-1 s each), and the key is by value: a closure changed to a new
    array, to -0.0 or to a NaN gives that call's result, never the first one's."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(event) if "backend_compile" in event else None
    )
    _, xs = data()
    for kind in ("auto", "explicit"):
        mesh = mesh_of(kind)
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        for name, ref in (("vmap", lambda y: y), ("sum", lambda y: y.sum(0)), ("mean", lambda y: y.mean(0))):
            for chunk in (3, "auto"):
                counts = []
                for scale in (1.0, 5.0, -0.0, 5.0, float("nan")):
                    w = jnp.asarray([scale, 1.0, 2.0])
                    fun = lambda v, w=w: jnp.sin(v) * w  # a new closure per call, as a training step makes
                    before = len(compiles)
                    with jax.set_mesh(mesh):
                        y = getattr(chunkop, name)(fun, chunk_size=chunk)(x)
                    counts.append(len(compiles) - before)
                    per_example = jax.vmap(fun)(xs)
                    expected = ref(per_example)
                    np.testing.assert_array_equal(np.signbit(np.asarray(y)), np.signbit(np.asarray(expected)))
                    close(y, expected, **({} if name == "vmap" else {"sum_of": per_example}))
                assert counts[1:] == [0, 0, 0, 0], (kind, name, chunk, counts)
            # an unmapped array argument (read in the body from the program's inputs)
            counts = []
            for scale in (1.0, 5.0, -0.0):
                w = jnp.asarray([scale, 1.0, 2.0])
                before = len(compiles)
                with jax.set_mesh(mesh):
                    y = getattr(chunkop, name)(lambda w, v: jnp.sin(v) * w, in_axes=(None, 0), chunk_size=3)(w, x)
                counts.append(len(compiles) - before)
                close(y, ref(jnp.sin(xs) * w), **({} if name == "vmap" else {"sum_of": jnp.sin(xs) * w}))
            assert counts[1:] == [0, 0], (kind, name, "unmapped", counts)


@check
def closures_over_enclosing_transforms_on_sharded_inputs():
    """``fun`` closing over a value of an enclosing ``jax.vmap`` / ``grad`` / ``jvp``, or over an
    array created under ``jax.set_mesh``, on inputs sharded over an Explicit, a 2-D Explicit and
    an Auto mesh. Closed over by the ``shard_map`` body such values keep their outer type: on
    the Explicit meshes every case raised NotImplementedError ("Closing over inputs to
    shard_map"), on the Auto mesh ``vmap`` of ``grad`` at chunk 3 raised "Context mesh ... should
    match". Now ``fun`` is traced in the caller's mesh context and each device's loop runs under
    ``jax.vmap`` over the device axis (no ``shard_map``), so they work as under ``jax.vmap``, also
    a ``fun`` that uses the mesh (a reshard)."""
    _, xs = data()
    ref = lambda s: jnp.sum(s * jnp.sin(xs))
    expected = jnp.arange(3.0)[:, None, None] * jnp.sin(xs)
    grads = jax.vmap(jax.grad(ref))(jnp.arange(3.0))
    meshes = {  # and the chunk sizes run on each: both on one mesh, one on the others
        "explicit": (mesh_of("explicit"), P("d"), (3, "auto")),
        "2d": (jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2), P(("a", "b")), ("auto",)),
        "auto": (mesh_of("auto"), P("d"), (3,)),  # chunk 3 raised "Context mesh" here
    }
    for kind, (mesh, spec, chunks) in meshes.items():
        with jax.set_mesh(mesh):
            x = jax.device_put(xs, NamedSharding(mesh, spec))
            w = jnp.asarray([1.0, -2.0, 0.5])  # created under jax.set_mesh: typed on the mesh
            for chunk in chunks:
                v = lambda s: chunkop.vmap(lambda r: s * jnp.sin(r), chunk_size=chunk)(x)
                close(jax.vmap(v)(jnp.arange(3.0)), expected)
                close(jax.jit(jax.vmap(v))(jnp.arange(3.0)), expected)
                close(chunkop.vmap(lambda r: r * w, chunk_size=chunk)(x), xs * w)
                close(
                    jax.jit(lambda x: chunkop.sum(lambda r: r * w, chunk_size=chunk)(x))(x),
                    (xs * w).sum(0),
                    sum_of=xs * w,
                )
                f = lambda s: chunkop.sum(lambda r: jnp.sum(s * w * jnp.sin(r)), chunk_size=chunk)(x)
                close(jax.grad(f)(2.0), jax.grad(lambda s: ref(s * w))(2.0), rtol=1e-4, atol=1e-5)
                f = lambda s: chunkop.sum(lambda r: jnp.sum(s * jnp.sin(r)), chunk_size=chunk)(x)
                close(jax.jvp(f, (2.0,), (1.0,))[1], jax.jvp(ref, (2.0,), (1.0,))[1], rtol=1e-4, atol=1e-5)
                close(jax.vmap(jax.grad(f))(jnp.arange(3.0)), grads, rtol=1e-4, atol=1e-5)
            if kind != "auto":  # fun uses the mesh (a reshard) and closes over w: as jax.vmap
                uses_mesh = lambda r: jax.sharding.reshard(r * w, P())
                close(chunkop.vmap(uses_mesh, chunk_size=3)(x), jax.vmap(uses_mesh)(x))
                close(chunkop.vmap(uses_mesh, chunk_size=3)(x), xs * w)
                as_argument = chunkop.vmap(lambda w, r: jax.sharding.reshard(r * w, P()), (None, 0), chunk_size=3)
                close(as_argument(w, x), xs * w)


@check
def vmap_sum_mapped_axis_on_a_other_axis_on_b():
    """Mapped axis sharded over mesh axis 'a', another array axis over 'b': each example whole."""
    _, xs = data()
    xs = jnp.concatenate([xs, xs[:, :1] ** 2], axis=1)  # (N, 4): axis 1 splits over 'b'
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(xs, NamedSharding(mesh, P("a", "b")))
    fun = lambda v: jnp.sin(v) * v.sum()  # reads the whole example: a split one would be wrong
    per_example = jax.vmap(fun)(xs)
    close(chunkop.vmap(fun, chunk_size=3)(x), per_example, xs.shape[1])  # v.sum(): 4 terms
    close(chunkop.sum(fun, chunk_size=3)(x), per_example.sum(0), xs.shape[1], sum_of=per_example)
    close(chunkop.mean(fun, chunk_size=3)(x), per_example.mean(0), xs.shape[1], sum_of=per_example)


@check
def check_linear_of_sharded_rows_inside_set_mesh():
    """chunkop.check_linear (a chunked vmap of row_fn in a shard_map, under jit) on rows sharded
    over an Explicit mesh, inside jax.set_mesh: nothing computed eagerly may carry the outer mesh."""
    mesh = mesh_of("explicit")
    rng = np.random.default_rng(3)
    d = jnp.linspace(0.1, 2.0, 6)

    def row_fn(r, x):
        w = -jnp.diff(jnp.exp(-(d - r["b"]) / (d * r["b"])))  # reads a concrete closed-over array
        return w @ x[r["idx"]]

    with jax.set_mesh(mesh):
        rows = {"idx": jnp.asarray(rng.integers(0, 10, N), jnp.int32), "b": jnp.asarray(rng.uniform(0.5, 2, N))}
        rows = jax.device_put(rows, NamedSharding(mesh, P("d")))
        A = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((10, 5), jnp.float32), chunk_size=8)
        errors = chunkop.check_linear(A)
    assert max(errors.values()) < 1e-5, errors


@check
def map_sharded():
    mesh = mesh_of("explicit")
    _, xs = data()
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        y = jax.jit(lambda x: chunkop.map(jnp.linalg.norm, x, chunk_size=3))(x)
        close(y, jnp.linalg.norm(xs, axis=1), xs.shape[1])
        assert mapped_spec(y) == "d"


# -- chunkop.sum / mean ------------------------------------------------------------------------

LOSS_TERMS = F_TERMS + 5  # one example's loss: x @ w (3 terms), then a sum of 5 squares


@check
def sum_mean_values_grad_one_allreduce():
    w, xs = data(2)
    loss = lambda w, x: (f(w, x) ** 2).sum()
    ref = jax.vmap(loss, (None, 0))(w, xs)
    gref = jax.grad(lambda w: jax.vmap(loss, (None, 0))(w, xs).sum())(w)
    for kind in ("explicit", "auto"):
        mesh = mesh_of(kind)
        with jax.set_mesh(mesh):
            x = jax.device_put(xs, NamedSharding(mesh, P("d")))
            for c in (None, 5, 16):
                s = chunkop.sum(loss, (None, 0), chunk_size=c)
                m = chunkop.mean(loss, (None, 0), chunk_size=c)
                close(jax.jit(s)(w, x), ref.sum(), LOSS_TERMS, sum_of=ref)
                close(jax.jit(m)(w, x), ref.mean(), LOSS_TERMS, sum_of=ref)
                close(s(w, x), ref.sum(), LOSS_TERMS, sum_of=ref)
                close(jax.jit(jax.grad(s))(w, x), gref, rtol=1e-4, atol=1e-5)
                if kind == "explicit":  # one all-reduce of the per-device sums, nothing else
                    assert collectives(s, w, x) == ["all-reduce"], (c, collectives(s, w, x))


@check
def grad_of_unmapped_parameters_one_allreduce_per_call():
    """The gradient w.r.t. an unmapped parameter of a loss over a sharded mapped axis: each device
    sums its chunks' cotangents in its own loop, and one all-reduce adds the devices' sums at the
    end. Before (issue #42, the transforms' device layout apart from the operators'): on an
    Explicit mesh, one all-reduce per chunk, inside the loop."""
    w, xs = data(3)
    loss = lambda w, x: (f(w, x) ** 2).sum()
    gref = jax.grad(lambda w: jax.vmap(loss, (None, 0))(w, xs).sum())(w)
    for kind, spmd in (("explicit", None), ("auto", "d")):
        mesh = mesh_of(kind)
        with jax.set_mesh(mesh):
            x = jax.device_put(xs, NamedSharding(mesh, P("d")))
            for transform in (chunkop.sum, chunkop.vmap):
                chunked = transform(loss, (None, 0), chunk_size=4, spmd_axis_name=spmd)
                total = (lambda w, x: chunked(w, x)) if transform is chunkop.sum else (lambda w, x: chunked(w, x).sum())
                g = jax.grad(total)
                close(jax.jit(g)(w, x), gref, rtol=1e-4, atol=1e-5)
                assert scan_lengths(g, w, x) and max(scan_lengths(g, w, x)) == N // 4 // 4, scan_lengths(g, w, x)
                assert collectives_in_loops(g, w, x) == [], (kind, transform.__name__, collectives_in_loops(g, w, x))
                assert collectives(g, w, x) == ["all-reduce"], (kind, transform.__name__, collectives(g, w, x))


@check
def sum_spmd_axis_name_auto_under_jit():
    # Under jit on an Auto mesh the traced input carries no sharding; spmd_axis_name names it:
    # each device sums its own shard (chunked), then one all-reduce, and no all-gather.
    mesh = mesh_of("auto")
    w, xs = data(2)
    loss = lambda w, x: (f(w, x) ** 2).sum()
    ref = jax.vmap(loss, (None, 0))(w, xs)
    gref = jax.grad(lambda w: jax.vmap(loss, (None, 0))(w, xs).sum())(w)
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        for c in (None, 5):
            s = chunkop.sum(loss, (None, 0), chunk_size=c, spmd_axis_name="d")
            m = chunkop.mean(loss, (None, 0), chunk_size=c, spmd_axis_name="d")
            close(jax.jit(s)(w, x), ref.sum(), LOSS_TERMS, sum_of=ref)
            close(jax.jit(m)(w, x), ref.mean(), LOSS_TERMS, sum_of=ref)
            close(jax.jit(jax.grad(s))(w, x), gref, rtol=1e-4, atol=1e-5)
            if c is not None:
                assert collectives(jax.jit(s), w, x) == ["all-reduce"], (c, collectives(jax.jit(s), w, x))
                assert scan_lengths(jax.jit(s), w, x) == [4]  # 16 rows a device: 4 chunks of 4 (make_plan)


# -- RowOperator with sharded rows -------------------------------------------------------------

NPIX = 50


def los_rows(seed=3):
    rng = np.random.default_rng(seed)
    return {
        "idx": jnp.asarray(rng.integers(0, NPIX, (N, 4)), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 1.5, (N, 4)), jnp.float32),
    }


def row_fn(r, x):
    return jnp.sum(r["w"] * jnp.log1p(r["w"]) * x[r["idx"]])


def longest_sum(M) -> int:
    """The longest sum in ``M @ x`` or ``M.T @ y``: the most nonzeros in a row or a column."""
    nonzero = np.asarray(M) != 0
    return int(max(nonzero.sum(0).max(), nonzero.sum(1).max()))


X_STRUCT = jax.ShapeDtypeStruct((NPIX,), jnp.float32)


def _operator_checks(kind):
    rows = los_rows()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=NPIX), jnp.float32)
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    M = np.asarray(chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=5).as_matrix())
    n = longest_sum(M)
    mesh = mesh_of(kind)
    with jax.set_mesh(mesh):
        rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
        ys = jax.device_put(y, NamedSharding(mesh, P("d")))
        A = chunkop.RowOperator(row_fn, rs, X_STRUCT, chunk_size=5)
        mv = jax.jit(lambda A, x: A.mv(x))
        tmv = jax.jit(lambda A, y: A.T.mv(y))
        out = mv(A, x)
        close(out, M @ x, n)
        assert mapped_spec(out) == "d", out.sharding
        close(A.mv(x), M @ x, n)
        close(tmv(A, ys), M.T @ y, n)
        close(A.T.mv(ys), M.T @ y, n)
        close(jax.jit(lambda A, x: A.T.mv(A.mv(x)))(A, x), M.T @ (M @ x), 2 * n)
        # collectives: mv is local; T.mv one all-reduce of the x-space result
        assert collectives(lambda A, x: A.mv(x), A, x) == [], collectives(lambda A, x: A.mv(x), A, x)
        assert collectives(lambda A, y: A.T.mv(y), A, ys) == ["all-reduce"], collectives(lambda A, y: A.T.mv(y), A, ys)
        assert scan_lengths(mv, A, x) == [4], scan_lengths(mv, A, x)  # 16 rows a device: 4 chunks of 4 (make_plan)

        # derivatives w.r.t. x and the row weights (operator rebuilt from its sharded rows)
        def loss(w, x, idx):
            B = chunkop.RowOperator(row_fn, {"idx": idx, "w": w}, X_STRUCT, chunk_size=5)
            return jnp.sum(jnp.sin(B.mv(x))) + jnp.sum(B.T.mv(B.mv(x)) ** 2)

        gref = jax.grad(loss, argnums=(0, 1))(rows["w"], x, rows["idx"])
        got = jax.jit(jax.grad(loss, argnums=(0, 1)))(rs["w"], x, rs["idx"])
        close(got, gref, rtol=1e-4, atol=1e-3)
        hv = lambda w, x, v, idx: jax.jvp(lambda x: jax.grad(loss, 1)(w, x, idx), (x,), (v,))[1]
        close(jax.jit(hv)(rs["w"], x, x, rs["idx"]), hv(rows["w"], x, x, rows["idx"]), rtol=1e-4, atol=1e-3)
        # vmap over x
        X2 = jnp.stack([x, 2 * x])
        close(jax.jit(jax.vmap(lambda A, x: A.mv(x), (None, 0)))(A, X2), X2 @ M.T, n)

        # lineax normal-equations solve under jit
        b = jax.device_put(jnp.asarray(M @ x), NamedSharding(mesh, P("d")))

        def solve(A, b):
            s = lx.Normal(lx.CG(rtol=1e-6, atol=1e-6, max_steps=500))
            return lx.linear_solve(A, b, s, throw=False).value

        sol = jax.jit(solve)(A, b)
        close(M @ np.asarray(sol), M @ x, rtol=1e-3, atol=1e-3)

    # outside the mesh context: the operator built from sharded rows still works, eagerly and
    # under jit (replicated inputs are resharded with the rows' own mesh)
    close(A.mv(x), M @ x, n)
    close(A.T.mv(y), M.T @ y, n)
    close(jax.jit(lambda A, y: A.T.mv(y))(A, y), M.T @ y, n)
    errors = chunkop.check_linear(A)
    assert max(errors.values()) < 1e-4, errors


@check
def operator_row_fn_sees_the_mesh():
    """A ``row_fn`` with sharded rows runs in the caller's mesh context, as ``jax.vmap`` of it
    would: a ``with_sharding_constraint`` in it, and (another ``row_fn``) a closed-over array
    created on the mesh, indexed by the row, work on Auto and Explicit meshes, under ``jit`` and
    ``grad``, against the dense matrix (before the operator's device layout, the constraint
    raised "requires a non-empty mesh")."""
    rows = los_rows()
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=NPIX), jnp.float32)
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    scale = np.linspace(0.5, 1.5, NPIX).astype(np.float32)
    plain = lambda r, x: row_fn(r, x) * jnp.asarray(scale)[r["idx"][0]]
    M = np.asarray(chunkop.RowOperator(plain, rows, X_STRUCT, chunk_size=5).as_matrix())
    n = longest_sum(M)
    for kind in ("explicit", "auto"):
        with jax.set_mesh(mesh_of(kind)):
            table = jnp.asarray(scale)  # typed on the mesh (replicated) on an Explicit mesh
            constrained = lambda r, x: jax.lax.with_sharding_constraint(plain(r, x), P())
            closing = lambda r, x: row_fn(r, x) * table[r["idx"][0]]
            rs = jax.device_put(rows, P("d"))
            for fn in (constrained, closing):
                A = chunkop.RowOperator(fn, rs, X_STRUCT, chunk_size=5)
                close(jax.jit(lambda A, x: A.mv(x))(A, x), M @ x, n)
                close(A.T.mv(jax.device_put(y, P("d"))), M.T @ y, n)
                g = jax.jit(jax.grad(lambda x: jnp.sum(A.mv(x) ** 2)))(x)
                close(g, 2 * M.T @ (M @ x), 2 * n)


@check
def operator_segment_transpose_sharded_rows():
    """``segment_key``: each device sums its own rows per target (sorted within each chunk of
    its shard), then the one all-reduce; values and the gradient w.r.t. ``y`` against the dense
    matrix; ``check_linear`` passes. On an Explicit mesh only: the sharded dispatch is the
    scatter transpose's, checked on both kinds above; the option changes the per-device kernel."""
    rng = np.random.default_rng(6)
    rows = {
        "pix": jnp.asarray(np.minimum(rng.geometric(0.2, N), NPIX - 1), jnp.int32),  # skewed: repeats
        "w": jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32),
    }
    fn = lambda r, x: jnp.exp(-r["w"]) * x[r["pix"]]
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    M = np.asarray(chunkop.RowOperator(fn, rows, X_STRUCT, chunk_size=5).as_matrix())
    n = longest_sum(M)
    mesh = mesh_of("explicit")
    with jax.set_mesh(mesh):
        rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
        ys = jax.device_put(y, NamedSharding(mesh, P("d")))
        A = chunkop.RowOperator(fn, rs, X_STRUCT, chunk_size=5, segment_key="pix")
        tmv = lambda A, y: A.T.mv(y)
        close(jax.jit(tmv)(A, ys), M.T @ y, n)
        assert collectives(tmv, A, ys) == ["all-reduce"], collectives(tmv, A, ys)
        grad = jax.jit(jax.grad(lambda y, A: jnp.sum(jnp.sin(A.T.mv(y)))))(ys, A)
        close(grad, M @ np.cos(M.T @ np.asarray(y)), n)
        errors = chunkop.check_linear(A)
        assert max(errors.values()) < 1e-4, errors


@check
def operator_eager_calls_compile_once_per_key():
    """Eager ``A.mv`` / ``A.T.mv`` with sharded rows reuse one compiled program per operator
    description (before: 5-7 compiles per call), and a new operator whose ``row_fn`` closes over
    other values (same code) gives its own result, not the first one's."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(event) if "backend_compile" in event else None
    )
    rows = los_rows()
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=NPIX), jnp.float32)
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    for kind in ("auto", "explicit"):
        mesh = mesh_of(kind)
        counts = []
        for scale in (1.0, 3.0, -2.0):
            c = jnp.asarray(scale, jnp.float32)
            fn = lambda r, v, c=c: c * row_fn(r, v)
            M = np.asarray(chunkop.RowOperator(fn, rows, X_STRUCT, chunk_size=5).as_matrix())
            with jax.set_mesh(mesh):
                rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
                ys = jax.device_put(y, NamedSharding(mesh, P("d")))
                A = chunkop.RowOperator(fn, rs, X_STRUCT, chunk_size=5)
                A.mv(x), A.T.mv(ys)  # first calls of this operator
                before = len(compiles)
                out, back = A.mv(x), A.T.mv(ys)
                counts.append(len(compiles) - before)
            close(out, M @ x, longest_sum(M))
            close(back, M.T @ y, longest_sum(M))
        assert counts == [0, 0, 0], (kind, counts)


@check
def operator_sharded_rows_explicit():
    _operator_checks("explicit")


@check
def operator_sharded_rows_auto():
    _operator_checks("auto")


@check
def device_put_inputs_under_jit_and_grad_without_set_mesh():
    """The common pattern (issue #42, finding 2): data placed with ``jax.device_put`` on an Auto
    mesh, closed over by a function that ``jax.jit`` or ``jax.grad`` traces, no ``jax.set_mesh``
    context. ``chunkop.vmap``/``sum`` (and a ``RowOperator`` on such rows) raised "`set_mesh` can
    only be used outside of `jax.jit`" (a concrete mesh set while a transform traced); now as
    ``jax.vmap``. (On an Explicit mesh JAX itself asks for ``jax.set_mesh`` there.)"""
    mesh = mesh_of("auto")
    x = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("d")))
    w = jnp.linspace(0.5, 1.5, 4)
    f = lambda v, w: jnp.sin(v) * w
    for kind in ("vmap", "sum"):
        chunked = lambda w: getattr(chunkop, kind)(f, in_axes=(0, None), chunk_size=2)(x, w).sum()
        ref = lambda w: jax.vmap(f, (0, None))(x, w).sum()
        for transform in (jax.jit, jax.grad, lambda h: jax.jit(jax.grad(h))):
            close(transform(chunked)(w), transform(ref)(w), 16)
    rows = jax.device_put(los_rows(), NamedSharding(mesh, P("d")))
    A = chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=5)
    v = jnp.linspace(-1.0, 1.0, NPIX)
    M = np.asarray(chunkop.RowOperator(row_fn, los_rows(), X_STRUCT, chunk_size=5).as_matrix())
    close(jax.jit(lambda v: A.mv(v))(v), M @ v, longest_sum(M))
    close(jax.grad(lambda v: jnp.sum(A.mv(v) ** 2))(v), 2 * M.T @ (M @ v), 2 * longest_sum(M))


@check
def gram_diagonal_of_sharded_rows():
    """``chunkop.gram_diagonal`` (generic and ``squared_row_fn``) of rows sharded over Explicit
    and Auto meshes, inside and outside ``jax.set_mesh``: as unsharded (issue #42, finding 3:
    the generic path ran ``row_fn`` in the Explicit context it was not traced in and crashed)."""
    rows = los_rows()
    M = np.asarray(chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=5).as_matrix())
    ref = (M**2).sum(0)
    for kind in ("explicit", "auto"):
        mesh = mesh_of(kind)
        for inside in (True, False):
            rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
            with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
                A = chunkop.RowOperator(row_fn, rs, X_STRUCT, chunk_size=5)
                close(chunkop.gram_diagonal(A), ref, N)


def window_row_fn(r, x):
    w = r["w"] * jnp.arange(1.0, 4.0, dtype=jnp.float32)
    return jnp.dot(w, x[r["pix"]])


@check
def operator_windowed_sharded_rows():
    """``layout="windowed"`` with rows sharded over 4 devices (Explicit and Auto meshes): each
    device sorts its own 16 rows (``row_order`` local to the device) and windows its chunks;
    ``A x`` and ``A^T y`` in the user's order, their gradient and a Hessian-vector product, as on
    one device with the plain layout (the dense matrix); ``A x`` stays sharded like the rows with
    no collective, ``A^T y`` sums over devices once."""
    rng = np.random.default_rng(11)
    rows = {
        "pix": jnp.asarray(rng.integers(0, 40, N), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32),
    }
    struct = jax.ShapeDtypeStruct((40, 3), jnp.float32)
    x = jnp.asarray(rng.normal(size=(40, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    M = np.asarray(chunkop.RowOperator(window_row_fn, rows, struct, chunk_size=4, layout="plain").as_matrix())
    n = longest_sum(M)
    flat = lambda v: np.asarray(v).reshape(-1)
    for kind in ("explicit", "auto"):
        mesh = mesh_of(kind)
        with jax.set_mesh(mesh):
            rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
            ys = jax.device_put(y, NamedSharding(mesh, P("d")))
            A = chunkop.RowOperator(window_row_fn, rs, struct, chunk_size=4, layout="windowed")
            order = np.asarray(A.row_order).reshape(4, 16)
            assert all(sorted(o) == list(range(16)) for o in order), order
            local_pix = np.asarray(rows["pix"]).reshape(4, 16)
            assert all(np.all(np.diff(p[o]) >= 0) for p, o in zip(local_pix, order))
            out = jax.jit(lambda A, x: A.mv(x))(A, x)
            close(out, M @ flat(x), n)
            assert mapped_spec(out) == "d", out.sharding
            close(jax.jit(lambda A, y: A.T.mv(y))(A, ys), (M.T @ y).reshape(40, 3), n)
            assert all(np.array_equal(np.asarray(A.rows[k]), np.asarray(rows[k])) for k in rows)
            assert collectives(lambda A, x: A.mv(x), A, x) == []
            assert collectives(lambda A, y: A.T.mv(y), A, ys) == ["all-reduce"]

            def loss(v, w):
                B = A.with_rows({**A.rows, "w": w})
                return 0.5 * jnp.sum((B.mv(v) - ys) ** 2)

            def ref_loss(v, w):
                B = chunkop.RowOperator(window_row_fn, {**rows, "w": w}, struct, chunk_size=4, layout="plain")
                return 0.5 * jnp.sum((B.mv(v) - y) ** 2)

            got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, rs["w"])
            close(got, jax.grad(ref_loss, argnums=(0, 1))(x, rows["w"]), rtol=1e-4, atol=1e-4)
            hvp = lambda L, w: jax.jvp(lambda v: jax.grad(L)(v, w), (x,), (x,))[1]
            close(jax.jit(lambda w: hvp(loss, w))(rs["w"]), hvp(ref_loss, rows["w"]), rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
