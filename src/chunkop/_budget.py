"""``chunk_size="auto"``: the largest chunk whose compiled temp memory fits a memory budget.

The planner never guesses memory from shapes: it asks XLA. Given a callable
``temp_bytes(chunk) -> int`` that compiles the chunked program at ``chunk`` and returns its
``memory_analysis().temp_size_in_bytes``, :func:`choose_chunk`

1. compiles the whole axis unchunked (``chunk = n``) - for a large axis only when step 2's
   model predicts that it may fit; if it fits, there is no chunking at all;
2. compiles at two chunk sizes and fits an affine model ``a + b * chunk`` (above a small floor,
   a chunked program's temp memory is one chunk's intermediates plus chunk-independent buffers);
3. compiles the largest chunk the model allows (preferring chunks that leave no or a small
   remainder) and, until one lands within 80-100% of the budget (50-100% of the CPU throughput
   cap, a speed heuristic where precision buys nothing), brackets between the largest
   chunk that fitted and the smallest that did not, interpolating linearly; the largest
   compiled chunk within the budget wins. No loop is compiled twice.

The temp memory counted is XLA's temporary buffers (intermediates, scan carries, residuals):
not the arguments and outputs, which exist whatever the chunk. The budget is compared with the
*worst* of the transforms the program may be run under (see :func:`program_temp_bytes`): the
forward program and its VJP (what ``jax.grad`` of a loss built on it compiles), since a wrapper
called inside a user's ``jax.grad`` cannot always know, when it plans, which transform will be
applied; and also the Hessian-vector product when the arguments arrive traced under two
forward-mode levels (:func:`plan_mode`).

The default budget (:func:`default_budget`) is ``chunkop.settings().budget_fraction`` of the device's free
memory: ``bytes_limit - bytes_in_use`` from ``device.memory_stats()`` on accelerators, and
``MemAvailable`` from ``/proc/meminfo`` on CPU. On CPU the search also aims no higher than
``chunkop.settings().cpu_temp_cap`` (cache-sized chunks are faster there); when that cap is at
least ``_estimate.MARGIN`` times below the budget (the default budget), it is the only bound
that binds, and a speed heuristic: the chunk then comes from :mod:`chunkop._estimate`, without
compiling anything (``plan.compiled_bytes`` is None).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _estimate
from ._axes import replace_at
from ._cache import register_cache
from ._chunking import divisors, make_plan
from ._settings import settings
from ._tree import is_float as _is_float
from ._tree import struct_of as _struct

__all__ = [
    "MODES",
    "BudgetPlan",
    "choose_chunk",
    "default_budget",
    "check_memory_budget",
    "check_mode",
    "program_temp_bytes",
]


#: The transforms a plan can cover: the forward program only, the worst of forward and VJP
#: (default; what ``jax.grad`` compiles), or those and a Hessian-vector product.
MODES = ("forward", "grad", "hvp")

# On CPU, chunking is also a throughput optimisation: chunks whose working set stays near the
# caches run faster than one large vectorised pass (benchmarks/results/vmap.json: a 4-layer MLP's
# grad at N = 65536 ran 1.21x jax.vmap's speed at chunk 1024, 4.8 MiB of temp, and 1.27-1.96x at
# chunk 4096, 17.5 MiB). So on CPU the planner aims at min(budget, settings().cpu_temp_cap)
# (16 MiB by default, chunkop.configure changes it). Accelerators get no cap.

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


def check_memory_budget(memory_budget: Any, where: str = "chunkop") -> int | None:
    """Validate ``memory_budget``: None (the default budget) or a positive number of bytes."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{where}: `memory_budget` must be a positive number of bytes or None, got "
            f"{memory_budget!r} of type {type(memory_budget).__name__}."
        )
    if not math.isfinite(memory_budget) or memory_budget < 1:
        raise ValueError(
            f"{where}: `memory_budget` must be a positive number of bytes (at least 1), got {memory_budget!r}."
        )
    return int(memory_budget)


def check_budget_needs_auto(chunk_size: Any, memory_budget: Any, where: str) -> None:
    """``memory_budget`` only means something with ``chunk_size="auto"``: refuse it otherwise."""
    if memory_budget is not None and chunk_size != "auto":
        raise ValueError(
            f'{where}: `memory_budget` is used only with chunk_size="auto" (it chooses the chunk), '
            f'but chunk_size={chunk_size!r}; pass chunk_size="auto", or drop memory_budget.'
        )


def check_mode(mode: Any, where: str = "chunkop") -> str:
    """Validate the ``mode`` a plan covers (one of :data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"{where}: `mode` must be one of {MODES}, got {mode!r}.")
    return mode


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_memory(device: Any = None) -> int:
    """Free memory of ``device`` (default: the first local device), in bytes.

    Args:
        device: a ``jax.Device``; None for ``jax.local_devices()[0]``.

    Returns:
        ``bytes_limit - bytes_in_use`` from ``device.memory_stats()`` when the backend reports
        them (GPU, TPU); otherwise (CPU) the available RAM (``MemAvailable`` in
        ``/proc/meminfo``, or the physical memory from ``os.sysconf``).
    """
    device = jax.local_devices()[0] if device is None else device
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (backends without memory stats raise or return None)
        stats = None
    if stats and "bytes_limit" in stats:
        return max(0, int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    available = _meminfo_available()
    if available is not None:
        return available
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**30


def throughput_cap(device: Any = None) -> int | None:
    """``chunkop.settings().cpu_temp_cap`` on a CPU device, None elsewhere (see the note above)."""
    device = jax.local_devices()[0] if device is None else device
    return settings().cpu_temp_cap if device.platform == "cpu" else None


def default_budget(device: Any = None) -> int:
    """The default memory budget: ``chunkop.settings().budget_fraction`` (0.5) of :func:`free_memory`, rounded down
    to three significant binary digits (e.g. 11.5 GB -> 10 GiB).

    The rounding keeps the budget, and so the plans cached under it, the same from call to call
    while the free memory drifts by a few pages.

    Args:
        device: a ``jax.Device``; None for the first local device.

    Returns:
        The budget in bytes.

    Example:
        >>> from chunkop._budget import default_budget, free_memory
        >>> 0 < default_budget() <= free_memory()
        True
    """
    budget = max(1, int(settings().budget_fraction * free_memory(device)))
    unit = 1 << max(0, budget.bit_length() - 3)
    return budget - budget % unit


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
        >>> from chunkop._budget import choose_chunk
        >>> plan = choose_chunk(lambda c: 1000 + 8 * c, n=10_000, budget=41_000)
        >>> plan.chunk, plan.compiled_bytes <= 41_000
        (5000, True)
    """
    if n <= 0:
        raise ValueError(f"choose_chunk: the axis size must be positive, got {n}.")
    probes: list[tuple[int, int]] = []
    measured: dict[int, int] = {}

    def effective(c: int) -> int:
        """The chunk the loop really runs when asked for ``c`` (make_plan may even out the chunks)."""
        return c if c >= n else make_plan(n, c).chunk

    def measure(c: int) -> int:
        c = effective(c)  # asked-for chunks that run the same loop are compiled once
        if c not in measured:
            measured[c] = int(temp_bytes(c))
            probes.append((c, measured[c]))
        return measured[c]

    def plan(c: int | None, predicted: int | None, compiled: int) -> BudgetPlan:
        c = None if c is None else effective(c)
        return BudgetPlan(c, n, int(user_budget), mode, predicted, compiled, tuple(probes), cap)

    user_budget, budget = budget, budget if cap is None else min(budget, cap)
    if element_bytes is not None and cap is not None and cap * _estimate.MARGIN <= user_budget:
        target = budget // max(1, element_bytes)
        if target >= max(1, n // 2):  # (a chunk over half the axis saves nothing)
            return plan(None, element_bytes * n, None)
        # a divisor of n when one is within 2x: no remainder chunk, whose body is a second compile
        even = [d for d in divisors(n) if target // 2 <= d <= target]
        c = effective(max(even) if even else _candidate(n, max(1, target), 0))
        return plan(c, element_bytes * c, None)
    # Within 80% of a user's budget is close enough; the throughput cap is a speed heuristic
    # (chunks a few times apart run at about the same speed), so half of it is: on first use
    # each further probe is a compile of the program and its VJP.
    close_enough = 0.5 if budget < user_budget else 0.8

    # Two probes well inside the axis, then a bracketing search: linear interpolation between the
    # largest chunk within the budget and the smallest over it (extrapolation while one is missing).
    # A small axis is compiled whole first (it may fit); a large one (over 16 probes of 256) only
    # when the probes' line predicts it might fit, since each compile is a planning cost.
    c1 = max(1, min(n // 16, 1024))
    c2 = max(c1 + 1, min(n // 2, 4 * c1))
    if n > 16 * 256:
        b1, b2 = measure(c1), measure(c2)
        c1e, c2e = effective(c1), effective(c2)
        predicted_whole = b2 + (b2 - b1) / max(1, c2e - c1e) * (n - c2e)
        whole = measure(n) if predicted_whole <= 1.25 * budget else None
    else:
        whole = measure(n)
    if whole is not None and (whole <= budget or (n == 1 and whole <= user_budget)):
        return plan(None, None, whole)
    if n == 1:
        raise _too_small(user_budget, n, (1, whole), mode)
    measure(c1)
    measure(c2)
    predictions: dict[int, int] = {}  # the model's prediction at each candidate, before compiling it
    for _ in range(_MAX_VERIFY):
        if any(close_enough * budget <= b <= budget for c, b in measured.items() if c < n):
            break  # a probe already landed close enough
        inside = sorted((c, b) for c, b in measured.items() if b <= budget and c < n)
        over = sorted((c, b) for c, b in measured.items() if b > budget and (not inside or c > inside[-1][0]))
        if inside and over:
            (ca, ba), (cb, bb) = inside[-1], over[0]
            if cb - ca <= max(1, ca // 20):
                break
        elif inside:
            (ca, ba), (cb, bb) = inside[-2:] if len(inside) > 1 else (inside[-1], inside[-1])
        else:
            (ca, ba), (cb, bb) = over[:2] if len(over) > 1 else (over[0], over[0])
        slope = (bb - ba) / (cb - ca) if cb != ca else 0.0
        target = n - 1 if slope <= 0 else math.floor(ca + (budget - ba) / slope)
        low = inside[-1][0] if inside else 0
        if low >= max(1, n // 2):
            break
        high = over[0][0] if (inside and over) else n
        # chunks above n / 2 leave one full chunk and a remainder of nearly the same size: no saving
        target = max(low + 1, min(target, high - 1, max(1, n // 2)))
        c = _candidate(n, target, low)
        if c in measured:
            break
        predictions[effective(c)] = round(ba + slope * (effective(c) - ca))
        b = measure(c)
        if b <= budget and b >= close_enough * budget:  # another compile costs more than it gains
            break

    inside = sorted((c, b) for c, b in measured.items() if b <= budget and c < n)
    if not inside:  # every model step was over the budget: halve from the smallest chunk tried
        c = min(measured)
        while c > 1:
            previous = measured[c]
            c = max(1, c // 2)
            if measure(c) <= budget:
                inside = [(c, measured[c])]
                break
            if measured[c] >= previous:  # smaller chunks stopped saving memory (per-step costs)
                break
        least = min(measured.items(), key=lambda kv: kv[1])
        if not inside and least[1] <= user_budget and least[0] < n:  # over the cap only
            inside = [least]
        if not inside:
            raise _too_small(user_budget, n, least, mode)
    c, b = inside[-1]
    return plan(c, predictions.get(c), b)


def _candidate(n: int, target: int, low: int) -> int:
    """A chunk in ``(low, target]`` for an axis of ``n``.

    The largest chunk of at least ``target / 2`` whose remainder ``n % chunk`` is at most an
    eighth of it (a divisor of ``n`` is best): XLA does not always share the remainder chunk's
    buffers with the scan's, so a large remainder can add up to a chunk's worth of temp memory
    (measured: chunk 4615 of 8192, remainder 3577, 40.5 MiB vs 24.3 MiB at chunk 4096).
    Otherwise ``target`` itself.
    """
    floor = max(low + 1, (target + 1) // 2)
    for c in range(target, floor - 1, -1):
        if n % c <= c // 8:
            return c
    return target


def _too_small(budget: int, n: int, smallest: tuple[int, int], mode: str) -> ValueError:
    return ValueError(
        f"chunkop: `memory_budget`={budget} bytes is too small: the least temp memory found "
        f"was {smallest[1]} bytes, at chunk_size={smallest[0]} (mode={mode!r}, axis size {n}). "
        f"Give a larger memory_budget or an explicit chunk_size."
    )


# ----------------------------------------------------------------------------------------------
# Measuring a program's temp memory under the transforms it may be run with.


# What a probe compile needs is XLA's buffer assignment, which runs before code generation: on
# CPU, the LLVM backend at optimisation level 0 gives the same temp size (checked in
# tests/test_budget.py) in about 60% of the compile time.
_PROBE_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0}}


def _compiled_temp(fn: Callable, *structs: Any) -> int:
    lowered = jax.jit(fn).lower(*structs)
    options = _PROBE_OPTIONS.get(jax.default_backend())
    compiled = lowered.compile(options) if options else lowered.compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def program_temp_bytes(fn: Callable, leaves: Sequence[Any], mode: str = "grad") -> int:
    """Compiled temp memory of ``fn(*leaves)`` under ``mode``'s transforms (the worst of them).

    ``leaves`` may be arrays, tracers or ``jax.ShapeDtypeStruct``: only shapes and dtypes are
    used; nothing runs. The programs compiled, all w.r.t. every float leaf:

    - ``"forward"``: ``fn`` itself;
    - ``"grad"``: also ``jax.vjp`` of ``fn`` (forward, residuals and backward pass), which is
      what ``jax.grad`` of a loss built on ``fn`` compiles (a program that also returned the
      forward outputs would count them as temp: they are copied out of the loop there);
    - ``"hvp"``: also the forward-over-reverse Hessian-vector product of ``<fn(x), 1>``.

    Args:
        fn: a function of ``len(leaves)`` positional arrays returning a pytree of arrays.
        leaves: example arguments (only their shapes/dtypes matter).
        mode: one of ``"forward"``, ``"grad"``, ``"hvp"``.

    Returns:
        The largest ``temp_size_in_bytes`` among the compiled programs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._budget import program_temp_bytes
        >>> f = lambda x: jnp.sin(x) * 2
        >>> program_temp_bytes(f, [jax.ShapeDtypeStruct((1000,), jnp.float32)], "forward") >= 0
        True
    """
    check_mode(mode)
    structs = [_struct(x) for x in leaves]
    worst = _compiled_temp(fn, *structs)
    diff = [i for i, s in enumerate(structs) if _is_float(s)]
    if mode == "forward" or not diff:
        return worst
    out = jax.eval_shape(fn, *structs)
    out_leaves = jax.tree_util.tree_leaves(out)
    if not any(_is_float(o) for o in out_leaves):
        return worst

    def loss(dargs: list, rest: list) -> jax.Array:
        outs = jax.tree_util.tree_leaves(fn(*replace_at(rest, diff, dargs)))
        # a fixed linear functional of the outputs: the VJP's cotangent is the weight vector
        return sum(jnp.vdot(jnp.full(o.shape, 0.5, o.dtype), o).real for o in outs if _is_float(o))

    def vjp_program(dargs: list, rest: list, cts: Any) -> Any:
        def g(d: list) -> Any:
            return fn(*replace_at(rest, diff, d))

        _, pullback = jax.vjp(g, dargs)
        return pullback(cts)

    dstructs = [structs[i] for i in diff]
    rest = list(structs)
    cts = jax.tree_util.tree_map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype if _is_float(o) else jax.dtypes.float0), out
    )
    try:
        if all(_is_float(o) for o in out_leaves):
            worst = max(worst, _compiled_temp(vjp_program, dstructs, rest, cts))
        else:
            worst = max(worst, _compiled_temp(lambda d, r: jax.grad(loss)(d, r), dstructs, rest))
        if mode == "hvp":

            def hvp(d: list, r: list, t: list) -> Any:
                return jax.jvp(lambda dd: jax.grad(loss)(dd, r), (d,), (t,))[1]

            worst = max(worst, _compiled_temp(hvp, dstructs, rest, dstructs))
    except (ValueError, TypeError, NotImplementedError) as err:
        # a program JAX cannot differentiate (a while loop with a traced trip count, ...) can only
        # be run forward: its forward program is what there is to plan for
        if "differentiat" not in str(err) and "transpose" not in str(err).lower():
            raise
    return worst


# ----------------------------------------------------------------------------------------------
# Plans for wrapped functions, cached per call signature.


_PLANS: dict = {}
register_cache(_PLANS.clear)


def cached_plan(key: Any, compute: Callable[[], BudgetPlan]) -> BudgetPlan:
    """The plan cached under ``key`` (hashable), computed by ``compute()`` on first use."""
    try:
        hash(key)
    except TypeError:
        return compute()
    plan = _PLANS.get(key)
    if plan is None:
        plan = compute()
        while _PLANS and len(_PLANS) >= settings().plan_cache_size:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


# ----------------------------------------------------------------------------------------------
# chunk_size="auto" on the chunked transforms (chunkop.vmap / map / sum / mean / jacrev / jacfwd).


def check_chunk_size_or_auto(chunk_size: Any, *, allow_none: bool = True, where: str = "chunkop") -> Any:
    """``"auto"``, or a chunk size as validated by :func:`chunkop._axes.check_chunk_size`."""
    if isinstance(chunk_size, str):
        if chunk_size == "auto":
            return "auto"
        raise TypeError(
            f"{where}: `chunk_size` must be a positive int, {'None, ' if allow_none else ''}or "
            f'"auto", got {chunk_size!r} of type str.'
        )
    from ._axes import check_chunk_size

    return check_chunk_size(chunk_size, allow_none=allow_none, where=where)


def transform_depth(leaves: Sequence[Any]) -> int:
    """How many forward-mode levels (``jvp``/``linearize``, as ``grad`` and ``hvp`` use) the
    arguments are traced under: 0 outside any, 1 under ``grad``, 2 under ``jvp(grad)``."""
    depth = 0
    for x in leaves:
        d = 0
        while type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
            d += 1
            x = getattr(x, "primal", None)
        depth = max(depth, d)
    return depth


def plan_mode(leaves: Sequence[Any]) -> str:
    """The transforms to plan for: ``"grad"`` (forward and VJP: the default, since a
    ``jax.grad`` applied around an enclosing ``jax.jit`` is not visible at trace time), or
    ``"hvp"`` when the arguments are traced under two forward-mode levels."""
    return "hvp" if transform_depth(leaves) >= 2 else "grad"


def enclosing_batch(leaves: Sequence[Any]) -> int:
    """The number of examples enclosing ``jax.vmap``s (also ``jacfwd``/``hessian``, which vmap
    over basis vectors) run a call on at once: the product of their batch sizes, 1 outside any.

    One compiled chunk loop under such a vmap holds that many chunks' temporaries at once, so
    ``"auto"`` plans for ``memory_budget`` divided by it.
    """

    def batch(x: Any, depth: int) -> int:
        if depth > 16:
            return 1
        kind = type(x).__name__
        if kind == "BatchTracer":
            bd = x.batch_dim
            size = int(x.val.shape[bd]) if isinstance(bd, int) else 1
            return size * batch(x.val, depth + 1)
        if kind in ("JVPTracer", "LinearizeTracer"):
            return max(batch(x.primal, depth + 1), batch(getattr(x, "tangent", None), depth + 1))
        return 1

    return max([batch(x, 0) for x in leaves], default=1)


def unchunked_plan(n: int, memory_budget: int | None, leaves: Sequence[Any]) -> BudgetPlan:
    """The plan of an ``"auto"`` call that does not chunk (an axis of one, or a collective)."""
    budget = memory_budget if memory_budget is not None else default_budget()
    return BudgetPlan(None, n, budget, plan_mode(leaves), None, 0, ())


def plan_traced(wrapper: Any, traced: Any, spec: Any, mapped: list, n: int) -> BudgetPlan:
    """The (cached) plan of an ``"auto"`` transform, made on the program the call will run.

    The candidate programs are the chunk loop built from the call's traced ``fun`` (``traced``,
    a :class:`chunkop._trace.Traced`) at each probed chunk, compiled on the shapes of its
    constants and mapped inputs (``fun`` is not traced again, and no wrapper is re-entered).
    The budget is ``wrapper.memory_budget`` (default: :func:`default_budget`) divided by the
    batch of enclosing ``jax.vmap``s (:func:`enclosing_batch`).

    Args:
        wrapper: the transform (its ``_loop``, ``memory_budget``, ``remat``, ``out_axes``).
        traced: ``fun`` traced on one example.
        spec: the call's :class:`chunkop._vmap.LoopSpec` (its plan is replaced per probe).
        mapped: the mapped argument leaves.
        n: the size of the mapped axis.

    Returns:
        The :class:`BudgetPlan`; its ``chunk`` is None when the whole axis fits.
    """
    leaves = [*traced.consts, *mapped]
    budget = wrapper.memory_budget if wrapper.memory_budget is not None else default_budget()
    budget = max(1, budget // enclosing_batch(leaves))
    mode = "forward" if traced.derivative_error else plan_mode(leaves)  # (it cannot be differentiated)
    k = len(traced.consts)
    probe_spec = spec._replace(progress=None)

    def temp_bytes(chunk: int) -> int:
        loop = wrapper._loop(traced.jaxpr, traced.out_shapes, probe_spec._replace(plan=make_plan(n, min(chunk, n))))
        return program_temp_bytes(lambda *flat: loop(list(flat[:k]), list(flat[k:])), leaves, mode)

    def compute() -> BudgetPlan:
        estimate = _estimate.element_bytes(traced.jaxpr)
        return choose_chunk(temp_bytes, n, budget, mode=mode, cap=throughput_cap(), element_bytes=estimate)

    if traced.key is None:
        return compute()
    from ._cache import Uncacheable, setting_key

    try:
        remat = setting_key(spec.remat)
    except Uncacheable:
        return compute()
    avals = tuple((tuple(jax.typeof(x).shape), str(jax.typeof(x).dtype)) for x in leaves)
    key = ("auto", type(wrapper).__name__, traced.key, avals, spec.axes, spec.out_axes, n, budget, mode, remat)
    key += (spec.spmd_axis_name, jax.default_backend())
    return cached_plan(key, compute)


def plan_call(wrapper: Any, args: tuple, kwargs: dict, leaves: list, treedef: Any, axes: list, n: int) -> BudgetPlan:
    """The (cached) plan an ``"auto"`` wrapper makes for this call (what :func:`plan` reports):
    the call's own pipeline up to the plan (``fun`` traced once, then :func:`plan_traced`)."""
    del args, kwargs  # the flat leaves say it all
    if n <= 1:
        return unchunked_plan(n, wrapper.memory_budget, leaves)
    wrapper._trace_and_plan(leaves, treedef, axes, n, "auto")
    return wrapper.last_plan


# ----------------------------------------------------------------------------------------------
# chunk_size="auto" on RowOperator, and chunkop.plan.


def rows_temp_bytes(row_fn: Callable, rows: Any, in_structure: Any, chunk: int) -> int:
    """The compiled temp memory a ``RowOperator`` needs at ``chunk`` rows per chunk (the planner's measure).

    The worst of ``mv`` and ``T.mv`` and their VJPs (w.r.t. ``x``/``y``, the float leaves of
    ``rows`` and the arrays ``row_fn`` closes over). ``rows`` may be ``ShapeDtypeStruct``s.
    """
    from . import _rows

    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    row_structs = [_struct(x) for x in row_leaves]
    x_leaves, x_tree = jax.tree_util.tree_flatten(in_structure)
    spec, consts = _rows.make_spec(row_fn, jax.tree_util.tree_unflatten(row_tree, row_structs), in_structure, chunk)
    k, r = len(consts), len(row_structs)

    def mv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return _rows.apply(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(x_tree, flat[k + r :]))

    y_leaves, y_tree = jax.tree_util.tree_flatten(jax.eval_shape(mv, *consts, *row_structs, *x_leaves))

    def tmv(*flat: Any) -> Any:
        rw = jax.tree_util.tree_unflatten(row_tree, flat[k : k + r])
        return _rows.apply_transpose(spec, tuple(flat[:k]), rw, jax.tree_util.tree_unflatten(y_tree, flat[k + r :]))

    return max(
        program_temp_bytes(mv, [*consts, *row_structs, *x_leaves], "grad"),
        program_temp_bytes(tmv, [*consts, *row_structs, *y_leaves], "grad"),
    )


def plan_rows(row_fn: Callable, rows: Any, in_structure: Any, memory_budget: int | None) -> BudgetPlan:
    """The chunk of rows for a ``RowOperator`` built with ``chunk_size="auto"``.

    Plans for :func:`rows_temp_bytes` (the worst of ``mv``, ``T.mv`` and their VJPs), compiled
    at each candidate chunk. With rows sharded over devices, the chunk is planned for one
    device's shard.
    """
    from . import _rows, _sharding

    budget = check_memory_budget(memory_budget, "RowOperator")
    budget = budget if budget is not None else default_budget()
    row_leaves, row_tree = jax.tree_util.tree_flatten(rows)
    n = int(row_leaves[0].shape[0])
    mesh_axes = _sharding.row_mesh(rows)
    shards = 1
    if mesh_axes is not None and n % mesh_axes.n_shards == 0:
        shards = mesh_axes.n_shards
        n //= shards
    row_structs = [jax.ShapeDtypeStruct((n,) + tuple(x.shape[1:]), x.dtype) for x in row_leaves]
    local_rows = jax.tree_util.tree_unflatten(row_tree, row_structs)
    cap = throughput_cap()

    # the same row_fn (by its traced jaxpr), row and x shapes, budget and device kind: the same plan
    spec, _ = _rows.make_spec(row_fn, local_rows, in_structure, 1)

    def compute() -> BudgetPlan:
        temp = lambda chunk: rows_temp_bytes(row_fn, local_rows, in_structure, chunk)
        estimate = _estimate.element_bytes(spec.jaxpr, n_inputs=len(row_leaves))
        return choose_chunk(temp, n, budget, mode="grad", cap=cap, element_bytes=estimate)._replace(shards=shards)

    if spec.key is None:
        return compute()
    shapes = tuple((s.shape, str(s.dtype)) for s in row_structs)
    return cached_plan(("rows", spec.key, shapes, shards, budget, cap, jax.default_backend()), compute)


def _plan_shard(f: Any, leaves: list, treedef: Any, axes: list, mesh_axes: Any, n_local: int) -> BudgetPlan:
    """The plan a sharded call of ``f`` makes on each device: for its local shard.

    A sharded call runs ``f`` inside a ``jax.shard_map`` on the traced local shards
    (:func:`chunkop._sharding.call_sharded`), and plans there. The same is done here, under
    ``jax.eval_shape`` (nothing runs), so that the plan, and what it caches, is the call's.
    """
    from . import _sharding

    names = mesh_axes.names
    dynamic = [_sharding._is_array(x) for x in leaves]
    dyn = [x for x, d in zip(leaves, dynamic) if d]
    specs = [_sharding._spec_at(a, names) if a is not None else P() for a, d in zip(axes, dynamic) if d]
    found: list = []

    def local(*d: Any) -> tuple:
        it = iter(d)
        full = [next(it) if is_dyn else x for x, is_dyn in zip(leaves, dynamic)]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        with _sharding._inside_local():
            found.append(plan_call(f, a, k, full, treedef, axes, n_local))
        return ()

    def run(*d: Any) -> tuple:
        d = _sharding._conform(list(d), specs, mesh_axes)
        return jax.shard_map(
            local,
            mesh=mesh_axes.mesh,
            in_specs=tuple(specs),
            out_specs=(),
            axis_names=set(mesh_axes.mesh.axis_names),
            check_vma=False,
        )(*d)

    jax.eval_shape(run, *dyn)
    return found[0]


def plan(f: Any, *args: Any, **kwargs: Any) -> BudgetPlan:
    """The memory plan of a ``chunk_size="auto"`` transform for these arguments (nothing runs).

    Args:
        f: a function made by ``chunkop.vmap`` / ``sum`` / ``mean`` (or ``chunkop.map``'s
            wrapper) with ``chunk_size="auto"``, or a ``chunkop.RowOperator`` (or its transpose)
            built with ``chunk_size="auto"``.
        *args: the positional arguments ``f`` would be called with (only their shapes and
            dtypes are used: they may be tracers); not needed for an operator.
        **kwargs: its keyword arguments, likewise.

    Returns:
        The :class:`BudgetPlan`: ``chunk`` (None: no chunking), ``budget``, ``mode``,
        ``predicted_bytes``, ``compiled_bytes`` and the ``probes`` compiled. Plans are cached per
        call signature, so calling ``f`` with the same arguments then plans nothing. With the
        mapped axis (or the operator's rows) sharded over devices, it is the plan each device
        makes for its own shard: ``size`` per shard, ``shards`` and ``global_size``.

    Raises:
        TypeError: when ``f`` is not an ``"auto"`` chunked transform or operator.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.vmap(jnp.sin, chunk_size="auto", memory_budget=2**30)
        >>> chunkop.plan(f, jnp.zeros(1000)).chunk is None  # the whole axis fits: no chunking
        True
    """
    from . import _sharding
    from ._axes import mapped_size

    target = getattr(f, "operator", f)
    if hasattr(target, "budget_plan") and hasattr(target, "rows"):
        if target.budget_plan is None:
            raise TypeError('chunkop.plan: this RowOperator was not built with chunk_size="auto".')
        return target.budget_plan
    if getattr(f, "chunk_size", None) == "auto" and hasattr(f, "jacobian_of"):  # chunkop.jacrev / jacfwd
        jax.eval_shape(functools.partial(f, **kwargs), *args)  # plans (cached) what a call would; runs nothing
        return f.last_plan
    if getattr(f, "chunk_size", None) != "auto" or not hasattr(f, "_flat_arguments"):
        raise TypeError(
            f'chunkop.plan: expected a chunkop transform made with chunk_size="auto" (or such a '
            f"RowOperator), got {f!r}."
        )
    leaves, treedef, axes, paths = f._flat_arguments(args, kwargs)
    n = mapped_size(leaves, axes, paths, f.axis_size, f.where)
    sharded = _sharding.mapped_mesh_axes(leaves, axes, f.where, f.spmd_axis_name)
    if sharded is not None:  # each device plans for its own shard: so does this
        shards = sharded.n_shards
        if n % shards:
            raise ValueError(
                f"chunkop.plan: the mapped axis (size {n}) is sharded over mesh axes {sharded.names} of "
                f"{shards} devices, which does not divide it; pad the inputs to a multiple of {shards}."
            )
        result = _plan_shard(f, leaves, treedef, axes, sharded, n // shards)._replace(shards=shards)
    else:
        result = plan_call(f, args, kwargs, leaves, treedef, axes, n)
    f.last_plan = result
    return result
