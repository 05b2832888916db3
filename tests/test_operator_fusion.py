"""The CPU fusion barrier of ``RowOperator`` (issue #16): values, placement and optimized HLO.

``_chunking.fusion_barrier`` passes each chunk's row data (and, in the transpose, the chunk of
``y``) through a ``lax.cond`` on a predicate that is always true but computed from the chunk's
index (opaque to XLA), so that XLA:CPU does not fuse the slicing of the stacked rows into the
fusion that computes the weights. With the users' literal weights ``-diff(exp(-(d - b) / (d s b)))`` that fusion (an
``exp`` fed by a ``dynamic-slice`` of the rows) ran about 4x slower than the same weights
computed from plain buffers. The checks here:

- values of the literal row function against dense / ``jax.vmap`` references, for every
  operation the barrier sits in (``mv``, ``T.mv``, grad, hvp, ``linear_transpose``, ``vmap`` over
  vectors, over batches of operators, derivatives w.r.t. the rows);
- the barrier is in the kernels' jaxprs, chosen per platform at lowering (the predicate and
  the lowering for other platforms: ``test_remainder_transpose.py``, ``test_lowering.py``);
- in XLA:CPU's optimized HLO no ``exponential`` is computed from a ``dynamic-slice`` within one
  fusion, while without the barrier it is (the check can fail).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose, primitive_names
from operator_registry import dense_matrix

import chunkop
from chunkop import _chunking

NPIX, K = 13, 32
EDGES = np.geomspace(40.0, 1700.0, K + 1)
X_STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)


def literal_row(r, x):
    """The users' own formula, unrewritten."""
    b = jnp.asarray(EDGES, jnp.float32)
    w = -jnp.diff(jnp.exp(-(r["d"] - b) / (r["d"] * r["s"] * b)))
    return jnp.dot(w, x[r["pix"]])


def make_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "pix": jnp.asarray(rng.integers(0, NPIX, n), jnp.int32),
        "d": jnp.asarray(rng.uniform(60.0, 1600.0, n), jnp.float32),
        "s": jnp.asarray(rng.uniform(0.05, 0.3, n), jnp.float32),
    }


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


N, CHUNK = 203, 64  # 3 chunks of 64 and a remainder of 11 (203 = 7 * 29 has no divisor in [48, 64])
ROWS = make_rows(N)
X, V, Y = rand(NPIX, K, seed=1), rand(NPIX, K, seed=2), rand(N, seed=3)


def op(rows=ROWS, chunk=CHUNK):
    return chunkop.RowOperator(literal_row, rows, X_STRUCT, chunk_size=chunk)


def ref(rows, x):
    return jax.vmap(literal_row, (0, None))(rows, x)


def dense(rows):
    return dense_matrix(literal_row, rows, X_STRUCT)


# -- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [CHUNK, 29, N])  # remainder; divides; one chunk
def test_literal_row_fn_against_dense(chunk):
    A, M = op(chunk=chunk), dense(ROWS)
    assert_tree_allclose(A.mv(X), M @ X.reshape(-1), rtol=1e-4, atol=1e-5)
    assert_tree_allclose(A.T.mv(Y), (M.T @ Y).reshape(NPIX, K), rtol=1e-4, atol=1e-5)
    assert_tree_allclose(A.as_matrix(), M, rtol=1e-4, atol=1e-6)
    assert_tree_allclose(jax.jit(lambda y: A.T.mv(y))(Y), (M.T @ Y).reshape(NPIX, K), rtol=1e-4, atol=1e-5)


def test_literal_row_fn_derivatives_against_vmap():
    def loss(mv, x, s):
        return jnp.sum((mv({**ROWS, "s": s}, x) - Y) ** 2)

    ours = lambda r, x: op(r).mv(x)
    for f in (
        lambda mv: jax.grad(loss, argnums=(1, 2))(mv, X, ROWS["s"]),
        lambda mv: jax.jvp(lambda x: jax.grad(loss, argnums=1)(mv, x, ROWS["s"]), (X,), (V,))[1],
        lambda mv: jax.jvp(lambda s: jax.grad(loss, argnums=1)(mv, X, s), (ROWS["s"],), (ROWS["d"],))[1],
        lambda mv: jax.grad(lambda x: jnp.sum(jax.grad(loss, argnums=1)(mv, x, ROWS["s"]) ** 2))(X),
        lambda mv: jax.linear_transpose(lambda x: mv(ROWS, x), X_STRUCT)(Y)[0],
    ):
        assert_tree_allclose(jax.jit(lambda: f(ours))(), f(ref), rtol=2e-4, atol=2e-4)


def test_literal_row_fn_under_vmap():
    """vmap over vectors keeps the conditional; over batches of operators (batched rows) its
    predicate is batched, and JAX turns it into a select: values are the same either way."""
    Xs = jnp.stack([X, V, 2 * X])
    assert_tree_allclose(jax.vmap(op().mv)(Xs), jax.vmap(lambda x: ref(ROWS, x))(Xs), rtol=1e-4, atol=1e-5)
    Ys = jnp.stack([Y, -Y])
    assert_tree_allclose(
        jax.vmap(op().T.mv)(Ys), jax.vmap(lambda y: (dense(ROWS).T @ y).reshape(NPIX, K))(Ys), rtol=1e-4, atol=1e-5
    )
    batch = jax.tree_util.tree_map(lambda *a: jnp.stack(a), ROWS, make_rows(N, seed=5))
    got = jax.vmap(lambda r, x: op(r).mv(x))(batch, jnp.stack([X, V]))
    assert_tree_allclose(got, jax.vmap(ref)(batch, jnp.stack([X, V])), rtol=1e-4, atol=1e-5)
    got_T = jax.vmap(lambda r, y: op(r).T.mv(y))(batch, jnp.stack([Y, -Y]))
    exp_T = jax.vmap(lambda r, y: jax.linear_transpose(lambda x: ref(r, x), X_STRUCT)(y)[0])(batch, jnp.stack([Y, -Y]))
    assert_tree_allclose(got_T, exp_T, rtol=1e-4, atol=1e-5)
    assert "cond" in primitive_names(jax.make_jaxpr(jax.vmap(op().mv))(Xs))


# -- the predicate and the barrier's placement ------------------------------------------------------


def test_barrier_in_the_kernels_for_cpu_only():
    """The barrier's conditional is in the jaxprs (``platform_dependent`` chooses it when
    lowering): the cpu program carries it, a cuda program exported from this host does not."""
    A = op()
    assert "cond" in primitive_names(jax.make_jaxpr(A.mv)(X))
    assert "cond" in primitive_names(jax.make_jaxpr(A.T.mv)(Y))
    for f, arg in ((A.mv, X), (A.T.mv, Y)):
        struct = jax.ShapeDtypeStruct(arg.shape, arg.dtype)
        text = {
            p: jax.export.export(jax.jit(lambda v, f=f: f(v)), platforms=[p])(struct).mlir_module()
            for p in ("cpu", "cuda")
        }
        assert "optimization_barrier" in text["cpu"]
        assert "optimization_barrier" not in text["cuda"]


# -- the optimized HLO ---------------------------------------------------------------------------


def _computations(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^(%[\w.\-]+) \(.*?\{\n(.*?)^\}", text, re.S | re.M)}


def exp_fed_by_slice(text: str) -> list[str]:
    """The computations of an optimized HLO module in which an ``exponential`` is computed from
    a ``dynamic-slice`` (following operands within the computation)."""
    bad = []
    for name, body in _computations(text).items():
        defs = {}
        for line in body.splitlines():
            m = re.match(r"^\s*(?:ROOT )?(%[\w.\-]+) = .*? ([\w\-]+)\((.*)$", line)
            if m:
                defs[m.group(1)] = (m.group(2), re.findall(r"%[\w.\-]+", m.group(3).split("),")[0]))
        stack = [a for opcode, args in defs.values() if opcode == "exponential" for a in args]
        seen = set()
        while stack:
            a = stack.pop()
            if a in seen or a not in defs:
                continue
            seen.add(a)
            if defs[a][0] == "dynamic-slice":
                bad.append(name)
                break
            stack.extend(defs[a][1])
    return bad


def _stacked(structs, k):
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), structs)


def _hlo_of_ops():
    n, chunk = 4 * 512, 512  # whole chunks: the scan reads them as slices of the stacked rows
    rows = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_rows(n))
    x, y = X_STRUCT, jax.ShapeDtypeStruct((n,), jnp.float32)
    A = lambda r: op(r, chunk)
    loss = lambda r, x, y: jnp.sum((A(r).mv(x) - y) ** 2)
    fns = {
        "mv": (lambda r, x, y: A(r).mv(x), (rows, x, y)),
        "T": (lambda r, x, y: A(r).T.mv(y), (rows, x, y)),
        "grad": (lambda r, x, y: jax.grad(loss, argnums=1)(r, x, y), (rows, x, y)),
        "hvp": (lambda r, x, y: jax.jvp(lambda u: jax.grad(loss, argnums=1)(r, u, y), (x,), (x,))[1], (rows, x, y)),
        # the transpose over two sets of rows (jax.vmap batches the rows: the barrier must stay)
        "T over row sets": (
            lambda r, x, y: jax.vmap(lambda r1, y1: A(r1).T.mv(y1))(r, y),
            (_stacked(rows, 2), x, jax.ShapeDtypeStruct((2, n), jnp.float32)),
        ),
    }
    return {k: jax.jit(f).lower(*a).compile().as_text() for k, (f, a) in fns.items()}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the barrier is XLA:CPU-specific")
def test_optimized_hlo_weights_not_computed_from_row_slices(monkeypatch):
    for name, text in _hlo_of_ops().items():
        assert "conditional(" in text, f"{name}: XLA removed the conditional"
        assert not exp_fed_by_slice(text), f"{name}: exp computed from a slice of the rows in {exp_fed_by_slice(text)}"
    # the check can fail: without the barrier XLA:CPU fuses the slice into the weights. If this
    # stops holding, XLA changed its fusion and the barrier should be measured again.
    monkeypatch.setattr(_chunking, "fusion_barrier", lambda chunk, key=None: chunk)
    jax.clear_caches()
    unguarded = _hlo_of_ops()
    jax.clear_caches()
    assert "conditional(" not in unguarded["T"]
    assert exp_fed_by_slice(unguarded["T"]) and exp_fed_by_slice(unguarded["mv"])
