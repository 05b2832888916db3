"""``chunkop.vmap`` and ``chunkop.map``: ``jax.vmap`` computed in sequential, rematerialised chunks."""

from __future__ import annotations

import abc
import collections
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ._axes import (
    check_axis_size,
    check_chunk_size,
    check_in_axes_spec,
    check_out_axes_spec,
    flat_in_axes,
    flat_out_axes,
    is_array_leaf,
    mapped_size,
)
from ._chunking import ChunkPlan, Remat, make_plan, stack_chunks
from ._progress import Progress, check_progress

__all__ = ["vmap", "map"]


def _check_remat(remat: Any, where: str) -> Remat:
    if isinstance(remat, bool) or callable(remat):
        return remat
    raise TypeError(
        f"{where}: `remat` must be True, False or a checkpoint policy such as "
        f"jax.checkpoint_policies.dots_saveable, got {remat!r}."
    )


def _wrap(fun: Callable, wrapper: Any) -> Any:
    """Give ``wrapper`` ``fun``'s name, docstring and ``__wrapped__``.

    Unlike ``functools.wraps``, ``fun.__dict__`` is *not* copied: the wrapper is a ``_Chunked``
    instance whose attributes (``fun``, ``in_axes``, ...) would otherwise be overwritten by
    those of a wrapped ``_Chunked`` (nesting) or of any callable object with attributes.
    """
    return functools.update_wrapper(wrapper, fun, updated=())


# ----------------------------------------------------------------------------------------------
# Collectives over the chunked axis.


def _mentions(value: Any, name: Hashable) -> bool:
    items = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
    for item in items:
        try:
            if type(item) is type(name) and item == name:
                return True
        except Exception:  # an array-valued param: not an axis name
            continue
    return False


def _subjaxprs(value: Any):
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if hasattr(item, "eqns"):
            yield item
        elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
            yield item.jaxpr


def _refers_to_axis(eqn: Any, name: Hashable) -> bool:
    """Whether one equation is a collective over axis ``name``.

    Collectives carry a ``NamedAxisEffect`` (``psum``, ``pmax``, ``axis_index``, ``all_gather``
    ...) or name the axis in an ``axis_name`` parameter (``ppermute`` has no effect). Other
    parameters are not looked at: a ``jit`` whose ``name`` happens to equal the axis name, or a
    ``reduce_sum`` over ``axes=(0,)`` with ``axis_name=0``, is not a collective.
    """
    for effect in getattr(eqn, "effects", ()):
        if _mentions(getattr(effect, "name", None), name):
            return True
    return _mentions(eqn.params.get("axis_name"), name)


def _uses_axis(jaxpr: Any, name: Hashable) -> str | None:
    """The first primitive in ``jaxpr`` (recursively) that is a collective over axis ``name``."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found = _uses_axis(sub, name)
                if found:
                    return found
        if _refers_to_axis(eqn, name):
            return eqn.primitive.name
    return None


# ----------------------------------------------------------------------------------------------
# The shared machinery of every chunked transform: argument resolution, caching, tracing.


_SHARED_JITS: collections.OrderedDict = collections.OrderedDict()
_MAX_SHARED_JITS = 256


def _shared_jit(config: tuple, make: Callable[[], Callable]) -> Callable:
    """A least-recently-used cache of jitted chunk loops, keyed by a wrapper's configuration."""
    try:
        hash(config)
    except TypeError:  # e.g. a dict in in_axes: this wrapper keeps its own jit
        return make()
    if config in _SHARED_JITS:
        _SHARED_JITS.move_to_end(config)
        return _SHARED_JITS[config]
    jitted = _SHARED_JITS[config] = make()
    if len(_SHARED_JITS) > _MAX_SHARED_JITS:
        _SHARED_JITS.popitem(last=False)
    return jitted


class _Chunked(abc.ABC):
    """A ``fun`` mapped over an axis in chunks. Subclasses define how chunk outputs combine."""

    where = "chunkop.vmap"

    def __init__(
        self,
        fun: Callable,
        in_axes: Any,
        *,
        chunk_size: int | None,
        axis_name: Hashable | None,
        axis_size: int | None,
        spmd_axis_name: Any,
        remat: Remat,
        progress: Progress = None,
    ) -> None:
        if not callable(fun):
            raise TypeError(f"{self.where}: `fun` must be callable, got {fun!r}.")
        self.fun = fun
        self.in_axes = check_in_axes_spec(in_axes, self.where)
        self.chunk_size = check_chunk_size(chunk_size, where=self.where)
        axis_size = check_axis_size(axis_size, self.where)
        self.axis_name = axis_name
        self.axis_size = axis_size
        self.spmd_axis_name = spmd_axis_name
        self.remat = _check_remat(remat, self.where)
        self.progress = check_progress(progress, self.where)
        self._jit: Callable | None = None  # made on first chunked call (see `_jitted`)

    def _config(self) -> tuple:
        """Everything that determines the computation besides the call's arguments."""
        return (
            type(self), self.fun, self.in_axes, getattr(self, "out_axes", None), self.chunk_size,
            self.axis_name, self.axis_size, self.spmd_axis_name, self.remat, self.progress,
        )

    @property
    def _jitted(self) -> Callable:
        """The jitted chunk loop, shared by every wrapper with the same configuration.

        ``chunkop.vmap(f, chunk_size=c)(x)`` written inside a Python loop builds a new wrapper
        each time; sharing the jit by configuration means it still compiles only once.
        """
        if self._jit is None:
            self._jit = _shared_jit(self._config(), lambda: jax.jit(self._run, static_argnums=(1,)))
        return self._jit

    # -- per call ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef, axes, paths = flat_in_axes(self.in_axes, args, kwargs, self.where)
        n = mapped_size(leaves, axes, paths, self.axis_size, self.where)
        if self.chunk_size is None or n <= self.chunk_size:
            return self._unchunked(args, kwargs)
        dynamic = [is_array_leaf(x) for x in leaves]
        static = tuple((i, x) for i, (x, d) in enumerate(zip(leaves, dynamic)) if not d)
        key = (treedef, tuple(axes), n, static)
        dyn = [x for x, d in zip(leaves, dynamic) if d]
        try:
            hash(key)
        except TypeError:  # unhashable non-array arguments: run without the cache
            return self._run(dyn, key)
        return self._jitted(dyn, key)

    @abc.abstractmethod
    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        """The result when nothing is chunked (``chunk_size`` is None or >= the axis size)."""

    @abc.abstractmethod
    def _combine(self, flat_fun: Callable, leaves: list, axes: list, plan: ChunkPlan, out_shapes: Any) -> Any:
        """Run the chunks of ``plan`` and combine their outputs (stack, sum, ...)."""

    def _vmapped(self, fn: Callable, in_axes: tuple, out_axes: Any, size: int) -> Callable:
        return jax.vmap(
            fn,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=self.axis_name,
            axis_size=size,
            spmd_axis_name=self.spmd_axis_name,
        )

    def _run(self, dyn: list, key: tuple) -> Any:
        treedef, axes, n, static = key
        leaves = list(dyn)
        for i, value in static:
            leaves.insert(i, value)

        def flat_fun(*flat: Any) -> Any:
            f_args, f_kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            return self.fun(*f_args, **f_kwargs)

        out_shapes = self._example_shapes(flat_fun, leaves, list(axes), n)
        plan = make_plan(n, self.chunk_size)
        return self._combine(flat_fun, leaves, list(axes), plan, out_shapes)

    def _example_shapes(self, flat_fun: Callable, leaves: list, axes: list, n: int) -> Any:
        """Trace ``fun`` once on one example: output shapes, and collectives over ``axis_name``."""
        mapped = [i for i, a in enumerate(axes) if a is not None]

        def one(*examples: Any) -> Any:
            flat = list(leaves)
            for i, ex in zip(mapped, examples):
                flat[i] = ex
            return flat_fun(*flat)

        structs = []
        for i in mapped:
            x, a = leaves[i], axes[i]
            shape = tuple(d for k, d in enumerate(jnp.shape(x)) if k != a)
            structs.append(jax.ShapeDtypeStruct(shape, jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype))
        if self.axis_name is None:
            return jax.eval_shape(one, *structs)
        jaxpr, shapes = jax.make_jaxpr(one, axis_env=[(self.axis_name, n)], return_shape=True)(*structs)
        prim = _uses_axis(jaxpr.jaxpr, self.axis_name)
        if prim is not None:
            raise ValueError(
                f"{self.where}: `fun` uses the collective `{prim}` over axis_name="
                f"{self.axis_name!r}, but with chunk_size={self.chunk_size} < axis size {n} each "
                f"chunk would see only part of the axis, giving a silently wrong result. Use "
                f"chunk_size=None (or >= {n}) for collectives, or compute the reduction outside "
                f"the chunked function (e.g. with chunkop.sum)."
            )
        return shapes

    @staticmethod
    def _chunk_inputs(leaves: list, axes: list) -> tuple[list[int], list, tuple]:
        """Mapped leaves moved to axis 0, their positions, and the chunk-level vmap in_axes."""
        mapped = [i for i, a in enumerate(axes) if a is not None]
        moved = [jnp.moveaxis(leaves[i], axes[i], 0) if axes[i] else leaves[i] for i in mapped]
        return mapped, moved, tuple(0 if a is not None else None for a in axes)


class _VMapped(_Chunked):
    def __init__(self, fun: Callable, in_axes: Any, out_axes: Any, **kw: Any) -> None:
        super().__init__(fun, in_axes, **kw)
        self.out_axes = check_out_axes_spec(out_axes, self.where)

    def _unchunked(self, args: tuple, kwargs: dict) -> Any:
        vmapped = functools.partial(
            jax.vmap,
            self.fun,
            in_axes=self.in_axes,
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )
        try:
            return vmapped(out_axes=self.out_axes)(*args, **kwargs)
        except ValueError:
            # A bad `out_axes` gets the same message as on the chunked path; any other error
            # (from `fun` itself) is jax.vmap's, re-raised as is.
            try:
                shapes = jax.eval_shape(vmapped(out_axes=0), *args, **kwargs)
            except Exception:
                shapes = None
            if shapes is not None:
                per_example = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes)
                flat_out_axes(self.out_axes, per_example, self.where)
            raise

    def _combine(self, flat_fun, leaves, axes, plan, out_shapes):
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
        oaxes = flat_out_axes(self.out_axes, out_shapes, self.where)
        mapped, moved, body_in_axes = self._chunk_inputs(leaves, axes)
        stacked = [k for k, a in enumerate(oaxes) if a is not None]
        carried = [k for k, a in enumerate(oaxes) if a is None]

        def flat_out_fun(*flat: Any) -> tuple:
            return tuple(jax.tree_util.tree_leaves(flat_fun(*flat)))

        def chunk_fn(chunk: list, m: int) -> tuple[list, list]:
            flat = list(leaves)
            for i, c in zip(mapped, chunk):
                flat[i] = c
            outs = self._vmapped(flat_out_fun, body_in_axes, tuple(oaxes), m)(*flat)
            return [outs[k] for k in stacked], [outs[k] for k in carried]

        ys_full, ys_rem, zs = stack_chunks(
            chunk_fn, moved, plan, self.remat, [out_leaves[k] for k in carried], progress=self.progress
        )
        result: list[Any] = [None] * len(out_leaves)
        for j, k in enumerate(stacked):
            a = oaxes[k]
            y = jnp.moveaxis(ys_full[j], 0, a)  # (..., n_full, chunk, ...)
            y = y.reshape(y.shape[:a] + (plan.n_full * plan.chunk,) + y.shape[a + 2 :])
            if ys_rem is not None:
                y = jnp.concatenate([y, ys_rem[j]], axis=a)
            result[k] = y
        for j, k in enumerate(carried):
            result[k] = zs[j]
        return jax.tree_util.tree_unflatten(out_tree, result)


def vmap(
    fun: Callable,
    in_axes: int | None | tuple | list = 0,
    out_axes: Any = 0,
    *,
    chunk_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    remat: Remat = True,
    progress: Progress = None,
) -> Callable:
    """``jax.vmap`` that computes the mapped axis in sequential chunks of at most ``chunk_size``.

    The result equals ``jax.vmap(fun, in_axes, out_axes, ...)`` (up to float reduction order).
    The mapped axis of size ``n`` is cut into ``n // chunk_size`` chunks run by one
    ``jax.lax.scan`` plus one remainder chunk of ``n % chunk_size`` elements; each chunk is
    vectorised with ``jax.vmap``. With ``remat=True`` (default) each chunk is wrapped in
    ``jax.checkpoint``, so under ``grad``/``vjp``/``hessian`` the backward pass stores only the
    chunk inputs and recomputes one chunk at a time: temp memory is bounded by the chunk, not by
    ``n`` (apart from the per-example outputs themselves). When ``n % chunk_size != 0`` the scan
    reads each full chunk with an in-bounds dynamic slice inside the checkpointed body, so the
    inputs are not copied either. ``chunk_size=None`` or ``chunk_size >= n`` is exactly
    ``jax.vmap``.

    Tracing: when chunking, ``fun`` is traced once abstractly on one example (output shapes,
    collectives), once at ``chunk_size`` and, if ``n % chunk_size != 0``, once at the remainder
    size; the chunk loop is then cached per input signature, so repeated calls (eager or under
    ``jit``) do not retrace. As under ``jax.jit``, array arguments are abstract while tracing.

    Collectives over ``axis_name`` (``psum``, ``axis_index``, ``all_gather`` ...) cannot be
    computed chunk by chunk; ``fun`` using one with ``chunk_size < n`` raises ``ValueError``.

    Args:
        fun: function to map. Keyword arguments are mapped over their axis 0 (as ``jax.vmap``).
        in_axes: int, None, or a tuple/list with one entry per positional argument, each a
            prefix pytree of that argument with int (negative allowed) or None leaves.
        out_axes: prefix pytree of the output with int or None leaves; None for outputs that do
            not vary over the mapped axis (an error, as in ``jax.vmap``, if they do).
        chunk_size: the largest number of elements vectorised at once; None for no chunking.
        axis_name: name of the mapped axis, for collectives (see above).
        axis_size: size of the mapped axis; needed only when no argument is mapped.
        spmd_axis_name: passed to the per-chunk ``jax.vmap``.
        remat: True to rematerialise each chunk in reverse mode (bounded memory, about one extra
            forward pass of compute); False to store every chunk's residuals (memory grows
            with ``n``, as ``jax.lax.map``); or a ``jax.checkpoint`` policy to save some.
        progress: True to show a progress bar on stderr (tqdm if installed, else ``k/n chunks``)
            advanced by every chunk from inside the compiled loop, eagerly and under ``jit``; or
            a callable ``progress(k, n)`` called on the host after chunk ``k`` of ``n`` (the
            remainder counts as one; under ``vmap`` it may be called repeatedly with the same
            ``k``; reports are asynchronous, ``jax.effects_barrier()`` waits for them). None or
            False (default): nothing is added to the program. No report when not chunking.

    Returns:
        A function with ``fun``'s signature whose outputs have the mapped axis at ``out_axes``.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> f = chunkop.vmap(lambda x, w: jnp.tanh(x @ w), in_axes=(0, None), chunk_size=3)
        >>> f(jnp.ones((10, 4)), jnp.ones((4, 2))).shape
        (10, 2)
    """
    return _wrap(
        fun,
        _VMapped(
            fun,
            in_axes,
            out_axes,
            chunk_size=chunk_size,
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
            remat=remat,
            progress=progress,
        ),
    )


class _Mapped(_VMapped):
    where = "chunkop.map"


def map(f: Callable, xs: Any, *, chunk_size: int, remat: Remat = True, progress: Progress = None) -> Any:  # noqa: A001
    """``jax.lax.map(f, xs)`` over the leading axis of the pytree ``xs``, ``chunk_size`` at a time.

    Like ``jax.lax.map(f, xs, batch_size=chunk_size)``, but each chunk is rematerialised in
    reverse mode, so memory under ``grad`` stays bounded by the chunk.

    Args:
        f: function of one slice of ``xs``.
        xs: pytree of arrays sharing a leading axis.
        chunk_size: the number of slices vectorised at once (a positive int).
        remat: as in :func:`chunkop.vmap`.
        progress: as in :func:`chunkop.vmap`.

    Returns:
        The stacked outputs of ``f``, leading axis ``xs``'s leading axis.

    Example:
        >>> import jax.numpy as jnp, chunkop
        >>> chunkop.map(lambda x: x.sum(), jnp.ones((7, 3)), chunk_size=2)
        Array([3., 3., 3., 3., 3., 3., 3.], dtype=float32)
    """
    chunk_size = check_chunk_size(chunk_size, allow_none=False, where=_Mapped.where)
    try:
        mapped = _mapped_for(f, chunk_size, remat, progress)
    except TypeError:  # unhashable f or policy: no cache
        mapped = _mapped_for.__wrapped__(f, chunk_size, remat, progress)
    return mapped(xs)


@functools.lru_cache(maxsize=64)
def _mapped_for(f: Callable, chunk_size: int, remat: Remat, progress: Progress = None) -> _Mapped:
    """One wrapper (and so one compiled chunk loop) per ``(f, chunk_size, remat)``: repeated
    eager ``chunkop.map`` calls with the same ``f`` do not recompile."""
    return _Mapped(
        f, 0, 0, chunk_size=chunk_size, axis_name=None, axis_size=None, spmd_axis_name=None, remat=remat,
        progress=progress,
    )
