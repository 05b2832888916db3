"""Inputs sharded along the mapped axis: each device chunks its own shard.

When a mapped argument of ``chunkop.vmap`` / ``map`` / ``sum`` / ``mean`` is sharded along its
mapped axis over mesh axes ``names`` (a ``NamedSharding`` on a concrete array, on an Auto or an
Explicit mesh; or, under ``jax.jit``, the sharding in the argument's type on an Explicit mesh),
each device runs the chunk loop of its own shard (:func:`chunkop._loops.device_loop`: the mapped
axis laid out as ``(devices, shard)``, the loop under ``jax.vmap`` over the device axis), and

- stacked outputs come back sharded along the mapped axis the same way (``out_axes``);
- outputs with ``out_axes=None`` are replicated (as in ``jax.vmap`` they must not vary);
- ``chunkop.sum`` / ``mean`` add the per-device sums: one all-reduce per call, and no
  all-gather of the inputs.

Under ``jax.jit`` on an Auto mesh the argument types carry no sharding, so there is nothing to
detect: ``spmd_axis_name`` names the mesh axes, or use an Explicit mesh (``jax.make_mesh``'s
default).

This module finds the mesh axes (:func:`mapped_mesh_axes`), sets their mesh as the context
(:func:`mesh_context`) and reshards to specs (:func:`conform`); the row-sharded kernels of
:class:`chunkop.RowOperator` (:mod:`chunkop._operator.row_sharding`: the same device layout over
the rows) use all three.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _jaxpr

__all__ = [
    "MeshAxes",
    "mapped_mesh_axes",
    "per_dim",
    "spec_at",
]


class MeshAxes(NamedTuple):
    """A mesh and the names of its axes that an array's mapped axis is sharded over."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    names: tuple

    @property
    def n_shards(self) -> int:
        return math.prod(int(self.mesh.shape[a]) for a in self.names)


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
        A :class:`MeshAxes`, or None.

    Raises:
        ValueError: when mapped inputs are sharded over different mesh axes or meshes.
    """
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


def mesh_context(mesh_axes: MeshAxes) -> Any:
    """The mesh of ``mesh_axes`` as the current mesh, where none is set (sharded arrays called
    on outside a ``jax.set_mesh`` context): the chunked program's device axis is then sharded
    over that mesh's axes by name. ``jax.set_mesh`` for a concrete mesh when nothing is being
    traced; the abstract mesh while anything is (``jax.set_mesh`` refuses to run under any
    transform, ``jax.grad`` as ``jax.jit``, also for arrays closed over concretely), or when the
    mesh is abstract (read off a traced array's type)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    mesh = mesh_axes.mesh
    if isinstance(mesh, jax.sharding.Mesh) and not _jaxpr.tracing():
        return jax.set_mesh(mesh)
    return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))


def unsplit(leaves: list, axes: list, mesh_axes: MeshAxes) -> list:
    """The mapped leaves no longer typed as split along their mapped axis (an Explicit mesh axis
    of size 1 splits nothing: resharding moves no data), so that they chunk as on one device."""
    if not explicit(mesh_axes):
        return leaves

    def unsplit_one(x: Any, axis: int | None) -> Any:
        s = _sharding_of(x)
        if axis is None or s is None:
            return x
        spec = per_dim(s.spec, x.ndim)
        return jax.sharding.reshard(x, NamedSharding(mesh_axes.mesh, P(*spec[:axis], None, *spec[axis + 1 :])))

    return [unsplit_one(x, a) for x, a in zip(leaves, axes)]


def split_devices(x: Any, axis: int, shards: int) -> Any:
    """The device layout of ``x``: its ``axis`` (sharded over ``shards`` devices) reshaped to
    ``(shards, size / shards)``; free, the device axis being the sharded, major one."""
    return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1 :])


def join_devices(y: Any, axis: int) -> Any:
    """:func:`split_devices` undone: ``y``'s ``(devices, per device)`` axes at ``axis`` joined."""
    return y.reshape(y.shape[:axis] + (y.shape[axis] * y.shape[axis + 1],) + y.shape[axis + 2 :])


def per_dim(spec: Any, ndim: int) -> tuple:
    """A ``PartitionSpec``'s entries, padded with ``None`` to one per dimension of an ``ndim``-D array.

    Example:
        >>> per_dim(P("d"), 3)
        ('d', None, None)
    """
    spec = tuple(spec)
    return (*spec, *([None] * (ndim - len(spec))))


def spec_at(axis: int, names: tuple) -> P:
    """The spec sharding an array's ``axis`` over the mesh axes ``names``."""
    return P(*([None] * axis), names if len(names) > 1 else names[0])


# ----------------------------------------------------------------------------------------------
# Resharding to the specs the device layout expects on an Explicit mesh (the transforms' and the
# row-sharded kernels').


def explicit(mesh_axes: MeshAxes) -> bool:
    """Whether every mesh axis of ``mesh_axes`` is Explicit (array types carry the sharding)."""
    mesh = mesh_axes.mesh
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    return all(types.get(a) == jax.sharding.AxisType.Explicit for a in mesh_axes.names)


def explicit_context() -> bool:
    """Whether the current (abstract) mesh context, if any, has an Explicit axis: where a
    ``jax.set_mesh`` context with Explicit axes types every array created in it."""
    mesh = jax.sharding.get_abstract_mesh()
    types = getattr(mesh, "axis_types", ()) or ()
    return not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in types)


def check_even(n: int, mesh_axes: MeshAxes, what: str) -> int:
    """``mesh_axes``' device count, when it divides the ``n`` elements of ``what`` (a sentence's
    subject: "chunkop.vmap: the mapped axis", "RowOperator: the rows"); else a ``ValueError``
    saying so (the device layout splits the axis evenly)."""
    shards = mesh_axes.n_shards
    if n % shards:
        raise ValueError(
            f"{what} ({n} elements) is sharded over mesh axes {mesh_axes.names} of {shards} devices, "
            f"which does not divide it evenly; pad it to a multiple of {shards} or shard it evenly."
        )
    return shards


def conform(tree: Any, specs: Any, mesh_axes: MeshAxes) -> Any:
    """On an Explicit mesh, reshard the leaves whose sharding type differs from ``specs``
    (the device layout splits the sharded axis; e.g. lineax may hand over replicated rows).

    Args:
        tree: a pytree of arrays.
        specs: a ``PartitionSpec`` per leaf (a pytree prefix of ``tree``).
        mesh_axes: the mesh (named, so that this works outside a ``jax.set_mesh`` context).

    Returns:
        ``tree``, resharded where needed; unchanged on a mesh that is not Explicit.
    """
    if not explicit(mesh_axes):
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
