"""lineax operator algebra and solves with ``RowOperator`` rows sharded over 1- and 4-device
meshes (Explicit and Auto), run in a subprocess by tests/test_lineax_mesh.py.

JAX fixes its CPU device count when the backend starts, so these checks run in their own
interpreter with ``--xla_force_host_platform_device_count=4`` set before ``jax`` is imported; the
1-device meshes use the first of those devices. Usage::

    python tests/_lineax_mesh_checks.py [NAME ...]

prints one JSON object (check name -> "ok" or the failure's traceback) as its last line.
References are NumPy: the dense matrix is built from the rows with ``np.add.at`` (not from the
operator), and solutions come from ``np.linalg.lstsq`` / ``np.linalg.solve`` in float64.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from _device_checks import run_checks
from _tolerance import rtol_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import chunkop

CHECKS = {}
K = 4  # pixels per row
LAM = 0.3
KINDS = ("explicit", "auto")
DEVICES = (1, 4)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def close(actual, expected, rtol=None, atol=None, what="", *, n_terms=1, condition=1.0):
    """``actual`` (float32) equals ``expected`` (often float64) to an explicit ``rtol``/``atol``
    (solvers: their own tolerance), or by default to the rounding of ``actual``'s computation
    (tests/_tolerance.py: ``n_terms`` the longest sum in it, ``condition`` its cancellation)."""
    rtol = rtol_for(np.asarray(actual).dtype, n_terms, condition) if rtol is None else rtol
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    atol = rtol * float(np.abs(e).max(initial=0.0)) if atol is None else atol
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def mesh_of(kind, n_dev):
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((n_dev,), ("rows",), axis_types=types, devices=jax.devices()[:n_dev])


def row_fn(r, x):
    return jnp.sum(r["w"] * x[r["idx"]])


def problem(n_rows, npix, seed):
    """Rows (numpy), the dense matrix (float64, from the rows directly), a consistent ``b``."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(npix, K, replace=False) for _ in range(n_rows)]).astype(np.int32)
    w = rng.normal(size=(n_rows, K)).astype(np.float32) + np.where(rng.uniform(size=(n_rows, K)) < 0.5, 1.5, -1.5)
    M = np.zeros((n_rows, npix))
    np.add.at(M, (np.repeat(np.arange(n_rows), K), idx.reshape(-1)), w.reshape(-1).astype(np.float64))
    assert np.linalg.cond(M) < 50, np.linalg.cond(M)  # a meaningful comparison in float32
    x_true = rng.normal(size=npix)
    return {"idx": idx, "w": w}, M, x_true, M @ x_true


WIDE = problem(24, 48, 0)  # fewer rows than unknowns (the astro case): 6 rows per device
TALL = problem(64, 16, 1)


def operator(kind, n_dev, prob, out_sharding="rows"):
    rows, M, _, b = prob
    mesh = mesh_of(kind, n_dev)
    rs = jax.device_put({k: jnp.asarray(v) for k, v in rows.items()}, NamedSharding(mesh, P("rows")))
    struct = jax.ShapeDtypeStruct((M.shape[1],), jnp.float32)
    A = chunkop.RowOperator(row_fn, rs, struct, chunk_size=4, out_sharding=out_sharding)
    spec = P("rows") if out_sharding == "rows" else P()
    return mesh, A, jax.device_put(jnp.asarray(b, jnp.float32), NamedSharding(mesh, spec))


def every_mesh():
    for kind in KINDS:
        for n_dev in DEVICES:
            yield kind, n_dev


MESHES = [("explicit", 1), ("explicit", 4), ("auto", 4)]  # algebra: Auto on 1 device adds nothing


@check
def structures_as_lineax_normalises():
    def lineax_form(tree):  # what lineax compares: without weak types
        return jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding), tree)

    for kind, n_dev in every_mesh():
        for out_sharding in ("rows", "replicated"):
            mesh, A, b = operator(kind, n_dev, WIDE, out_sharding)
            with jax.set_mesh(mesh):
                where = (kind, n_dev, out_sharding)
                I_in = lx.IdentityLinearOperator(A.in_structure())
                I_out = lx.IdentityLinearOperator(A.out_structure())
                assert I_in.in_structure() == A.in_structure(), (where, I_in.in_structure(), A.in_structure())
                assert I_out.in_structure() == A.out_structure(), (where, I_out.in_structure(), A.out_structure())
                # the structures are the types of the vectors the operator returns
                x = jnp.ones(A.in_structure().shape, jnp.float32)
                assert lineax_form(jax.eval_shape(A.mv, x)) == A.out_structure(), where
                assert lineax_form(jax.eval_shape(A.T.mv, b)) == A.in_structure(), where
                assert lineax_form(jax.eval_shape(lambda: b)) == A.out_structure(), where
                if kind == "explicit":
                    assert tuple(A.in_structure().sharding.spec) == (None,), where
                    want = ("rows",) if out_sharding == "rows" else (None,)
                    assert tuple(A.out_structure().sharding.spec) == want, where
                else:  # Auto: jax.eval_shape reports no sharding, and neither do the structures
                    assert A.in_structure().sharding is None and A.out_structure().sharding is None, where


@check
def unsharded_operator_under_an_explicit_mesh():
    # rows not sharded, used inside jax.set_mesh of an Explicit mesh: vectors made there are
    # typed replicated on that mesh, and so are the operator's structures (as lineax compares)
    rows, M, _, b_np = TALL
    struct = jax.ShapeDtypeStruct((M.shape[1],), jnp.float32)
    A = chunkop.RowOperator(row_fn, {k: jnp.asarray(v) for k, v in rows.items()}, struct, chunk_size=4)
    assert A.in_structure().sharding is None  # no mesh: none
    with jax.set_mesh(mesh_of("explicit", 4)):
        b = jnp.asarray(b_np, jnp.float32)
        assert jax.eval_shape(lambda: b) == A.out_structure(), (jax.eval_shape(lambda: b), A.out_structure())
        assert lx.IdentityLinearOperator(A.in_structure()).in_structure() == A.in_structure()
        x = solve(A, b, lx.Normal(CG))
        close(x, np.linalg.lstsq(M, b_np, rcond=None)[0], 1e-3, 1e-3)
        damped = A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure())
        close(damped.mv(x), (M.T @ M + LAM * np.eye(M.shape[1])) @ np.asarray(x, np.float64), 1e-4, 1e-4)


@check
def operator_algebra():
    _, M, _, _ = WIDE
    rng = np.random.default_rng(5)
    x_np, y_np = rng.normal(size=M.shape[1]), rng.normal(size=M.shape[0])
    damped_ref = M.T @ M + LAM * np.eye(M.shape[1])
    combos = [(kind, n_dev, "rows") for kind, n_dev in MESHES] + [("explicit", 4, "replicated")]
    for kind, n_dev, out_sharding in combos:
        mesh, A, _ = operator(kind, n_dev, WIDE, out_sharding)
        where = f"{kind}, {n_dev} devices, out_sharding={out_sharding}"
        with jax.set_mesh(mesh):
            x = jnp.asarray(x_np, jnp.float32)
            y = jax.device_put(jnp.asarray(y_np, jnp.float32), NamedSharding(mesh, P("rows")))

            def algebra(A, x, y):
                damped = A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure())
                return damped.mv(x), (A @ A.T).mv(y), (2.0 * A - A).mv(x), A.normal(LAM).mv(x)

            got = jax.jit(algebra)(A, x, y)
            close(got[0], damped_ref @ x_np, 1e-4, 1e-4, where)
            close(got[1], M @ (M.T @ y_np), 1e-4, 1e-4, where)
            close(got[2], M @ x_np, what=where, n_terms=K, condition=3.0)  # 2 A x - A x: (2 + 1) / 1
            close(got[3], damped_ref @ x_np, 1e-4, 1e-4, where)
            assert A.T.T is A
            assert lx.is_positive_semidefinite(A.normal()) and lx.is_symmetric(A.normal())
            if (kind, n_dev, out_sharding) == ("explicit", 4, "rows"):  # eagerly, and dense matrices
                damped = A.T @ A + LAM * lx.IdentityLinearOperator(A.in_structure())
                close(damped.mv(x), damped_ref @ x_np, 1e-4, 1e-4, where)
                close(A.as_matrix(), M, what=where, n_terms=K)
                close(damped.as_matrix(), damped_ref, 1e-4, 1e-4, where)


CG = lx.CG(rtol=1e-6, atol=1e-6, max_steps=500)
LSMR = lx.LSMR(rtol=1e-6, atol=1e-6)


def solve(A, b, solver):
    return jax.jit(lambda A, b: lx.linear_solve(A, b, solver, throw=False).value)(A, b)


def solves(A, b, damping, *solvers):
    """Under one jit: CG on ``A.normal(damping)`` and ``A^T b`` (unless ``damping`` is None), then
    ``linear_solve`` with each solver."""

    def run(A, b):
        out = [] if damping is None else [lx.linear_solve(A.normal(damping), A.T.mv(b), CG, throw=False).value]
        return out + [lx.linear_solve(A, b, s, throw=False).value for s in solvers]

    return jax.jit(run)(A, b)


@check
def solves_wide_and_tall():
    _solves_on([("explicit", 4), ("auto", 4)])


@check
def solves_on_one_device():
    # slow (tests/test_lineax_mesh.py): the solves of solves_wide_and_tall on a 1-device
    # Explicit mesh, the same kernels with one shard (operator_algebra checks them there)
    _solves_on([("explicit", 1)])


def _solves_on(meshes):
    # wide (more unknowns than rows, the astro case): the minimum-norm solution, np.linalg.lstsq's
    _, M, _, b_np = WIDE
    ref = np.linalg.lstsq(M, b_np, rcond=None)[0]
    # tall, inconsistent: least squares; and the damped normal equations
    _, Mt, _, bt_np = TALL
    bt_np = bt_np + 0.1 * np.random.default_rng(7).normal(size=bt_np.shape)
    ref_t = np.linalg.lstsq(Mt, bt_np, rcond=None)[0]
    damped_t = np.linalg.solve(Mt.T @ Mt + LAM * np.eye(Mt.shape[1]), Mt.T @ bt_np)
    for kind, n_dev in meshes:
        where = f"{kind}, {n_dev} devices"
        # rows sharded, row space sharded. Explicit: A.normal() keeps every CG vector in the
        # (replicated) x space; lineax.Normal's CG on row-space vectors (for a wide operator)
        # needs an Auto mesh with a row-sharded b
        mesh, A, b = operator(kind, n_dev, WIDE)
        with jax.set_mesh(mesh):
            got = solves(A, b, 0.0) if kind == "explicit" else solves(A, b, None, lx.Normal(CG))
        for x in got:
            close(x, ref, 1e-3, 1e-3, where)
        if kind == "explicit":  # the row space replicated: lineax.Normal and LSMR there too
            mesh, A, b = operator(kind, n_dev, WIDE, "replicated")
            with jax.set_mesh(mesh):
                got = solves(A, b, None, lx.Normal(CG), *([LSMR] if n_dev == 4 else []))
            for x in got:
                close(x, ref, 1e-3, 1e-3, where + ", replicated")
        if n_dev == 4:  # tall: lineax.Normal solves in the x space (A^T A), fine with a row-sharded b
            mesh, A, _ = operator(kind, n_dev, TALL)
            with jax.set_mesh(mesh):
                b = jax.device_put(jnp.asarray(bt_np, jnp.float32), NamedSharding(mesh, P("rows")))
                got = solves(A, b, LAM, lx.Normal(CG)) if kind == "explicit" else solves(A, b, None, lx.Normal(CG))
            close(got[-1], ref_t, 1e-3, 1e-3, where + ", tall")
            if kind == "explicit":
                close(got[0], damped_t, 1e-3, 1e-3, where + ", tall damped")


@check
def replicated_out_collectives_and_grad():
    # out_sharding="replicated": mv gathers the rows' outputs (one all-gather), T.mv one
    # all-reduce; derivatives w.r.t. the row weights match the unsharded operator's
    rows, M, x_np, _ = WIDE
    x = jnp.asarray(x_np, jnp.float32)
    struct = jax.ShapeDtypeStruct((M.shape[1],), jnp.float32)

    def loss(w, idx, out_sharding="rows"):
        B = chunkop.RowOperator(row_fn, {"idx": idx, "w": w}, struct, chunk_size=4, out_sharding=out_sharding)
        y = B.mv(x)
        return jnp.sum(jnp.sin(y)) + jnp.sum(B.T.mv(y) ** 2)

    gref = jax.grad(loss)(jnp.asarray(rows["w"]), jnp.asarray(rows["idx"]))
    mesh, A, b = operator("explicit", 4, WIDE, "replicated")
    with jax.set_mesh(mesh):

        def hlo(f, *a):
            text = jax.jit(f).lower(*a).compile().as_text()
            return re.findall(r"= [^ ]+ (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", text)

        assert hlo(lambda A, x: A.mv(x), A, x) == ["all-gather"], hlo(lambda A, x: A.mv(x), A, x)
        assert hlo(lambda A, b: A.T.mv(b), A, b) == ["all-reduce"], hlo(lambda A, b: A.T.mv(b), A, b)
        close(A.mv(x), M @ x_np, n_terms=K)
        assert tuple(A.mv(x).sharding.spec) in ((), (None,)), A.mv(x).sharding
        got = jax.jit(jax.grad(lambda w, idx: loss(w, idx, "replicated")))(A.rows["w"], A.rows["idx"])
        close(got, gref, 1e-4, 1e-4)


@check
def plan_reports_shard_and_global_sizes():
    mesh = mesh_of("explicit", 4)
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.ones((256, 16)), NamedSharding(mesh, P("rows")))
        w = jnp.ones((16, 16)) / 16
        f = chunkop.vmap(lambda w, x: jnp.tanh(x @ w) @ w, in_axes=(None, 0), chunk_size="auto", memory_budget=16 << 10)
        plan = chunkop.plan(f, w, xs)
        assert (plan.size, plan.shards, plan.global_size) == (64, 4, 256), plan
        assert "per shard" in repr(plan), repr(plan)
        f(w, xs)  # the call plans inside each device's shard: the same chunk
        assert f.last_plan.chunk == plan.chunk and f.last_plan.size == 64, (f.last_plan, plan)
        rows, M, _, _ = TALL
        rs = jax.device_put({k: jnp.asarray(v) for k, v in rows.items()}, NamedSharding(mesh, P("rows")))
        A = chunkop.RowOperator(row_fn, rs, jax.ShapeDtypeStruct((M.shape[1],), jnp.float32), memory_budget=1 << 20)
        plan = chunkop.plan(A)
        assert (plan.size, plan.shards, plan.global_size) == (16, 4, 64), plan


@check
def docs_scaling_blocks_on_4_devices():
    # docs/scaling.md's blocks of a RowOperator on a mesh, run in order in one namespace, on 4 devices
    text = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    blocks = re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL)
    assert blocks and len(jax.devices()) == 4
    namespace = {"__name__": "docs.scaling"}
    for code in [b for b in blocks if "RowOperator" in b and "set_mesh" in b]:  # (test_docs.py runs all)
        exec(compile(code, "docs/scaling.md", "exec"), namespace)
    assert namespace.get("npix", 0) >= 1000, "docs/scaling.md's operator example should be the wide (astro) case"


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1:])
