"""Smoke test at the dependency floor (the lowest jax/jaxlib pyproject.toml allows), run by .ci/run.

Each check compares chunkop against plain JAX (``jax.vmap``, dense matrices,
``jax.linear_transpose``) and fails loudly; it covers what depends on newer JAX APIs: the
transforms and their derivatives, ``chunk_size="auto"``, the fusion barrier, ``RowOperator``
with its transpose and derivatives, a lineax solve, sharding over 2 CPU devices, progress.
"""

from __future__ import annotations

import os
import sys

# 2 CPU devices, compiled as the test suite compiles (tests/_device_checks.py: TEST_XLA_FLAGS;
# half the time of XLA's defaults here, 14 s against 25 s)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _device_checks import TEST_XLA_FLAGS

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}")

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np

import chunkop

print("jax", jax.__version__, "devices", len(jax.devices()))
rng = np.random.default_rng(0)
W = jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)
X = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)


def f(x, w):
    return jnp.tanh(w @ jnp.tanh(w @ x))


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


ref = jax.vmap(f, (0, None))(X, W)
for chunk in (7, 10, "auto", None):
    g = chunkop.vmap(f, (0, None), chunk_size=chunk)
    close(g(X, W), ref)
    close(jax.jit(g)(X, W), ref)
    close(
        jax.grad(lambda w: g(X, w).sum())(W),
        jax.grad(lambda w: jax.vmap(f, (0, None))(X, w).sum())(W),
    )
    close(
        jax.hessian(lambda w: chunkop.sum(f, (0, None), chunk_size=chunk)(X, w).sum())(W),
        jax.hessian(lambda w: jax.vmap(f, (0, None))(X, w).sum())(W),
        1e-4,
    )
seen = []
chunkop.vmap(f, (0, None), chunk_size=7, progress=lambda k, n: seen.append((k, n)))(X, W)
jax.effects_barrier()
assert seen and seen[-1] == (8, 8), seen

# RowOperator: mv, T.mv, derivatives w.r.t. rows, lineax
rows = {"i": jnp.asarray(rng.integers(0, 12, 40), jnp.int32), "a": jnp.asarray(rng.uniform(0.5, 2, 40), jnp.float32)}
row_fn = lambda r, x: jnp.exp(-r["a"]) * x[r["i"]].sum()
xs = jax.ShapeDtypeStruct((12, 3), jnp.float32)
A = chunkop.RowOperator(row_fn, rows, xs, chunk_size=9)
dense = jax.jacfwd(lambda x: jax.vmap(row_fn, (0, None))(rows, x))(jnp.zeros((12, 3))).reshape(40, 36)
x = jnp.asarray(rng.normal(size=(12, 3)), jnp.float32)
y = jnp.asarray(rng.normal(size=40), jnp.float32)
close(A.mv(x), dense @ x.ravel())
close(A.T.mv(y).ravel(), dense.T @ y)
close(A.as_matrix(), dense)
da = jax.grad(lambda a: jnp.sum(chunkop.RowOperator(row_fn, {**rows, "a": a}, xs, chunk_size=9).mv(x) ** 2))(rows["a"])
da_ref = jax.grad(lambda a: jnp.sum(jax.vmap(row_fn, (0, None))({**rows, "a": a}, x) ** 2))(rows["a"])
close(da, da_ref, 1e-4)
B = chunkop.RowOperator(row_fn, rows, xs)  # chunk_size="auto"
close(B.mv(x), dense @ x.ravel())
damped = A.T @ A + 1.0 * lx.IdentityLinearOperator(A.in_structure())
normal = lx.TaggedLinearOperator(damped, lx.positive_semidefinite_tag)
sol = lx.linear_solve(normal, A.T.mv(y), lx.CG(rtol=1e-6, atol=1e-6))
close(sol.value.ravel(), np.linalg.solve(dense.T @ dense + np.eye(36), dense.T @ y), 1e-3)
chunkop.check_linear(A)

# sharded rows over 2 CPU devices
mesh = jax.make_mesh((2,), ("d",))
Xs = jax.device_put(X[:50], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
close(chunkop.vmap(f, (0, None), chunk_size=5)(Xs, W), ref)
print("floor smoke: all checks passed")
