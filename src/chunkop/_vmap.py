"""``chunkop.vmap`` and ``chunkop.map``: ``jax.vmap`` computed in sequential, rematerialised chunks.

Both are a :class:`chunkop._transform.Chunked` of kind ``"stack"``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from . import _budget
from ._chunking import Remat
from ._progress import Progress
from ._transform import Chunked

__all__ = ["vmap", "map"]


def vmap(
    fun: Callable,
    in_axes: int | tuple | list | None = 0,
    out_axes: Any = 0,
    *,
    chunk_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
) -> Callable:
    """``jax.vmap`` that computes the mapped axis in sequential chunks of at most ``chunk_size``.

    The result equals ``jax.vmap(fun, in_axes, out_axes, ...)`` (up to float reduction order).
    The mapped axis of size ``n`` is cut into chunks of at most ``chunk_size`` run by one
    ``jax.lax.scan``: equal chunks when a divisor of ``n`` lies in ``[3/4 chunk_size,
    chunk_size]`` (20000 in chunks of 4096 runs as 5 x 4000), else ``n // chunk_size`` chunks
    plus one remainder chunk of ``n % chunk_size`` elements; each chunk is vectorised with
    ``jax.vmap``. With ``remat=True`` (default) each chunk is wrapped in
    ``jax.checkpoint``, so under ``grad``/``vjp``/``hessian`` the backward pass stores only the
    chunk inputs and recomputes one chunk at a time: temp memory is bounded by the chunk, not by
    ``n`` (apart from the per-example outputs themselves). When ``n % chunk_size != 0`` the scan
    reads each full chunk with an in-bounds dynamic slice inside the checkpointed body, so the
    inputs are not copied either. ``chunk_size=None`` or ``chunk_size >= n`` is exactly
    ``jax.vmap``.

    Tracing: when chunking, each call traces ``fun`` once on one abstract example (as
    ``jax.vmap`` traces it once per call; ``chunk_size="auto"`` plans on that same trace), so
    results always reflect the state at call time. Operations on unmapped concrete values alone
    are computed while tracing, as under ``jax.vmap`` (``if float(w.sum()) > 0:`` works).
    Arrays ``fun`` closes over, unmapped array arguments and tracers of enclosing transforms are
    hoisted out of that trace and passed to the compiled chunk loop as arguments (closure
    conversion); the loop is cached by what was traced (the jaxpr's structure, shapes and
    dtypes; ``custom_jvp``/``custom_vjp`` rules by what they trace to), never by ``fun``, so
    repeated calls compile once. Unmapped non-array arguments reach ``fun`` as ``jax.vmap``
    passes them. See :func:`chunkop.clear_caches`.

    Collectives over ``axis_name`` (``psum`` of mapped values, ``axis_index``, ``all_gather``
    ...) cannot be computed chunk by chunk; ``fun`` using one with ``chunk_size < n`` raises
    ``ValueError`` (also when only a custom rule uses it). Queries of the axis size
    (``lax.axis_size``, ``lax.psum`` of an unmapped value) give the full size ``n``.

    Args:
        fun: function to map. Keyword arguments are mapped over their axis 0 (as ``jax.vmap``).
        in_axes: int, None, or a tuple/list with one entry per positional argument, each a
            prefix pytree of that argument with int (negative allowed) or None leaves.
        out_axes: prefix pytree of the output with int or None leaves; None for outputs that do
            not vary over the mapped axis (an error, as in ``jax.vmap``, if they do).
        chunk_size: the largest number of elements vectorised at once; None for no chunking;
            ``"auto"`` for the largest chunk whose compiled temp memory (forward and VJP;
            also the Hessian-vector product when called under two ``jvp`` levels) fits
            ``memory_budget``, found from XLA's memory analysis once per call signature
            (no chunking when the whole axis fits); on CPU with the default budget, where only
            the 16 MiB throughput cap binds, from a compile-free estimate instead. Under an
            enclosing ``jax.vmap`` the budget is shared by its batch. See ``docs/scaling.md``.
        axis_name: name of the mapped axis, for collectives (see above).
        axis_size: size of the mapped axis; needed only when no argument is mapped.
        spmd_axis_name: passed to the per-chunk ``jax.vmap``.
        remat: True to rematerialise each chunk in reverse mode (bounded memory, about one extra
            forward pass of compute); False to store every chunk's residuals (memory grows
            with ``n``, as ``jax.lax.map``); or a ``jax.checkpoint`` policy to save some.
        progress: True to show progress on stderr (a tqdm bar on a terminal or in Jupyter when
            tqdm is installed, a ``\r`` line on a terminal, plain lines at most once a second in
            a log), reported from inside the compiled loop, eagerly and under ``jit``; or a
            callable ``progress(k, n)`` called on the host with ``k`` of ``n`` chunks done (the
            remainder counts as one). About 20 reports per loop (the first, the last and every
            ``ceil(n/20)``-th chunk), each call of the loop one run with ``k`` rising to ``n``;
            under ``jit(grad)`` the backward loop reports. Reports are asynchronous
            (``jax.effects_barrier()`` waits for them). None or False (default): nothing is
            added to the program. No report when not chunking.
        memory_budget: bytes of temp memory for ``chunk_size="auto"`` (only then: with
            another ``chunk_size`` it is refused); None for ``chunkop.settings().budget_fraction``
            (half) of the device's free memory.

    Returns:
        A function with ``fun``'s signature whose outputs have the mapped axis at ``out_axes``.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.vmap(lambda x, w: jnp.tanh(x @ w), in_axes=(0, None), chunk_size=3)
        >>> f(jnp.ones((10, 4)), jnp.ones((4, 2))).shape
        (10, 2)
    """
    return Chunked(
        fun,
        in_axes,
        out_axes,
        kind="stack",
        where="chunkop.vmap",
        chunk_size=chunk_size,
        axis_name=axis_name,
        axis_size=axis_size,
        spmd_axis_name=spmd_axis_name,
        remat=remat,
        progress=progress,
        memory_budget=memory_budget,
    )


def map(  # noqa: A001
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str = "auto",
    remat: Remat = True,
    progress: Progress = None,
    memory_budget: int | None = None,
) -> Any:
    """``jax.lax.map(f, xs)`` over the leading axis of the pytree ``xs``, ``chunk_size`` at a time.

    Like ``jax.lax.map(f, xs, batch_size=chunk_size)``, but each chunk is rematerialised in
    reverse mode, so memory under ``grad`` stays bounded by the chunk. As :func:`chunkop.vmap`,
    ``f`` is traced on every call and the compiled chunk loop is reused by what was traced, so
    repeated eager calls compile once.

    Args:
        f: function of one slice of ``xs``.
        xs: pytree of arrays sharing a leading axis.
        chunk_size: the number of slices vectorised at once (a positive int), or ``"auto"``
            (the default; as in :func:`chunkop.vmap`: planned from ``memory_budget``, by
            compiling the chunk loop at a few sizes, once per signature).
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.
        memory_budget: as in :func:`chunkop.vmap`.

    Returns:
        The stacked outputs of ``f``, leading axis ``xs``'s leading axis.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.map(lambda x: x.sum(), jnp.ones((7, 3)), chunk_size=2)
        Array([3., 3., 3., 3., 3., 3., 3.], dtype=float32)
    """
    chunk_size = _budget.check_chunk_size_or_auto(chunk_size, allow_none=False, where="chunkop.map")
    mapped = Chunked(
        f,
        0,
        0,
        kind="stack",
        where="chunkop.map",
        arg_names=("xs",),  # messages name chunkop.map's argument `xs` (not `args[0]`)
        chunk_size=chunk_size,
        remat=remat,
        progress=progress,
        memory_budget=memory_budget,
    )
    return mapped(xs)
