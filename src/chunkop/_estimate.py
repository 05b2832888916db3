"""A compile-free estimate of what one mapped element costs in a chunk: the CPU throughput plan.

On CPU, ``chunk_size="auto"`` with the default budget (half the free memory, gigabytes) is
bound by ``chunkop.settings().cpu_temp_cap`` (16 MiB), a *speed* heuristic: chunks whose
working set stays near the caches run fastest. Measuring the program's temp memory at probe
chunks costs a compile of the chunked program and its VJP per probe, about as long as the
user's own first compile, for a figure whose precision buys nothing there. So when the cap is far
below the memory budget (:data:`MARGIN` times), the chunk is chosen from this estimate instead:
the bytes of every value ``fun`` computes for one element (its inputs, every intermediate in its
jaxpr and sub-jaxprs that depends on them, a ``scan`` body counted once per iteration), with no
compile at all.

The estimate errs high for fused elementwise chains (XLA keeps few of them alive at once) and is
compared with compiled temp memory in ``tests/test_budget.py``. A jaxpr with a ``while`` loop
(unknown trip count) has no estimate: the plan is then measured as usual.

The same walk gives the other side of a chunk's cost, :func:`fixed_bytes`: the work every chunk
does whatever its size (passes over a buffer the size of an unmapped operand for each use after the first:
the cotangents of a constant under ``jax.grad``, the ``x`` space a ``RowOperator``'s transpose
scatters into; and the values computed from the constants alone). :func:`chunkop._search.overhead_floor` turns the
two into the smallest chunk that amortises it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import _jaxpr

__all__ = ["COTANGENT_PASSES", "MARGIN", "element_bytes", "fixed_bytes"]

#: The estimate is used only when the memory budget is at least this many times the CPU cap:
#: an estimate off by less than this factor still fits the budget.
MARGIN = 64

#: Passes over an unmapped operand's bytes that each of its uses after the first costs a chunk
#: under a derivative or transpose: XLA fills a buffer of zeros, copies it into the scatter (or
#: cotangent) that writes it, and adds the result into the loop's carry (read in the compiled
#: loop body of a ``RowOperator``'s transpose: ``benchmarks/RESULTS.md``).
COTANGENT_PASSES = 3


def _bytes(aval: Any) -> int:
    """The bytes of a value of ``aval`` (0 for abstract values without an array shape)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)  # (also of PRNG key dtypes, which NumPy cannot read)
    if shape is None or not isinstance(itemsize, int) or dtype is object or str(dtype) == "object":
        return 0
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _inexact(aval: Any) -> bool:
    """Whether ``aval`` has a float or complex dtype (not an integer, boolean or PRNG key one)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(np.issubdtype(np.dtype(dtype), np.inexact))


def _jaxpr_bytes(jaxpr: Any, mapped: set) -> int | None:
    """Bytes of the values in ``jaxpr`` that depend on the variables in ``mapped`` (what ``vmap``
    batches: values computed from constants alone exist once per chunk, not per element)."""
    total = 0
    for eqn, subs in _jaxpr.dependent_eqns(jaxpr, mapped):
        total += sum(_bytes(v.aval) for v in eqn.outvars)
        if eqn.primitive.name == "while":
            return None  # the trip count is not known: no estimate
        repeat = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
        for sub, inputs in subs:
            inner = _jaxpr_bytes(sub, inputs)
            if inner is None:
                return None
            total += repeat * inner
    return total


def element_bytes(jaxpr: Any, n_inputs: int | None = None) -> int | None:
    """The estimated bytes one element of a chunk costs: ``jaxpr``'s first ``n_inputs`` inputs
    (default: all ``invars``; one element's mapped inputs) and every value computed from them,
    or None when it cannot be estimated. Values computed from the constants (``constvars``) or
    the other inputs alone are not per element (``vmap`` leaves them unbatched).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._estimate import element_bytes
        >>> element_bytes(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.zeros(10)).jaxpr)
        120
        >>> w = jnp.ones((100, 100))
        >>> element_bytes(jax.make_jaxpr(lambda x: (w @ w)[0] * x)(jnp.zeros(100)).jaxpr)
        800
    """
    inputs = jaxpr.invars[:n_inputs]
    inner = _jaxpr_bytes(jaxpr, set(inputs))
    if inner is None:
        return None
    return inner + sum(_bytes(v.aval) for v in inputs)


def _uses(jaxpr: Any, watched: set, mapped: set) -> int:
    """How many equations of ``jaxpr`` (and its sub-jaxprs, input by input) read a variable in
    ``watched`` together with a value that depends on ``mapped``: per-element uses."""
    count = 0
    for eqn, subs in _jaxpr.dependent_eqns(jaxpr, mapped):
        reads = [not isinstance(v, _jaxpr.Literal) and v in watched for v in eqn.invars]
        if not any(reads):
            continue
        lined_up = [(sub, inputs) for sub, inputs in subs if len(sub.invars) == len(eqn.invars)]
        if not lined_up:
            count += 1
            continue
        for sub, inputs in lined_up:
            inner = {w for w, r in zip(sub.invars, reads) if r}
            count += max(1, _uses(sub, inner, inputs))
    return count


def _independent_bytes(jaxpr: Any, mapped: set) -> int:
    """Bytes of the values ``jaxpr`` computes without reading ``mapped``: once per chunk."""
    depends = set(mapped)
    for eqn, _ in _jaxpr.dependent_eqns(jaxpr, mapped):
        depends.update(eqn.outvars)
    return sum(_bytes(v.aval) for eqn in jaxpr.eqns for v in eqn.outvars if v not in depends)


def fixed_bytes(jaxpr: Any, n_inputs: int | None = None, *, operands: Any = ()) -> int:
    """The estimated bytes of work every chunk does whatever its size (the per-chunk overhead).

    Two parts. Each variable in ``operands`` (unmapped arrays: constants, or a ``RowOperator``'s
    ``x``), counted :data:`COTANGENT_PASSES` times per per-element equation that reads it
    *after the first*: under a derivative or a transpose each use makes a cotangent of the
    operand's size per chunk, and all but one of them are separate buffers, zeroed, written and
    summed into the loop's carry (the first updates it in place: on XLA:CPU, a ``RowOperator``
    whose row reads ``x`` once scatters each chunk into the carry; one that reads it at the four
    corners of a bilinear interpolation may fill more images per chunk and add them). And the
    values computed without the first ``n_inputs`` inputs (the mapped ones), which every chunk
    recomputes.

    Args:
        jaxpr: ``fun`` (or ``row_fn``) traced on one example.
        n_inputs: how many leading ``invars`` are mapped (default: all).
        operands: the unmapped variables (``constvars`` or trailing ``invars``) to count per use;
            only those of a float or complex dtype count (others have no cotangent).

    Returns:
        The estimated bytes (0 when nothing is fixed).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from chunkop._estimate import fixed_bytes
        >>> f = lambda x, w: jnp.tanh(w @ x) + jnp.tanh(x @ w)  # w (16 KiB), read twice
        >>> closed = jax.make_jaxpr(f)(jnp.zeros(64), jnp.zeros((64, 64)))
        >>> fixed_bytes(closed.jaxpr, 1, operands=closed.jaxpr.invars[1:])  # one extra use: 3 passes
        49152
    """
    mapped = set(jaxpr.invars[:n_inputs])
    watched = {v for v in operands if not isinstance(v, _jaxpr.Literal) and _inexact(v.aval)}
    extra = sum(_bytes(v.aval) * max(0, _uses(jaxpr, {v}, mapped) - 1) for v in watched)
    per_use = COTANGENT_PASSES * extra
    return per_use + _independent_bytes(jaxpr, mapped)
