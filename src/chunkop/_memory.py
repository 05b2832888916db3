"""Memory, measured: what a program needs (XLA's compiled temp memory) and what a device has.

The planner of ``chunk_size="auto"`` never guesses memory from shapes: :func:`program_temp_bytes`
compiles the program and reads XLA's ``memory_analysis().temp_size_in_bytes``, the temporary
buffers (intermediates, scan carries, residuals): not the arguments and outputs, which exist
whatever the chunk. It measures the *worst* of the transforms the program may be run under
(:data:`MODES`): the forward program and its VJP (what ``jax.grad`` of a loss built on it
compiles), since a wrapper called inside a user's ``jax.grad`` cannot always know, when it
plans, which transform will be applied; and also the Hessian-vector product when the arguments
arrive traced under two forward-mode levels (:func:`chunkop._budget.plan_mode`).

What the device has: :func:`free_memory` (``bytes_limit - bytes_in_use`` from
``device.memory_stats()`` on accelerators, ``MemAvailable`` from ``/proc/meminfo`` on CPU),
:func:`default_budget` (``chunkop.settings().budget_fraction`` of it, rounded so that it stays
put from call to call) and :func:`throughput_cap` (``chunkop.settings().cpu_temp_cap`` on CPU,
where cache-sized chunks are faster; none elsewhere).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._axes import replace_at
from ._settings import settings
from ._tree import is_float as _is_float
from ._tree import struct_of as _struct

__all__ = [
    "MODES",
    "check_mode",
    "program_temp_bytes",
    "free_memory",
    "default_budget",
    "throughput_cap",
]


#: The transforms a plan can cover: the forward program only, the worst of forward and VJP
#: (default; what ``jax.grad`` compiles), or those and a Hessian-vector product.
MODES = ("forward", "grad", "hvp")


def check_mode(mode: Any, where: str = "chunkop") -> str:
    """Validate the ``mode`` a plan covers.

    Args:
        mode: the value to check.
        where: the caller, for the error message.

    Returns:
        ``mode``, one of :data:`MODES`.

    Raises:
        ValueError: when it is not.
    """
    if mode not in MODES:
        raise ValueError(f"{where}: `mode` must be one of {MODES}, got {mode!r}.")
    return mode


# ----------------------------------------------------------------------------------------------
# What a program needs: its compiled temp memory under the transforms it may be run with.


# What a probe compile needs is XLA's buffer assignment, which runs before code generation: on
# CPU, the LLVM backend at optimisation level 0 gives the same temp size (checked in
# tests/test_budget.py) in about 60% of the compile time.
_PROBE_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0}}


class NotDifferentiable(Exception):
    """A derivative program that JAX cannot trace, of a program whose forward pass it traced."""


def _compiled_temp(fn: Callable, *structs: Any, derivative: bool = False) -> int:
    """The temp bytes XLA reports for ``jax.jit(fn)`` compiled on ``structs`` (probe options).

    With ``derivative`` (``fn`` differentiates a program already traced forward), a failure to
    trace ``fn`` is that program's: raised as :class:`NotDifferentiable`. A failure to lower or
    compile is raised as it is, either way.
    """
    try:
        traced = jax.jit(fn).trace(*structs)
    except Exception as err:
        if derivative:
            raise NotDifferentiable(f"{type(err).__name__}: {err}") from err
        raise
    lowered = traced.lower()
    options = _PROBE_OPTIONS.get(jax.default_backend())
    compiled = lowered.compile(options) if options else lowered.compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def program_temp_bytes(fn: Callable, leaves: Sequence[Any], mode: str = "grad", *, forward_only_ok: bool = True) -> int:
    """Compiled temp memory of ``fn(*leaves)`` under ``mode``'s transforms (the worst of them).

    ``leaves`` may be arrays, tracers or ``jax.ShapeDtypeStruct``: only shapes and dtypes are
    used; nothing runs. The programs compiled, all w.r.t. every float leaf:

    - ``"forward"``: ``fn`` itself;
    - ``"grad"``: also ``jax.vjp`` of ``fn`` (forward, residuals and backward pass), which is
      what ``jax.grad`` of a loss built on ``fn`` compiles (a program that also returned the
      forward outputs would count them as temp: they are copied out of the loop there);
    - ``"hvp"``: also the forward-over-reverse Hessian-vector product of ``<fn(x), 1>``.

    A program JAX cannot differentiate (a while loop with a traced trip count, ...: tracing a
    derivative program fails, :class:`NotDifferentiable`) can only be run forward: its
    derivatives are skipped. Errors in lowering or compiling are raised.

    Args:
        fn: a function of ``len(leaves)`` positional arrays returning a pytree of arrays.
        leaves: example arguments (only their shapes/dtypes matter).
        mode: one of ``"forward"``, ``"grad"``, ``"hvp"``.
        forward_only_ok: False: a derivative program that cannot be traced raises
            :class:`NotDifferentiable` instead of being skipped (a caller with another way to
            measure, e.g. per example instead of under an enclosing batch).

    Returns:
        The largest ``temp_size_in_bytes`` among the compiled programs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._memory import program_temp_bytes
        >>> f = lambda x: jnp.sin(x) * 2
        >>> program_temp_bytes(f, [jax.ShapeDtypeStruct((1000,), jnp.float32)], "forward") >= 0
        True
    """
    check_mode(mode)
    structs = [_struct(x, typed=True) for x in leaves]
    worst = _compiled_temp(fn, *structs)
    if mode == "forward" or not any(_is_float(s) for s in structs):
        return worst
    out = jax.eval_shape(fn, *structs)
    if not any(_is_float(o) for o in jax.tree_util.tree_leaves(out)):
        return worst
    try:
        for temp in _derivative_temps(fn, structs, out, mode):
            worst = max(worst, temp)
    except NotDifferentiable:
        if not forward_only_ok:
            raise
        # its forward program (and the derivatives measured before the failing one) is what
        # there is to plan for
    return worst


def _derivative_temps(fn: Callable, structs: list, out: Any, mode: str) -> Iterator[int]:
    """The temp bytes of ``fn``'s derivative programs, compiled one after the other.

    Args:
        fn: the program (see :func:`program_temp_bytes`).
        structs: its arguments' ``ShapeDtypeStruct``s, some of them float.
        out: the structure of its outputs, some of them float.
        mode: ``"grad"`` (the VJP) or ``"hvp"`` (the VJP, then the Hessian-vector product).

    Returns:
        An iterator over the temp bytes of each program (a compile per item: a program that
        cannot be differentiated raises while it is iterated).
    """
    diff = [i for i, s in enumerate(structs) if _is_float(s)]
    dstructs = [structs[i] for i in diff]
    rest = list(structs)

    def loss(dargs: list, r: list) -> jax.Array:
        outs = jax.tree_util.tree_leaves(fn(*replace_at(r, diff, dargs)))
        # a fixed linear functional of the outputs: the VJP's cotangent is the weight vector
        return sum(jnp.vdot(jnp.full(o.shape, 0.5, o.dtype), o).real for o in outs if _is_float(o))

    def vjp_program(dargs: list, r: list, cts: Any) -> Any:
        _, pullback = jax.vjp(lambda d: fn(*replace_at(r, diff, d)), dargs)
        return pullback(cts)

    if all(_is_float(o) for o in jax.tree_util.tree_leaves(out)):
        # typed as the outputs are (on an Explicit mesh an output may be sharded, by a value
        # the program closes over, though the probe's arguments are plain)
        cts = jax.tree_util.tree_map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding), out)
        yield _compiled_temp(vjp_program, dstructs, rest, cts, derivative=True)
    else:
        yield _compiled_temp(lambda d, r: jax.grad(loss)(d, r), dstructs, rest, derivative=True)
    if mode == "hvp":

        def hvp(d: list, r: list, t: list) -> Any:
            return jax.jvp(lambda dd: jax.grad(loss)(dd, r), (d,), (t,))[1]

        yield _compiled_temp(hvp, dstructs, rest, dstructs, derivative=True)


# ----------------------------------------------------------------------------------------------
# What a device has: its free memory, the default budget, the CPU throughput cap.


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where there is none."""
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
    except (RuntimeError, NotImplementedError):  # backends without memory stats raise or return None
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


# On CPU, chunking is also a throughput optimisation: chunks whose working set stays near the
# caches run faster than one large vectorised pass (figures: benchmarks/RESULTS.md, "Chunked
# vmap", the chunk-size sweep). So on CPU the planner aims at min(budget, settings().cpu_temp_cap)
# (16 MiB by default, chunkop.configure changes it). Accelerators get no cap.


def throughput_cap(device: Any = None) -> int | None:
    """The temp memory the planner aims no higher than, for speed (see the note above).

    Args:
        device: a ``jax.Device``; None for the first local device.

    Returns:
        ``chunkop.settings().cpu_temp_cap`` on a CPU device, None elsewhere.
    """
    device = jax.local_devices()[0] if device is None else device
    return settings().cpu_temp_cap if device.platform == "cpu" else None


def default_budget(device: Any = None) -> int:
    """The default memory budget: ``chunkop.settings().budget_fraction`` (0.5) of
    :func:`free_memory`, rounded down to three significant binary digits (e.g. 11.5 GB -> 10 GiB).

    The rounding keeps the budget, and so the plans cached under it, the same from call to call
    while the free memory drifts by a few pages.

    Args:
        device: a ``jax.Device``; None for the first local device.

    Returns:
        The budget in bytes.

    Example:
        >>> from chunkop._memory import default_budget, free_memory
        >>> 0 < default_budget() <= free_memory()
        True
    """
    budget = max(1, int(settings().budget_fraction * free_memory(device)))
    unit = 1 << max(0, budget.bit_length() - 3)
    return budget - budget % unit
