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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _jaxpr

__all__ = ["MARGIN", "element_bytes"]

#: The estimate is used only when the memory budget is at least this many times the CPU cap:
#: an estimate off by less than this factor still fits the budget.
MARGIN = 64


def _bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize if np.dtype(dtype) != object else 0


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
