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

**The per-chunk overhead floor** (where the cap binds, i.e. on CPU below a larger budget). Every
loop step costs work that does not shrink with the chunk: the step itself (slicing, the fusion
barrier, a few kernel launches: :data:`STEP_BYTES` of work) and a buffer the size of each
unmapped operand per use after the first (:func:`chunkop._estimate.fixed_bytes`: the cotangents
of a weight matrix under ``jax.grad``, the images a ``RowOperator``'s transpose scatters into). A chunk whose
estimated bytes are less than :data:`OVERHEAD_RATIO` times that fixed work spends a tenth or
more of its time on overhead (figures: ``benchmarks/RESULTS.md``, "Figures behind the planner's
constants"). So the chunk is at least :func:`overhead_floor` elements, even where
one element is so large that the cap alone would allow fewer: the soft cap is then exceeded, up
to :data:`OVER_CAP` times it (by the estimate, which errs high), never past a caller's budget.
The floor is reported as ``plan.floor``.

The result is a :class:`BudgetPlan`: the chunk and the measurements behind it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from . import _estimate
from ._chunking import divisors, make_plan

__all__ = ["BudgetPlan", "choose_chunk", "overhead_floor", "OVERHEAD_RATIO", "STEP_BYTES", "OVER_CAP"]


_MAX_VERIFY = 6  # compiles after the two probes before falling back to halving

#: A chunk's estimated bytes should be at least this many times the work every chunk does
#: whatever its size (:func:`overhead_floor`): the overhead is then a small share of a step.
OVERHEAD_RATIO = 16
#: The fixed work of one loop step (the scan step, the chunk's slices and fusion barrier, the
#: launches of the body's kernels), in bytes of estimated work: the time of one step's overhead
#: on CPU, times the rate at which the CPU processes estimated bytes (how it was measured:
#: ``benchmarks/RESULTS.md``, "Figures behind the planner's constants").
STEP_BYTES = 2**20
#: How far past the CPU throughput cap the overhead floor may push a chunk (by the estimate of
#: its memory, or by its measured memory): the cap is a speed heuristic, the budget is not.
OVER_CAP = 16


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
            far below the budget: the chunk then comes from a compile-free estimate of one
            element's bytes, read from the traced program; ``predicted_bytes`` is then the
            estimate).
        probes: every ``(chunk, temp_bytes)`` compiled while planning, in order.
        cap: the throughput cap the search aimed at, if any (``chunkop.settings().cpu_temp_cap`` on CPU).
        shards: the number of devices the axis is sharded over (1: not sharded); each device
            chunks its own ``size`` elements. ``global_size`` is the whole axis,
            ``size * shards``.
        floor: the per-chunk overhead floor the search took into account (the smallest chunk
            whose estimated work is large against the fixed cost of a loop step), or None where
            it had no estimate of an element's bytes. Where the cap binds, the chunk is at least
            this (up to 16 times the cap, within the budget), even when that exceeds the cap.

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
    floor: int | None = None

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
            f"compiled={mib(self.compiled_bytes)}, probes={len(self.probes)}"
            + ("" if self.floor is None else f", floor={self.floor}")
            + ")"
        )


def choose_chunk(
    temp_bytes: Callable[[int], int],
    n: int,
    budget: int,
    *,
    mode: str = "grad",
    cap: int | None = None,
    element_bytes: int | None = None,
    fixed_bytes: int | None = None,
    batch: int = 1,
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
        fixed_bytes: the estimated work every chunk does whatever its size
            (:func:`chunkop._estimate.fixed_bytes`), or None for none but the loop step's. With
            ``element_bytes``, it sets the overhead floor (:func:`overhead_floor`) that a chunk
            bound by the cap is raised to, past the cap up to ``OVER_CAP`` times it.
        batch: how many elements one chunk element stands for in memory (the examples of
            enclosing ``jax.vmap``s when ``temp_bytes`` measures the batched program): scales
            ``element_bytes`` for the memory estimate, not for the floor (which compares per
            example work with per example overhead).

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
    floor = None if element_bytes is None else min(n, overhead_floor(element_bytes, fixed_bytes))
    search = _Search(temp_bytes, n, budget, budget if cap is None else min(budget, cap), mode, cap, floor)
    if element_bytes is not None and cap is not None and cap * _estimate.MARGIN <= budget:
        return _from_estimate(search, element_bytes * max(1, batch))
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
    c, b = _raised_to_floor(search, c, b, predictions)
    return search.result(c, predictions.get(c), b)


def overhead_floor(element_bytes: int, fixed_bytes: int | None = None) -> int:
    """The smallest chunk whose work amortises the per-chunk overhead (see the module notes).

    ``ceil(OVERHEAD_RATIO * (fixed_bytes + STEP_BYTES) / element_bytes)``: a chunk's estimated
    bytes are then at least :data:`OVERHEAD_RATIO` times the work every step does whatever its
    size (one loop step, :data:`STEP_BYTES`, and ``fixed_bytes``).

    Args:
        element_bytes: the estimated bytes of one element (:func:`chunkop._estimate.element_bytes`).
        fixed_bytes: the estimated fixed work of a chunk (:func:`chunkop._estimate.fixed_bytes`),
            or None for none besides the step.

    Returns:
        The floor, at least 1.

    Example:
        >>> from chunkop._search import overhead_floor
        >>> overhead_floor(1024)  # 1 KiB elements: 16 MiB of work per step
        16384
        >>> overhead_floor(600 * 1024, fixed_bytes=36 * 2**20)  # a CT ray: 3 passes over 3 extra 4 MiB images
        1011
    """
    fixed = STEP_BYTES + max(0, fixed_bytes or 0)
    return max(1, -(-OVERHEAD_RATIO * fixed // max(1, int(element_bytes))))


def _raised_to_floor(search: _Search, c: int, b: int, predictions: dict[int, int]) -> tuple[int, int]:
    """The measured chunk ``c`` (``b`` bytes), raised toward the overhead floor where the cap bound it.

    Only where the search aimed at the throughput cap (below the caller's budget) and ``c`` is
    below ``search.floor``: one more chunk is compiled, the floor (a divisor of ``n`` at or just
    above it when there is one) or, when the line through the two largest measured chunks
    predicts more, the largest chunk predicted within ``min(budget, OVER_CAP * cap)``; it is
    taken if its measured memory is within that bound.

    Returns:
        ``(chunk, bytes)``: the raised chunk, or ``(c, b)`` unchanged.
    """
    floor, n = search.floor, search.n
    if floor is None or c >= floor or search.budget >= search.user_budget:
        return c, b
    bound = search.over_cap_bound
    target = search.floor_chunk()
    line = sorted((k, v) for k, v in search.measured.items() if k < n)[-2:]
    slope = (line[1][1] - line[0][1]) / (line[1][0] - line[0][0]) if len(line) == 2 else 0.0
    if slope > 0:
        target = min(target, math.floor(line[1][0] + (bound - line[1][1]) / slope))
    chunk = search.effective(max(1, target))
    if chunk <= c or chunk in search.measured:
        return c, b
    if slope > 0:
        predictions[chunk] = round(line[1][1] + slope * (chunk - line[1][0]))
    bt = search.measure(chunk)
    return (chunk, bt) if bt <= bound else (c, b)


def _at_least(n: int, low: int, limit: int) -> int:
    """A chunk of at least ``low`` as the chunk plan runs it: the smallest divisor of ``n`` in
    ``[low, limit]`` (no remainder chunk), else the smallest chunk from ``low`` up that
    :func:`chunkop._chunking.make_plan` does not even out below ``low``, at most ``limit``
    (where it may then run a little below ``low``)."""
    even = [d for d in divisors(n) if low <= d <= limit]
    if even:
        return min(even)
    c = low
    for _ in range(8):
        ran = make_plan(n, c).chunk if c < n else c
        if ran >= low or c >= limit:
            return min(c, max(low, limit))
        c = ran * 4 // 3 + 1  # (make_plan evens out to a divisor of at least 3/4 of the chunk)
    return min(c, max(low, limit))


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
        floor: the per-chunk overhead floor (:func:`overhead_floor`), or None.
        measured: ``{chunk: temp_bytes}`` in the order measured, keyed by the chunk the loop
            really runs (the plan's probes).
    """

    temp_bytes: Callable[[int], int]
    n: int
    user_budget: int
    budget: int
    mode: str
    cap: int | None
    floor: int | None = None
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

    @property
    def over_cap_bound(self) -> int:
        """How far past the throughput cap the overhead floor may take a chunk's memory:
        ``OVER_CAP`` times the cap, never past the caller's budget."""
        return min(self.user_budget, OVER_CAP * self.budget)

    def floor_chunk(self) -> int:
        """The chunk the overhead floor asks for: the smallest divisor of ``n`` at or just above
        ``floor`` (:func:`_at_least`), at most half the axis."""
        return min(_at_least(self.n, self.floor, self.floor + self.floor // 2), max(1, self.n // 2))

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
        plan = BudgetPlan(c, self.n, int(self.user_budget), self.mode, predicted, compiled, probes, self.cap)
        return plan._replace(floor=self.floor)


def _from_estimate(search: _Search, element_bytes: int) -> BudgetPlan:
    """The compile-free plan: ``cap // element_bytes`` elements per chunk, nothing measured.

    When that is below the overhead floor (``search.floor``), the chunk is the floor instead,
    as long as its estimated bytes stay within ``OVER_CAP`` times the cap: the estimate errs
    high and the budget is at least ``_estimate.MARGIN`` times the cap here, so the raised chunk
    still fits the budget. Where the floor's estimate is past that bound, the floor's program is
    compiled once and taken if its measured memory is within the bound; else the largest chunk
    whose estimate is.

    Args:
        search: the search (its ``budget`` is the cap).
        element_bytes: the estimated bytes of one element (times an enclosing batch).

    Returns:
        The plan: unchunked when the chunk reaches half the axis (which would save nothing);
        otherwise a divisor of ``n`` within 2x below the target if there is one (no remainder
        chunk, whose body is a second compile), else a chunk with a small remainder; a chunk
        raised to the floor is the smallest divisor of ``n`` up to 1.5x above it, else the floor.
    """
    n = search.n
    element_bytes = max(1, element_bytes)
    target = search.budget // element_bytes
    floor = search.floor or 1
    if target < floor:  # the overhead floor, past the cap (bounded)
        limit = max(1, OVER_CAP * search.budget // element_bytes)
        if floor > limit:  # past the bound by the estimate, which errs high: measured instead
            c = search.effective(search.floor_chunk())
            if c > limit:
                b = search.measure(c)
                if b <= search.over_cap_bound:
                    return search.result(c, element_bytes * c, b)
        target = min(floor, limit)
        if target >= max(1, n // 2):
            return search.result(None, element_bytes * n, None)
        c = search.effective(_at_least(n, target, min(limit, target + target // 2)))
        return search.result(c, element_bytes * c, None)
    if target >= max(1, n // 2):
        return search.result(None, element_bytes * n, None)
    even = [d for d in divisors(n) if max(target // 2, floor) <= d <= target]
    if even:
        c = max(even)
    else:  # (no divisor between the floor and the cap: the smallest above the floor, within the bound)
        limit = max(1, OVER_CAP * search.budget // element_bytes)
        c = _at_least(n, max(floor, _candidate(n, max(1, target), 0)), min(limit, floor + floor // 2))
    c = search.effective(c)
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
    memory (per-step costs) or cannot save enough (what halving saves halves each time: from
    ``b`` after saving ``previous - b``, nothing reaches below ``2 b - previous``); then tries
    the other way of reading chunks (:func:`_other_layout`); failing that, the least-memory
    chunk found, if it is within the caller's budget (over the throughput cap only).

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
        if b >= previous or 2 * b - previous > search.budget:
            break
    other = _other_layout(search)
    if other is not None:
        return other
    least = min(search.measured.items(), key=lambda kv: kv[1])
    if least[1] <= search.user_budget and least[0] < search.n:  # over the cap only
        return least
    raise _too_small(search.user_budget, search.n, least, search.mode)


def _with_remainder(n: int, c: int) -> int | None:
    """The largest chunk in ``(c - 64, c]`` that leaves a remainder of ``n`` (and that the chunk
    plan keeps as it is), or None."""
    for k in range(min(c, n - 1), max(1, c - 64), -1):
        if n % k and make_plan(n, k).chunk == k:
            return k
    return None


def _other_layout(search: _Search) -> tuple[int, int] | None:
    """A chunk within the budget among those that leave a remainder, when every chunk measured divides ``n``.

    A chunk that divides the axis is read through a reshape of the inputs, one that does not
    through slices inside the loop body (:mod:`chunkop._chunking`); under an enclosing
    ``jax.vmap`` the two can differ by a copy of the batched inputs (an example:
    ``benchmarks/RESULTS.md``, "Figures behind the planner's constants"). So when every chunk
    tried divides ``n`` and none fits, chunks with a remainder are tried: from the first
    probe down by halves (at most four compiles) and, from one that fits, one step up along the
    probes' slope.

    Returns:
        ``(chunk, temp_bytes)`` within ``search.budget``, or None.
    """
    n, budget = search.n, search.budget
    if any(n % c for c in search.measured if c < n):
        return None  # (chunks with a remainder were measured: the search saw that layout)
    c1, c2 = (search.effective(c) for c in search.probe_chunks())
    b1, b2 = search.measured.get(c1), search.measured.get(c2)
    slope = (b2 - b1) / (c2 - c1) if b1 is not None and b2 is not None and c2 > c1 else 0.0
    c = _with_remainder(n, c1)
    for _ in range(4):
        if c is None or c in search.measured:
            return None
        b = search.measure(c)
        if b <= budget:
            up = _with_remainder(n, min(n // 2, math.floor(c + (budget - b) / slope))) if slope > 0 else None
            if up is not None and up > c and up not in search.measured:
                bu = search.measure(up)
                if bu <= budget:
                    return up, bu
            return c, b
        c = _with_remainder(n, c // 2)
    return None


def _candidate(n: int, target: int, low: int) -> int:
    """A chunk in ``(low, target]`` for an axis of ``n``.

    The largest chunk of at least ``target / 2`` whose remainder ``n % chunk`` is at most an
    eighth of it (a divisor of ``n`` is best): XLA does not always share the remainder chunk's
    buffers with the scan's, so a large remainder can add up to a chunk's worth of temp memory
    (an example: ``benchmarks/RESULTS.md``, "Figures behind the planner's constants").

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
