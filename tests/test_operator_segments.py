"""``RowOperator(..., segment_key=...)``: the transpose summed per target, written once per target.

The registry's ``segment`` case (tests/operator_registry.py) runs the generic operator tests
(values, derivatives, lineax, SciPy); here: the target distributions the option exists for
(uniform, skewed, all rows on one target, targets out of range), against the dense matrix and
the scatter-add transpose; bitwise repeatability; batched row sets; the argument errors;
``check_linear`` catching a ``row_fn`` that breaks the option's contract; the accelerator
program's scatter (unique indices); and temp memory that does not grow with the rows.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_tree_allclose
from conftest import temp_bytes
from operator_registry import dense_matrix, longest_sum

import chunkop

NPIX, K, N, CHUNK = 9, 5, 37, 8  # four full chunks and a remainder of 5
X = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)


def row_fn(r, x):
    return jnp.dot(jnp.exp(-r["d"] * jnp.arange(1.0, K + 1.0)), x[r["pix"]])


def fill_row_fn(r, x):  # reads nothing outside the grid (a target out of range reads zeros)
    return jnp.dot(jnp.exp(-r["d"] * jnp.arange(1.0, K + 1.0)), x.at[r["pix"]].get(mode="fill", fill_value=0.0))


def targets(kind: str, n: int = N, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(0, NPIX, n)
    if kind == "skewed":  # most rows on a few targets
        return np.floor(NPIX * rng.uniform(size=n) ** 4).astype(int)
    if kind == "same":
        return np.full(n, 3)
    if kind == "negative":  # counted from the end, as x[t] counts them
        return rng.integers(-NPIX, NPIX, n)
    assert kind == "out_of_range"
    return rng.integers(-2 * NPIX, 2 * NPIX, n)


def rows_of(pix, seed: int = 1) -> dict:
    d = np.random.default_rng(seed).uniform(0.2, 1.0, len(pix))
    return {"pix": jnp.asarray(pix, jnp.int32), "d": jnp.asarray(d, jnp.float32)}


def y_of(n: int = N, seed: int = 2) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=n), jnp.float32)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "same", "negative", "out_of_range"])
def test_transpose_matches_the_dense_matrix_and_the_scatter(kind):
    fn = fill_row_fn if kind == "out_of_range" else row_fn
    rows, y = rows_of(targets(kind)), y_of()
    M = dense_matrix(fn, rows, X)
    seg = chunkop.RowOperator(fn, rows, X, chunk_size=CHUNK, segment_key="pix")
    scatter = chunkop.RowOperator(fn, rows, X, chunk_size=CHUNK)
    got = jax.jit(lambda A, y: A.T.mv(y))(seg, y)
    n = longest_sum(M)
    assert_tree_allclose(got, (M.T @ y).reshape(NPIX, K), n_terms=n)
    assert_tree_allclose(got, scatter.T.mv(y), n_terms=n)
    x = rows["d"][:NPIX, None] * jnp.ones((NPIX, K))
    assert_tree_allclose(seg.mv(x), scatter.mv(x))  # the matvec is the same kernel
    if kind == "out_of_range":  # rows off the grid add nothing
        off = (targets(kind) >= NPIX) | (targets(kind) < -NPIX)
        assert off.any() and np.abs(np.asarray(M)[off]).max() == 0.0


def test_ordered_dict_rows_and_a_narrow_index_dtype():
    """Rows as an ``OrderedDict`` (the local rows keep the rows' own type) and int8 targets with
    negative values (normalised in a wider dtype: ``t + n`` does not overflow)."""
    pix = targets("negative").astype(np.int8)
    rows = collections.OrderedDict(d=rows_of(pix)["d"], pix=jnp.asarray(pix, jnp.int8))
    y = y_of()
    got = chunkop.RowOperator(row_fn, rows, X, chunk_size=CHUNK, segment_key="pix").T.mv(y)
    assert_tree_allclose(got, (dense_matrix(row_fn, rows, X).T @ y).reshape(NPIX, K), n_terms=N)


def test_transpose_repeats_bitwise_and_does_not_depend_on_the_chunk():
    rows, y = rows_of(targets("skewed")), y_of()
    A = chunkop.RowOperator(row_fn, rows, X, chunk_size=CHUNK, segment_key="pix")
    first = np.asarray(A.T.mv(y))
    assert all(np.array_equal(first, np.asarray(A.T.mv(y))) for _ in range(3))
    assert np.array_equal(first, np.asarray(jax.jit(lambda y: A.T.mv(y))(y)))
    M = dense_matrix(row_fn, rows, X)
    for chunk in (1, 5, N):
        B = chunkop.RowOperator(row_fn, rows, X, chunk_size=chunk, segment_key="pix")
        assert_tree_allclose(B.T.mv(y), first, n_terms=longest_sum(M))


def test_batched_row_sets_and_their_derivatives():
    """``jax.vmap`` over two row sets with different targets; grad w.r.t. the rows' floats
    through the segment transpose, against the scatter transpose."""
    sets = [rows_of(targets("uniform", seed=s), seed=s) for s in (3, 4)]
    batched = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *sets)
    y = y_of()

    def loss(d, y, key):
        A = chunkop.RowOperator(row_fn, {**sets[0], "d": d}, X, chunk_size=CHUNK, segment_key=key)
        return jnp.sum(jnp.sin(A.T.mv(y)))

    for key in ("pix", None):
        got = jax.vmap(lambda r: chunkop.RowOperator(row_fn, r, X, chunk_size=CHUNK, segment_key=key).T.mv(y))(batched)
        for i, rows in enumerate(sets):
            assert_tree_allclose(got[i], (dense_matrix(row_fn, rows, X).T @ y).reshape(NPIX, K), n_terms=N)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    assert_tree_allclose(grad(sets[0]["d"], y, "pix"), grad(sets[0]["d"], y, None), n_terms=N)


def test_check_linear_catches_a_row_fn_that_reads_more_than_its_target():
    """The option's contract: ``row_fn`` reads ``x`` only at ``x[row[segment_key]]``. A row that
    also reads ``x[0]`` gives a wrong segment transpose, which the adjoint test reports; the
    same operator without the option passes."""
    extra = lambda r, x: row_fn(r, x) + x[0, 0]
    rows = rows_of(targets("uniform"))
    assert chunkop.check_linear(chunkop.RowOperator(extra, rows, X, chunk_size=CHUNK))["adjoint"] < 1e-5
    with pytest.raises(ValueError, match=r"does not transpose row_fn.*`segment_key`='pix'"):
        chunkop.check_linear(chunkop.RowOperator(extra, rows, X, chunk_size=CHUNK, segment_key="pix"))


@pytest.mark.parametrize(
    ("rows", "key", "x", "match"),
    [
        ({"pix": np.zeros(4, np.int32)}, 3, X, "`segment_key` must be a str"),
        ((np.zeros(4, np.int32),), "pix", X, "needs `rows` to be a dict"),
        ({"pix": np.zeros(4, np.int32)}, "idx", X, r"not a key of `rows` \(keys: \['pix'\]\)"),
        ({"pix": np.zeros(4, np.float32)}, "pix", X, r"must be an integer array of shape \(4,\)"),
        ({"pix": np.zeros((4, 2), np.int32)}, "pix", X, r"must be an integer array of shape \(4,\)"),
        (
            {"pix": np.zeros(4, np.int32)},
            "pix",
            {"a": X, "b": jax.ShapeDtypeStruct((NPIX + 1,), jnp.float32)},
            "the same leading axis",
        ),
    ],
    ids=["key_type", "rows_not_dict", "missing_key", "float_targets", "2d_targets", "x_leading_axes_differ"],
)
def test_bad_segment_key_is_a_clear_error(rows, key, x, match):
    fn = lambda r, v: jnp.sum(jax.tree_util.tree_leaves(v)[0][r["pix"]])
    with pytest.raises((ValueError, TypeError), match=match):
        chunkop.RowOperator(fn, rows, x, chunk_size=2, segment_key=key)


def test_accelerator_program_writes_each_target_once():
    """Exported for CUDA on this CPU host: every scatter of the segment transpose (each row's
    slice into its own one-slice ``x``, each target's sum into ``x``; full chunks and remainder)
    declares unique indices; the scatter-add transpose's do not."""
    rows, y = rows_of(targets("same")), jax.ShapeDtypeStruct((N,), jnp.float32)

    def unique_flags(key):
        A = chunkop.RowOperator(row_fn, rows, X, chunk_size=CHUNK, segment_key=key)
        text = jax.export.export(jax.jit(lambda y: A.T.mv(y)), platforms=["cuda"])(y).mlir_module()
        return text.count('"stablehlo.scatter"'), re.findall(r"unique_indices = (\w+)", text)

    assert unique_flags("pix") == (4, ["true"] * 4)
    assert unique_flags(None) == (2, [])


def test_temp_memory_does_not_grow_with_the_rows():
    """The segment transpose's compiled temp memory at 4096 and 65536 rows (chunks of 512, a
    256 x 64 sky): the same, and within 4x of the scatter transpose's (the segmented scan's
    temporaries are a few chunk-sized arrays)."""
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    fn = lambda r, v: jnp.dot(jnp.exp(-r["d"] * jnp.arange(1.0, 65.0)), v[r["pix"]])

    def temp(n, key):
        rows = {"pix": jax.ShapeDtypeStruct((n,), jnp.int32), "d": jax.ShapeDtypeStruct((n,), jnp.float32)}
        tmv = lambda rows, y: chunkop.RowOperator(fn, rows, x, chunk_size=512, segment_key=key).T.mv(y)
        return temp_bytes(tmv, rows, jax.ShapeDtypeStruct((n,), jnp.float32))

    small, big = temp(4096, "pix"), temp(65536, "pix")
    assert big <= small * 1.05 + 4 * 65536, (small, big)  # at most a few bytes per row (the sort's keys)
    assert big <= 4 * temp(65536, None), (big, temp(65536, None))


def test_auto_chunk_is_planned_on_the_segment_kernel():
    """``chunk_size="auto"`` under a budget measures the per-target transpose (whose temporaries
    are larger than the scatter's), so its compiled ``T.mv`` fits the budget."""
    rng = np.random.default_rng(5)
    n, npix, k = 20000, 500, 64
    rows = {
        "pix": jnp.asarray(rng.integers(0, npix, n), jnp.int32),
        "d": jnp.asarray(rng.uniform(0.5, 2, n), jnp.float32),
    }
    fn = lambda r, v: jnp.dot(jnp.exp(-r["d"] * jnp.arange(1.0, k + 1.0)), v[r["pix"]])
    x, budget = jax.ShapeDtypeStruct((npix, k), jnp.float32), 2 * 2**20
    A = chunkop.RowOperator(fn, rows, x, memory_budget=budget, segment_key="pix")
    assert A.spec.segment_key == "pix"
    assert temp_bytes(lambda A, y: A.T.mv(y), A, jax.ShapeDtypeStruct((n,), jnp.float32)) <= budget
