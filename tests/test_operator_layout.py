"""The windowed row layout (``RowOperator(..., layout="windowed")``, ``_operator/row_layout.py``):
rows sorted once by target, each chunk reading one window of ``x``, every transpose summing into
that window, vectors in the user's order.

Values and every derivative against the dense matrix and the plain layout, for every kind of
targets the registry's ``make_windowed`` draws; the fallback where the layout cannot apply; the
compiled gradient's scatters; bitwise repeatability; the user's order (``row_order``,
``with_rows``); ``jax.vmap`` over operators; memory; reads by narrow and unsigned index dtypes.
The registry's windowed cases also run every generic operator test (``operator_registry.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from _tolerance import assert_tree_allclose
from conftest import temp_bytes
from operator_registry import longest_sum, make_windowed

import chunkop

TARGETS = ["random", "sorted", "skewed", "one", "out_of_range"]
READS = ["row", "slice", "two"]


def plain_of(case, **kw):
    return case.op(layout="plain", **kw)


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("targets", TARGETS)
def test_values_and_derivatives_match_the_dense_matrix_and_the_plain_layout(targets, read):
    """``mv``, ``T.mv``, ``jax.linear_transpose(A.mv)``, the gradient w.r.t. ``x`` and the rows'
    floats, forward mode, a Hessian-vector product and a second derivative w.r.t. the rows, in
    the user's order, against the plain layout and (values) the dense matrix."""
    case = make_windowed(targets=targets, read=read)
    W, P = case.op(), plain_of(case)
    assert W.layout is not None and W.spec.windows is not None and P.layout is None
    assert (W.row_order is None) == (targets in ("sorted", "one"))
    x, y, M = case.x(), case.y(), case.dense()
    n = longest_sum(M)

    def loss(A, x, p):
        A = A.with_rows({**A.rows, **p})
        return 0.5 * jnp.sum((A.mv(x) - y) ** 2) + jnp.sum(jnp.sin(A.T.mv(y)) * x)

    @jax.jit
    def everything(A, x, p):
        g_x, g_p = jax.grad(loss, argnums=(1, 2))(A, x, p)
        hvp = jax.jvp(lambda v: jax.grad(loss, argnums=1)(A, v, p), (x,), (x,))[1]
        dd = jax.jvp(lambda d: jax.grad(loss, argnums=2)(A, x, {**p, "d": d})["d"], (p["d"],), (p["d"] * 1e-3,))[1]
        fwd = jax.jvp(lambda v, s: A.with_rows({**A.rows, "s": s}).mv(v), (x, p["s"]), (x, p["s"]))[1]
        return {
            "mv": A.mv(x),
            "T": A.T.mv(y),
            "lt": jax.linear_transpose(A.mv, x)(y)[0],
            "g_x": g_x,
            "g_p": g_p,
            "hvp": hvp,
            "dd": dd,
            "fwd": fwd,
            "vmap": jax.vmap(A.mv)(jnp.stack([x, -2 * x])),
        }

    p = case.p
    got, ref = everything(W, x, p), everything(P, x, p)
    assert_tree_allclose(got, ref, n_terms=4 * n)
    assert_tree_allclose(got["mv"].reshape(-1), M @ x.reshape(-1), n_terms=n)
    assert_tree_allclose(got["T"].reshape(-1), M.T @ y, n_terms=n)


def test_the_windows_are_smaller_than_x_and_straddle_chunks():
    """53 lines over 40 pixels in chunks of 8 (a remainder of 5): each window is a handful of
    rows, and chunks share pixels (a pixel's lines split over two chunks)."""
    case = make_windowed()
    A = case.op()
    (window,) = A.spec.windows
    assert window < 40
    idx = np.asarray(A.row_data["idx"])
    assert np.all(np.diff(idx) >= 0)  # the kernels' rows: sorted by target
    boundary = idx[7::8][: len(idx) // 8 - 1]
    assert np.any(boundary == idx[8::8][: len(boundary)])  # a pixel on both sides of a chunk boundary


def test_rows_built_under_jit_fall_back_to_the_plain_layout():
    """Targets traced (rows built inside ``jax.jit``): the plain layout, the same values;
    ``layout="windowed"`` then says what it needs."""
    case = make_windowed()
    rows, x = case.rows, case.x()
    layouts = []

    @jax.jit
    def mv(idx, x):
        A = chunkop.RowOperator(case.row_fn, {**rows, "idx": idx}, case.in_structure, chunk_size=8)
        layouts.append(A.layout)
        return A.mv(x)

    assert_tree_allclose(mv(rows["idx"], x), plain_of(case).mv(x), n_terms=1)
    assert layouts == [None]
    with pytest.raises(ValueError, match=r"targets are traced.*concrete"):
        jax.jit(
            lambda idx: chunkop.RowOperator(case.row_fn, {**rows, "idx": idx}, case.in_structure, layout="windowed").mv(
                x
            )
        )(rows["idx"])


@pytest.mark.parametrize(
    "row_fn, match",
    [
        (lambda r, x: r["d"] * x.sum(), "reads `x` otherwise"),
        (lambda r, x: r["d"] * x[r["idx"], 1], "reads `x` otherwise"),
        (lambda r, x: r["d"] * x[x[r["idx"], 0].astype(jnp.int32)].sum(), "reads `x` otherwise"),
    ],
    ids=["reduction", "element", "index_from_x"],
)
def test_windowed_refuses_other_reads_and_auto_keeps_the_plain_layout(row_fn, match):
    case = make_windowed()
    with pytest.raises(ValueError, match=match):
        chunkop.RowOperator(row_fn, case.rows, case.in_structure, chunk_size=8, layout="windowed")
    assert chunkop.RowOperator(row_fn, case.rows, case.in_structure, chunk_size=8).layout is None


def test_bad_layout_arguments():
    case = make_windowed()
    with pytest.raises(ValueError, match='`layout` must be "auto", "windowed" or "plain"'):
        case.op(layout="sorted")
    with pytest.raises(ValueError, match=r"segment_key.*pass one of them"):
        case.op(segment_key="idx")
    assert case.op(layout="auto", segment_key="idx").layout is None  # the per-target transpose


def _scatters(fn, *args) -> list[tuple[tuple, tuple]]:
    """``(operand shape, updates shape)`` of every scatter in the program ``jax.jit(fn)`` hands to
    XLA (its jaxpr, at any depth: independent of XLA's own rewrites, which turn a scatter into a
    loop at some optimisation settings)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("scatter"):
                found.append((tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[2].aval.shape)))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub if hasattr(sub, "eqns") else sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("targets", ["random", "sorted"])
def test_the_gradient_scatters_no_row_into_x(targets):
    """The program of ``jax.grad`` of ``0.5 |A x - y|^2``: the plain layout scatters every row
    into an ``x``-shaped buffer; the windowed one sums a chunk's rows into its window (a
    window-shaped scatter on CPU, a matrix product on a TPU) and, for rows in random order,
    permutes ``n_rows`` scalars (no row)."""
    case = make_windowed(n=512, npix=200, chunk=64, targets=targets)
    x, y = case.x(), case.y()
    n = case.rows["idx"].shape[0]
    grad = lambda A: _scatters(jax.grad(lambda v: 0.5 * jnp.sum((A.mv(v) - y) ** 2)), x)
    assert any(shape == x.shape for shape, _ in grad(plain_of(case)))
    W = case.op()
    (window,) = W.spec.windows
    windowed = grad(W)
    assert windowed and all(shape in ((window, x.shape[1]), (n,)) for shape, _ in windowed), windowed
    assert all(updates[0] == 64 for shape, updates in windowed if shape != (n,))  # one chunk's rows
    if targets == "sorted":  # no permutation: no scatter of n_rows values at all
        assert all(shape == (window, x.shape[1]) for shape, _ in windowed)


def test_repeats_bitwise_and_chunk_size_changes_only_rounding():
    case = make_windowed(n=300, npix=60, chunk=32)
    A, x, y = case.op(), case.x(), case.y()
    grad = jax.jit(jax.grad(lambda v: 0.5 * jnp.sum((A.mv(v) - y) ** 2)))
    for f, v in ((jax.jit(lambda v: A.T.mv(v)), y), (jax.jit(lambda v: A.mv(v)), x), (grad, x)):
        assert np.array_equal(np.asarray(f(v)), np.asarray(f(v)))
    B = case.op(chunk=48)
    assert B.spec.windows != A.spec.windows or B.chunk_size != A.chunk_size
    n = longest_sum(case.dense())
    assert_tree_allclose(B.T.mv(y), A.T.mv(y), n_terms=n)
    assert_tree_allclose(B.mv(x), A.mv(x), n_terms=n)


def test_row_order_sorts_a_catalog_once():
    """``rows[row_order]`` is sorted: an operator built on it needs no permutation, and gives
    ``A x`` in that order."""
    case = make_windowed()
    A, x, y = case.op(), case.x(), case.y()
    order = np.asarray(A.row_order)
    assert sorted(order.tolist()) == list(range(len(order)))
    B = case.op(rows=jax.tree_util.tree_map(lambda a: a[order], case.rows))
    assert B.row_order is None and B.layout is not None
    assert_tree_allclose(B.mv(x), A.mv(x)[order], n_terms=1)
    assert_tree_allclose(B.T.mv(y[order]), A.T.mv(y), n_terms=longest_sum(case.dense()))
    S = A.in_sorted_order()  # the same, without a new sort: A's kernels, no permutation
    assert S.row_order is None and S.spec is A.spec and B.in_sorted_order() is B
    assert_tree_allclose(S.mv(x), A.mv(x)[order], n_terms=1)
    assert_tree_allclose(S.T.mv(y[order]), A.T.mv(y), n_terms=longest_sum(case.dense()))
    assert_tree_allclose(S.rows, B.rows, n_terms=1)


def test_with_rows_keeps_the_layout_and_refuses_new_targets():
    case = make_windowed()
    A, x = case.op(), case.x()
    rows2 = {**case.rows, "d": case.rows["d"] * 1.5}
    B = A.with_rows(rows2)
    assert B.spec == A.spec and B.layout.order is A.layout.order
    assert_tree_allclose(B.mv(x), case.op(rows=rows2).mv(x), n_terms=1)
    assert_tree_allclose(B.rows, rows2, n_terms=1)
    with pytest.raises(ValueError, match="change the targets"):
        A.with_rows({**case.rows, "idx": (case.rows["idx"] + 1) % 40})
    with pytest.raises(ValueError, match="row structure, shapes and dtypes"):
        A.with_rows({**case.rows, "d": case.rows["d"][:3]})


def test_vmap_over_operators():
    """A batch of operators: built under ``jax.vmap`` from batched floats (concrete targets: the
    windowed layout, each member's rows sorted alike), and a stack of operators passed to
    ``jax.vmap``; against the plain layout."""
    case = make_windowed()
    x = case.x()
    ds = jnp.stack([case.rows["d"], case.rows["d"] * 0.7])
    layouts = []

    def mv(d, layout):
        A = chunkop.RowOperator(case.row_fn, {**case.rows, "d": d}, case.in_structure, chunk_size=8, layout=layout)
        layouts.append(A.layout is not None)
        return A.mv(x)

    assert_tree_allclose(jax.vmap(lambda d: mv(d, "windowed"))(ds), jax.vmap(lambda d: mv(d, "plain"))(ds), n_terms=1)
    assert layouts == [True, False]
    ops = [case.op(rows={**case.rows, "d": d}) for d in ds]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ops)
    xs = jnp.stack([x, 2 * x])
    assert_tree_allclose(
        jax.vmap(lambda A, v: A.mv(v))(stacked, xs), jnp.stack([A.mv(v) for A, v in zip(ops, xs)]), n_terms=1
    )
    g = jax.vmap(jax.grad(lambda v, A: jnp.sum(A.mv(v) ** 2)), in_axes=(0, 0))(xs, stacked)
    assert_tree_allclose(
        g, jnp.stack([jax.grad(lambda v: jnp.sum(A.mv(v) ** 2))(v) for A, v in zip(ops, xs)]), n_terms=8
    )


def test_check_linear_scipy_and_a_lineax_solve():
    case = make_windowed()
    W, P = case.op(), plain_of(case)
    assert max(chunkop.check_linear(W).values()) < 1e-4
    b = W.mv(case.x())
    solve = lambda A: lx.linear_solve(A.normal(1.0), A.T.mv(b), lx.CG(rtol=1e-6, atol=1e-9, max_steps=500)).value
    assert_tree_allclose(solve(W), solve(P), rtol=1e-3, atol=1e-5)
    S = chunkop.to_scipy(W)
    np.testing.assert_allclose(S.matvec(np.asarray(case.x()).reshape(-1)), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_gradient_memory_is_bounded_by_the_chunk_and_the_window():
    """16x the lines on one sky (0.5 to 8 lines per pixel): the gradient's temp memory grows by
    a few row-space vectors at most (the residual; in random order also the permutation's), never
    by a buffer of ``x``'s size (the sky is 8x a row-space vector here)."""

    def temp(n, targets):
        case = make_windowed(n=n, npix=2048, chunk=64, targets=targets, k=64)
        A, x, y = case.op(), case.x(), case.y()
        return temp_bytes(jax.grad(lambda v, t: 0.5 * jnp.sum((A.mv(v) - t) ** 2)), x, y), x.size * 4, n * 4

    small, _, _ = temp(1024, "sorted")
    large, x_bytes, row_bytes = temp(16384, "sorted")
    assert large - small <= 4 * row_bytes < x_bytes, (small, large)
    shuffled, _, _ = temp(16384, "random")
    assert shuffled - large <= 4 * row_bytes, (large, shuffled)


def test_auto_chunk_plans_with_the_windows():
    """``chunk_size="auto"`` under a budget: planned on the windowed programs (the windows of
    each candidate chunk compiled in), and the operator runs at the planned chunk."""
    case = make_windowed(n=20000, npix=2000, targets="random")
    A = chunkop.RowOperator(
        case.row_fn, case.rows, case.in_structure, chunk_size="auto", memory_budget=2**19, layout="windowed"
    )
    plan = chunkop.plan(A)
    assert A.layout is not None and plan.chunk == A.chunk_size < 20000 and plan.compiled_bytes <= 2**19
    y = case.y()
    assert_tree_allclose(A.T.mv(y), plain_of(case, chunk=A.chunk_size).T.mv(y), n_terms=64)


@pytest.mark.parametrize(
    "dtype, n_rows", [(jnp.uint8, 300), (jnp.int8, 300), (jnp.uint16, 70000), (jnp.int16, 70000), (jnp.uint32, 300)]
)
def test_reads_by_narrow_and_unsigned_indices_keep_jax_semantics(dtype, n_rows):
    """A start read in a narrow or unsigned dtype: chunkop's row reads (the gather of whole rows,
    the windows) clamp it as ``lax.dynamic_slice`` does, in int32 (clamped in ``uint8``, the bound
    298 is 42: issue #42, finding 1). ``x[i]`` and ``dynamic_slice_in_dim(x, i, 2)`` as
    ``chunkop.vmap`` reads them, and a ``RowOperator`` (both layouts: ``A x`` and ``A^T y``),
    against the same function applied to one start at a time (unbatched JAX, whatever it does with
    a negative start in that dtype) and its gradient per row (no scatter: XLA's batched scatter
    with such indices is not a safe reference, at some compiler settings it wraps too)."""
    info = jnp.iinfo(dtype)
    starts = np.linspace(max(info.min, -5), min(info.max, n_rows + 20), 37).astype(dtype)
    T = jnp.arange(n_rows * 2, dtype=jnp.float32).reshape(n_rows, 2)
    for f in (lambda i, x: jax.lax.dynamic_slice_in_dim(x, i, 2).sum(), lambda i, x: x[i].sum()):
        one = jax.jit(f)
        expected = np.array([one(i, T) for i in starts])
        np.testing.assert_array_equal(chunkop.vmap(f, in_axes=(0, None), chunk_size=8)(starts, T), expected)
    row_fn = lambda r, x: r["w"] * jax.lax.dynamic_slice_in_dim(x, r["i"], 2).sum()
    w = np.linspace(0.5, 1.5, starts.size, dtype=np.float32)
    rows = {"i": jnp.asarray(starts), "w": jnp.asarray(w)}
    struct = jax.ShapeDtypeStruct((n_rows, 2), jnp.float32)
    y = np.linspace(-1.0, 1.0, starts.size, dtype=np.float32)
    one_row = jax.jit(lambda i, wi, x: row_fn({"i": i, "w": wi}, x))
    expected_mv = np.array([one_row(i, wi, T) for i, wi in zip(starts, w)])
    # the rows each start reads, as unbatched JAX reads them (rows numbered 0, 1, ... in column 0)
    numbered = jnp.zeros((n_rows, 2), jnp.float32).at[:, 0].set(jnp.arange(n_rows, dtype=jnp.float32))
    first = ((np.array([one_row(i, 1.0, numbered) for i in starts]) - 1) / 2).astype(np.int64)
    expected_T = np.zeros((n_rows, 2))
    np.add.at(expected_T, first, (w * y)[:, None])
    np.add.at(expected_T, first + 1, (w * y)[:, None])
    for layout in ("plain", "windowed"):
        A = chunkop.RowOperator(row_fn, rows, struct, chunk_size=8, layout=layout)
        np.testing.assert_allclose(A.mv(T), expected_mv, rtol=1e-6)
        np.testing.assert_allclose(A.T.mv(jnp.asarray(y)), expected_T, rtol=1e-6, atol=1e-6)


def test_the_permutation_primitive_against_indexing():
    """``row_layout.permute`` (one primitive, its rules in JAX's tables) against NumPy indexing
    and JAX's own gather: values (floats and integers), forward and reverse mode, second order,
    ``jax.linear_transpose``, ``jax.vmap`` along either axis and over batched permutations; and
    what each platform lowers it to (a TPU sorts a vector by ``dest``; elsewhere a scatter)."""
    from chunkop._operator.row_layout import permute

    rng = np.random.default_rng(3)
    n = 11
    dest_np = rng.permutation(n).astype(np.int32)
    src_np = np.argsort(dest_np).astype(np.int32)
    dest, src = jnp.asarray(dest_np), jnp.asarray(src_np)
    v = jnp.asarray(rng.normal(size=n), jnp.float32)
    want = np.asarray(v)[src_np]  # element k of the result is v[src[k]]
    np.testing.assert_array_equal(np.asarray(permute(v, dest, src)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(permute)(v, dest, src)), want)
    ints = jnp.arange(n, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(permute(ints, dest, src)), src_np)
    weights = jnp.asarray(rng.normal(size=n), jnp.float32)
    f = lambda v: jnp.sum(jnp.sin(permute(v, dest, src)) * weights)
    g = lambda v: jnp.sum(jnp.sin(v[src]) * weights)
    np.testing.assert_allclose(jax.grad(f)(v), jax.grad(g)(v), rtol=1e-6)
    np.testing.assert_allclose(jax.hessian(f)(v), jax.hessian(g)(v), rtol=1e-6, atol=1e-7)
    t = jnp.asarray(rng.normal(size=n), jnp.float32)
    np.testing.assert_allclose(jax.jvp(f, (v,), (t,))[1], jax.jvp(g, (v,), (t,))[1], rtol=1e-6)
    (back,) = jax.linear_transpose(lambda u: permute(u, dest, src), v)(v)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(v)[dest_np])
    V = jnp.asarray(rng.normal(size=(3, n)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda u: permute(u, dest, src))(V)), np.asarray(V)[:, src_np])
    by_column = jax.vmap(lambda u: permute(u, dest, src), in_axes=1, out_axes=1)(V.T)
    np.testing.assert_array_equal(np.asarray(by_column), np.asarray(V.T)[src_np])
    perms = np.stack([rng.permutation(n) for _ in range(3)]).astype(np.int32)
    inverses = np.argsort(perms, axis=1).astype(np.int32)
    batched = jax.vmap(permute)(V, jnp.asarray(perms), jnp.asarray(inverses))
    np.testing.assert_array_equal(np.asarray(batched), np.take_along_axis(np.asarray(V), inverses, 1))
    for platform, op in (("tpu", "stablehlo.sort"), ("cpu", "stablehlo.scatter"), ("cuda", "stablehlo.scatter")):
        text = jax.export.export(jax.jit(permute), platforms=[platform])(v, dest, src).mlir_module()
        assert op in text, platform


def test_auto_keeps_the_plain_layout_for_a_small_x_on_a_cpu():
    """``"auto"`` on a CPU: below ``PLATFORMS["cpu"].min_x_bytes`` of ``x`` read (a sky that stays
    in cache) the plain layout, without sorting the rows; from there the windows, as where
    ``"windowed"`` is forced; the same values every way."""
    from chunkop._operator import row_layout

    bound = row_layout.PLATFORMS["cpu"].min_x_bytes
    assert bound == 2 << 20 and jax.default_backend() == "cpu"
    k = 64
    for npix, windowed in ((bound // (4 * k) - 1, False), (bound // (4 * k), True)):
        case = make_windowed(n=4 * npix, npix=npix, chunk=256, targets="random", k=k)
        A, W, P = case.op(layout="auto"), case.op(layout="windowed"), plain_of(case)
        assert row_layout.read_bytes(A.spec.reads, A.spec.in_leaves) == npix * k * 4
        assert (A.layout is not None) == windowed and W.layout is not None and P.layout is None
        assert (A.row_order is not None) == windowed  # no sort below the bound
        x, y = case.x(), case.y()
        assert_tree_allclose(A.mv(x), P.mv(x), n_terms=1)
        assert_tree_allclose(A.T.mv(y), W.T.mv(y), n_terms=16)


@pytest.mark.parametrize("layout", ["plain", "windowed"])
def test_many_rows_into_one_entry_round_no_worse_than_jax(layout):
    """Thousands of float32 rows summed into one entry of ``x``: ``A.T.mv`` and the gradient of
    ``A.mv`` carry the rounding of a running float32 sum, no worse than ``jax.vmap``'s own linear
    transpose (a scatter-add) at any chunk size, against a float64 NumPy sum."""
    rng = np.random.default_rng(0)
    n_out, per = 8, 4000
    idx = rng.integers(0, n_out, n_out * per)
    w = (rng.standard_normal((idx.size, 4)) + 3.0).astype(np.float32)
    y = (rng.standard_normal(idx.size) + 1.0).astype(np.float32)
    rows = {"idx": jnp.asarray(idx), "w": jnp.asarray(w)}
    x = jnp.zeros((n_out, 4), jnp.float32)
    terms = w.astype(np.float64) * y.astype(np.float64)[:, None]
    exact, size = np.zeros((n_out, 4)), np.zeros((n_out, 4))
    np.add.at(exact, idx, terms)
    np.add.at(size, idx, np.abs(terms))

    def err(a):
        return float(np.max(np.abs(np.asarray(a, np.float64) - exact) / size))

    def row_fn(r, x):
        return jnp.sum(r["w"] * x[r["idx"]])

    jax_err = err(jax.linear_transpose(lambda x: jax.vmap(row_fn, (0, None))(rows, x), x)(jnp.asarray(y))[0])
    assert 1e-8 < jax_err < 1e-4  # a float32 running sum: rounding shows, and is small
    for chunk in (512, 8192, idx.size):
        A = chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct(x.shape, x.dtype), chunk_size=chunk, layout=layout)
        assert err(A.T.mv(jnp.asarray(y))) <= 1.5 * jax_err, chunk
        assert err(jax.grad(lambda x: A.mv(x) @ jnp.asarray(y))(x)) <= 1.5 * jax_err, chunk


def test_auto_on_a_tpu_keeps_the_plain_layout_below_its_bounds(monkeypatch):
    """``"auto"`` with the TPU's measured platform (``PLATFORMS["tpu"]``): an ``x`` below its
    ``min_x_bytes`` read by fewer rows than its ``min_rows`` (rows of 200: an unaligned last axis,
    as the astro families' latent fields of 24 and 24 x 24) keeps the plain layout and is not
    sorted, with the plain layout's values; at either bound the rows are sorted; and the unaligned
    rule keeps windows that the size rule alone would drop (``max_window_per_row``)."""
    from chunkop._operator import row_layout

    tpu = row_layout.PLATFORMS["tpu"]
    monkeypatch.setattr(row_layout, "platform", lambda: tpu)
    assert (tpu.min_x_bytes, tpu.min_rows, tpu.unaligned) == (32 << 20, 2 << 20, 128)
    k, npix = 200, 4096
    case = make_windowed(n=2 * npix, npix=npix, chunk=256, targets="random", k=k)
    A, P = case.op(layout="auto"), plain_of(case)
    assert A.row_order is None and A.layout is None
    x, y = case.x(), case.y()
    assert_tree_allclose(A.mv(x), P.mv(x), n_terms=1)
    assert_tree_allclose(A.T.mv(y), P.T.mv(y), n_terms=16)
    reads = A.spec.reads
    for pixels, n_rows, sorts in (
        (tpu.min_x_bytes // (4 * k) - 1, tpu.min_rows - 1, False),
        (-(-tpu.min_x_bytes // (4 * k)), tpu.min_rows - 1, True),
        (npix, tpu.min_rows, True),
    ):
        leaf = jax.ShapeDtypeStruct((pixels, k), jnp.float32)
        assert row_layout.worth_sorting(reads, (leaf,), n_rows) == sorts, (pixels, n_rows)
    leaf = jax.ShapeDtypeStruct((1 << 20, 24), jnp.float32)
    assert row_layout.use_windows("auto", (4096,), (leaf,), chunk=1024)  # 4 rows of x a row: unaligned keeps them
    aligned = jax.ShapeDtypeStruct((1 << 20, 128), jnp.float32)
    assert not row_layout.use_windows("auto", (4096,), (aligned,), chunk=1024)
