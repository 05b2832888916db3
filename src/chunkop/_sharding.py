"""Inputs sharded along the mapped axis: each device chunks its own shard.

When a mapped argument of ``chunkop.vmap`` / ``map`` / ``sum`` / ``mean`` is sharded along its
mapped axis over mesh axes ``names`` (a ``NamedSharding`` on a concrete array, on an Auto or an
Explicit mesh; or, under ``jax.jit``, the sharding in the argument's type on an Explicit mesh),
the chunked function is run inside a ``jax.shard_map`` over those mesh axes: every device
maps its local shard chunk by chunk, and

- stacked outputs come back sharded along the mapped axis the same way (``out_axes``);
- outputs with ``out_axes=None`` are replicated (as in ``jax.vmap`` they must not vary);
- ``chunkop.sum`` / ``mean`` add (``psum``) / average (``pmean``) the per-device results: one
  all-reduce per call, and no all-gather of the inputs.

Unmapped arguments are passed replicated. Under ``jax.jit`` on an Auto mesh the argument types
carry no sharding, so there is nothing to detect: use an Explicit mesh (``jax.make_mesh``'s
default) or call outside ``jit`` with sharded arrays.

The row-sharded kernels of :class:`chunkop.RowOperator` are in :mod:`chunkop._row_sharding`;
they use this module's :class:`MeshAxes` and its resharding to a ``shard_map``'s specs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._axes import flat_out_axes

__all__ = [
    "MeshAxes",
    "mapped_mesh_axes",
    "call_sharded",
]


class MeshAxes(NamedTuple):
    """A mesh and the names of its axes that an array's mapped axis is sharded over."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    names: tuple

    @property
    def n_shards(self) -> int:
        return math.prod(int(self.mesh.shape[a]) for a in self.names)


_LOCAL = threading.local()


@contextlib.contextmanager
def _inside_local(global_size: int | None = None):
    """While tracing a device-local body: no further sharding dispatch (the shards are local);
    ``global_size`` is the whole mapped axis' size, what axis-size queries must give there."""
    prev = getattr(_LOCAL, "active", False), getattr(_LOCAL, "global_size", None)
    _LOCAL.active, _LOCAL.global_size = True, global_size
    try:
        yield
    finally:
        _LOCAL.active, _LOCAL.global_size = prev


def local_global_size() -> int | None:
    """Inside a device-local body of a sharded call: the size of the whole mapped axis."""
    return getattr(_LOCAL, "global_size", None) if getattr(_LOCAL, "active", False) else None


def _sharding_of(x: Any) -> NamedSharding | None:
    if isinstance(x, jax.core.Tracer):
        try:
            s = jax.typeof(x).sharding
        except Exception:  # noqa: BLE001
            return None
    elif isinstance(x, jax.Array):
        try:
            s = x.sharding
        except Exception:  # noqa: BLE001  (deleted / donated arrays)
            return None
    else:
        return None
    return s if isinstance(s, NamedSharding) else None


def _names_at(s: NamedSharding, axis: int) -> tuple:
    spec = tuple(s.spec)
    entry = spec[axis] if axis < len(spec) else None
    if entry is None:
        return ()
    names = entry if isinstance(entry, tuple) else (entry,)
    manual = set(getattr(s.mesh, "manual_axes", ()) or ())
    return tuple(a for a in names if a not in manual)


def mapped_mesh_axes(
    leaves: Sequence[Any], axes: Sequence[int | None], where: str, spmd_axis_name: Any = None
) -> MeshAxes | None:
    """The mesh axes the mapped axis is sharded over, or None when no mapped input is sharded.

    Found from the mapped inputs' ``NamedSharding`` (concrete arrays; or traced ones on an
    Explicit mesh). Failing that, ``spmd_axis_name`` names them, when the current mesh
    (``jax.set_mesh``) has those axes: this is how an Auto mesh under ``jax.jit`` (where traced
    values carry no sharding) asks for device-local chunking.

    Args:
        leaves: the flat arguments.
        axes: their mapped axes (None: not mapped).
        where: the calling transform, for error messages.
        spmd_axis_name: the transform's ``spmd_axis_name`` (a mesh axis name or tuple of them).

    Returns:
        A :class:`MeshAxes`, or None (also inside a device-local body: no nested dispatch).

    Raises:
        ValueError: when mapped inputs are sharded over different mesh axes or meshes.
    """
    if getattr(_LOCAL, "active", False):
        return None
    found: MeshAxes | None = None
    for x, a in zip(leaves, axes):
        if a is None:
            continue
        s = _sharding_of(x)
        if s is None:
            continue
        names = _names_at(s, a)
        if not names:
            continue
        here = MeshAxes(s.mesh, names)
        if found is None:
            found = here
        elif here.names != found.names or here.mesh.shape != found.mesh.shape:
            raise ValueError(
                f"{where}: mapped arguments are sharded differently along the mapped axis: "
                f"mesh axes {found.names} and {here.names}; shard them the same way (or reshard "
                f"with jax.device_put / jax.sharding.reshard)."
            )
    if found is None and spmd_axis_name is not None and any(a is not None for a in axes):
        names = tuple(spmd_axis_name) if isinstance(spmd_axis_name, (tuple, list)) else (spmd_axis_name,)
        mesh = jax.sharding.get_abstract_mesh()
        manual = set(getattr(mesh, "manual_axes", ()) or ())
        if not mesh.empty and all(a in mesh.axis_names and a not in manual for a in names):
            found = MeshAxes(mesh, names)
    return found


def _spec_at(axis: int, names: tuple) -> P:
    return P(*([None] * axis), names if len(names) > 1 else names[0])


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def call_sharded(
    wrapper: Any,
    kind: str,
    leaves: list,
    treedef: Any,
    axes: list,
    n: int,
    mesh_axes: MeshAxes,
) -> Any:
    """Run ``wrapper`` (a chunked transform) on each device's shard of the mapped axis.

    Args:
        wrapper: the chunked callable; called on the local shards inside ``jax.shard_map``.
        kind: ``"stack"`` (vmap/map: outputs along the mapped axis), ``"sum"`` or ``"mean"``.
        leaves, treedef, axes: the flat arguments, their structure and mapped axes.
        n: the size of the mapped axis.
        mesh_axes: what :func:`mapped_mesh_axes` found.

    Returns:
        ``wrapper(*args, **kwargs)``, with stacked outputs sharded along the mapped axis.
    """
    where = getattr(wrapper, "where", "chunkop")
    _, names = mesh_axes
    shards = mesh_axes.n_shards
    if n % shards:
        raise ValueError(
            f"{where}: the mapped axis (size {n}) is sharded over mesh axes {names} of "
            f"{shards} devices, which does not divide it; pad the inputs to a multiple of "
            f"{shards} or shard them evenly."
        )
    axis_name = getattr(wrapper, "axis_name", None)
    if axis_name is not None and _refuse_collectives(wrapper, leaves, treedef, axes, n, mesh_axes):
        # "auto" with a collective runs unchunked, as when not sharded: exactly jax.vmap
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return wrapper._unchunked(args, kwargs)
    dynamic = [_is_array(x) for x in leaves]
    static = tuple((i, x) for i, (x, d) in enumerate(zip(leaves, dynamic)) if not d)
    dyn = [x for x, d in zip(leaves, dynamic) if d]
    shapes = tuple((tuple(x.shape), x.dtype) for x in dyn)
    # Not cached by the wrapper: as the unsharded path, ``fun`` is traced on every call (the
    # chunk loop inside is what is cached). Under an enclosing ``jax.jit`` this is staged once.
    specs = [_spec_at(a, mesh_axes.names) if a is not None else P() for a, d in zip(axes, dynamic) if d]
    dyn = [_conform(x, spec, mesh_axes) for x, spec in zip(dyn, specs)]
    return _build(wrapper, kind, treedef, axes, static, shapes, mesh_axes, n)(*dyn)


def _refuse_collectives(wrapper: Any, leaves: list, treedef: Any, axes: list, n: int, mesh_axes: MeshAxes) -> bool:
    """A collective over ``axis_name`` would see one device's shard only: refuse it (True: it is
    there, and ``chunk_size="auto"`` runs unchunked instead, as it does without sharding)."""
    from ._trace import trace_example

    try:
        trace_example(
            wrapper.fun,
            leaves,
            treedef,
            axes,
            n,
            axis_name=wrapper.axis_name,
            chunk_size=n // mesh_axes.n_shards,
            remat=False,
            where=wrapper.where,
        )
    except ValueError as e:
        if "collective" not in str(e):
            raise
        if wrapper.chunk_size == "auto":
            return True
        used = str(e).split("`fun` uses ", 1)[-1].split(",", 1)[0]  # "the collective `psum` over axis_name='i'"
        raise ValueError(
            f"{wrapper.where}: `fun` uses {used}, but the mapped inputs are sharded over mesh axes "
            f"{mesh_axes.names}, so each device would see only its own shard "
            f"({n // mesh_axes.n_shards} of {n}) and, with chunk_size={wrapper.chunk_size}, only a "
            f"chunk of it: a silently wrong result. Use chunk_size=None (exactly jax.vmap), "
            f"replicate the inputs, or compute the reduction with chunkop.sum."
        ) from None
    return False


def _build(
    wrapper: Any, kind: str, treedef: Any, axes: list, static: tuple, shapes: tuple, mesh_axes: MeshAxes, n: int
):
    """The ``shard_map`` of ``wrapper`` over the dynamic (array) leaves (``n``: the whole axis)."""
    where = getattr(wrapper, "where", "chunkop")
    mesh, names = mesh_axes
    n_leaves = len(axes)
    static_at = dict(static)
    dyn_idx = [i for i in range(n_leaves) if i not in static_at]
    in_specs = tuple(_spec_at(axes[i], names) if axes[i] is not None else P() for i in dyn_idx)

    def full_leaves(d: Sequence[Any]) -> list:
        full: list = [None] * n_leaves
        for i, v in static_at.items():
            full[i] = v
        for i, v in zip(dyn_idx, d):
            full[i] = v
        return full

    def call_local(*d: Any) -> Any:
        a, k = jax.tree_util.tree_unflatten(treedef, full_leaves(d))
        with _inside_local(n):
            return wrapper(*a, **k)

    if kind == "stack":
        examples = [
            jax.ShapeDtypeStruct(tuple(s for j, s in enumerate(shape) if j != axes[i]), dtype)
            if axes[i] is not None
            else jax.ShapeDtypeStruct(shape, dtype)
            for i, (shape, dtype) in zip(dyn_idx, shapes)
        ]

        def one(*ex: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(treedef, full_leaves(ex))
            return wrapper.fun(*a, **k)

        axis_name = getattr(wrapper, "axis_name", None)
        env = [(axis_name, n)] if axis_name is not None else []  # axis-size queries give the whole axis
        per_example = jax.make_jaxpr(one, axis_env=env, return_shape=True)(*examples)[1]
        oaxes = flat_out_axes(wrapper.out_axes, per_example, where)
        out_specs = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(per_example), [P() if a is None else _spec_at(a, names) for a in oaxes]
        )
        body = call_local
    else:
        out_specs = P()
        reduce = jax.lax.psum if kind == "sum" else jax.lax.pmean

        def body(*d: Any) -> Any:
            return jax.tree_util.tree_map(lambda o: reduce(o, names), call_local(*d))

    # check_vma=False: the chunk loops' carries start from (unvarying) zeros, which the
    # varying-manual-axes type check rejects; values and derivatives are checked by the tests.
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(mesh.axis_names), check_vma=False
    )


# ----------------------------------------------------------------------------------------------
# RowOperator with rows sharded along the row axis: moved to _row_sharding.py. Here: resharding
# to the specs a shard_map expects on an Explicit mesh (the transforms' dispatch and the
# row-sharded kernels both use it).


def _explicit(mesh_axes: MeshAxes) -> bool:
    """Whether every mesh axis of ``mesh_axes`` is Explicit (array types carry the sharding)."""
    mesh = mesh_axes.mesh
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    return all(types.get(a) == jax.sharding.AxisType.Explicit for a in mesh_axes.names)


def _conform(tree: Any, specs: Any, mesh_axes: MeshAxes) -> Any:
    """On an Explicit mesh, reshard the leaves whose sharding type differs from ``specs``
    (``shard_map`` requires the types to match; e.g. lineax may hand over replicated rows).

    Args:
        tree: a pytree of arrays.
        specs: a ``PartitionSpec`` per leaf (a pytree prefix of ``tree``).
        mesh_axes: the mesh (named, so that this works outside a ``jax.set_mesh`` context).

    Returns:
        ``tree``, resharded where needed; unchanged on a mesh that is not Explicit.
    """
    if not _explicit(mesh_axes):
        return tree

    def fix(x: Any, spec: P) -> Any:
        s = _sharding_of(x)
        have = tuple(s.spec) if s is not None else ()
        want = tuple(spec)
        pad = lambda t: t + (None,) * (max(len(have), len(want)) - len(t))
        if pad(have) == pad(want):
            return x
        # the mesh is named (concrete, or abstract under jit), so that this works outside a
        # `jax.set_mesh` context too
        return jax.sharding.reshard(x, NamedSharding(mesh_axes.mesh, spec))

    return jax.tree_util.tree_map(fix, tree, specs)


_MOVED = ("row_mesh", "operator_mesh", "spec_context", "with_sharding", "sharded_apply", "replicate")


def __getattr__(name: str) -> Any:
    """The row-sharded kernels moved to :mod:`chunkop._row_sharding`: forwarded there for now
    (``sharded_apply_transpose`` is now ``sharded_apply(..., transpose=True)``)."""
    from . import _row_sharding

    if name == "sharded_apply_transpose":
        return functools.partial(_row_sharding.sharded_apply, transpose=True)
    if name in _MOVED:
        return getattr(_row_sharding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
