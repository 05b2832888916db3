"""Multi-device checks of ``progress=`` with sharded inputs and rows (4 CPU devices), run in a
subprocess by tests/test_progress_multidevice.py (the device count must be set before JAX
starts; the rest of the suite runs with one device). Usage::

    python tests/_multidevice_progress.py [NAME ...]

prints one JSON object (check name -> "ok" or the failure's traceback) as its last line.

Every device runs its own chunk loop over its shard (16 of the 64 rows: 5 chunks of 3 and a
remainder of 1, so n = 6), and each reports; the callable must still see each call as one run
``(1, 6), ..., (6, 6)`` (the slowest shard's count), not four interleaved ones, and the values
must equal the unsharded reference.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import contextlib
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _device_checks import run_checks
from _tolerance import rtol_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkop

N = 64  # 16 rows per device
RUN = [(k, 6) for k in range(1, 7)]  # 16 rows in chunks of 3: 5 full chunks + a remainder of 1
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, k, n):
        self.calls.append((k, n))


def close(a, b, n_terms=1, *, rtol=None, atol=None):
    """To the tolerance of the computation (tests/_tolerance.py: ``n_terms`` the longest sum
    the two evaluations order differently), or to an explicit ``rtol``/``atol``."""
    a, b = np.asarray(a), np.asarray(b)
    r = rtol_for(b.dtype, n_terms) if rtol is None else rtol
    np.testing.assert_allclose(a, b, rtol=r, atol=r * float(np.abs(b).max(initial=0.0)) if atol is None else atol)


def mesh_of(kind):
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((4,), ("d",), axis_types=types)


def data():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)


def f(w, x):
    return jnp.tanh(x @ w)


F_TERMS = 3  # x @ w: a sum of 3 products
LOSS_TERMS = N + F_TERMS + 5  # the sum of N examples' losses (each a sum of 5 squares): positive terms


def loss(w, x):
    return (f(w, x) ** 2).sum()


@check
def sum_forward_and_grad_explicit():
    w, xs = data()
    ref = jax.vmap(loss, (None, 0))(w, xs).sum()
    gref = jax.grad(lambda w: jax.vmap(loss, (None, 0))(w, xs).sum())(w)
    mesh = mesh_of("explicit")
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        rec = Recorder()
        s = chunkop.sum(loss, (None, 0), chunk_size=3, progress=rec)
        close(jax.block_until_ready(s(w, x)), ref, LOSS_TERMS)  # eagerly (used to raise: ordered effects)
        assert rec.calls == RUN, rec.calls
        close(jax.block_until_ready(jax.jit(s)(w, x)), ref, LOSS_TERMS)
        assert rec.calls == 2 * RUN, rec.calls
        rec.calls.clear()
        close(jax.block_until_ready(jax.jit(jax.grad(s))(w, x)), gref, rtol=1e-4, atol=1e-5)
        assert rec.calls == RUN, rec.calls  # the backward loop, once per call (not once per device)
        rec.calls.clear()
        m = chunkop.mean(loss, (None, 0), chunk_size=3, progress=rec)
        close(jax.block_until_ready(jax.jit(m)(w, x)), ref / N, LOSS_TERMS)
        assert rec.calls == RUN, rec.calls


@check
def vmap_progress_true_plain_lines():
    w, xs = data()
    mesh = mesh_of("explicit")
    err = io.StringIO()
    with jax.set_mesh(mesh), contextlib.redirect_stderr(err):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        y = jax.block_until_ready(chunkop.vmap(f, (None, 0), chunk_size=3, progress=True)(w, x))
        jax.block_until_ready(chunkop.map(lambda r: jnp.sum(r**2), x, chunk_size=3, progress=True))
    close(y, jax.vmap(f, (None, 0))(w, xs), F_TERMS)
    assert y.sharding.spec[0] == "d", y.sharding
    text = err.getvalue()
    assert "\r" not in text, repr(text)
    assert text.count("chunkop: 6/6 chunks\n") == 2, repr(text)  # one finished run per call


@check
def vmap_spmd_axis_name_auto_under_jit():
    w, xs = data()
    mesh = mesh_of("auto")
    rec = Recorder()
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("d")))
        g = chunkop.vmap(f, (None, 0), chunk_size=3, spmd_axis_name="d", progress=rec)
        y = jax.block_until_ready(jax.jit(g)(w, x))
    close(y, jax.vmap(f, (None, 0))(w, xs), F_TERMS)
    assert rec.calls == RUN, rec.calls


NPIX = 50


def row_fn(r, x):
    return jnp.sum(r["w"] * x[r["idx"]])


@check
def operator_sharded_rows():
    rng = np.random.default_rng(3)
    rows = {
        "idx": jnp.asarray(rng.integers(0, NPIX, (N, 4)), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 1.5, (N, 4)), jnp.float32),
    }
    struct = jax.ShapeDtypeStruct((NPIX,), jnp.float32)
    M = np.asarray(chunkop.RowOperator(row_fn, rows, struct, chunk_size=3).as_matrix())
    x = jnp.asarray(rng.normal(size=NPIX), jnp.float32)
    y = jnp.asarray(rng.normal(size=N), jnp.float32)
    mesh = mesh_of("explicit")
    rec = Recorder()
    with jax.set_mesh(mesh):
        rs = jax.device_put(rows, NamedSharding(mesh, P("d")))
        ys = jax.device_put(y, NamedSharding(mesh, P("d")))
        A = chunkop.RowOperator(row_fn, rs, struct, chunk_size=3, progress=rec)
        nonzero = M != 0  # a row sums its 4 pixels; a pixel the rows through it
        close(jax.block_until_ready(jax.jit(lambda A, x: A.mv(x))(A, x)), M @ x, int(nonzero.sum(1).max()))
        assert rec.calls == RUN, rec.calls
        close(jax.block_until_ready(jax.jit(lambda A, y: A.T.mv(y))(A, ys)), M.T @ y, int(nonzero.sum(0).max()))
        assert rec.calls == 2 * RUN, rec.calls


@check
def partial_manual_mesh_clear_error():
    # On a 2 x 2 mesh, rows sharded over one axis: chunkop's own shard_map reports (every mesh
    # axis manual); inside a user's shard_map that leaves the other axis automatic, JAX host
    # callbacks cannot run: a clear error, and without progress it works.
    w, xs = data()
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    rec = Recorder()
    with jax.set_mesh(mesh):
        x = jax.device_put(xs, NamedSharding(mesh, P("a")))
        y = jax.block_until_ready(chunkop.vmap(f, (None, 0), chunk_size=3, progress=rec)(w, x))
        close(y, jax.vmap(f, (None, 0))(w, xs), F_TERMS)
        assert rec.calls == [(k, 11) for k in range(1, 12)], rec.calls  # 32 rows a shard: 10 x 3 + 2

        def inside(progress):
            g = chunkop.vmap(f, (None, 0), chunk_size=3, progress=progress)
            return jax.jit(jax.shard_map(lambda x: g(w, x), in_specs=P("a"), out_specs=P("a"), axis_names={"a"}))

        close(inside(None)(x), jax.vmap(f, (None, 0))(w, xs), F_TERMS)
        try:
            inside(rec)(x)
        except NotImplementedError as e:
            assert "progress=" in str(e) and "automatic" in str(e), str(e)
        else:
            raise AssertionError("no error")


def main(names):
    assert len(jax.devices()) == 4, jax.devices()
    run_checks(CHECKS, names)


if __name__ == "__main__":
    main(sys.argv[1:])
