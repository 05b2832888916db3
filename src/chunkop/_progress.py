"""Progress reports from inside a compiled chunk loop.

``progress=True`` (or a callable ``progress(k, n)``) on a chunked transform reports ``k``
(chunks done) out of ``n`` (chunks in the loop: the scan's full chunks plus the remainder chunk,
if any) to the host while the compiled program runs.

**Where the reports come from.** Every chunk's output passes through a tap (the
``chunkop_progress`` primitive below, placed in the scan body *outside* the chunk's
``jax.checkpoint``). In the forward loop the tap reports after the chunk: its host callback takes
a one-element slice of the chunk's output, and the output's first element is rewritten with a
select on the callback's (always zero) result, so the callback runs after the chunk and before
anything that uses the chunk's output, and the values are bit for bit unchanged. The callback is
*pure* (``jax.pure_callback``): when nothing uses the loop's output, the tap goes with it. This
matters under ``jit(grad)``: the backward loop recomputes every chunk, so the forward loop's
values are dead and the whole forward loop is dropped; a report there would force it to run (a
whole extra forward pass). Instead the tap's derivative is an identity whose *transpose*
reports: the backward loop reports as each chunk's backward pass starts (all it can wait for is
the cotangent of the chunk's output, so its last report comes one chunk before the loop ends).
The recomputation inside the checkpoint does not report. Forward mode (``jvp``) reports from the
forward loop only; ``jax.linear_transpose`` from the transposed loop.

**How often.** Of a loop's ``n_full`` full chunks, the first, the last and every ``stride``-th
one report (``stride = ceil(n_full / MAX_REPORTS)``: at most ``MAX_REPORTS + 2`` host callbacks
per loop, whatever the chunk count; the cost of a call: ``benchmarks/RESULTS.md``, "Progress",
and ``_call_p``), and so does the remainder chunk. The choice is a ``lax.cond`` in the loop:
the other chunks make no callback.

**The host side.** The callbacks are unordered (an ordered effect threads a token through the
loop and is refused on more than one device), so the host makes sense of them: each report names
its chunk (the remainder is chunk ``n_full + 1``) and, inside ``shard_map`` (sharded inputs), its
shard (``lax.axis_index`` over the manual mesh axes): every device runs its own loop over its
shard. Per direction (forward / backward) a run's progress is the fewest chunks done on any
shard (forward: the highest full chunk reported plus the remainder; backward: the full chunks
started, counted from the last, plus the remainder), and ``progress(k, n)`` is called when it
grows: a callable sees each call of the loop as one run of ``k`` increasing to ``n``, whatever
order the remainder and the shards report in. A run ends at ``k == n``; a full chunk that goes
back on its shard (below one already reported; above, backward) starts a new run (a fresh call
of the same compiled loop after one that did not finish); repeats are ignored. Under
``jax.vmap`` of a chunked function the tap is batched, not repeated: one report per chunk. A
forward and a backward loop in one program (``value_and_grad``) are two runs.

Reports are made while the program runs: by the time its outputs are ready, all are made. Each
loop with progress also makes one operand-free, unordered ``jax.debug.callback`` (it keeps
nothing alive), so that ``jax.effects_barrier()`` waits for the program and its reports too.

``progress=True`` shows a ``tqdm`` bar on stderr when tqdm is installed and stderr is a terminal
(or this is a Jupyter kernel: tqdm.auto's widget); otherwise plain lines: ``\\r{desc}: k/n chunks``
rewritten in place on a terminal, and on anything else (a log file, a pipe) one
``{desc}: k/n chunks`` line per report, at most one every ``min_interval`` seconds plus the
final one.

For a chunk loop of its own (e.g. ``RowOperator``'s kernels), a caller makes
``hook = progress_hook(plan, progress)`` and wraps the scan with ``hook.scan(xs, body)`` and the
remainder chunk's output with ``hook.remainder(out)``; both are identities when it is off, so
with progress off nothing is added to the program.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _jaxpr, _sharding
from ._tree import has_shape
from ._tree import is_float as _is_float

__all__ = [
    "MAX_REPORTS",
    "Progress",
    "ProgressBar",
    "ProgressHook",
    "check_progress",
    "progress_hook",
    "report_stride",
]

Progress = bool | Callable[[int, int], Any] | None

MAX_REPORTS = 20
"""About how many full chunks of one loop report (see :func:`report_stride`)."""


def check_progress(progress: Any, where: str) -> Progress:
    """``progress`` if it is None, a bool or a callable; else a ``TypeError`` naming ``where``."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(
        f"{where}: `progress` must be None, True/False or a callable progress(k, n) "
        f"(k chunks done out of n), got {progress!r}."
    )


def report_stride(n_full: int, max_reports: int | None = None) -> int:
    """Every how many full chunks one reports: full chunks ``1``, ``n_full`` and the multiples
    of the stride report, at most ``max_reports + 2`` of them (default :data:`MAX_REPORTS`,
    read when a loop is traced).

    Example:
        >>> report_stride(10), report_stride(200), report_stride(1000)
        (1, 10, 50)
    """
    return max(1, math.ceil(n_full / (MAX_REPORTS if max_reports is None else max_reports)))


# -- the host side --------------------------------------------------------------------------------


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, a closed stream, a detached one
        return False


def _in_notebook() -> bool:
    """Whether this is an IPython kernel (Jupyter), where tqdm.auto draws a widget."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # noqa: BLE001 - IPython's own failure: not a notebook
        return False
    return shell is not None and hasattr(shell, "kernel")


class ProgressBar:
    """The host side of ``progress=True``: a bar driven by counts.

    ``update(k, n)`` moves the bar to ``k`` of ``n``; a ``k`` lower than the last one starts a new
    bar (the same compiled loop called again), a repeated ``(k, n)`` is ignored, and ``k >= n``
    closes the bar (the next update opens a new one).

    The bar is tqdm's (``tqdm.auto``) when tqdm is installed and ``file`` is a terminal or this
    is a Jupyter kernel (a widget); otherwise a plain ``\\r{desc}: k/n chunks`` line rewritten in place on a
    terminal (its first and last count, and at most one every ``min_interval / 10`` s between),
    and on anything else one
    ``{desc}: k/n chunks`` line per update at most every ``min_interval`` seconds, the final
    update (``k == n``) always.
    """

    def __init__(self, desc: str, file: Any = None, min_interval: float = 1.0) -> None:
        self.desc = desc
        self.file = file
        self.min_interval = min_interval
        self._bar: Any = None
        self._open = False
        self._tty = False
        self._last = 0
        self._n = 0
        self._written = -math.inf  # when the last plain line was written
        self._pending: str | None = None  # a throttled \r line not written yet
        self._lock = threading.Lock()

    def update(self, k: int, n: int) -> None:
        with self._lock:
            if k == self._last and n == self._n:
                return
            if not self._open or k < self._last or n != self._n:
                self._close()
                self._start(n)
            self._advance(k, n)
            self._last, self._n = k, n
            if k >= n:
                self._close()

    def _stream(self) -> Any:
        return self.file if self.file is not None else sys.stderr

    def _start(self, n: int) -> None:
        self._open = True
        self._pending = None  # (None: nothing written in this run yet)
        self._tty = _is_tty(self._stream())
        if not (self._tty or _in_notebook()):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=n, desc=self.desc, unit="chunk", file=self._stream(), leave=True)

    def _advance(self, k: int, n: int) -> None:
        if self._bar is not None:
            self._bar.update(k - self._bar.n)
            return
        now = time.monotonic()
        final = k >= n
        interval = self.min_interval / 10 if self._tty else self.min_interval
        if self._tty:
            line = f"\r{self.desc}: {k}/{n} chunks"
            if final or self._pending is None or now - self._written >= interval:
                self._write(line + ("\n" if final else ""))
                self._written, self._pending = now, ""
            else:
                self._pending = line
        elif final or now - self._written >= interval:
            self._write(f"{self.desc}: {k}/{n} chunks\n")
            self._written = now

    def _write(self, text: str) -> None:
        stream = self._stream()
        stream.write(text)
        stream.flush()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._open and self._tty and self._last < self._n:  # an unfinished \r line
            self._write((self._pending or "") + "\n")
        self._pending = None
        self._open = False


class _Run:
    """What one direction (forward or backward) of one chunk loop has reported so far."""

    def __init__(self, n_full: int, rem: bool, n_shards: int, backward: bool, sink: Callable[[int, int], Any]):
        self.n_full, self.rem, self.n_shards, self.backward, self.sink = n_full, rem, n_shards, backward, sink
        self.n = n_full + int(rem)
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self.scan: dict[int, int] = {}  # shard -> highest (forward) / lowest (backward) full chunk
        self.rem_seen: set[int] = set()
        self.emitted = 0

    def _done(self, shard: int) -> int:
        if shard in self.scan:
            i = self.scan[shard]
            full = self.n_full - i + 1 if self.backward else i
        else:
            full = 0
        return full + (shard in self.rem_seen)

    def receive(self, chunk: int, shard: int) -> None:
        """Chunk ``chunk`` (1-based; ``n_full + 1``: the remainder) was reported on ``shard``."""
        with self._lock:  # (the sink is called under the lock: devices report from several threads)
            k = self._receive(chunk, shard)
            if k:
                self.sink(k, self.n)

    def _receive(self, chunk: int, shard: int) -> int:
        """The run's new count, or 0 when it did not grow."""
        if self.n_shards > 1 and self._done(shard) == self.n:
            return 0  # this shard finished the run and the others have not: drop its next run's report
        if chunk > self.n_full:
            if shard in self.rem_seen:
                return 0  # a repeated remainder
            self.rem_seen.add(shard)
        else:
            last = self.scan.get(shard)
            if last == chunk:
                return 0  # a repeat
            if last is not None and (chunk < last) != self.backward:  # went back: a new call
                self._reset()
            self.scan[shard] = chunk
        k = min(self._done(s) for s in range(self.n_shards))
        if k <= self.emitted:
            return 0
        self.emitted = k
        if k >= self.n:
            self._reset()
        return k


class _Loop:
    """The host-side state of one traced chunk loop: a :class:`_Run` per direction."""

    def __init__(self, n_full: int, rem: bool, n_shards: int, sinks: tuple) -> None:
        self.n_full, self.rem, self.n_shards = n_full, rem, n_shards
        self.runs = (_Run(n_full, rem, n_shards, False, sinks[0]), _Run(n_full, rem, n_shards, True, sinks[1]))
        self.stride = report_stride(n_full)

    def __repr__(self) -> str:
        return f"ProgressLoop(n_full={self.n_full}, rem={self.rem}, n_shards={self.n_shards})"


def _sinks(progress: Progress, desc: str) -> tuple | None:
    if progress is None or progress is False:
        return None
    if progress is True:
        return (ProgressBar(desc).update, ProgressBar(f"{desc} (backward)").update)
    return (progress, progress)


# -- the tap: an identity on a chunk's output that reports ----------------------------------------


def _tap(xs: list, k: Any, shard: Any, *, loop: _Loop, backward: bool, silent: bool) -> list:
    return _tap_p.bind(*xs, k, shard, loop=loop, backward=backward, silent=silent)


def _host(loop: _Loop, backward: bool) -> Callable:
    def host(k: Any, shard: Any, _after: Any) -> np.ndarray:
        loop.runs[backward].receive(int(np.max(k)), int(np.max(shard)))
        return np.zeros((), np.int32)

    return host


def _tap_impl(*args: Any, loop: _Loop, backward: bool, silent: bool) -> list:
    *xs, k, shard = args
    if not silent:
        _host(loop, backward)(np.asarray(k), np.asarray(shard), None)
    return list(xs)


def _tap_abstract_eval(*avals: Any, **params: Any) -> list:
    return list(avals[:-2])


def _tap_lowered(*args: Any, loop: _Loop, backward: bool, silent: bool) -> list:
    *xs, k, shard = args
    if silent:
        return list(xs)
    sized = [x for x in xs if x.size > 0]
    after = jnp.ravel(sized[0])[:1] if sized else jnp.zeros((0,), jnp.float32)  # waits for the chunk
    host = _host(loop, backward)
    chosen = (k == 1) | (k >= loop.n_full) | (k % loop.stride == 0)

    def report(k: Any, shard: Any, after: Any) -> Any:
        if _callback_op_sharding is not None:
            return _call_p.bind(k, shard, after, loop=loop, backward=backward)
        out = jax.ShapeDtypeStruct((), jnp.int32)  # (fallback: about 40x the cost per call)
        return jax.pure_callback(host, out, k, shard, after, vmap_method="broadcast_all")

    done = jax.lax.cond(chosen, report, lambda *_: jnp.zeros((), jnp.int32), k, shard, after)
    return _tie(list(xs), done)


# The host call itself. ``jax.pure_callback`` would do, but it moves its operands into JAX arrays
# on the host before calling (``device_put``), which costs many times a plain Python callback of
# NumPy arrays (figures: benchmarks/RESULTS.md, "Progress"). So it is such a callback
# (``mlir.emit_python_callback``, what ``pure_callback`` lowers to), placed the same way
# (``_callback_op_sharding``: per device inside ``shard_map``). Pure (no side effect for XLA), so
# it goes when its result is unused.
_callback_op_sharding = _jaxpr.callback_op_sharding  # None: another JAX, jax.pure_callback instead


def _call_abstract_eval(*avals: Any, loop: _Loop, backward: bool) -> Any:
    return jax.core.ShapedArray((), jnp.int32)


def _call_impl(*args: Any, loop: _Loop, backward: bool) -> Any:
    return jnp.asarray(_host(loop, backward)(*map(np.asarray, args)))


def _call_lowering(ctx: Any, *args: Any, loop: _Loop, backward: bool) -> Any:
    host = _host(loop, backward)
    sharding = _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    result, _, _ = _jaxpr.emit_python_callback(
        ctx,
        lambda *arrays: (host(*arrays),),
        list(args),
        has_side_effect=False,
        returns_token=False,
        sharding=sharding,
    )
    return result


_call_p = _jaxpr.define_primitive(
    "chunkop_progress_call", impl=_call_impl, abstract_eval=_call_abstract_eval, lowering=_call_lowering
)


def _tie(xs: list, done: Any) -> list:
    """``xs`` unchanged, but (for XLA) computed from ``done`` (always 0), so the report is made
    whenever the outputs are used and before they are. The first element of the first non-empty
    ``x`` is rewritten with a select on ``done`` (one element; an ``optimization_barrier`` is not
    enough: XLA prunes its unused operands)."""
    for i, x in enumerate(xs):
        if x.size > 0:
            first = jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
            kept = jnp.where(done == 0, first, jnp.ones_like(first))
            xs[i] = jax.lax.dynamic_update_slice(x, kept, (jnp.zeros((), jnp.int32),) * x.ndim)
            break
    return xs


def _tap_some(vals: list, use: list, k: Any, shard: Any, **params: Any) -> list:
    """``vals`` with those where ``use`` is true passed through one tap (symbolic zeros
    instantiated); the others unchanged. No tap at all when none is used."""
    idx = [i for i, u in enumerate(use) if u]
    if not idx:
        return list(vals)
    out = list(vals)
    for i, t in zip(idx, _tap([_jaxpr.instantiate_zeros(vals[i]) for i in idx], k, shard, **params)):
        out[i] = t
    return out


def _tap_jvp(primals: tuple, tangents: tuple, *, loop: _Loop, backward: bool, silent: bool) -> tuple:
    *xs, k, shard = primals
    out = _tap(xs, k, shard, loop=loop, backward=backward, silent=silent)
    ts = list(tangents[: len(xs)])
    use = [not _jaxpr.is_symbolic_zero(t) and _is_float(x) for t, x in zip(ts, xs)]
    # the tangent goes through a silent tap, whose transpose (in a backward loop) reports
    return out, _tap_some(ts, use, k, shard, loop=loop, backward=backward, silent=True)


def _tap_transpose(cts: list, *args: Any, loop: _Loop, backward: bool, silent: bool) -> list:
    *xs, k, shard = args
    linear = [_jaxpr.is_undefined_primal(x) for x in xs]
    use = [lin and not _jaxpr.is_symbolic_zero(c) and _is_float(x) for lin, c, x in zip(linear, cts, xs)]
    out = _tap_some(list(cts), use, k, shard, loop=loop, backward=not backward, silent=False)
    return [c if lin else None for c, lin in zip(out, linear)] + [None, None]


def _tap_batch(args: tuple, dims: tuple, **params: Any) -> tuple:
    *xs, k, shard = args
    *xdims, kdim, sdim = dims
    if kdim is not None:  # (chunk counts are never batched in chunkop's loops; be safe anyway)
        k = jnp.max(k, axis=kdim)
    if sdim is not None:
        shard = jnp.max(shard, axis=sdim)
    return _tap(list(xs), k, shard, **params), list(xdims)


def _unsharded(aval: Any) -> Any:
    """``aval`` typed on no mesh (see :func:`_tap_lowering`)."""
    if not isinstance(aval, jax.core.ShapedArray) or aval.sharding.mesh.empty:
        return aval
    return aval.update(sharding=jax.sharding.NamedSharding(jax.sharding.AbstractMesh((), ()), P()))


def _tap_lowering(ctx: Any, *args: Any, **params: Any) -> Any:
    """The tap's lowering (:func:`_tap_lowered`), traced on its operands' shapes without their
    mesh types: its one-element slices and update are plain HLO, which XLA's partitioner places
    (on an Explicit mesh their types would refuse a one-element slice of a sharded axis)."""
    ctx = ctx.replace(avals_in=[_unsharded(a) for a in ctx.avals_in], avals_out=[_unsharded(a) for a in ctx.avals_out])
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return _jaxpr.lower_fun(_tap_lowered, multiple_results=True)(ctx, *args, **params)


_tap_p = _jaxpr.define_primitive(
    "chunkop_progress",
    multiple_results=True,
    impl=_tap_impl,
    abstract_eval=_tap_abstract_eval,
    lowering=_tap_lowering,
    jvp=_tap_jvp,
    transpose=_tap_transpose,
    batch=_tap_batch,
)


def _nothing() -> None:
    return None


def _shard() -> tuple[Any, int]:
    """This device's index over the manual mesh axes (inside ``shard_map``) and their size."""
    mesh = jax.sharding.get_abstract_mesh()
    names = _sharding.manual_axes(mesh)
    if not names:
        return jnp.int32(0), 1
    auto = [a for a in mesh.axis_names if a not in names]
    if auto:
        raise NotImplementedError(
            f"progress=: a chunk loop inside a shard_map over mesh axes {names} that leaves {tuple(auto)} "
            "automatic cannot report (JAX host callbacks need every mesh axis manual). Pass progress=None, "
            "or shard over every mesh axis."
        )
    return jax.lax.axis_index(names).astype(jnp.int32), math.prod(int(mesh.shape[a]) for a in names)


def _report(loop: _Loop, k: Any, out: Any) -> Any:
    """``out`` (a pytree) passed through the tap with chunk number ``k``: its float leaves (else
    its first other array, else the data of its first PRNG key array)."""
    leaves, tree = jax.tree_util.tree_flatten(out)
    arrays = [i for i, x in enumerate(leaves) if has_shape(x)]
    keys = [i for i in arrays if jax.dtypes.issubdtype(leaves[i].dtype, jax.dtypes.prng_key)]
    floats = [i for i in arrays if i not in keys and jnp.issubdtype(leaves[i].dtype, jnp.inexact)]
    idx = floats or [i for i in arrays if i not in keys][:1] or keys[:1]  # (keys: their key data)
    if not idx:
        return out
    shard, _ = _shard()
    raw = [jax.random.key_data(leaves[i]) if i in keys else leaves[i] for i in idx]
    tapped = _tap(raw, jnp.asarray(k, jnp.int32), shard, loop=loop, backward=False, silent=False)
    for i, t in zip(idx, tapped):
        leaves[i] = jax.random.wrap_key_data(t, impl=jax.random.key_impl(leaves[i])) if i in keys else t
    return jax.tree_util.tree_unflatten(tree, leaves)


class ProgressHook:
    """Progress reports for one chunk loop (see :func:`progress_hook`)."""

    def __init__(self, plan: Any, sinks: tuple | None) -> None:
        self.plan = plan
        self.sinks = sinks
        self._loop: _Loop | None = None

    def _state(self) -> _Loop:
        if self._loop is None:
            _, n_shards = _shard()
            self._loop = _Loop(self.plan.n_full, bool(self.plan.rem), n_shards, self.sinks)
        return self._loop

    def scan(self, xs: Any, full_fn: Callable[[Any], Any]) -> tuple[Any, Callable[[Any], Any]]:
        """The scan's ``(xs, full_fn)`` with a report after each full chunk.

        Unchanged when progress is off. Otherwise ``xs`` becomes ``(xs, counts)`` with
        ``counts = 1..plan.n_full`` and the body passes ``full_fn(item)`` through the tap.
        """
        if self.sinks is None:
            return xs, full_fn
        loop = self._state()
        counts = jnp.arange(1, self.plan.n_full + 1, dtype=jnp.int32)
        # One unordered, operand-free effect per loop: it keeps nothing alive (the forward loop
        # can still be dropped under grad), but makes ``jax.effects_barrier()`` wait for the
        # program, hence for its reports (made by pure callbacks, which it does not track).
        jax.debug.callback(_nothing, ordered=False)

        def reported(item: tuple) -> Any:
            inner, k = item
            return _report(loop, k, full_fn(inner))

        return (xs, counts), reported

    def remainder(self, out: Any) -> Any:
        """``out`` (the remainder chunk's output) passed through the tap as chunk ``n_full + 1``."""
        if self.sinks is None or not self.plan.rem:
            return out
        return _report(self._state(), self.plan.n_full + 1, out)


def progress_hook(plan: Any, progress: Progress, desc: str = "chunkop") -> ProgressHook:
    """The progress hook of one chunk loop over ``plan``: ``hook.scan(xs, body)`` wraps the scan,
    ``hook.remainder(out)`` the remainder chunk's output; both are identities when ``progress``
    is None or False, so the traced program is then exactly the one without progress.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._chunking import make_plan
        >>> plan = make_plan(10, 4)                        # 2 full chunks + a remainder of 2
        >>> seen = []
        >>> hook = progress_hook(plan, lambda k, n: seen.append((k, n)))
        >>> xs, body = hook.scan(jnp.ones((2, 4)), lambda chunk: chunk.sum())
        >>> sums = jax.lax.scan(lambda c, item: (c, body(item)), 0, xs)[1]
        >>> rest = hook.remainder(jnp.ones(2).sum())
        >>> seen
        [(1, 3), (2, 3), (3, 3)]
    """
    return ProgressHook(plan, _sinks(progress, desc))
