"""The chunk search of ``chunk_size="auto"``: the largest chunk whose temp memory fits a budget.

Given a measure ``temp_bytes(chunk) -> int`` (in practice: compile the chunked program at
``chunk`` and read its temp memory, :func:`chunkop._memory.program_temp_bytes`),
:func:`choose_chunk`

1. compiles the whole axis unchunked (``chunk = n``) - for a large axis only when step 2's
   model predicts that it may fit; if it fits, there is no chunking at all;
2. compiles at two chunk sizes and fits an affine model ``a + b * chunk`` (above a small floor,
   a chunked program's temp memory is one chunk's intermediates plus chunk-independent buffers);
3. compiles the largest chunk the model allows (preferring chunks that leave no or a small
   remainder) and, until one lands within 80-100% of the budget (50-100% of the CPU throughput
   cap, a speed heuristic where precision buys nothing), brackets between the largest
   chunk that fitted and the smallest that did not, interpolating linearly; the largest
   compiled chunk within the budget wins. No loop is compiled twice. When no step fits, it
   halves from the smallest chunk tried.

On CPU the search aims no higher than the throughput cap (:func:`chunkop._memory.throughput_cap`);
when that cap is at least ``_estimate.MARGIN`` times below the budget (the default budget), it
is the only bound that binds, and a speed heuristic: the chunk then comes from a compile-free
estimate of one element's bytes (:mod:`chunkop._estimate`), without measuring anything
(``plan.compiled_bytes`` is None).

The result is a :class:`BudgetPlan`: the chunk and the measurements behind it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from . import _estimate
from ._chunking import divisors, make_plan

__all__ = ["BudgetPlan", "choose_chunk"]


_MAX_VERIFY = 6  # compiles after the two probes before falling back to halving


class BudgetPlan(NamedTuple):
    """The chunk chosen for a memory budget, and the measurements behind it.

    Attributes:
        chunk: the chosen chunk size, or None when the whole axis fits (no chunking).
        size: the size of the axis the chunk was planned for: one device's shard of the mapped
            axis (or of the rows) when it is sharded over devices, else the whole axis.
        budget: the budget in bytes the chunk was chosen for.
        mode: the transforms planned for (``"forward"``, ``"grad"`` or ``"hvp"``).
        predicted_bytes: the temp memory the affine model predicted at ``chunk`` (None when no
            model was needed, i.e. the unchunked program fits).
        compiled_bytes: the temp memory XLA reports for the program compiled at ``chunk``;
            None when the plan was made without compiling (on CPU under the throughput cap,
            far below the budget: see :mod:`chunkop._estimate`; ``predicted_bytes`` is then the
            estimate).
        probes: every ``(chunk, temp_bytes)`` compiled while planning, in order.
        cap: the throughput cap the search aimed at, if any (``chunkop.settings().cpu_temp_cap`` on CPU).
        shards: the number of devices the axis is sharded over (1: not sharded); each device
            chunks its own ``size`` elements. ``global_size`` is the whole axis,
            ``size * shards``.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.sum(lambda x: jnp.sin(x) ** 2, chunk_size="auto", memory_budget=2**20)
        >>> plan = chunkop.plan(f, jnp.zeros(1000))
        >>> plan.chunk, plan.size, plan.compiled_bytes <= plan.budget
        (None, 1000, True)
        >>> # on CPU with a budget far above the throughput cap: planned without compiling
        >>> big = chunkop.plan(chunkop.sum(lambda x: jnp.sin(x) ** 2, chunk_size="auto",
        ...                                memory_budget=2**33), jnp.zeros(10**7))
        >>> big.chunk is not None and big.compiled_bytes is None and big.probes == ()
        True
    """

    chunk: int | None
    size: int
    budget: int
    mode: str
    predicted_bytes: int | None
    compiled_bytes: int | None
    probes: tuple
    cap: int | None = None
    shards: int = 1

    @property
    def global_size(self) -> int:
        """The size of the whole mapped axis (all shards): ``size * shards``."""
        return self.size * self.shards

    def __repr__(self) -> str:
        mib = lambda b: "None" if b is None else f"{b / 2**20:.2f} MiB"
        size = f"size={self.size}" if self.shards == 1 else f"size={self.size} per shard x {self.shards} shards"
        return (
            f"BudgetPlan(chunk={self.chunk}, {size}, budget={mib(self.budget)}, "
            f"mode={self.mode!r}, cap={mib(self.cap)}, predicted={mib(self.predicted_bytes)}, "
            f"compiled={mib(self.compiled_bytes)}, probes={len(self.probes)})"
        )


def choose_chunk(
    temp_bytes: Callable[[int], int],
    n: int,
    budget: int,
    *,
    mode: str = "grad",
    cap: int | None = None,
    element_bytes: int | None = None,
) -> BudgetPlan:
    """The largest chunk of an axis of ``n`` whose compiled temp memory is within ``budget``.

    Args:
        temp_bytes: ``temp_bytes(chunk) -> int``, the compiled temp memory (bytes) of the
            program at ``chunk`` (``chunk == n`` meaning unchunked). It is called a few times
            (one compile each, never twice for chunks that run the same loop): at ``n`` (for a
            large axis only when two probe chunks predict that it may fit), at the two probes,
            and at each candidate until one is within 80-100% of the budget.
        n: the size of the mapped axis (positive).
        budget: the budget in bytes.
        mode: recorded in the plan (what ``temp_bytes`` measures).
        cap: a throughput cap (bytes, or None): the search aims at ``min(budget, cap)``; when
            no chunk fits the cap, the least-memory chunk found within ``budget`` is taken.
        element_bytes: a compile-free estimate of one element's bytes
            (:func:`chunkop._estimate.element_bytes`), or None. When given and the cap is at
            least ``_estimate.MARGIN`` times below ``budget`` (CPU with the default budget), the
            chunk is ``cap // element_bytes`` (no chunking when that reaches half the axis) and
            nothing is compiled: the plan's ``compiled_bytes`` is None.

    Returns:
        A :class:`BudgetPlan`; ``plan.chunk`` is None when the whole axis fits.

    Raises:
        ValueError: when even ``chunk=1`` is over the budget (the message gives its memory).

    Example:
        >>> from chunkop._search import choose_chunk
        >>> plan = choose_chunk(lambda c: 1000 + 8 * c, n=10_000, budget=41_000)
        >>> plan.chunk, plan.compiled_bytes <= 41_000
        (5000, True)
    """
    if n <= 0:
        raise ValueError(f"choose_chunk: the axis size must be positive, got {n}.")
    search = _Search(temp_bytes, n, budget, budget if cap is None else min(budget, cap), mode, cap)
    if element_bytes is not None and cap is not None and cap * _estimate.MARGIN <= budget:
        return _from_estimate(search, element_bytes)
    whole = _whole_axis(search)
    if whole is not None:
        return whole
    for c in search.probe_chunks():
        search.measure(c)
    predictions: dict[int, int] = {}  # the model's prediction at each candidate, before compiling it
    for _ in range(_MAX_VERIFY):
        if not _bracketing_step(search, predictions):
            break
    inside = search.inside()
    c, b = inside[-1] if inside else _halving_fallback(search)
    return search.result(c, predictions.get(c), b)


@dataclasses.dataclass
class _Search:
    """One search's measure, axis and budgets, and every chunk measured so far.

    Attributes:
        temp_bytes: the measure (see :func:`choose_chunk`).
        n: the size of the axis.
        user_budget: the caller's budget: what the plan reports, and the bound no chunk may pass.
        budget: what the search aims at: ``min(user_budget, cap)``.
        mode: recorded in the plan.
        cap: the throughput cap, or None.
        measured: ``{chunk: temp_bytes}`` in the order measured, keyed by the chunk the loop
            really runs (the plan's probes).
    """

    temp_bytes: Callable[[int], int]
    n: int
    user_budget: int
    budget: int
    mode: str
    cap: int | None
    measured: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def close_enough(self) -> float:
        """The share of ``budget`` a measured chunk must reach to end the search: 80% of a user's
        budget; half of the throughput cap, a speed heuristic (chunks a few times apart run at
        about the same speed) where each further probe is a compile of the program and its VJP."""
        return 0.5 if self.budget < self.user_budget else 0.8

    def effective(self, c: int) -> int:
        """The chunk the loop really runs when asked for ``c`` (make_plan may even out the chunks)."""
        return c if c >= self.n else make_plan(self.n, c).chunk

    def measure(self, c: int) -> int:
        """``temp_bytes`` at ``c``, measured once per loop (asked-for chunks that run the same
        loop share one measurement)."""
        c = self.effective(c)
        if c not in self.measured:
            self.measured[c] = int(self.temp_bytes(c))
        return self.measured[c]

    def probe_chunks(self) -> tuple[int, int]:
        """The two probes the affine model starts from, well inside the axis."""
        c1 = max(1, min(self.n // 16, 1024))
        return c1, max(c1 + 1, min(self.n // 2, 4 * c1))

    def inside(self) -> list[tuple[int, int]]:
        """The measured ``(chunk, bytes)`` within ``budget`` (chunked: below ``n``), by chunk."""
        return sorted((c, b) for c, b in self.measured.items() if b <= self.budget and c < self.n)

    def result(self, c: int | None, predicted: int | None, compiled: int | None) -> BudgetPlan:
        """The plan of chunk ``c`` (None: unchunked), with what was predicted and measured there."""
        c = None if c is None else self.effective(c)
        probes = tuple(self.measured.items())
        return BudgetPlan(c, self.n, int(self.user_budget), self.mode, predicted, compiled, probes, self.cap)


def _from_estimate(search: _Search, element_bytes: int) -> BudgetPlan:
    """The compile-free plan: ``cap // element_bytes`` elements per chunk, nothing measured.

    Args:
        search: the search (its ``budget`` is the cap).
        element_bytes: the estimated bytes of one element.

    Returns:
        The plan: unchunked when the chunk reaches half the axis (which would save nothing);
        otherwise a divisor of ``n`` within 2x below the target if there is one (no remainder
        chunk, whose body is a second compile), else a chunk with a small remainder.
    """
    n = search.n
    target = search.budget // max(1, element_bytes)
    if target >= max(1, n // 2):
        return search.result(None, element_bytes * n, None)
    even = [d for d in divisors(n) if target // 2 <= d <= target]
    c = search.effective(max(even) if even else _candidate(n, max(1, target), 0))
    return search.result(c, element_bytes * c, None)


def _whole_axis(search: _Search) -> BudgetPlan | None:
    """The unchunked plan when the whole axis fits, else None (the chunk search goes on).

    A small axis is compiled whole first (it may fit); a large one (over 16 probes of 256) only
    when the two probes' line predicts that it might fit, since each compile is a planning cost.

    Args:
        search: the search (the probes measured here stay measured).

    Returns:
        The plan without chunking, or None.

    Raises:
        ValueError: for an axis of one element over the caller's budget.
    """
    n = search.n
    if n > 16 * 256:
        c1, c2 = search.probe_chunks()
        b1, b2 = search.measure(c1), search.measure(c2)
        c1e, c2e = search.effective(c1), search.effective(c2)
        predicted_whole = b2 + (b2 - b1) / max(1, c2e - c1e) * (n - c2e)
        whole = search.measure(n) if predicted_whole <= 1.25 * search.budget else None
    else:
        whole = search.measure(n)
    if whole is not None and (whole <= search.budget or (n == 1 and whole <= search.user_budget)):
        return search.result(None, None, whole)
    if n == 1:
        raise _too_small(search.user_budget, n, (1, whole), search.mode)
    return None


def _bracketing_step(search: _Search, predictions: dict[int, int]) -> bool:
    """Measure the next candidate chunk, interpolated on the line through two measured chunks.

    The line runs between the largest chunk within the budget and the smallest over it
    (extrapolating while one side is missing); the candidate is where it meets the budget,
    kept within that bracket and at most half the axis (a chunk above ``n / 2`` leaves one full
    chunk and a remainder of nearly the same size: no saving).

    Args:
        search: the search (the candidate measured here stays measured).
        predictions: the line's prediction at each candidate, recorded here before measuring it.

    Returns:
        False when the search is settled (a chunk within ``close_enough`` of the budget, a
        bracket too narrow to split, or nothing new to measure); True to take another step.
    """
    n, budget = search.n, search.budget
    if any(search.close_enough * budget <= b <= budget for c, b in search.measured.items() if c < n):
        return False  # a chunk already landed close enough
    inside = search.inside()
    over = sorted((c, b) for c, b in search.measured.items() if b > budget and (not inside or c > inside[-1][0]))
    line = _line(inside, over)
    if line is None:
        return False
    (ca, ba), (cb, bb) = line
    low = inside[-1][0] if inside else 0
    if low >= max(1, n // 2):
        return False
    slope = (bb - ba) / (cb - ca) if cb != ca else 0.0
    target = n - 1 if slope <= 0 else math.floor(ca + (budget - ba) / slope)
    high = over[0][0] if (inside and over) else n
    target = max(low + 1, min(target, high - 1, max(1, n // 2)))
    c = _candidate(n, target, low)
    if c in search.measured:
        return False
    predictions[search.effective(c)] = round(ba + slope * (search.effective(c) - ca))
    b = search.measure(c)
    return not search.close_enough * budget <= b <= budget  # another compile costs more than it gains


def _line(inside: list[tuple[int, int]], over: list[tuple[int, int]]) -> tuple | None:
    """The two measured ``(chunk, bytes)`` to interpolate between, or None.

    Args:
        inside: the measured chunks within the budget, by chunk.
        over: the measured chunks over it (above the largest inside), by chunk.

    Returns:
        The largest inside and smallest over (None when they are within 5% of each other: the
        bracket is settled); else the two largest inside, or the two smallest over (one point
        twice when there is only one).
    """
    if inside and over:
        (ca, _), (cb, _) = inside[-1], over[0]
        return None if cb - ca <= max(1, ca // 20) else (inside[-1], over[0])
    points = inside[-2:] if inside else over[:2]
    return (points[0], points[-1])


def _halving_fallback(search: _Search) -> tuple[int, int]:
    """The chunk to take when every bracketing step was over the budget.

    Halves from the smallest chunk measured until one fits, or until smaller chunks stop saving
    memory (per-step costs); failing that, the least-memory chunk found, if it is within the
    caller's budget (over the throughput cap only).

    Args:
        search: the search.

    Returns:
        ``(chunk, temp_bytes)``.

    Raises:
        ValueError: when no chunk is within the caller's budget.
    """
    c = min(search.measured)
    while c > 1:
        previous = search.measure(c)  # (measured already)
        c = max(1, c // 2)
        b = search.measure(c)
        if b <= search.budget:
            return c, b
        if b >= previous:  # smaller chunks stopped saving memory
            break
    least = min(search.measured.items(), key=lambda kv: kv[1])
    if least[1] <= search.user_budget and least[0] < search.n:  # over the cap only
        return least
    raise _too_small(search.user_budget, search.n, least, search.mode)


def _candidate(n: int, target: int, low: int) -> int:
    """A chunk in ``(low, target]`` for an axis of ``n``.

    The largest chunk of at least ``target / 2`` whose remainder ``n % chunk`` is at most an
    eighth of it (a divisor of ``n`` is best): XLA does not always share the remainder chunk's
    buffers with the scan's, so a large remainder can add up to a chunk's worth of temp memory
    (measured: chunk 4615 of 8192, remainder 3577, 40.5 MiB vs 24.3 MiB at chunk 4096).

    Args:
        n: the size of the axis.
        target: the largest chunk wanted.
        low: every chunk up to it is already known to fit (or 0).

    Returns:
        That chunk; otherwise ``target`` itself.
    """
    floor = max(low + 1, (target + 1) // 2)
    for c in range(target, floor - 1, -1):
        if n % c <= c // 8:
            return c
    return target


def _too_small(budget: int, n: int, smallest: tuple[int, int], mode: str) -> ValueError:
    """The error for a budget that no chunk fits, with the least memory found."""
    return ValueError(
        f"chunkop: `memory_budget`={budget} bytes is too small: the least temp memory found "
        f"was {smallest[1]} bytes, at chunk_size={smallest[0]} (mode={mode!r}, axis size {n}). "
        f"Give a larger memory_budget or an explicit chunk_size."
    )
