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

Under ``jax.jit`` on an Auto mesh the argument types name the mesh but not the sharding, so
there is nothing to detect: ``spmd_axis_name`` names the mesh axes (of the current mesh, or else
of the mesh the mapped arguments are on), or use an Explicit mesh (``jax.make_mesh``'s default).

This module finds the mesh axes (:func:`mapped_mesh_axes`), sets their mesh as the context
(:func:`mesh_context`), reshards to specs (:func:`conform`) and runs the one device layout
(:func:`on_devices`) that both the transforms' loops and the row-sharded kernels of
:class:`chunkop.RowOperator` (:mod:`chunkop._operator.row_sharding`) run in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _jaxpr
from ._tree import is_float

__all__ = [
    "MeshAxes",
    "on_devices",
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
        s = getattr(jax.typeof(x), "sharding", None)  # (abstract values without one: none)
    elif isinstance(x, jax.Array):
        s = x.sharding  # (kept by deleted and donated arrays too)
    else:
        return None
    return s if isinstance(s, NamedSharding) else None


def manual_axes(mesh: Any) -> tuple:
    """The mesh axes that are manual (inside ``shard_map``); none on meshes without the notion."""
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def _names_at(s: NamedSharding, axis: int) -> tuple:
    spec = tuple(s.spec)
    entry = spec[axis] if axis < len(spec) else None
    if entry is None:
        return ()
    names = entry if isinstance(entry, tuple) else (entry,)
    return tuple(a for a in names if a not in manual_axes(s.mesh))


def mapped_mesh_axes(
    leaves: Sequence[Any], axes: Sequence[int | None], where: str, spmd_axis_name: Any = None
) -> MeshAxes | None:
    """The mesh axes the mapped axis is sharded over, or None when no mapped input is sharded.

    Found from the mapped inputs' ``NamedSharding`` (concrete arrays; or traced ones on an
    Explicit mesh). Failing that, ``spmd_axis_name`` names them where the types cannot
    (:func:`_named_axes`): this is how an Auto mesh under ``jax.jit`` (where traced values carry
    their mesh but no sharding) asks for device-local chunking, with or without ``jax.set_mesh``.

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
    if found is None and spmd_axis_name is not None:
        found = _named_axes(leaves, axes, spmd_axis_name)
    return found


def _named_axes(leaves: Sequence[Any], axes: Sequence[int | None], spmd_axis_name: Any) -> MeshAxes | None:
    """The mesh axes ``spmd_axis_name`` names, where the mapped inputs' types do not say how they
    are sharded (traced values on Auto mesh axes): on the current mesh or, where none is set, on
    the one mesh the mapped inputs are on (their types name it). None where the inputs are
    known not to be split along the mapped axis, as ``jax.vmap``'s result then is not: concrete
    arrays or Explicit mesh axes (the sharding is known, and was not along the mapped axis), or
    mesh axes that do not divide the mapped axis evenly."""
    mapped = [(x, a) for x, a in zip(leaves, axes) if a is not None]
    if not mapped or not all(isinstance(x, jax.core.Tracer) for x, _ in mapped):
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        meshes = [s.mesh for x, _ in mapped if (s := _sharding_of(x)) is not None and not s.mesh.empty]
        if not meshes or any(m != meshes[0] for m in meshes):
            return None
        mesh = meshes[0]
    names = tuple(spmd_axis_name) if isinstance(spmd_axis_name, (tuple, list)) else (spmd_axis_name,)
    if not all(a in mesh.axis_names and a not in manual_axes(mesh) for a in names):
        return None
    found = MeshAxes(mesh, names)
    x, a = mapped[0]
    return None if explicit(found) or jnp.shape(x)[a] % found.n_shards else found


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


# ----------------------------------------------------------------------------------------------
# The device layout, one for both layers: the transforms' loops over a sharded mapped axis
# (``chunkop._loops.device_loop``) and a RowOperator's kernels over sharded rows
# (``chunkop._operator.row_sharding``).


def on_devices(
    local: Callable,
    mapped: Sequence[Any],
    axes: Sequence[int],
    unmapped: Any,
    mesh_axes: MeshAxes,
    *,
    out_axes: Any = 0,
    reduce: bool = False,
    per_device: Sequence[Any] = (),
    automatic: bool = False,
    spread: bool = True,
    what: str = "the sharded axis",
) -> Any:
    """``local(mapped_shard, unmapped, per_device)`` run by each device on its own shard of ``mapped``.

    The device layout: each array of ``mapped`` (its ``axes[i]`` of ``n`` elements sharded over
    ``mesh_axes``) is reshaped to ``(devices, n / devices)`` at that axis (free: the device axis is
    the sharded, major one) and ``local`` runs under ``jax.vmap`` over the device axis, so XLA's
    partitioner gives each device its own call on its own shard. No ``shard_map``: ``local`` runs
    in the caller's mesh context.

    One policy for what every device reads whole: the floating-point leaves of ``unmapped`` enter
    broadcast over the device axis (each device holds its one copy, as replicated), so that under
    reverse mode their cotangents sum on each device, inside its own loop, and the devices' sums
    are added once at the end (one all-reduce per call, not one per chunk of a loop's transpose);
    the other leaves (integers, keys; arrays typed on another mesh) enter unbatched, as do all
    with ``spread=False``.

    Args:
        local: ``local(shards, unmapped, per_device) -> outputs`` (a pytree) on one device.
        mapped: arrays sharded along ``axes`` (resharded to that spec on an Explicit mesh).
        axes: the sharded axis of each array of ``mapped``.
        unmapped: a pytree every device reads whole.
        mesh_axes: the mesh axes the mapped axis is sharded over.
        out_axes: where each output's device axis is joined (an int, or a pytree prefix of the
            outputs; None: an output that must not vary, ``jax.vmap``'s ``out_axes=None``, which
            needs ``spread=False`` when it depends on ``unmapped``), unless ``reduce``.
        reduce: sum every output over the devices instead (one all-reduce; replicated).
        per_device: arrays with a leading device axis already (``(devices, ...)``, e.g. running
            sums that start per device), resharded along it on an Explicit mesh.
        automatic: run ``local`` with the mesh axes automatic on an Explicit mesh
            (``jax.sharding.auto_axes``): for a ``row_fn`` that gathers a replicated ``x`` by
            row-sharded indices, which JAX's sharding types refuse and the partitioner places
            locally (its outputs then join along axis 0). Without it, ``local`` sees the arrays'
            Explicit types, as ``jax.vmap`` shows them.
        spread: broadcast ``unmapped``'s floats over the devices (above); False for a loop
            with an output that must not vary (``out_axes=None``): carried through its chunks,
            a batched value there would need the scan to broadcast its start inside the devices'
            ``vmap``, where JAX 0.10 loses an Explicit mesh.
        what: the sharded axis, for the uneven-split error (:func:`check_even`).

    Returns:
        ``local``'s outputs, joined along ``out_axes`` (sharded like ``mapped``) or summed.
    """
    shards, names = mesh_axes.n_shards, mesh_axes.names
    mapped = list(mapped)
    if mapped:
        check_even(mapped[0].shape[axes[0]], mesh_axes, what)
    mapped = conform(mapped, [spec_at(a, names) for a in axes], mesh_axes)
    per_device = conform(list(per_device), [spec_at(0, names)] * len(per_device), mesh_axes)
    auto = automatic and explicit(mesh_axes)
    # (Explicit types carry the device axis' sharding; elsewhere spmd_axis_name names it)
    spmd = names if auto or not explicit(mesh_axes) else None

    def body(mapped: list, unmapped: Any, per_device: list) -> Any:
        floats = jax.tree_util.tree_map(lambda v: spread and _spreadable(v, mesh_axes), unmapped)
        u_axes = jax.tree_util.tree_map(lambda f: 0 if f else None, floats)

        def broadcast(v: Any, f: bool) -> Any:
            if not f:
                return v
            shape = (shards, *jnp.shape(v))
            if auto or not explicit(mesh_axes):
                return jnp.broadcast_to(v, shape)
            # typed split over the devices from the start: its transpose is one all-reduce
            rest = per_dim(jax.typeof(v).sharding.spec, jnp.ndim(v))
            spec = P(*spec_at(0, names), *rest)
            return jnp.broadcast_to(v, shape, out_sharding=NamedSharding(mesh_axes.mesh, spec))

        unmapped = jax.tree_util.tree_map(broadcast, unmapped, floats)
        split = [split_devices(x, a, shards) for x, a in zip(mapped, axes)]
        vmapped = jax.vmap(
            local,
            in_axes=(list(axes), u_axes, 0),
            out_axes=0 if reduce else out_axes,
            axis_size=shards,
            spmd_axis_name=spmd,
        )
        per = vmapped(split, unmapped, per_device)
        if reduce:
            return jax.tree_util.tree_map(lambda p: p.sum(0, dtype=p.dtype), per)
        joins = out_axes if _is_tree(out_axes) else jax.tree_util.tree_map(lambda _: out_axes, per)
        return jax.tree_util.tree_map(
            lambda a, p: p if a is None else join_devices(p, a), joins, per, is_leaf=lambda a: a is None
        )

    with mesh_context(mesh_axes):
        if auto:
            specs = P() if reduce else spec_at(0, names)
            body = jax.sharding.auto_axes(body, axes=names, out_sharding=specs)
        return body(mapped, unmapped, per_device)


def _spreadable(v: Any, mesh_axes: MeshAxes) -> bool:
    """Whether ``v`` enters the device layout broadcast over the devices: a float array on no
    mesh or on one with ``mesh_axes``' axis types (JAX refuses to broadcast an array typed on an
    Auto mesh under an Explicit context)."""
    if not is_float(v):
        return False
    mesh = getattr(getattr(jax.typeof(v), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return True
    return tuple(getattr(mesh, "axis_types", ())) == tuple(getattr(mesh_axes.mesh, "axis_types", ()))


def _is_tree(out_axes: Any) -> bool:
    return not (out_axes is None or isinstance(out_axes, int))
