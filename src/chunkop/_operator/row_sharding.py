"""A ``RowOperator`` whose rows are sharded over devices along their leading (row) axis.

Rows sharded along axis 0 (:func:`row_mesh`; recorded on the operator when it is built, see
:func:`operator_mesh`) make ``A.mv`` and ``A.T.mv`` run in the one device layout
(:func:`on_devices`, :func:`chunkop._sharding.on_devices`): the rows as ``(devices, rows per
device)``, the single-device kernel under ``jax.vmap`` over the device axis, the arrays ``row_fn``
closes over and ``x`` read whole by every device.

- ``A x`` comes back sharded like the rows, with no collective; or, for
  ``out_sharding="replicated"``, resharded to replicated (:func:`replicate`: one all-gather,
  whose derivative is a local slice);
- ``A^T y`` sums the devices' x-space results: one all-reduce.

On an Explicit mesh the operator's in/out structures carry these shardings
(:func:`with_sharding`), as lineax expects of the vectors it compares them with, and ``row_fn``
is traced (:func:`traced_for_rows`) and run with the rows' mesh axes automatic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .._cache import register_cache
from .._sharding import (
    MeshAxes,
    conform,
    explicit,
    explicit_context,
    mapped_mesh_axes,
    mesh_context,
    spec_at,
)
from .._sharding import on_devices as on_all_devices

__all__ = [
    "row_mesh",
    "operator_mesh",
    "traced_for_rows",
    "with_sharding",
    "sharded_apply",
    "map_rows",
    "replicate",
]


def row_mesh(rows: Any) -> MeshAxes | None:
    """The mesh axes the leading (row) axis of ``rows`` is sharded over.

    All sharded leaves must agree; unsharded leaves are resharded to the rows' sharding.

    Args:
        rows: the operator's row pytree.

    Returns:
        A :class:`chunkop._sharding.MeshAxes`, or None when no leaf is sharded along axis 0.
    """
    leaves = jax.tree_util.tree_leaves(rows)
    return mapped_mesh_axes(leaves, [0] * len(leaves), "RowOperator")


def traced_for_rows(make: Callable[[], Any], rows: Any) -> Any:
    """``make()`` (the trace of ``row_fn``, and the plan made on it) in the context the kernels
    run ``row_fn`` in (:func:`on_devices`).

    On an Explicit mesh the kernels run ``row_fn`` with the rows' mesh axes automatic: a jaxpr
    traced in the Explicit context would carry that mesh's types into its constants and
    broadcasts, which JAX then refuses beside the automatic values. So ``row_fn`` is traced with
    those axes automatic (a ``with_sharding_constraint`` in it works). A ``row_fn`` that closes
    over an array typed on the Explicit mesh cannot be traced so (JAX refuses that array beside
    automatic values): it is traced without a mesh context instead, and its inner jits are then
    evaluated inline (:func:`chunkop._trace.eval_traced`). Elsewhere: the caller's context.

    Args:
        make: the trace (and plan) to run.
        rows: the operator's row pytree.

    Returns:
        ``make()``.
    """
    mesh_axes = row_mesh(rows)
    if mesh_axes is None or not explicit(mesh_axes):
        return make()
    mesh = getattr(mesh_axes.mesh, "abstract_mesh", mesh_axes.mesh)
    try:
        with jax.sharding.use_abstract_mesh(mesh.update_axis_types({a: AxisType.Auto for a in mesh_axes.names})):
            return make()
    except ValueError:  # an Explicit-typed closed-over array beside automatic values
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return make()


def operator_mesh(op: Any) -> MeshAxes | None:
    """The mesh axes a ``RowOperator``'s rows are sharded over.

    From the rows themselves, or as recorded when the operator was built (under ``jax.jit`` on
    an Auto mesh, traced rows carry no sharding; an operator built outside ``jit`` from sharded
    rows keeps it).

    Args:
        op: the operator (its ``rows`` and ``mesh_axes``).

    Returns:
        A :class:`chunkop._sharding.MeshAxes`, or None for rows on one device.
    """
    found = row_mesh(op.kernel_rows)
    return getattr(op, "mesh_axes", None) if found is None else found


@functools.lru_cache(maxsize=1024)
def _normalised(struct: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """``struct`` as lineax normalises structures: through ``jax.eval_shape`` (which, on an
    Explicit mesh, writes the partition spec out to one entry per dimension, e.g. ``P()`` ->
    ``P(None,)``), without a weak dtype. lineax compares structures with ``==``, so ours must be
    in that form for ``A.T @ A + lam * lx.IdentityLinearOperator(A.in_structure())``."""
    out = jax.eval_shape(lambda v: v, struct)
    return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding)


register_cache(_normalised.cache_clear)


def with_sharding(structs: Any, op: Any, *, rows: bool) -> Any:
    """A ``RowOperator``'s in/out structure, typed as the vectors it takes and returns are.

    lineax compares an operator's structures with ``jax.eval_shape`` of vectors (and of other
    operators' structures), which on an Explicit mesh include the sharding. So:

    - rows sharded over an Explicit mesh: the row space (``rows=True``) is sharded like the
      rows along its leading axis (replicated for ``out_sharding="replicated"``), the x space
      replicated (``T.mv`` ends in an all-reduce);
    - otherwise, under a ``jax.set_mesh`` context with Explicit axes: both spaces replicated
      on that mesh (what a vector created there is typed as);
    - otherwise (no mesh, Auto axes): no sharding, as ``jax.eval_shape`` reports there.

    Every sharding is normalised as ``jax.eval_shape`` (and so lineax) writes it.

    Args:
        structs: the structure, a pytree of ``jax.ShapeDtypeStruct``.
        op: the operator (its rows, recorded mesh axes and ``out_sharding``).
        rows: True for the row (output) space, False for the x (input) space.

    Returns:
        ``structs`` with those shardings.
    """
    mesh_axes = operator_mesh(op)
    if mesh_axes is not None and explicit(mesh_axes):
        mesh = getattr(mesh_axes.mesh, "abstract_mesh", mesh_axes.mesh)
        row_sharded = rows and getattr(op, "out_sharding", "rows") == "rows"
        sharding = NamedSharding(mesh, spec_at(0, mesh_axes.names) if row_sharded else P())
    else:
        context = jax.sharding.get_abstract_mesh()
        if mesh_axes is not None or not explicit_context():
            return structs
        sharding = NamedSharding(context, P())
    return jax.tree_util.tree_map(
        lambda s: _normalised(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype, sharding=sharding)), structs
    )


def replicate(tree: Any, mesh_axes: MeshAxes) -> Any:
    """On an Explicit mesh, ``tree`` resharded to replicated (an all-gather); else unchanged.

    Outside the device layout (``jax.sharding.reshard``), so that its derivative is the exact
    transpose (a local slice).

    Args:
        tree: a pytree of arrays (``A x``, sharded like the rows).
        mesh_axes: the mesh axes the rows are sharded over.

    Returns:
        ``tree``, replicated on an Explicit mesh.
    """
    if not explicit(mesh_axes):
        return tree
    return conform(tree, jax.tree_util.tree_map(lambda _: P(), tree), mesh_axes)


def sharded_apply(
    kernel: Callable,
    spec: Any,
    consts: Any,
    rows: Any,
    vector: Any,
    mesh_axes: MeshAxes,
    *,
    transpose: bool = False,
) -> Any:
    """``A x`` (or ``A^T y``) with each device running ``kernel`` on its own rows.

    - ``A x`` (``transpose=False``): ``x`` replicated on every device; the rows of ``A x``
      come back sharded along axis 0 like ``rows``, with no collective.
    - ``A^T y`` (``transpose=True``): ``y``'s rows are sharded like ``rows`` (resharded if they
      are not); each device transposes its own rows, then one all-reduce over ``mesh_axes``
      sums the x-space results (replicated).

    Args:
        kernel: the single-device kernel ``kernel(spec, consts, rows, vector)``: the matvec,
            or with ``transpose=True`` the transpose.
        spec: the operator's static description.
        consts: the arrays ``row_fn`` closes over (replicated on every device).
        rows: the row pytree, sharded along axis 0 over ``mesh_axes``.
        vector: ``x`` (x-space), or ``y`` (row space) with ``transpose=True``.
        mesh_axes: from :func:`row_mesh`.
        transpose: which of the two products.

    Returns:
        The rows of ``A x``, sharded along axis 0 like ``rows``; or ``A^T y``, replicated.
    """
    with mesh_context(mesh_axes):  # (the jit's cache keys on the context mesh)
        return _sharded_program(
            consts, rows, vector, kernel=kernel, spec=spec, mesh_axes=mesh_axes, transpose=transpose
        )


def map_rows(fn: Callable, rows: Any, *unmapped: Any, reduce: bool = False) -> Any:
    """``fn(rows, *unmapped)``, a function that maps over the rows (every output has the rows'
    leading axis), evaluated where the operator's kernels run its rows: with rows sharded over
    devices, each device on its own rows (:func:`on_devices`, ``unmapped`` replicated, the
    result sharded like the rows, no collective); else directly. With ``reduce``, ``fn`` sums
    over the rows instead (no rows' axis), and the devices' sums are added (one all-reduce).

    For the tools that evaluate ``row_fn`` row by row (``check_linear``'s reference matvec,
    ``as_matrix``, the diagonal).

    Args:
        fn: a function of the rows and ``unmapped``.
        rows: a row pytree (leading axis: the rows).
        *unmapped: arrays every device reads whole.

    Returns:
        ``fn(rows, *unmapped)``.
    """
    mesh_axes = row_mesh(rows)
    if mesh_axes is None or mesh_axes.n_shards == 1:
        return fn(rows, *unmapped)
    return on_devices(lambda r, u: fn(r, *u), rows, unmapped, mesh_axes, reduce=reduce)


def on_devices(local: Callable, mapped: Any, unmapped: Any, mesh_axes: MeshAxes, *, reduce: bool = False) -> Any:
    """``local(mapped, unmapped)`` run by each device on its own rows of ``mapped``: the one
    device layout (:func:`chunkop._sharding.on_devices`) over the rows' leading axis, with the
    mesh axes automatic on an Explicit mesh (JAX's sharding types refuse the gather of a
    replicated ``x`` by row-sharded indices that a ``row_fn`` makes, where the partitioner places
    it locally).

    Args:
        local: ``local(mapped_rows, unmapped)`` on one device's rows.
        mapped: a pytree of arrays with the rows' leading axis (resharded along it if needed).
        unmapped: a pytree every device reads whole.
        mesh_axes: the mesh axes the rows are sharded over (from :func:`row_mesh`).
        reduce: sum ``local``'s outputs over the devices (one all-reduce; replicated), instead
            of joining them along the rows (sharded like the rows).

    Returns:
        ``local``'s outputs joined along the rows, or summed over the devices.
    """
    leaves, tree = jax.tree_util.tree_flatten(mapped)
    return on_all_devices(
        lambda m, u, _: local(jax.tree_util.tree_unflatten(tree, m), u),
        leaves,
        [0] * len(leaves),
        unmapped,
        mesh_axes,
        reduce=reduce,
        automatic=True,
        what="RowOperator: the rows",
    )


@functools.partial(jax.jit, static_argnames=("kernel", "spec", "mesh_axes", "transpose"))
def _sharded_program(
    consts: Any, rows: Any, vector: Any, *, kernel: Callable, spec: Any, mesh_axes: MeshAxes, transpose: bool
) -> Any:
    """:func:`sharded_apply`'s program, jitted on its static description (the kernel, the
    operator's ``spec``, the mesh, the direction), so that an eager call compiles once per
    operator description and input types. The arrays are arguments, never baked in."""
    if transpose:
        local = lambda m, c: kernel(spec, c, m[0], m[1])
        return on_devices(local, (rows, vector), consts, mesh_axes, reduce=True)
    return on_devices(lambda r, u: kernel(spec, u[0], r, u[1]), rows, (consts, vector), mesh_axes)


register_cache(_sharded_program.clear_cache)
