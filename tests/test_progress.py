"""``progress=`` on chunkop.vmap / map / sum / mean: reports per chunk from inside the compiled
loop (eagerly, under jit, grad, jvp and vmap), at most about ``MAX_REPORTS`` per loop, results
and compiled temp memory unchanged, no forward loop forced under ``jit(grad)``, the host side's
run tracking (unordered reports, shards, repeats), plain log lines when stderr is not a
terminal, and nothing at all added to the program when progress is off. Sharded inputs: see
``tests/test_progress_multidevice.py``."""

from __future__ import annotations

import builtins
import io
import re
import sys
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose, primitive_names

import chunkop
from chunkop import _progress
from chunkop._chunking import make_plan


def _mlp(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w).sum()


W = jnp.full((8, 8), 0.1)
X = jax.random.normal(jax.random.key(0), (23, 8))  # 23 = 4 chunks of 5 + a remainder of 3


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, k, n):
        assert isinstance(k, int) and isinstance(n, int)
        self.calls.append((k, n))


def _transforms(progress, chunk_size=5):
    return {
        "vmap": lambda w, x: chunkop.vmap(_mlp, in_axes=(None, 0), chunk_size=chunk_size, progress=progress)(w, x),
        "sum": lambda w, x: chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=chunk_size, progress=progress)(w, x),
        "mean": lambda w, x: chunkop.mean(_mlp, in_axes=(None, 0), chunk_size=chunk_size, progress=progress)(w, x),
        "map": lambda w, x: chunkop.map(lambda xi: _mlp(w, xi), x, chunk_size=chunk_size, progress=progress),
    }


@pytest.mark.parametrize("name", ["vmap", "sum", "mean", "map"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("n", [23, 20], ids=["remainder", "divisible"])
def test_reports_every_chunk_in_order_and_results_are_unchanged(name, jit, n):
    rec = Recorder()
    x = X[:n]
    fn = _transforms(rec)[name]
    ref = _transforms(None)[name]
    if jit:
        fn, ref = jax.jit(fn), jax.jit(ref)
    out = jax.block_until_ready(fn(W, x))  # the reports are made by the time the outputs are ready
    n_chunks = -(-n // 5)
    assert rec.calls == [(k, n_chunks) for k in range(1, n_chunks + 1)]
    np.testing.assert_array_equal(out, ref(W, x))  # bit for bit: the chunks are computed as before
    jax.block_until_ready(fn(W, x))  # a second call reports again
    assert rec.calls == 2 * [(k, n_chunks) for k in range(1, n_chunks + 1)]


def test_effects_barrier_waits_for_the_reports():
    rec = Recorder()
    jax.jit(_transforms(rec)["sum"])(W, X)
    jax.effects_barrier()
    assert rec.calls == [(k, 5) for k in range(1, 6)]


def _n_while(fn, *args):
    return len(re.findall(r"\bwhile\(", jax.jit(fn).lower(*args).compile().as_text()))


def test_under_jit_grad_the_backward_loop_reports_once_and_no_forward_loop_is_forced():
    rec = Recorder()
    loss = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec)
    g = jax.block_until_ready(jax.jit(jax.grad(loss))(W, X))
    assert rec.calls == [(k, 5) for k in range(1, 6)]  # the recomputation inside the checkpoint is silent
    plain = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5)
    np.testing.assert_array_equal(g, jax.jit(jax.grad(plain))(W, X))
    # the forward loop's values are dead under grad: reporting must not keep that loop alive
    assert _n_while(jax.grad(loss), W, X) == _n_while(jax.grad(plain), W, X) == 1
    assert _n_while(jax.value_and_grad(loss), W, X) == 2


def test_value_and_grad_reports_the_forward_and_the_backward_loop():
    rec = Recorder()
    loss = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec)
    v, g = jax.block_until_ready(jax.jit(jax.value_and_grad(loss))(W, X))
    assert sorted(rec.calls) == sorted(2 * [(k, 5) for k in range(1, 6)])  # two runs
    ref = jax.jit(jax.value_and_grad(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5)))(W, X)
    np.testing.assert_array_equal(v, ref[0])
    np.testing.assert_array_equal(g, ref[1])


@pytest.mark.parametrize("name", ["vmap", "sum"])
def test_jvp_reports_the_forward_loop_once(name):
    rec = Recorder()
    fn, plain = _transforms(rec)[name], _transforms(None)[name]
    out, tan = jax.block_until_ready(jax.jit(lambda w, t: jax.jvp(lambda w: fn(w, X), (w,), (t,)))(W, W))
    assert rec.calls == [(k, 5) for k in range(1, 6)]
    ref = jax.jit(lambda w, t: jax.jvp(lambda w: plain(w, X), (w,), (t,)))(W, W)
    np.testing.assert_array_equal(out, ref[0])
    np.testing.assert_array_equal(tan, ref[1])


def test_hessian_vector_product_is_unchanged():
    rec = Recorder()

    def hvp(loss):
        return jax.jit(lambda w, v: jax.jvp(jax.grad(lambda w: loss(w, X)), (w,), (v,))[1])

    got = jax.block_until_ready(hvp(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec))(W, W))
    np.testing.assert_array_equal(got, hvp(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5))(W, W))
    assert rec.calls[-1] == (5, 5) and sorted(set(rec.calls)) == [(k, 5) for k in range(1, 6)]


def test_linear_transpose_reports_from_the_transposed_loop():
    rec = Recorder()
    f = chunkop.vmap(lambda w, x: x @ w, in_axes=(None, 0), chunk_size=5, progress=rec)
    ct = jnp.ones((23, 8))
    (got,) = jax.block_until_ready(jax.linear_transpose(lambda w: f(w, X), W)(ct))
    assert rec.calls == [(k, 5) for k in range(1, 6)]
    # got[i, j] sums X[n, i] over the 23 examples: cancelling, so the condition of the worst sum
    cancel = float(jnp.max(jnp.abs(X).sum(0)) / jnp.max(jnp.abs(X.sum(0))))
    assert_tree_allclose(got, X.T @ ct, n_terms=X.shape[0], condition=cancel)


def test_many_chunks_report_at_a_bounded_rate_and_results_do_not_depend_on_chunk_size():
    x = jax.random.normal(jax.random.key(2), (1000, 8))
    ref = jax.vmap(_mlp, (None, 0))(W, x)
    for chunk in (1, 3, 7, 64, 999):
        rec = Recorder()
        out = jax.block_until_ready(chunkop.vmap(_mlp, in_axes=(None, 0), chunk_size=chunk, progress=rec)(W, x))
        # the taps may change XLA's fusion of the chunk (jaxlib 0.12: 1 ulp of tanh), not the sums
        assert_tree_allclose(out, chunkop.vmap(_mlp, in_axes=(None, 0), chunk_size=chunk)(W, x), n_terms=8)
        assert_tree_allclose(out, ref, n_terms=8)  # per example: dot products and a sum of 8
        plan = make_plan(1000, chunk)
        n = plan.n_full + (plan.rem > 0)
        ks = [k for k, _ in rec.calls]
        assert all(m == n for _, m in rec.calls), (chunk, rec.calls)
        assert ks == sorted(set(ks)) and ks[-1] == n, (chunk, ks)  # increasing, ending at n
        assert len(ks) <= _progress.MAX_REPORTS + 3, (chunk, len(ks))  # first, last, remainder + strides
        if plan.n_full <= _progress.MAX_REPORTS:
            assert ks == list(range(1, n + 1))
    # the same under grad (the backward loop)
    rec = Recorder()
    loss = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=3, progress=rec)
    jax.block_until_ready(jax.jit(jax.grad(loss))(W, x))
    ks = [k for k, _ in rec.calls]
    assert ks == sorted(set(ks)) and ks[-1] == 334 and len(ks) <= _progress.MAX_REPORTS + 3, ks


def test_report_stride():
    assert _progress.report_stride(1) == 1
    assert _progress.report_stride(_progress.MAX_REPORTS) == 1
    assert _progress.report_stride(_progress.MAX_REPORTS + 1) == 2
    for n_full in range(1, 400):
        s = _progress.report_stride(n_full)
        chosen = sorted({k for k in range(1, n_full + 1) if k == 1 or k == n_full or k % s == 0})
        assert len(chosen) <= _progress.MAX_REPORTS + 2
        assert chosen[0] == 1 and chosen[-1] == n_full
        assert max(np.diff(chosen), default=0) <= s


def test_under_vmap_reports_once_per_chunk():
    rec = Recorder()
    f = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec)
    xs = jnp.stack([X, 2 * X, 3 * X])
    out = jax.block_until_ready(jax.vmap(f, in_axes=(None, 0))(W, xs))
    assert rec.calls == [(k, 5) for k in range(1, 6)]  # the tap is batched, not repeated per element
    per_example = jax.vmap(jax.vmap(_mlp, (None, 0)), (None, 0))(W, xs)  # (3, 23): summed over axis 1
    cancel = float(jnp.max(jnp.abs(per_example).sum(1)) / jnp.max(jnp.abs(per_example.sum(1))))
    assert_tree_allclose(out, per_example.sum(1), n_terms=X.shape[0], condition=cancel)
    g = jax.block_until_ready(jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(W, xs))
    assert rec.calls[5:] == [(k, 5) for k in range(1, 6)]
    plain = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5)
    assert_tree_allclose(g, jax.jit(jax.vmap(jax.grad(plain), in_axes=(None, 0)))(W, xs), n_terms=X.shape[0])


def test_no_report_when_not_chunked():
    rec = Recorder()
    chunkop.vmap(jnp.sin, chunk_size=None, progress=rec)(jnp.ones(10))
    jax.block_until_ready(chunkop.vmap(jnp.sin, chunk_size=10, progress=rec)(jnp.ones(10)))
    assert rec.calls == []


def test_progress_off_adds_nothing_to_the_program():
    # the hook is the identity when off: the scan is built from the very same objects
    plan = make_plan(23, 5)
    xs, body = object(), object()
    for off in (None, False):
        assert _progress.progress_hook(plan, off).scan(xs, body) == (xs, body)
        out = object()
        assert _progress.progress_hook(plan, off).remainder(out) is out
    for name in ("vmap", "sum", "map"):
        default = {
            "vmap": lambda x: chunkop.vmap(jnp.sin, chunk_size=5)(x),
            "sum": lambda x: chunkop.sum(jnp.sin, chunk_size=5)(x),
            "map": lambda x: chunkop.map(jnp.sin, x, chunk_size=5),
        }[name]
        hlo = {}
        for off in (None, False):
            fn = _transforms(off)[name]
            jaxpr = jax.make_jaxpr(fn)(W, X)
            assert "chunkop_progress" not in primitive_names(jaxpr)
            hlo[off] = jax.jit(fn).lower(W, X).as_text()
        assert hlo[None] == hlo[False]
        assert "callback" not in jax.jit(default).lower(X).as_text()
    on = jax.make_jaxpr(_transforms(Recorder())["sum"])(W, X)
    assert "chunkop_progress" in primitive_names(on)


def test_compiled_temp_memory_is_unchanged():
    """Progress adds only the ``n_full`` int32 chunk counts (and a few scalars) to temp memory."""
    w = jnp.full((64, 64), 0.01)
    x = jax.random.normal(jax.random.key(1), (10_000, 64))
    n_full = 10_000 // 512
    for make in (chunkop.sum, chunkop.vmap):
        temps = {}
        for label, prog in (("off", None), ("on", lambda k, n: None)):
            f = make(_mlp, in_axes=(None, 0), chunk_size=512, progress=prog)
            g = jax.grad(f) if make is chunkop.sum else f
            temps[label] = jax.jit(g).lower(w, x).compile().memory_analysis().temp_size_in_bytes
        assert temps["off"] > 0
        assert temps["off"] <= temps["on"] <= temps["off"] + 4 * n_full + 1024, (make.__name__, temps)


def _without_tqdm(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_not_a_terminal(monkeypatch):
    _without_tqdm(monkeypatch)
    stream = io.StringIO()
    bar = _progress.ProgressBar("demo", file=stream, min_interval=0.0)
    for k in (1, 1, 2, 3, 3, 4, 4):  # repeated counts are ignored
        bar.update(k, 4)
    bar.update(1, 4)  # a new call of the same loop starts again
    assert stream.getvalue() == "".join(f"demo: {k}/4 chunks\n" for k in (1, 2, 3, 4, 1))
    # at a bounded rate: within min_interval only the first line and the final one
    stream = io.StringIO()
    bar = _progress.ProgressBar("demo", file=stream, min_interval=3600.0)
    for k in range(1, 101):
        bar.update(k, 100)
    bar.update(1, 100)
    assert stream.getvalue() == "demo: 1/100 chunks\ndemo: 100/100 chunks\n"
    assert "\r" not in stream.getvalue()


def test_carriage_return_line_on_a_terminal(monkeypatch):
    _without_tqdm(monkeypatch)
    stream = FakeTTY()
    bar = _progress.ProgressBar("demo", file=stream, min_interval=0.0)
    for k in (1, 2, 3, 4):
        bar.update(k, 4)
    assert stream.getvalue() == "\rdemo: 1/4 chunks\rdemo: 2/4 chunks\rdemo: 3/4 chunks\rdemo: 4/4 chunks\n"
    stream = FakeTTY()
    bar = _progress.ProgressBar("demo", file=stream, min_interval=3600.0)
    for k in (1, 2, 3):
        bar.update(k, 4)
    bar.update(1, 4)  # an unfinished run is ended by a newline (with its last count) before the next
    assert stream.getvalue() == "\rdemo: 1/4 chunks\rdemo: 3/4 chunks\n\rdemo: 1/4 chunks"


def test_progress_true_writes_plain_lines_to_a_non_terminal_stderr(monkeypatch, capsys):
    _without_tqdm(monkeypatch)
    f = jax.jit(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=True))
    jax.block_until_ready(f(W, X))
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.startswith("chunkop: 1/5 chunks\n") and err.endswith("chunkop: 5/5 chunks\n")
    jax.block_until_ready(jax.jit(jax.grad(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=True)))(W, X))
    err = capsys.readouterr().err
    assert err.endswith("chunkop (backward): 5/5 chunks\n") and "\r" not in err


class FakeTqdm:
    """Stands in for tqdm (an optional dependency, maybe not installed): records what it is told."""

    made: typing.ClassVar[list] = []

    def __init__(self, total, desc, unit, file, leave):
        self.total, self.desc, self.file, self.n, self.closed = total, desc, file, 0, False
        FakeTqdm.made.append(self)

    def update(self, d):
        self.n += d

    def close(self):
        self.closed = True


def _fake_tqdm(monkeypatch):
    FakeTqdm.made = []
    tqdm_mod, auto_mod = types.ModuleType("tqdm"), types.ModuleType("tqdm.auto")
    auto_mod.tqdm = FakeTqdm
    tqdm_mod.auto = auto_mod
    monkeypatch.setitem(sys.modules, "tqdm", tqdm_mod)
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto_mod)


def test_tqdm_on_a_terminal_plain_lines_otherwise(monkeypatch, capsys):
    _fake_tqdm(monkeypatch)
    stream = FakeTTY()
    bar = _progress.ProgressBar("demo", file=stream)
    for k in (1, 3, 4):
        bar.update(k, 4)
    bar.update(2, 4)
    assert [(b.total, b.desc, b.n, b.closed, b.file is stream) for b in FakeTqdm.made] == [
        (4, "demo", 4, True, True),
        (4, "demo", 2, False, True),
    ]
    assert stream.getvalue() == ""  # tqdm draws, not the plain line
    FakeTqdm.made = []
    jax.block_until_ready(chunkop.vmap(jnp.sin, chunk_size=3, progress=True)(jnp.ones(10)))
    err = capsys.readouterr().err  # pytest's stderr is not a terminal: plain lines, no tqdm
    assert FakeTqdm.made == [] and err.endswith("chunkop: 4/4 chunks\n") and "\r" not in err


# -- the host side's run tracking -----------------------------------------------------------------


def _run(n_full, rem, n_shards=1, backward=False):
    calls = []
    return _progress._Run(n_full, rem, n_shards, backward, lambda k, n: calls.append(k)), calls


def test_run_tracking_unordered_remainder_and_new_runs():
    run, calls = _run(4, True)
    for chunk in (5, 1, 2, 3, 4):  # the remainder (chunk 5) reported before the scan's chunks
        run.receive(chunk, 0)
    assert calls == [1, 2, 3, 4, 5]  # chunks done: the remainder counts as soon as it reports
    for chunk in (1, 2, 5, 3, 4):  # the next call of the loop
        run.receive(chunk, 0)
    assert calls == 2 * [1, 2, 3, 4, 5]
    run.receive(1, 0)
    run.receive(2, 0)
    run.receive(2, 0)  # a repeat
    run.receive(1, 0)  # went back without finishing: a new run
    assert calls[10:] == [1, 2, 1]


def test_run_tracking_backward():
    run, calls = _run(4, True, backward=True)
    for chunk in (5, 4, 3, 2, 1):  # the remainder's backward first, then the scan's in reverse
        run.receive(chunk, 0)
    for chunk in (4, 3, 5, 2, 1):
        run.receive(chunk, 0)
    assert calls == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]


def test_run_tracking_shards():
    run, calls = _run(3, False, n_shards=2)
    for chunk, shard in [(1, 0), (2, 0), (1, 1), (3, 0), (2, 1)]:
        run.receive(chunk, shard)
    assert calls == [1, 2]  # the slowest shard's count
    run.receive(1, 0)  # shard 0 already finished this run: its next run's report waits
    run.receive(3, 1)
    assert calls == [1, 2, 3]
    for chunk, shard in [(1, 1), (1, 0), (2, 0), (2, 1), (3, 1), (3, 0)]:
        run.receive(chunk, shard)
    assert calls == [1, 2, 3, 1, 2, 3]


# -- RowOperator: every kernel reports its chunks ------------------------------------------------


def _row_operator(progress):
    rows = {"i": jnp.arange(23) % 5, "w": jnp.linspace(0.5, 2.0, 23)}
    return chunkop.RowOperator(
        lambda r, x: r["w"] * x[r["i"]], rows, jax.ShapeDtypeStruct((5,), jnp.float32), chunk_size=5, progress=progress
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_row_operator_kernels_report_and_results_are_unchanged(jit):
    rec = Recorder()
    A, ref = _row_operator(rec), _row_operator(None)
    x, y = jnp.arange(5.0), jnp.ones(23)
    mv = (lambda op, v: op.mv(v)) if not jit else jax.jit(lambda op, v: op.mv(v))
    rmv = (lambda op, v: op.T.mv(v)) if not jit else jax.jit(lambda op, v: op.T.mv(v))
    np.testing.assert_array_equal(mv(A, x), mv(ref, x))  # (a comparison waits for the outputs)
    np.testing.assert_array_equal(rmv(A, y), rmv(ref, y))
    assert rec.calls == 2 * [(k, 5) for k in range(1, 6)]  # 4 chunks of 5 + a remainder of 3, twice
    assert "chunkop_progress" not in primitive_names(jax.make_jaxpr(lambda v: ref.mv(v))(x))
    assert "chunkop_progress" in primitive_names(jax.make_jaxpr(lambda v: A.mv(v))(x))


def test_integer_and_key_outputs_report_and_are_unchanged():
    keys = jax.random.split(jax.random.key(0), 11)
    for fn in (lambda k: jax.random.split(k, 3), lambda k: jax.random.bits(k, (2,)), lambda k: jnp.int32(7)):
        rec = Recorder()
        got = jax.block_until_ready(chunkop.vmap(fn, chunk_size=3, progress=rec)(keys))
        ref = chunkop.vmap(fn, chunk_size=3)(keys)
        if jax.dtypes.issubdtype(ref.dtype, jax.dtypes.prng_key):
            got, ref = jax.random.key_data(got), jax.random.key_data(ref)
        np.testing.assert_array_equal(got, ref)
        assert rec.calls == [(k, 4) for k in range(1, 5)]


def test_pure_callback_fallback(monkeypatch):
    """Without JAX's private callback placement helper, reports go through jax.pure_callback."""
    monkeypatch.setattr(_progress, "_callback_op_sharding", None)
    used = []
    real = jax.pure_callback
    monkeypatch.setattr(jax, "pure_callback", lambda *a, **k: used.append(1) or real(*a, **k))
    rec = Recorder()
    loss = chunkop.sum(lambda w, x: jnp.sin(x @ w).sum(), in_axes=(None, 0), chunk_size=5, progress=rec)
    hlo = jax.jit(loss).lower(W, X).as_text()
    assert hlo.count("python_cpu_callback") >= 2 and used  # the loop's and the remainder's report
    v = jax.block_until_ready(jax.jit(loss)(W, X))
    g = jax.block_until_ready(jax.jit(jax.grad(loss))(W, X))
    assert rec.calls == 2 * [(k, 5) for k in range(1, 6)]
    plain = chunkop.sum(lambda w, x: jnp.sin(x @ w).sum(), in_axes=(None, 0), chunk_size=5)
    np.testing.assert_array_equal(v, jax.jit(plain)(W, X))
    np.testing.assert_array_equal(g, jax.jit(jax.grad(plain))(W, X))
