"""``chunk_size="auto"``: chunks chosen from XLA's compiled memory analysis and a budget.

Every memory figure asserted here is re-measured independently: the program the user would
run (``jax.grad`` of a loss on the chunked function, the operator's ``mv``/``T.mv``) is
compiled at the chosen chunk and its ``temp_size_in_bytes`` compared with the budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose, make_los_rows, primitive_names, temp_bytes

import chunkop
from chunkop import _memory, _search
from chunkop._operator import row_plan as _operator_plan

MiB = 2**20


def mlp(w, x):
    h = x
    for _ in range(3):
        h = jnp.tanh(h @ w)
    return jnp.sum(h)


MLP_TERMS = 64  # the longest sum in one example of mlp (its 64-wide dot products and sum)


def _sum_tolerance(terms):
    """``n_terms`` and ``condition`` of a sum over axis 0 of ``terms``: its length and its worst
    cancellation."""
    t = np.asarray(terms, np.float64)
    return {"n_terms": t.shape[0], "condition": float(np.max(np.abs(t).sum(0)) / np.max(np.abs(t.sum(0))))}


@pytest.fixture(scope="module")
def mlp_data():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32)
    xs = jnp.asarray(rng.normal(size=(4096, 64)), jnp.float32)
    return w, xs


# -- the planner on synthetic memory curves ----------------------------------------------------


def test_choose_chunk_affine_takes_the_largest_chunk_within_budget():
    calls = []

    def temp(c):
        calls.append(c)
        return 10_000 + 100 * c

    plan = _search.choose_chunk(temp, n=100_000, budget=1_010_000)
    assert plan.compiled_bytes <= 1_010_000
    assert plan.compiled_bytes == temp(plan.chunk)
    # the largest chunk within budget is 10_000, a divisor of n: found exactly
    assert plan.chunk == 10_000
    assert len(calls) <= 8  # whole axis, two probes, few candidates (+1 recheck above)


def test_choose_chunk_whole_axis_fits_means_no_chunking():
    plan = _search.choose_chunk(lambda c: 8 * c, n=1000, budget=10_000)
    assert plan.chunk is None and plan.compiled_bytes == 8000 and len(plan.probes) == 1


def test_choose_chunk_non_affine_stays_within_budget():
    # remainder chunks cost extra memory, as XLA's buffer assignment may not share them
    def temp(c):
        rem = 10_000 % c
        return 5_000 + 40 * c + (30 * rem if rem else 0)

    for budget in (20_000, 60_000, 150_000):
        plan = _search.choose_chunk(temp, n=10_000, budget=budget)
        assert temp(plan.chunk) <= budget
        best = max(c for c in range(1, 5001) if temp(c) <= budget)
        assert plan.chunk >= 0.5 * best, (budget, plan, best)


def test_choose_chunk_budget_too_small_raises_with_the_least_memory():
    with pytest.raises(ValueError, match=r"memory_budget.*too small.*chunk_size=1\b"):
        _search.choose_chunk(lambda c: 1000 + c, n=100, budget=500)


def test_choose_chunk_halving_measures_the_chunk_the_loop_runs():
    """Halving from the smallest chunk tried (75 of 1200) asks for 37, which the chunk plan runs
    as 30 (a divisor of 1200): it is measured, and taken, as 30 (it used to raise KeyError)."""
    plan = _search.choose_chunk(lambda c: 10**6 if c > 40 else 100 + c, n=1200, budget=140)
    assert plan.chunk == 30 and plan.compiled_bytes == 130 and plan.probes[-1] == (30, 130)


def test_choose_chunk_throughput_cap():
    temp = lambda c: 1000 + 10 * c
    plan = _search.choose_chunk(temp, n=100_000, budget=10**9, cap=101_000)
    assert plan.chunk == 10_000 and plan.budget == 10**9 and plan.cap == 101_000
    # nothing fits the cap but something fits the budget: the least-memory chunk, no error
    plan = _search.choose_chunk(lambda c: 50_000 + c, n=1000, budget=60_000, cap=10_000)
    assert plan.chunk is not None and plan.compiled_bytes <= 60_000
    assert _memory.throughput_cap() == chunkop.settings().cpu_temp_cap  # the tests run on CPU


def test_default_budget_is_a_fraction_of_free_memory():
    free = _memory.free_memory()
    assert free > 0
    budget = _memory.default_budget()
    # rounded down to 3 significant bits: within (3/4, 1] of the fraction (free memory moves a little
    # between the two reads)
    fraction = chunkop.settings().budget_fraction
    assert 0.7 * fraction * free < budget <= 1.05 * fraction * free
    assert bin(budget).rstrip("0").count("1") <= 3  # few significant bits: stable from call to call


def test_default_budget_rounding(monkeypatch):
    for free, expected in [(23_000_000_000, 10 * 2**30), (2 * 2**30, 2**30), (3, 1), (2**20 + 5, 2**19)]:
        monkeypatch.setattr(_memory, "free_memory", lambda device=None, free=free: free)
        assert _memory.default_budget() == expected, (free, _memory.default_budget())


def test_auto_plans_with_the_default_budget_are_cached(monkeypatch):
    """The default budget moves with free memory; within the rounding, plans are reused."""
    frees = iter([8_000_000_000 + 4096 * k for k in range(100)])
    monkeypatch.setattr(_memory, "free_memory", lambda device=None: next(frees))
    f = chunkop.vmap(jnp.sin, chunk_size="auto")
    x = jnp.ones((3000, 4))
    f(x)
    first = f.last_plan
    f(x)
    assert f.last_plan is first
    rows = jnp.arange(3000) % 17
    xs = jax.ShapeDtypeStruct((17,), jnp.float32)
    A = chunkop.RowOperator(lambda r, x: 2.0 * x[r], rows, xs)  # chunk_size="auto" by default
    B = chunkop.RowOperator(lambda r, x: 2.0 * x[r], rows, xs)
    assert A.budget_plan is not None and B.budget_plan is A.budget_plan
    C = chunkop.RowOperator(lambda r, x: 3.0 * x[r] ** 1, rows, xs)  # another row_fn: planned anew
    assert C.budget_plan is not A.budget_plan


# -- chunkop.vmap / sum with chunk_size="auto" -------------------------------------------------


def test_vmap_auto_grad_memory_within_budget_and_values(mlp_data):
    w, xs = mlp_data
    budget = 1 * MiB
    f = chunkop.vmap(mlp, in_axes=(None, 0), chunk_size="auto", memory_budget=budget)
    ref = jax.vmap(mlp, (None, 0))(w, xs)
    assert_tree_allclose(f(w, xs), ref, n_terms=MLP_TERMS)
    plan = f.last_plan
    assert plan is not None and plan.chunk is not None and plan.mode == "grad"
    assert plan.compiled_bytes <= budget

    # independently: the user's grad program at the chosen chunk fits the budget (+10%)
    loss = lambda w, x: jnp.sum(chunkop.vmap(mlp, (None, 0), chunk_size=plan.chunk)(w, x) ** 2)
    assert temp_bytes(jax.grad(loss), w, xs) <= 1.1 * budget
    assert temp_bytes(chunkop.vmap(mlp, (None, 0), chunk_size=plan.chunk), w, xs) <= 1.1 * budget
    g = jax.grad(lambda w, x: jnp.sum(f(w, x) ** 2))(w, xs)
    gref = jax.grad(lambda w: jnp.sum(jax.vmap(mlp, (None, 0))(w, xs) ** 2))(w)
    scale = float(jnp.abs(gref).max())  # float32 sums of ~4000 terms in another order
    assert_tree_allclose(g, gref, rtol=1e-4, atol=1e-5 * scale)

    # near the largest chunk that fits: the largest fitting power of two is at most 2x bigger
    def grad_temp(c):
        return temp_bytes(jax.grad(lambda w, x: jnp.sum(chunkop.vmap(mlp, (None, 0), chunk_size=c)(w, x) ** 2)), w, xs)

    p = 2 ** int(np.log2(plan.chunk))
    assert grad_temp(4 * p) > budget, "a 4x larger chunk fits too: the plan is far from the largest"


def test_vmap_auto_plan_is_cached_per_signature(mlp_data):
    w, xs = mlp_data
    f = chunkop.vmap(mlp, in_axes=(None, 0), chunk_size="auto", memory_budget=MiB)
    f(w, xs)
    first = f.last_plan
    g = chunkop.vmap(mlp, in_axes=(None, 0), chunk_size="auto", memory_budget=MiB)  # a new wrapper
    g(w, xs)
    assert g.last_plan is first  # same traced signature: the plan is reused, nothing recompiled
    g(w, xs[:2048])
    assert g.last_plan is not first and g.last_plan.size == 2048
    assert chunkop.plan(g, w, xs) is first


def test_vmap_auto_whole_axis_fits_is_plain_vmap(mlp_data):
    w, xs = mlp_data
    f = chunkop.vmap(mlp, in_axes=(None, 0), chunk_size="auto", memory_budget=1 << 30)
    plan = chunkop.plan(f, w, xs)
    assert plan.chunk is None
    assert "scan" not in primitive_names(jax.make_jaxpr(f)(w, xs))
    assert_tree_allclose(f(w, xs), jax.vmap(mlp, (None, 0))(w, xs), n_terms=MLP_TERMS)


def test_sum_auto_under_hvp_plans_for_hvp(mlp_data):
    w, xs = mlp_data
    budget = 4 * MiB
    s = chunkop.sum(mlp, (None, 0), chunk_size="auto", memory_budget=budget)
    per_example = jax.vmap(mlp, (None, 0))(w, xs)
    tol = _sum_tolerance(per_example)  # a sum over the 4096 examples, each of MLP_TERMS-long sums
    assert_tree_allclose(s(w, xs), per_example.sum(), n_terms=tol["n_terms"] + MLP_TERMS, condition=tol["condition"])
    assert s.last_plan.mode == "grad"
    v = jnp.ones_like(w) / 64
    hvp = jax.jvp(jax.grad(lambda w: s(w, xs)), (w,), (v,))[1]
    assert s.last_plan.mode == "hvp" and s.last_plan.compiled_bytes <= budget
    ref = jax.jvp(jax.grad(lambda w: jax.vmap(mlp, (None, 0))(w, xs).sum()), (w,), (v,))[1]
    assert_tree_allclose(hvp, ref, rtol=1e-4, atol=1e-4)
    chunk = s.last_plan.chunk
    hvp_prog = lambda w, x, v: jax.jvp(
        jax.grad(lambda w: chunkop.sum(mlp, (None, 0), chunk_size=chunk)(w, x)), (w,), (v,)
    )[1]
    assert temp_bytes(hvp_prog, w, xs, v) <= 1.1 * budget


def test_map_and_mean_auto():
    xs = jnp.arange(3000.0).reshape(1000, 3)
    tol = _sum_tolerance(jnp.sin(xs).T)  # sums of 3 sines, cancelling
    assert_tree_allclose(
        chunkop.map(lambda x: jnp.sin(x).sum(), xs, chunk_size="auto", memory_budget=MiB), jnp.sin(xs).sum(1), **tol
    )
    assert_tree_allclose(chunkop.map(lambda x: jnp.sin(x).sum(), xs), jnp.sin(xs).sum(1), **tol)  # "auto" by default
    m = chunkop.mean(lambda x: jnp.cos(x), chunk_size="auto", memory_budget=MiB)
    assert_tree_allclose(m(xs), jnp.cos(xs).mean(0), **_sum_tolerance(jnp.cos(xs)))  # over the 1000 examples


def test_jacrev_jacfwd_auto():
    f = lambda x: jnp.tanh(jnp.outer(x, x)).sum(0)
    x = jnp.linspace(0.0, 1.0, 200)
    budget = 2 * MiB
    diag = np.eye(x.size, dtype=bool)  # J[j, j] sums 200 terms (the outer product's transpose); the rest one
    for ours, ref in [
        (chunkop.jacrev(f, chunk_size="auto", memory_budget=budget)(x), jax.jacrev(f)(x)),
        (chunkop.jacfwd(f, chunk_size="auto", memory_budget=budget)(x), jax.jacfwd(f)(x)),
    ]:
        assert_tree_allclose(ours[diag], ref[diag], n_terms=x.size)
        assert_tree_allclose(ours[~diag], ref[~diag])


# -- RowOperator -------------------------------------------------------------------------------


def test_row_operator_auto_memory_within_budget():
    npix, n = 400, 6000
    r = make_los_rows(n, npix)
    rows = {"idx": jnp.stack([r["idx"], (r["idx"] + 7) % npix], 1), "d": r["d"]}

    def row_fn(row, x):
        wts = jnp.exp(-row["d"] / 1000.0) * jnp.array([1.0, 0.5])
        return jnp.sum(wts * x[row["idx"]])

    xs = jax.ShapeDtypeStruct((npix,), jnp.float32)
    dense = chunkop.RowOperator(row_fn, rows, xs, chunk_size=n).as_matrix()
    budget = 96 * 1024  # the unchunked programs need ~140 KiB, chunk 54 ~50 KiB
    A = chunkop.RowOperator(row_fn, rows, xs, chunk_size="auto", memory_budget=budget)
    plan = chunkop.plan(A)
    assert plan is chunkop.plan(A.T) and plan.chunk == A.chunk_size < n and plan.compiled_bytes <= budget
    x = jnp.linspace(-1.0, 1.0, npix)
    y = jnp.linspace(0.0, 1.0, n)
    nonzero = np.asarray(dense) != 0  # a row sums its 2 pixels; a pixel the rows through it
    assert_tree_allclose(A.mv(x), dense @ x, n_terms=int(nonzero.sum(1).max()))
    assert_tree_allclose(A.T.mv(y), dense.T @ y, n_terms=int(nonzero.sum(0).max()))
    # independent measurements of the programs a user runs
    assert temp_bytes(lambda A, x: A.mv(x), A, x) <= 1.1 * budget
    assert temp_bytes(lambda A, y: A.T.mv(y), A, y) <= 1.1 * budget
    # the VJP of mv (what a gradient through A pulls back; the surrounding loss's own n-sized
    # intermediates, e.g. A x and its cotangent, are the user's program, not the operator's)
    assert temp_bytes(lambda A, x, ct: jax.vjp(lambda x: A.mv(x), x)[1](ct), A, x, y) <= 1.1 * budget
    big = chunkop.RowOperator(row_fn, rows, xs, chunk_size="auto", memory_budget=1 << 30)
    assert chunkop.plan(big).chunk is None and big.chunk_size == n


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 0, "1GB", float("nan"), True])
def test_bad_memory_budget(bad):
    with pytest.raises((TypeError, ValueError), match="memory_budget"):
        chunkop.vmap(jnp.sin, chunk_size="auto", memory_budget=bad)


def test_bad_chunk_size_string():
    with pytest.raises(TypeError, match=r"chunk_size.*\"auto\", got 'automatic'"):
        chunkop.vmap(jnp.sin, chunk_size="automatic")
    with pytest.raises(TypeError, match="RowOperator: `chunk_size`"):
        chunkop.RowOperator(lambda r, x: r * x[0], jnp.ones(3), jnp.zeros(2), chunk_size="max")


def test_plan_of_a_non_auto_transform_raises():
    with pytest.raises(TypeError, match="auto"):
        chunkop.plan(chunkop.vmap(jnp.sin, chunk_size=4), jnp.zeros(10))
    with pytest.raises(TypeError, match="auto"):
        chunkop.plan(chunkop.RowOperator(lambda r, x: r * x[0], jnp.ones(3), jnp.zeros(2), chunk_size=2))


def test_budget_too_small_is_a_clear_error(mlp_data):
    w, xs = mlp_data
    f = chunkop.vmap(mlp, in_axes=(None, 0), chunk_size="auto", memory_budget=1000)
    with pytest.raises(ValueError, match=r"memory_budget.*too small"):
        f(w, xs)


def test_choose_chunk_large_axis_skips_the_whole_compile_and_never_compiles_a_loop_twice():
    """First use: each probe is a compile. At 131072 rows a 16 MiB cap is reached in 3 probes
    (256, 1024, 4096: within 50% of the cap; 80% of a user's budget), not 8 (the whole axis first, then 4096 three times
    as asked-for chunks 4369, ... that the divisor-aware plan runs as 4096)."""
    calls = []

    def temp(c):
        calls.append(c)
        return 3400 * c + 20_000

    plan = _search.choose_chunk(temp, n=131072, budget=10 * 2**30, cap=16 * 2**20)
    assert 131072 not in calls  # predicted far over the cap: never compiled whole
    assert len(calls) == len(set(calls)) <= 4, calls
    assert 0.5 * 16 * 2**20 <= plan.compiled_bytes <= 16 * 2**20
    # a user's budget of 16 MiB (no cap) is filled to within 80%
    plan = _search.choose_chunk(temp, n=131072, budget=16 * 2**20)
    assert 0.8 * 16 * 2**20 <= plan.compiled_bytes <= 16 * 2**20
    # and a large axis predicted to fit is compiled whole, and taken
    calls.clear()
    assert _search.choose_chunk(temp, n=131072, budget=2**30).chunk is None
    assert calls[-1] == 131072


def test_probe_compiles_at_backend_opt_level_0_measure_the_same_temp():
    """Planning probes compile with LLVM at -O0 on CPU (buffer assignment runs before code
    generation): the temp size must equal the default compile's, for a chunk loop and its VJP."""
    assert _memory._PROBE_OPTIONS.get("cpu")
    w = jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)
    f = chunkop.vmap(lambda x: jnp.tanh(w @ jnp.tanh(w @ x)).sum(), chunk_size=300)
    x = jax.ShapeDtypeStruct((2000, 64), jnp.float32)
    for prog in (f, jax.grad(lambda x: f(x).sum())):
        lowered = jax.jit(prog).lower(x)
        default = lowered.compile().memory_analysis().temp_size_in_bytes
        assert default > 0 and _memory._compiled_temp(prog, x) == default


# -- the compile-free throughput plan (CPU, default budget) --------------------------------------


def _cpu_default_case(monkeypatch):
    monkeypatch.setattr(_memory, "free_memory", lambda device=None: 16 * 2**30)  # default budget 8 GiB
    return chunkop.settings().cpu_temp_cap


def test_cpu_default_auto_plan_compiles_nothing_and_its_chunk_fits_the_cap(monkeypatch, mlp_data):
    """On CPU with the default budget the cap binds far below it: the chunk comes from the jaxpr
    estimate (no compile, issue #16 first use). The compiled temp memory at that chunk, measured
    here independently, must lie within the cap (the estimate errs high), and not far below it."""
    cap = _cpu_default_case(monkeypatch)
    w, _ = mlp_data
    xs = jnp.zeros((131072, 64), jnp.float32)
    f = chunkop.vmap(lambda x: mlp(w, x), chunk_size="auto")
    with jax.ensure_compile_time_eval():
        plan = chunkop.plan(f, xs)
    assert plan.compiled_bytes is None and plan.probes == () and plan.chunk is not None
    measured = _memory.program_temp_bytes(chunkop.vmap(lambda x: mlp(w, x), chunk_size=plan.chunk), [xs], "grad")
    assert cap / 16 <= measured <= cap, (plan, measured)
    # the users' LOS operator: every kernel and VJP measured at the chosen chunk
    rows = make_los_rows(131072, 3072)
    x_struct = jax.ShapeDtypeStruct((3072, 96), jnp.float32)
    edges = jnp.geomspace(40.0, 1700.0, 97)

    def row_fn(r, x):
        b = edges[1:]
        w = jnp.exp(-(r["d"] - b) / (r["d"] * r["s"] * b))
        return jnp.dot(w, x[r["idx"]])

    A = chunkop.RowOperator(row_fn, rows, x_struct)
    assert A.budget_plan.compiled_bytes is None and A.budget_plan.probes == ()
    measured = _operator_plan.rows_temp_bytes(row_fn, rows, x_struct, A.chunk_size)
    assert cap / 16 <= measured <= cap, (A.budget_plan, measured)


def test_cpu_default_auto_plan_measures_when_it_cannot_estimate(monkeypatch):
    """A ``while`` loop (unknown trip count) has no estimate: the plan is compiled and measured."""
    _cpu_default_case(monkeypatch)
    f = chunkop.vmap(
        lambda x: jax.lax.fori_loop(0, x.astype(jnp.int32).sum() % 3, lambda i, v: v * 2, x), chunk_size="auto"
    )
    plan = chunkop.plan(f, jnp.ones((20000, 8)))
    assert plan.probes and (plan.chunk is None or plan.compiled_bytes is not None)


def test_cpu_default_auto_plan_does_not_count_unmapped_work_per_element(monkeypatch):
    """Values ``fun`` computes from its constants alone (a 512 x 512 matrix product here) stay
    unbatched under ``vmap``: once per chunk, not per element. Counting them per element would
    shrink the chunk to a handful of elements (1 MiB each) and make the loop thousands of steps."""
    _cpu_default_case(monkeypatch)
    w = jnp.linspace(-1.0, 1.0, 512 * 512).reshape(512, 512)
    f = chunkop.vmap(lambda x: jnp.tanh((w @ w)[:16, :16] @ x), chunk_size="auto")
    plan = chunkop.plan(f, jnp.ones((65536, 16)))
    assert plan.compiled_bytes is None and (plan.chunk is None or plan.chunk >= 4096), plan


def test_program_not_differentiable_is_measured_forward_only():
    """A program JAX cannot differentiate (a while loop with a traced trip count) is planned on
    its forward program: the derivative's trace fails with a typed error, not one matched by its
    text; a program whose forward trace fails raises its own error."""
    f = lambda x: jax.lax.fori_loop(0, x.astype(jnp.int32).sum() % 3, lambda i, v: v * 2, x)
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32)
    with pytest.raises(_memory.NotDifferentiable, match=r"while_loop|differentiat"):
        list(_memory._derivative_temps(f, [x], jax.eval_shape(f, x), "grad"))
    assert _memory.program_temp_bytes(f, [x], "grad") == _memory.program_temp_bytes(f, [x], "forward")
    with pytest.raises(_memory.NotDifferentiable):  # a caller that measures another way instead
        _memory.program_temp_bytes(f, [x], "grad", forward_only_ok=False)

    def broken(x):
        raise RuntimeError("fun's own error")

    with pytest.raises(RuntimeError, match="fun's own error"):
        _memory.program_temp_bytes(broken, [x], "grad")
