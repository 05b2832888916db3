"""Progress reports from inside a compiled chunk loop.

``progress=True`` (or a callable ``progress(k, n)``) on a chunked transform makes every chunk
report ``k`` (chunks done, 1-based) out of ``n`` (chunks in the loop: the scan's full chunks
plus the remainder chunk, if any) to the host while the compiled program runs. The report is a
``jax.debug.callback`` placed in the scan body *after* the chunk (it takes a one-element slice
of the chunk's output, so XLA cannot run it before the chunk is computed) and *outside* the
chunk's ``jax.checkpoint``, so under ``grad`` the forward loop reports and the recomputation in
the backward loop does not. The chunk computation itself is unchanged; with ``progress``
off nothing is added at all and the compiled program is the one without this module.

The callback is *ordered* (``ordered=True``): without it XLA may run the remainder chunk, which
does not depend on the scan, and its report before the scan's. It reports the absolute count
``k``, not an increment: under ``jax.vmap`` of a chunked function the callback runs once per
batch element with the same ``k``, and a count is idempotent. Reports are asynchronous
(``jax.effects_barrier()`` waits for them).

``progress=True`` shows a ``tqdm`` bar on stderr when tqdm is installed (an optional
dependency) and otherwise a plain ``\\r{desc}: k/n chunks`` line on stderr.

For a chunk loop of its own (e.g. ``RowOperator``'s kernels), a caller makes
``hook = progress_hook(plan, progress)`` and wraps the scan with ``hook.scan(xs, body)`` and the
remainder chunk's output with ``hook.remainder(out)``; both are identities when it is off.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Progress", "ProgressBar", "ProgressHook", "check_progress", "n_chunks", "progress_hook"]

Progress = bool | Callable[[int, int], Any] | None


def check_progress(progress: Any, where: str) -> Progress:
    """``progress`` if it is None, a bool or a callable; else a ``TypeError`` naming ``where``."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(
        f"{where}: `progress` must be None, True/False or a callable progress(k, n) "
        f"(k chunks done out of n), got {progress!r}."
    )


def n_chunks(plan: Any) -> int:
    """The number of chunks of ``plan``: full chunks plus the remainder chunk, if any."""
    return plan.n_full + (1 if plan.rem else 0)


class ProgressBar:
    """The host side of ``progress=True``: a tqdm bar (or a plain stderr line) driven by counts.

    ``update(k, n)`` moves the bar to ``k`` of ``n``; a ``k`` lower than the last one starts a new
    bar (the same compiled loop called again); a repeated ``k`` is ignored (``vmap`` of a chunked
    function reports every chunk once per batch element); ``k == n`` closes the bar.
    """

    def __init__(self, desc: str, file: Any = None) -> None:
        self.desc = desc
        self.file = file
        self._bar: Any = None
        self._plain_open = False
        self._last = 0
        self._n = 0
        self._lock = threading.Lock()

    def update(self, k: int, n: int) -> None:
        with self._lock:
            if k == self._last and n == self._n:
                return
            if (self._bar is None and not self._plain_open) or k < self._last or n != self._n:
                self._close()
                self._open(n)
            self._advance(k, n)
            self._last, self._n = k, n
            if k >= n:
                self._close()

    def _stream(self) -> Any:
        return self.file if self.file is not None else sys.stderr

    def _open(self, n: int) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._plain_open = True
            return
        self._bar = tqdm(total=n, desc=self.desc, unit="chunk", file=self._stream(), leave=True)

    def _advance(self, k: int, n: int) -> None:
        if self._bar is not None:
            self._bar.update(k - self._bar.n)
        else:
            self._stream().write(f"\r{self.desc}: {k}/{n} chunks")
            self._stream().flush()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain_open:
            self._stream().write("\n")
            self._stream().flush()
            self._plain_open = False


def _reporter(progress: Progress, desc: str) -> Callable[[int, int], Any] | None:
    if progress is None or progress is False:
        return None
    if progress is True:
        return ProgressBar(desc).update
    return progress


def _report(report: Callable[[int, int], Any], k: Any, n: int, out: Any) -> None:
    """Emit ``report(k, n)`` once ``out`` (a pytree) is computed."""
    leaves = [x for x in jax.tree_util.tree_leaves(out) if hasattr(x, "size") and x.size > 0]
    after = jnp.ravel(leaves[0])[:1] if leaves else jnp.zeros((0,))  # a data dependence on the chunk

    def host(k: Any, _after: Any) -> None:
        report(int(k), n)

    jax.debug.callback(host, k, after, ordered=True)


class ProgressHook:
    """Progress reports for one chunk loop (see :func:`progress_hook`)."""

    def __init__(self, plan: Any, report: Callable[[int, int], Any] | None) -> None:
        self.plan = plan
        self.report = report

    def scan(self, xs: Any, full_fn: Callable[[Any], Any]) -> tuple[Any, Callable[[Any], Any]]:
        """The scan's ``(xs, full_fn)`` with a report after each full chunk.

        Unchanged when progress is off. Otherwise ``xs`` becomes ``(xs, counts)`` with
        ``counts = 1..plan.n_full`` and the body reports ``(count, n_chunks(plan))`` once
        ``full_fn(item)`` is computed.
        """
        if self.report is None:
            return xs, full_fn
        report, n = self.report, n_chunks(self.plan)
        counts = jnp.arange(1, self.plan.n_full + 1, dtype=jnp.int32)

        def reported(item: tuple) -> Any:
            inner, k = item
            out = full_fn(inner)
            _report(report, k, n, out)
            return out

        return (xs, counts), reported

    def remainder(self, out: Any) -> Any:
        """``out`` (the remainder chunk's output), reporting the last chunk once it is computed."""
        if self.report is not None and self.plan.rem:
            n = n_chunks(self.plan)
            _report(self.report, jnp.int32(n), n, out)
        return out


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
        >>> jax.effects_barrier(); seen
        [(1, 3), (2, 3), (3, 3)]
    """
    return ProgressHook(plan, _reporter(progress, desc))
