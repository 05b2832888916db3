"""Feature-interaction matrix (issue #15, item 4): chunkop.vmap against jax.vmap, features combined.

Features tested one at a time hid every bug, so each test here runs one *combination* of

- ``chunk_size``: None / 5 (18 = 3 x 5 + 3: a remainder) / 6 (divides 18) / ``"auto"`` (with a
  small ``memory_budget``, so that it really chunks: ``last_plan.chunk < N`` is asserted). Not
  12 examples in chunks of 5: the plan takes equal chunks when a divisor of the axis lies in
  ``[3/4 chunk, chunk]`` (``_chunking.make_plan``), so 5 on 12 runs three chunks of 4 and no
  remainder (``test_chunk_axis_has_a_remainder`` keeps the axis honest);
- ``progress``: off / a recording callable / ``True`` (once, eager and jit);
- ``axis_name`` collectives: none / axis-size queries (``lax.axis_size``, ``lax.psum`` of an
  unmapped value: the full size ``N`` always) / ``lax.psum`` of a mapped value (refused with a
  ``ValueError`` naming ``psum`` when chunking; exactly ``jax.vmap`` with chunk None, and with
  ``"auto"``, which then does not chunk);
- ``fun``'s body: plain ``jnp.tanh`` / a ``jax.custom_jvp`` / a ``jax.custom_vjp`` function;
- the transform around the call: eager / ``jit`` / ``grad`` (w.r.t. the unmapped and the mapped
  argument) / ``jax.vmap`` of the chunked function / ``jax.hessian``,

and compares the result with ``jax.vmap`` of the same ``fun`` on the same inputs; plus a
``custom_jvp`` closing over a ``jit`` tracer (the unstaged chunk fallback) with progress. Combinations
``jax.vmap`` itself does not support are left out (``jax.hessian`` of a ``custom_vjp``: JAX has
no forward mode for it). Sharded inputs (Auto / Explicit / 2-D meshes, ``spmd_axis_name``) are
checked by ``tests/_interaction_checks.py`` in one subprocess with 4 CPU devices
(``test_sharded``), among them (issue #24) ``fun`` closing over mesh values (a mesh-replicated
array it indexes, a PRNG key folded with mapped data, a sharding constraint, concrete values in
Python control flow and shapes) and ``chunkop.jacrev`` / ``jacfwd`` on an Explicit mesh.

In process, also from issue #24 ("one engine"), each with the axes above where they apply:

- inner ``jax.jit``s at depth (in ``jax.checkpoint``, ``lax.cond``, ``lax.scan``, another jit)
  over a parameter that changes between calls, in ``fun`` and in a ``RowOperator``'s ``row_fn``:
  right values, and nothing compiles after the first call (``CompileCounter``);
- ``jax.linear_transpose`` (and ``lineax``'s ``.T``) of ``chunkop.vmap`` / ``sum`` with a
  remainder chunk, against that of ``jax.vmap``;
- compiled temp memory under an enclosing ``jax.vmap``: a remainder chunk against a dividing
  chunk and the unchunked ``jax.vmap``; ``"auto"`` within its ``memory_budget``.

Combinations that run a code path another default test already runs are marked ``slow`` (run
with ``pytest -m slow``; ``_slow`` and each parametrization's comment here, ``_names`` there say
which and why).

Known failures are marked ``xfail(strict=True)`` with the reason; each has a standalone repro
script under ``/tmp/interaction_repros/`` (see the lead's report for issue #15).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import _interaction_model as _model
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from _device_checks import subprocess_env
from conftest import CompileCounter, assert_tree_allclose, temp_bytes
from jax import lax
from test_trace_inline import ROW_DEPTHS, X_STRUCT, _in_fun, _params, _row_fn

import chunkop
from chunkop import _chunking

N = 18  # mapped axis; one (D, D) intermediate per example (tests/_interaction_model.py)
BUDGET = 4096  # bytes: "auto" plans a chunk < N for the forward/grad program at this size
CHUNKS = [None, 5, 6, "auto"]  # 5: a remainder; 6 divides N
MODES = ["eager", "jit", "grad", "vmap", "hessian"]
BODIES = ["plain", "custom_jvp", "custom_vjp"]

make_fun = functools.partial(_model.make_fun, n=N)
data = functools.partial(_model.data, N)
run = _model.run


def budget_for(mode: str) -> int:
    """``BUDGET`` per example of the enclosing ``jax.vmap`` batch: "auto" divides its budget by
    that batch (2 for ``vmap``, and 2 tangents for ``jax.hessian``'s ``jacfwd``)."""
    return BUDGET * {"vmap": 2, "hessian": 2}.get(mode, 1)


def chunked(f, chunk, mode, **kw):
    budget = budget_for(mode) if chunk == "auto" else None
    return chunkop.vmap(f, in_axes=(None, 0), chunk_size=chunk, memory_budget=budget, **kw)


@functools.cache
def reference(body: str, coll: str | None, mode: str):
    """``jax.vmap`` of ``make_fun(body, coll)`` under ``mode`` (computed once per combination)."""
    kw = {"axis_name": "i"} if coll else {}
    return run(mode, jax.vmap(make_fun(body, coll), in_axes=(None, 0), **kw), *data())


def check_auto_chunked(g, chunk):
    """With "auto" the plan must really chunk (else the test would only test jax.vmap)."""
    if chunk == "auto":
        assert g.last_plan is not None and g.last_plan.chunk is not None and g.last_plan.chunk < N, g.last_plan


def chunk_count(chunk: int, n: int = N) -> int:
    """The chunks a loop over ``n`` in chunks of at most ``chunk`` runs (the remainder one included)."""
    plan = _chunking.make_plan(n, chunk)
    return plan.n_full + (plan.rem > 0)


def expected_chunks(g, chunk) -> int | None:
    """The chunk count reported by progress, or None when not chunking."""
    c = g.last_plan.chunk if chunk == "auto" else chunk
    return None if c is None or c >= N else chunk_count(c)


def test_chunk_axis_has_a_remainder():
    """The matrix's chunk 5 leaves a remainder chunk and 6 divides N, as the axes claim."""
    assert _chunking.make_plan(N, 5)[2:] == (3, 3)
    assert _chunking.make_plan(N, 6)[2:] == (3, 0)


def _cases(bodies, modes, chunk):
    # jax.hessian of a custom_vjp function: jax.vmap fails too (no forward mode): left out.
    # Pruned for time: a dividing chunk (6) runs eager and jit only (the remainder chunk 5 and
    # "auto" run every transform), and chunk None (jax.vmap itself) skips the slow Hessian.
    def keep(b, m):
        if b == "custom_vjp" and m == "hessian":
            return False
        return not ((chunk == 6 and m not in ("eager", "jit")) or (chunk is None and m == "hessian"))

    return [(b, m) for b in bodies for m in modes if keep(b, m)]


XFAIL: dict[tuple, str] = {}  # (test, *params) -> reason, filled in below


def _slow(test: str, chunk, body: str, mode: str) -> bool:
    """Variants that repeat a code path a default test runs: marked ``slow`` (``pytest -m slow``).

    - chunk None is ``jax.vmap`` itself (``Chunked.__call__`` returns ``_unchunked`` first),
      whatever ``fun``'s body: the custom bodies there run ``jax.vmap``'s own custom rules;
    - "auto" with a custom rule: the plan is made once per traced body for every transform but
      the Hessian (the planner's mode is "grad" unless two forward levels enclose the call: the
      forward program and its VJP are probed, through the rules) and is run by ``grad``; the
      other transforms loop like the remainder chunk 5 with that rule. Its Hessian probes the
      Hessian-vector program that chunk 5's Hessian runs through the same rule;
    - progress and axis-size queries with a ``custom_jvp`` body: ``test_combined`` runs both
      with a ``custom_jvp`` under every transform; axis-size queries under "auto"'s Hessian:
      ``test_matrix[auto-plain-hessian]`` plans it, chunk 5 and ``test_combined`` query there.
    """
    if test == "matrix":
        return body != "plain" and (chunk is None or (chunk == "auto" and mode != "grad"))
    if test in ("progress", "axis_size"):
        return body != "plain" or (test == "axis_size" and chunk == "auto" and mode == "hessian")
    return False


def _param(test: str, *values, slow: bool | None = None):
    """One combination; ``slow`` marks it (by default: the ``_slow`` rule of the matrix's tests)."""
    reason = XFAIL.get((test, *values))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    if slow if slow is not None else (len(values) == 3 and _slow(test, *values)):
        marks.append(pytest.mark.slow)
    return pytest.param(*values, marks=marks, id="-".join(str(v) for v in values))


# -- values and derivatives, no progress, no collective -----------------------------------------


def _matrix_params():
    return [_param("matrix", c, b, m) for c in CHUNKS for b, m in _cases(BODIES, MODES, c)]


@pytest.mark.parametrize(("chunk", "body", "mode"), _matrix_params())
def test_matrix(chunk, body, mode):
    f = make_fun(body)
    g = chunked(f, chunk, mode)
    assert_tree_allclose(run(mode, g, *data()), reference(body, None, mode), rtol=1e-4, atol=1e-4)
    check_auto_chunked(g, chunk)


# -- progress: a recording callable ---------------------------------------------------------------


def _progress_params():
    return [_param("progress", c, b, m) for c in CHUNKS for b, m in _cases(["plain", "custom_jvp"], MODES, c)]


@pytest.mark.parametrize(("chunk", "body", "mode"), _progress_params())
def test_progress_callable(chunk, body, mode):
    calls = []
    f = make_fun(body)
    g = chunked(f, chunk, mode, progress=lambda k, n: calls.append((int(k), int(n))))
    assert_tree_allclose(run(mode, g, *data()), reference(body, None, mode), rtol=1e-4, atol=1e-4)
    jax.effects_barrier()
    check_auto_chunked(g, chunk)
    total = expected_chunks(g, chunk)
    if total is None:
        assert calls == [], f"progress reported while not chunking: {calls}"
        return
    assert calls, "no progress report"
    assert {n for _, n in calls} == {total}, calls
    assert all(1 <= k <= total for k, _ in calls), calls
    assert max(k for k, _ in calls) == total, calls  # every run reaches n


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_progress_true(mode, capfd):
    f = make_fun("plain")
    g = chunked(f, 5, mode, progress=True)
    assert_tree_allclose(run(mode, g, *data()), reference("plain", None, mode), rtol=1e-4, atol=1e-4)
    jax.effects_barrier()
    err = capfd.readouterr().err
    total = chunk_count(5)
    assert f"{total}/{total} chunks" in err, err  # 18 = 5 + 5 + 5 + 3: four chunks


# -- axis_name collectives ------------------------------------------------------------------------


def _collective_params(test):
    return [_param(test, c, b, m) for c in CHUNKS for b, m in _cases(["plain", "custom_jvp"], MODES, c)]


@pytest.mark.parametrize(("chunk", "body", "mode"), _collective_params("axis_size"))
def test_axis_size_queries(chunk, body, mode):
    f = make_fun(body, "size")
    g = chunked(f, chunk, mode, axis_name="i")
    assert_tree_allclose(run(mode, g, *data()), reference(body, "size", mode), rtol=1e-4, atol=1e-4)
    check_auto_chunked(g, chunk)


@pytest.mark.parametrize(("chunk", "body", "mode"), _collective_params("psum"))
def test_psum_of_mapped_value(chunk, body, mode):
    f = make_fun(body, "psum")
    g = chunked(f, chunk, mode, axis_name="i")
    if isinstance(chunk, int):  # chunking: refused, naming the collective
        with pytest.raises(ValueError, match=r"collective `psum` over axis_name='i'"):
            run(mode, g, *data())
        return
    # None: exactly jax.vmap; "auto": does not chunk a collective (plans the whole axis)
    assert_tree_allclose(run(mode, g, *data()), reference(body, "psum", mode), rtol=1e-4, atol=1e-4)


# -- all at once: a remainder chunk, progress, an axis-size query and a custom_jvp -------------


@pytest.mark.parametrize("mode", [_param("combined", m) for m in MODES])
def test_combined(mode):
    calls = []
    f = make_fun("custom_jvp", "size")
    g = chunked(f, 5, mode, axis_name="i", progress=lambda k, n: calls.append((int(k), int(n))), remat=True)
    assert_tree_allclose(run(mode, g, *data()), reference("custom_jvp", "size", mode), rtol=1e-4, atol=1e-4)
    jax.effects_barrier()
    total = chunk_count(5)
    assert calls and {n for _, n in calls} == {total} and max(k for k, _ in calls) == total, calls


# -- a custom rule closing over a tracer of an enclosing transform (the unstaged fallback) ------


def make_closing_fun(w):
    """``fun`` whose custom_jvp closes over ``w`` (a tracer under an enclosing ``jit``)."""

    @jax.custom_jvp
    def act(z):
        return jnp.sin(z) * w[0, 0]

    @act.defjvp
    def act_jvp(primals, tangents):
        (z,), (t,) = primals, tangents
        return act(z), jnp.cos(z) * w[0, 0] * t

    return lambda x: act(jnp.outer(x, x) @ w).sum(0)


# jax.grad / jax.hessian / jax.vmap over w: jax.vmap itself fails (a custom_jvp rule closing over
# a differentiated tracer leaks it: UnexpectedTracerError), so only eager and jit are run.
CLOSING_XFAIL = {
    ("jit", 5): "progress callable never called under jit when fun's custom_jvp closes over a jit tracer "
    "(the unstaged chunk fallback adds no progress tap); repro /tmp/interaction_repros/progress_unstaged_under_jit.py",
}


@pytest.mark.parametrize(
    ("mode", "chunk"),
    [
        pytest.param(
            m,
            c,
            marks=[pytest.mark.xfail(strict=True, reason=CLOSING_XFAIL[(m, c)])] if (m, c) in CLOSING_XFAIL else [],
        )
        for m in ("eager", "jit")
        for c in (None, 5)
    ],
)
def test_custom_rule_closing_over_tracer_with_progress(mode, chunk):
    w, x, _ = data()
    calls = []

    def call(w):
        g = chunkop.vmap(make_closing_fun(w), chunk_size=chunk, progress=lambda k, n: calls.append((int(k), int(n))))
        return g(x)

    out = call(w) if mode == "eager" else jax.jit(call)(w)
    jax.effects_barrier()
    # one example: outer(x, x) @ w, then a sum over its rows: two sums of D terms
    assert_tree_allclose(out, jax.vmap(make_closing_fun(w))(x), n_terms=2 * _model.D)
    if chunk is None:
        assert calls == [], calls
    else:
        total = chunk_count(chunk)
        assert calls and {n for _, n in calls} == {total} and max(k for k, _ in calls) == total, calls


# -- inner jits at depth over a parameter that changes between calls (issue #24) ---------------
#
# A training step builds ``jax.jit(lambda v: act(v * p))`` afresh over new parameters ``p`` and
# calls it from ``fun`` inside ``jax.checkpoint``, ``lax.cond``, ``lax.scan`` and another
# ``jax.jit`` (``_in_fun`` of tests/test_trace_inline.py, which runs chunk 3 eagerly): here
# with the matrix's chunks, transforms and bodies (the body inside the inner jit), against
# ``jax.vmap`` with ``p`` an argument; after the first step nothing compiles. Chunk None is
# ``jax.vmap`` itself, which compiles every new inner jit: left out. ``jit``: one jitted step
# with ``p`` its argument (the inner jit closes over its tracer).

DEEP = "checkpoint-cond-scan-jit"  # the four levels nested (test_trace_inline's depth 4)
WHERES = [DEEP, "checkpoint", "cond", "scan", "jit"]
STEPS = 3


def depth_fun(where: str, body: str, inner):
    """The matrix's ``f(w, x)`` plus ``inner`` (a jit over the step's parameters) at ``where``,
    fed by both arguments (so that both gradients pass through it)."""
    base = make_fun(body)
    return lambda w, x: base(w, x) + 0.05 * _in_fun(where, inner)(jnp.dot(x, w[0]))


@functools.cache
def depth_reference(where: str, body: str, mode: str):
    """``jax.vmap`` of ``depth_fun`` under ``mode``, the parameter an argument (compiled once)."""
    act = _model.BODY[body]

    def value(p, w, x, ws):
        return run(mode, jax.vmap(depth_fun(where, body, lambda v: act(v * p)), in_axes=(None, 0)), w, x, ws)

    return jax.jit(value)


def _depth_params():
    # Default: the four levels nested, with every transform at chunk 5, "auto" under grad (it
    # plans in mode "grad" eagerly too), the dividing chunk eagerly and the custom_vjp rule
    # under grad; the single levels (subsets of the nest, test_trace_inline runs each at chunk
    # 3) and the other combinations: slow.
    default = {(DEEP, 5, "plain", m) for m in ("eager", "jit", "grad", "vmap")}
    default |= {(DEEP, "auto", "plain", "grad"), (DEEP, 6, "plain", "eager"), (DEEP, 5, "custom_vjp", "grad")}
    cases = [(DEEP, c, b, m) for c in (5, 6, "auto") for b in BODIES for m in MODES[:4]]
    cases += [(w, c, "plain", m) for w in WHERES[1:] for c in (5, "auto") for m in MODES[:4]]
    return [_param("depth", *case, slow=case not in default) for case in cases]


@pytest.mark.parametrize(("where", "chunk", "body", "mode"), _depth_params())
def test_inner_jit_at_depth_compiles_once(where, chunk, body, mode):
    if body == "custom_vjp" and "checkpoint" in where and getattr(jax.config, "jax_custom_vjp3", False):
        pytest.skip("jax_custom_vjp3: JAX cannot differentiate jax.checkpoint around a custom_vjp (jax.vmap neither)")
    act = _model.BODY[body]
    made = []

    def chunked_fun(p):  # a new inner jit over this step's parameter
        made.append(chunked(depth_fun(where, body, jax.jit(lambda v: act(v * p))), chunk, mode))
        return made[-1]

    if mode == "jit":
        step = jax.jit(lambda p, w, x: chunked_fun(p)(w, x))
        call = lambda p: step(p, *data()[:2])
    else:
        call = lambda p: run(mode, chunked_fun(p), *data())
    compiles = []
    for i in range(STEPS):
        p = _params(i)
        with CompileCounter() as counter:
            out = jax.block_until_ready(call(p))
        compiles.append(counter.count)
        # sums over the examples (grad w.r.t. w) of sums of 64 terms (twice in a scan)
        assert_tree_allclose(out, depth_reference(where, body, mode)(p, *data()), n_terms=N + 2 * p.size)
    assert compiles[1:] == [0] * (STEPS - 1), f"compiles per new parameter: {compiles}"
    check_auto_chunked(made[-1], chunk)


# -- a RowOperator whose row_fn calls an inner jit over a changing parameter ---------------------

OP_N = 242  # rows: chunk 5 is 48 x 5 + 2 (a remainder), 11 divides, "auto" plans below OP_N
OP_ROWS = {"idx": jnp.arange(OP_N) % 4, "w": jnp.linspace(0.5, 1.0, OP_N)}
OP_X = jnp.arange(4.0) + 1.0
OP_Y = jnp.linspace(-1.0, 2.0, OP_N)
OP_XS, OP_YS = jnp.stack([OP_X, OP_X[::-1] - 1.0]), jnp.stack([OP_Y, 2.0 - OP_Y])
OP_BUDGET = {DEEP: 8192, "cond": 4096}  # bytes: "auto" chunks the rows at this size (30: 8 x 30 + 2; 15)


def deep_row_fn(inner):
    """A ``row_fn`` linear in ``x`` calling ``inner`` inside a jit, in a scan, in a cond, in a
    checkpoint (the row-side counterpart of ``DEEP``)."""

    def row_fn(row, x):
        def scanned(r, v):
            body = lambda c, _: (jax.jit(inner)(c), None)
            return lax.scan(body, v, None, length=2)[0][r["idx"]]

        def checkpointed(r, v):
            return r["w"] * lax.cond(r["w"] > 0.7, scanned, lambda r, v: -v[r["idx"]], r, v)

        return jax.checkpoint(checkpointed)(row, x)

    return row_fn


def op_row_fn(where: str, inner):
    return deep_row_fn(inner) if where == DEEP else _row_fn(where, inner)


@functools.cache
def op_dense(where: str):
    """The dense matrix of ``op_row_fn(where, v -> v * p)`` as a jitted function of ``p``."""
    rows_map = lambda p, v: jax.vmap(op_row_fn(where, lambda u: u * p), (0, None))(OP_ROWS, v)
    return jax.jit(lambda p: jax.jacfwd(functools.partial(rows_map, p))(OP_X))


def run_operator(mode: str, op):
    """``op.mv`` and ``op.T.mv`` under ``mode`` ("param": see the test)."""
    if mode in ("eager", "jit"):
        return op.mv(OP_X), op.T.mv(OP_Y)
    if mode == "grad":
        return jax.grad(lambda x: jnp.sum(jnp.sin(op.mv(x))))(OP_X), jax.grad(lambda y: jnp.sum(jnp.sin(op.T.mv(y))))(
            OP_Y
        )
    if mode == "vmap":
        return jax.vmap(op.mv)(OP_XS), jax.vmap(op.T.mv)(OP_YS)
    raise AssertionError(mode)


def operator_reference(mode: str, M):
    if mode in ("eager", "jit"):
        return M @ OP_X, M.T @ OP_Y
    if mode == "grad":
        return M.T @ jnp.cos(M @ OP_X), M @ jnp.cos(M.T @ OP_Y)
    if mode == "vmap":
        return OP_XS @ M.T, OP_YS @ M
    raise AssertionError(mode)


OP_MODES = ["eager", "jit", "grad", "vmap", "param"]


def _operator_params():
    # Default: the nested row_fn with every transform at chunk 5 and the dividing chunk eagerly;
    # "auto" (its plan compiles the operator's probes: 2.5-4 s) once, in the cond, under the
    # parameter's gradient (planned with the inner jit closing over a grad tracer).
    # test_trace_inline runs the single levels eagerly and in a jitted step at chunk 3: here
    # they are slow, at chunk 5 (and "auto" in the cond: at 242 rows, the other levels' whole
    # axis takes less temp memory than any chunk, so "auto" cannot chunk them).
    default = {(DEEP, 5, m) for m in OP_MODES} | {(DEEP, 11, "eager"), ("cond", "auto", "param")}
    cases = [(DEEP, c, m) for c in (5, 11, "auto") for m in OP_MODES]
    cases += [(w, 5, m) for w in ROW_DEPTHS for m in OP_MODES] + [("cond", "auto", m) for m in OP_MODES]
    return [_param("operator", *case, slow=case not in default) for case in cases]


@pytest.mark.parametrize(("where", "chunk", "mode"), _operator_params())
def test_row_operator_inner_jit_at_depth_compiles_once(where, chunk, mode):
    """``mv`` / ``T.mv`` eagerly, through a jitted step taking the operator, their gradients,
    under ``jax.vmap``, and ("param") the gradient w.r.t. ``p`` of a loss building the operator
    (the inner jit closes over a grad tracer): against the dense matrix, compiled once."""
    budget = OP_BUDGET[where] if chunk == "auto" else None
    build = lambda p: chunkop.RowOperator(
        op_row_fn(where, jax.jit(lambda v: v * p)), OP_ROWS, X_STRUCT, chunk_size=chunk, memory_budget=budget
    )
    made = []
    if mode == "jit":
        step = jax.jit(lambda op: run_operator(mode, op))
        call = lambda p: step(made.append(build(p)) or made[-1])
    elif mode == "param":
        call = jax.grad(lambda p: jnp.sum(jnp.sin((made.append(build(p)) or made[-1]).mv(OP_X))))
        reference = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(op_dense(where)(p) @ OP_X))))
    else:
        call = lambda p: run_operator(mode, made.append(build(p)) or made[-1])
    compiles = []
    for i in range(STEPS):
        p = _params(i)[:4]
        with CompileCounter() as counter:
            out = jax.block_until_ready(call(p))
        compiles.append(counter.count)
        expected = reference(p) if mode == "param" else operator_reference(mode, op_dense(where)(p))
        assert_tree_allclose(out, expected, n_terms=OP_N)  # T.mv: sums over the rows
    assert compiles[1:] == [0] * (STEPS - 1), f"compiles per new parameter: {compiles}"
    if chunk == "auto":
        assert made[-1].chunk_size < OP_N, made[-1].budget_plan


# -- remainder chunks under jax.linear_transpose (issue #24) ------------------------------------
#
# ``jax.linear_transpose`` of ``chunkop.vmap`` / ``chunkop.sum`` of a function linear in the
# mapped input (``_model.make_linear_fun``, its body plain or a linear ``custom_jvp``), against
# that of ``jax.vmap``; tests/test_remainder_transpose.py checks the plans themselves on a
# fixed linear map. Transforms: eager, jit, grad (of a function of the transpose: the transpose
# of the transpose), vmap over cotangents, and ``lineax.FunctionLinearOperator(...).T.mv``.

LIN_STRUCT = jax.ShapeDtypeStruct((N, _model.D), jnp.float32)
LIN_BUDGET = 4096  # bytes: "auto" chunks the linear function at this size
LIN_MODES = ["eager", "jit", "grad", "vmap", "lineax"]


def lin_mapped(kind: str, body: str, chunk):
    f = _model.make_linear_fun(body)
    if chunk == "reference":
        return jax.vmap(f, (None, 0)) if kind == "vmap" else (lambda w, x: jax.vmap(f, (None, 0))(w, x).sum(0))
    return getattr(chunkop, kind)(f, (None, 0), chunk_size=chunk, memory_budget=LIN_BUDGET if chunk == "auto" else None)


def run_transpose(mode: str, mapped, kind: str):
    w, _, _ = data()
    rng = np.random.default_rng(5)
    shape = (N, _model.D) if kind == "vmap" else (_model.D,)
    ct = jnp.asarray(rng.normal(size=shape), jnp.float32)
    cts = jnp.asarray(rng.normal(size=(2, *shape)), jnp.float32)
    transpose = lambda c: jax.linear_transpose(lambda x: mapped(w, x), LIN_STRUCT)(c)[0]
    if mode == "eager":
        return transpose(ct)
    if mode == "jit":
        return jax.jit(transpose)(ct)
    if mode == "grad":
        return jax.grad(lambda c: jnp.sum(jnp.sin(transpose(c))))(ct)
    if mode == "vmap":
        return jax.vmap(transpose)(cts)
    if mode == "lineax":
        return lx.FunctionLinearOperator(functools.partial(mapped, w), LIN_STRUCT).T.mv(ct)
    raise AssertionError(mode)


def _transpose_params():
    # Default: chunk 5 (a remainder) with every transform for both kinds; the dividing chunk
    # eagerly; "auto" for the sum, eagerly and under grad; the custom_jvp body at chunk 5
    # eagerly and under grad. Chunk None (jax.vmap itself) and the rest: slow.
    default = {(k, 5, "plain", m) for k in ("vmap", "sum") for m in LIN_MODES}
    default |= {(k, 6, "plain", "eager") for k in ("vmap", "sum")}
    default |= {("sum", "auto", "plain", m) for m in ("eager", "grad")}
    default |= {("vmap", 5, "custom_jvp", m) for m in ("eager", "grad")}
    cases = [(k, c, b, m) for k in ("vmap", "sum") for c in CHUNKS for b in _model.LINEAR_BODY for m in LIN_MODES]
    return [_param("transpose", *case, slow=case not in default) for case in cases]


@pytest.mark.parametrize(("kind", "chunk", "body", "mode"), _transpose_params())
def test_linear_transpose_with_remainder(kind, chunk, body, mode):
    mapped = lin_mapped(kind, body, chunk)
    expected = run_transpose(mode, lin_mapped(kind, body, "reference"), kind)
    # sums of D terms (the matmul's, transposed) and, for chunkop.sum, the broadcast over N examples
    assert_tree_allclose(run_transpose(mode, mapped, kind), expected, n_terms=N + _model.D)
    if chunk == "auto":
        check_auto_chunked(mapped, chunk)


# -- memory under an enclosing jax.vmap (issue #24) ----------------------------------------------
#
# ``jax.vmap(chunkop.sum(f, chunk_size=c))`` over a batch of 8 (of the mapped or of the unmapped
# argument) and its gradient, compiled on ShapeDtypeStructs: the temp memory of a chunk with a
# remainder stays near that of a dividing chunk of about its size, and far below the unchunked
# jax.vmap's. ``f`` is the matrix's with a second matmul (its (D, D) intermediate is
# materialised: XLA fuses the model's own sum away in the unchunked forward).

MEM_N, MEM_D, MEM_B = 1024, 32, 8
MEM_REM, MEM_DIV = 48, 64  # 1024 = 21 x 48 + 16; 16 x 64
MiB = 2**20


def mem_fun(body: str):
    act = _model.BODY[body]
    return lambda w, x: jnp.sum(act(jnp.outer(x, x) @ w) @ w)


def mem_programs(s) -> dict:
    """The batched programs of a per-batch-element sum ``s(w, x)`` and their argument shapes."""
    f32 = jnp.float32
    w, x = jax.ShapeDtypeStruct((MEM_D, MEM_D), f32), jax.ShapeDtypeStruct((MEM_N, MEM_D), f32)
    ws = jax.ShapeDtypeStruct((MEM_B, MEM_D, MEM_D), f32)
    xs = jax.ShapeDtypeStruct((MEM_B, MEM_N, MEM_D), f32)
    grad = jax.grad(s, argnums=(0, 1))
    return {
        "forward over w": (jax.vmap(s, (0, None)), (ws, x)),
        "grad over x": (jax.vmap(grad, (None, 0)), (w, xs)),
        "grad over w": (jax.vmap(grad, (0, None)), (ws, x)),
    }


@functools.cache
def mem_temps(body: str, chunk) -> dict:
    f = mem_fun(body)
    s = (
        (lambda w, x: jax.vmap(f, (None, 0))(w, x).sum())
        if chunk is None
        else chunkop.sum(f, (None, 0), chunk_size=chunk)
    )
    return {name: temp_bytes(prog, *args) for name, (prog, args) in mem_programs(s).items()}


@pytest.mark.parametrize("body", [_param("memory", b, slow=b != "plain") for b in BODIES])
def test_memory_under_enclosing_vmap_bounded_by_the_chunk(body):
    """A remainder chunk (48) under ``jax.vmap``: at most 2x a dividing chunk's (64) temp memory,
    at most 1/8 of the unchunked ``jax.vmap``'s (measured: about 0.8x and 1/20)."""
    assert _chunking.make_plan(MEM_N, MEM_REM)[2:] == (21, 16) and _chunking.make_plan(MEM_N, MEM_DIV)[3] == 0
    rem, div, full = mem_temps(body, MEM_REM), mem_temps(body, MEM_DIV), mem_temps(body, None)
    for name in rem:
        # a remainder costs one more (smaller) chunk program, not a copy of the batched inputs
        assert rem[name] <= 2 * div[name], (name, rem[name], div[name])
        assert 8 * rem[name] <= full[name], (name, rem[name], full[name])
    # values: the same programs on the matrix's data (N = 18, chunk 5: a remainder)
    _, x, ws = data()
    f = mem_fun(body)
    ours, ref = chunkop.sum(f, (None, 0), chunk_size=5), lambda w, x: jax.vmap(f, (None, 0))(w, x).sum()
    for prog in (lambda s: jax.vmap(s, (0, None)), lambda s: jax.vmap(jax.grad(s, argnums=(0, 1)), (0, None))):
        assert_tree_allclose(prog(ours)(ws, x), prog(ref)(ws, x), n_terms=N * _model.D)


def _auto_memory_params():
    # Default: a sum batched over its unmapped argument, with a custom rule (tests/test_planner.py
    # runs a plain sum batched over its mapped argument). The rest: slow.
    default = {("sum", "custom_jvp", "w")}
    cases = [(k, b, o) for k in ("sum", "vmap") for b in BODIES for o in ("x", "w")]
    return [_param("auto_memory", *case, slow=case not in default) for case in cases]


@pytest.mark.parametrize(("kind", "body", "over"), _auto_memory_params())
def test_auto_under_enclosing_vmap_stays_within_its_budget(kind, body, over):
    """``chunk_size="auto"`` with ``memory_budget`` under ``jax.vmap`` over 8: the batched
    forward and gradient programs compile within the budget, and equal ``jax.vmap``'s values."""
    budget = 2 * MiB
    f = mem_fun(body)
    s = getattr(chunkop, kind)(f, (None, 0), chunk_size="auto", memory_budget=budget)
    total = s if kind == "sum" else (lambda w, x: s(w, x).sum())
    axes = (None, 0) if over == "x" else (0, None)
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.normal(size=(MEM_B, MEM_D, MEM_D) if over == "w" else (MEM_D, MEM_D)) / MEM_D, jnp.float32)
    x = jnp.asarray(rng.normal(size=(MEM_B, MEM_N, MEM_D) if over == "x" else (MEM_N, MEM_D)), jnp.float32)
    forward = temp_bytes(jax.vmap(s, axes), w, x)
    grad = temp_bytes(jax.vmap(jax.grad(total, argnums=(0, 1)), axes), w, x)
    plan = s.last_plan
    assert forward <= budget and grad <= budget, (forward / MiB, grad / MiB, plan)
    assert plan is not None and plan.chunk is not None and plan.chunk < MEM_N, plan
    assert plan.budget == budget // MEM_B  # planned per example of the batch
    mapped = jax.vmap(f, (None, 0))
    ref = mapped if kind == "vmap" else (lambda w, x: mapped(w, x).sum())
    # per example: 2 D-term matmuls, then (sum) a sum over MEM_N examples of D * D terms
    n_terms = 2 * MEM_D + (MEM_N + MEM_D * MEM_D if kind == "sum" else MEM_D * MEM_D)
    assert_tree_allclose(jax.vmap(s, axes)(w, x), jax.vmap(ref, axes)(w, x), n_terms=n_terms)


# -- sharded inputs: 4 CPU devices in one subprocess ----------------------------------------------

SCRIPT = Path(__file__).with_name("_interaction_checks.py")


def _run_checks(*args: str, timeout: int = 900) -> str:
    env = subprocess_env()
    cmd = [sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"checks subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return lines[-1]


SHARDED = json.loads(_run_checks("--list", timeout=300))  # {"default": [names], "slow": [names]}


@pytest.fixture(scope="module")
def sharded_results() -> dict:
    return json.loads(_run_checks())  # the default checks


@pytest.fixture(scope="module")
def sharded_slow_results() -> dict:
    return json.loads(_run_checks(*SHARDED["slow"]))


REPROS = "/tmp/interaction_repros"


def sharded_xfail(name: str) -> str | None:
    """The known failure of a sharded check, or None (the three found by this matrix are fixed:
    axis-size queries on sharded inputs give the whole axis, "auto" with a psum runs unchunked,
    the sharded refusal names the collective)."""
    del name
    return None


def _sharded_param(name: str):
    reason = sharded_xfail(name)
    return pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("name", [_sharded_param(n) for n in SHARDED["default"]])
def test_sharded(sharded_results: dict, name: str) -> None:
    assert sharded_results.get(name) == "ok", sharded_results.get(name, "check not run")


@pytest.mark.slow
@pytest.mark.parametrize("name", [_sharded_param(n) for n in SHARDED["slow"]])
def test_sharded_slow(sharded_slow_results: dict, name: str) -> None:
    """Variants that repeat a code path of a default check (see ``_interaction_checks._names``)."""
    assert sharded_slow_results.get(name) == "ok", sharded_slow_results.get(name, "check not run")
