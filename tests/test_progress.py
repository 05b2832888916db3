"""``progress=`` on chunkop.vmap / map / sum / mean: reports per chunk from inside the compiled
loop (eagerly, under jit, grad and vmap), results and compiled temp memory unchanged, and
nothing at all added to the program when progress is off."""

from __future__ import annotations

import builtins
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import primitive_names

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
    out = fn(W, x)
    jax.effects_barrier()
    n_chunks = -(-n // 5)
    assert rec.calls == [(k, n_chunks) for k in range(1, n_chunks + 1)]
    np.testing.assert_array_equal(out, ref(W, x))  # bit for bit: the chunks are computed as before
    fn(W, x)  # a second call reports again
    jax.effects_barrier()
    assert rec.calls == 2 * [(k, n_chunks) for k in range(1, n_chunks + 1)]


def test_under_grad_the_forward_loop_reports_once():
    rec = Recorder()
    loss = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec)
    g = jax.jit(jax.grad(loss))(W, X)
    jax.effects_barrier()
    assert rec.calls == [(k, 5) for k in range(1, 6)]  # the backward recomputation does not report
    ref = jax.jit(jax.grad(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5)))(W, X)
    np.testing.assert_array_equal(g, ref)


def test_under_vmap_counts_repeat_per_batch_element():
    rec = Recorder()
    f = chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=rec)
    xs = jnp.stack([X, 2 * X, 3 * X])
    out = jax.vmap(f, in_axes=(None, 0))(W, xs)
    jax.effects_barrier()
    assert sorted(set(rec.calls)) == [(k, 5) for k in range(1, 6)]
    assert len(rec.calls) == 15
    np.testing.assert_allclose(out, jax.vmap(lambda x: jax.vmap(_mlp, (None, 0))(W, x).sum())(xs), rtol=1e-5)


def test_no_report_when_not_chunked():
    rec = Recorder()
    chunkop.vmap(jnp.sin, chunk_size=None, progress=rec)(jnp.ones(10))
    chunkop.vmap(jnp.sin, chunk_size=10, progress=rec)(jnp.ones(10))
    jax.effects_barrier()
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
            assert "debug_callback" not in primitive_names(jaxpr)
            hlo[off] = jax.jit(fn).lower(W, X).as_text()
        assert hlo[None] == hlo[False]
        assert "callback" not in jax.jit(default).lower(X).as_text()
    on = jax.make_jaxpr(_transforms(Recorder())["sum"])(W, X)
    assert "debug_callback" in primitive_names(on)


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


def test_bad_progress_argument():
    with pytest.raises(TypeError, match="`progress` must be"):
        chunkop.vmap(jnp.sin, chunk_size=2, progress="yes")
    with pytest.raises(TypeError, match=r"chunkop\.sum: `progress`"):
        chunkop.sum(jnp.sin, chunk_size=2, progress=3)
    with pytest.raises(TypeError, match=r"chunkop\.map: `progress`"):
        chunkop.map(jnp.sin, jnp.ones(4), chunk_size=2, progress=1.5)


def _without_tqdm(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_plain_fallback_bar(monkeypatch):
    _without_tqdm(monkeypatch)
    stream = io.StringIO()
    bar = _progress.ProgressBar("demo", file=stream)
    for k in (1, 1, 2, 3, 3, 4, 4):  # repeated counts (vmap) are ignored
        bar.update(k, 4)
    bar.update(1, 4)  # a new call of the same loop starts a new line
    assert (
        stream.getvalue()
        == "\rdemo: 1/4 chunks\rdemo: 2/4 chunks\rdemo: 3/4 chunks\rdemo: 4/4 chunks\n\rdemo: 1/4 chunks"
    )


def test_progress_true_writes_k_of_n_to_stderr(monkeypatch, capsys):
    _without_tqdm(monkeypatch)
    f = jax.jit(chunkop.sum(_mlp, in_axes=(None, 0), chunk_size=5, progress=True))
    f(W, X)
    jax.effects_barrier()
    err = capsys.readouterr().err
    assert "chunkop: 1/5 chunks" in err and err.endswith("chunkop: 5/5 chunks\n")


def test_progress_true_with_tqdm(capsys):
    pytest.importorskip("tqdm")
    chunkop.vmap(jnp.sin, chunk_size=3, progress=True)(jnp.ones(10))
    jax.effects_barrier()
    err = capsys.readouterr().err
    assert "4/4" in err and "chunk" in err


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
    np.testing.assert_array_equal(mv(A, x), mv(ref, x))
    np.testing.assert_array_equal(rmv(A, y), rmv(ref, y))
    jax.effects_barrier()
    assert rec.calls == 2 * [(k, 5) for k in range(1, 6)]  # 4 chunks of 5 + a remainder of 3, twice
    assert "debug_callback" not in primitive_names(jax.make_jaxpr(lambda v: ref.mv(v))(x))
    assert "debug_callback" in primitive_names(jax.make_jaxpr(lambda v: A.mv(v))(x))


def test_row_operator_bad_progress_argument():
    with pytest.raises(TypeError, match=r"RowOperator: `progress` must be None, True/False or a callable"):
        _row_operator("yes")
