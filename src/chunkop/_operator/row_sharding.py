"""A ``RowOperator`` whose rows are sharded over devices along their leading (row) axis.

Rows sharded along axis 0 (:func:`row_mesh`; recorded on the operator when it is built, see
:func:`operator_mesh`) make ``A.mv`` and ``A.T.mv`` run in one ``jax.shard_map`` over the rows'
mesh axes (:func:`sharded_apply`): the arrays ``row_fn`` closes over and ``x`` replicated, each
device running the single-device kernel on its own rows.

- ``A x`` comes back sharded like the rows, with no collective; or, for
  ``out_sharding="replicated"``, resharded to replicated outside the ``shard_map``
  (:func:`replicate`: one all-gather, whose derivative is a local slice);
- ``A^T y`` sums the devices' x-space results with one ``psum``.

On an Explicit mesh the operator's in/out structures carry these shardings
(:func:`with_sharding`), as lineax expects of the vectors it compares them with. ``row_fn`` is
traced without a mesh context (:func:`spec_context`), so that its jaxpr runs inside the
``shard_map`` too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._cache import register_cache
from .._sharding import MeshAxes, _conform, _explicit, _inside_local, in_local_body, mapped_mesh_axes, spec_at

__all__ = [
    "row_mesh",
    "operator_mesh",
    "spec_context",
    "with_sharding",
    "sharded_apply",
    "map_rows",
    "replicate",
]


def row_mesh(rows: Any) -> MeshAxes | None:
    """The mesh axes the leading (row) axis of ``rows`` is sharded over.

    All sharded leaves must agree; unsharded leaves are resharded by ``shard_map``.

    Args:
        rows: the operator's row pytree.

    Returns:
        A :class:`chunkop._sharding.MeshAxes`, or None when no leaf is sharded along axis 0.
    """
    leaves = jax.tree_util.tree_leaves(rows)
    return mapped_mesh_axes(leaves, [0] * len(leaves), "RowOperator")


def spec_context(rows: Any) -> Any:
    """The context to trace a row-sharded operator's ``row_fn`` in: no mesh.

    A jaxpr traced under ``jax.set_mesh`` records that mesh in its nested ``jit`` equations
    (``jnp`` functions are jitted), and evaluating it inside ``shard_map``, where the row axis is
    Manual, then fails (context mesh vs aval mesh). Traced without a mesh it runs in both
    places. Only operators with sharded rows are traced so (an unsharded operator built under
    an Explicit mesh needs its mesh context for its derivatives); so the ``row_fn`` of an
    operator built under a mesh from unsharded rows cannot be reused for sharded rows: build
    the sharded operator from its own ``row_fn``, or build the first one outside the mesh.

    Args:
        rows: the operator's row pytree.

    Returns:
        A context manager: an empty abstract mesh for sharded rows under a mesh, else a no-op.
    """
    if row_mesh(rows) is None or jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def operator_mesh(op: Any) -> MeshAxes | None:
    """The mesh axes a ``RowOperator``'s rows are sharded over.

    From the rows themselves, or as recorded when the operator was built (under ``jax.jit`` on
    an Auto mesh, traced rows carry no sharding; an operator built outside ``jit`` from sharded
    rows keeps it). None inside a device-local body, where the rows are one device's.

    Args:
        op: the operator (its ``rows`` and ``mesh_axes``).

    Returns:
        A :class:`chunkop._sharding.MeshAxes`, or None for rows on one device.
    """
    found = row_mesh(op.rows)
    if found is None and not in_local_body():
        found = getattr(op, "mesh_axes", None)
    return found


def _any_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` (a context's abstract mesh) has an Explicit axis."""
    types = getattr(mesh, "axis_types", ()) or ()
    return not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in types)


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
      replicated (``T.mv`` ends in a ``psum``);
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
    if mesh_axes is not None and _explicit(mesh_axes):
        mesh = getattr(mesh_axes.mesh, "abstract_mesh", mesh_axes.mesh)
        row_sharded = rows and getattr(op, "out_sharding", "rows") == "rows"
        sharding = NamedSharding(mesh, spec_at(0, mesh_axes.names) if row_sharded else P())
    else:
        context = jax.sharding.get_abstract_mesh()
        if mesh_axes is not None or not _any_explicit(context):
            return structs
        sharding = NamedSharding(context, P())
    return jax.tree_util.tree_map(
        lambda s: _normalised(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype, sharding=sharding)), structs
    )


def replicate(tree: Any, mesh_axes: MeshAxes) -> Any:
    """On an Explicit mesh, ``tree`` resharded to replicated (an all-gather); else unchanged.

    Outside the ``shard_map`` (``jax.sharding.reshard``), so that its derivative is the exact
    transpose (a local slice) rather than a ``psum_scatter`` of replicated cotangents.

    Args:
        tree: a pytree of arrays (``A x``, sharded like the rows).
        mesh_axes: the mesh axes the rows are sharded over.

    Returns:
        ``tree``, replicated on an Explicit mesh.
    """
    if not _explicit(mesh_axes):
        return tree
    return _conform(tree, jax.tree_util.tree_map(lambda _: P(), tree), mesh_axes)


def _check_even(n: int, mesh_axes: MeshAxes) -> None:
    """Refuse ``n`` rows that the devices of ``mesh_axes`` do not divide evenly."""
    if n % mesh_axes.n_shards:
        raise ValueError(
            f"RowOperator: the {n} rows are sharded over mesh axes {mesh_axes.names} of "
            f"{mesh_axes.n_shards} devices, which does not divide them; pad the rows to a "
            f"multiple of {mesh_axes.n_shards}."
        )


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
      are not); each device transposes its own rows, then one ``psum`` over ``mesh_axes``
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
    _check_even(jax.tree_util.tree_leaves(rows)[0].shape[0], mesh_axes)
    specs = _in_specs(consts, rows, vector, mesh_axes.names, transpose)
    consts, rows, vector = (_conform(t, p, mesh_axes) for t, p in zip((consts, rows, vector), specs))
    return _sharded_program(consts, rows, vector, kernel=kernel, spec=spec, mesh_axes=mesh_axes, transpose=transpose)


def map_rows(fn: Callable, rows: Any, *unmapped: Any) -> Any:
    """``fn(rows, *unmapped)``, a function that maps over the rows (every output has the rows'
    leading axis), evaluated where the operator's kernels run its rows: with rows sharded over
    devices, each device on its own rows (one ``jax.shard_map``, ``unmapped`` replicated, the
    result sharded like the rows, no collective); else directly.

    For the tools that evaluate ``row_fn`` row by row (``check_linear``'s reference matvec,
    ``as_matrix``, the diagonal): inside the ``shard_map`` a row's ``x[idx]`` reads the
    replicated ``x`` on its own device, where ``jax.vmap`` along an Explicit mesh axis refuses a
    gather by sharded indices.

    Args:
        fn: a function of the rows and ``unmapped``.
        rows: a row pytree (leading axis: the rows).
        *unmapped: arrays every device reads whole.

    Returns:
        ``fn(rows, *unmapped)``.
    """
    mesh_axes = row_mesh(rows)  # (None inside a device-local body)
    if mesh_axes is None or mesh_axes.n_shards == 1:
        return fn(rows, *unmapped)
    _check_even(jax.tree_util.tree_leaves(rows)[0].shape[0], mesh_axes)
    specs = (_by_rows(rows, mesh_axes.names), _replicated(unmapped))
    rows, unmapped = (_conform(t, p, mesh_axes) for t, p in zip((rows, unmapped), specs))
    return _shard_rows(lambda r, u: fn(r, *u), (rows, unmapped), specs, spec_at(0, mesh_axes.names), mesh_axes)


def _replicated(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda _: P(), tree)


def _by_rows(tree: Any, names: tuple) -> Any:
    return jax.tree_util.tree_map(lambda _: spec_at(0, names), tree)


def _shard_rows(local: Callable, operands: tuple, in_specs: tuple, out_specs: Any, mesh_axes: MeshAxes) -> Any:
    """``jax.shard_map`` of ``local(*operands)`` over the rows' mesh axes, traced as a
    device-local body (the transforms it calls chunk that device's rows, no further dispatch)."""

    def body(*ops: Any) -> Any:
        with _inside_local():
            return local(*ops)

    # check_vma=False: the chunk loops' carries start from (unvarying) zeros, which the
    # varying-manual-axes type check rejects; values and derivatives are checked by the tests.
    return jax.shard_map(
        body,
        mesh=mesh_axes.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(mesh_axes.names),
        check_vma=False,
    )(*operands)


def _in_specs(consts: Any, rows: Any, vector: Any, names: tuple, transpose: bool) -> tuple:
    """The ``shard_map`` specs of a row-sharded kernel's operands: ``consts`` replicated, ``rows``
    split along the row axis, the vector replicated (``x``) or split like the rows (``y``)."""
    return _replicated(consts), _by_rows(rows, names), _by_rows(vector, names) if transpose else _replicated(vector)


@functools.partial(jax.jit, static_argnames=("kernel", "spec", "mesh_axes", "transpose"))
def _sharded_program(
    consts: Any, rows: Any, vector: Any, *, kernel: Callable, spec: Any, mesh_axes: MeshAxes, transpose: bool
) -> Any:
    """The ``shard_map`` of :func:`sharded_apply`, jitted on its static description (the
    kernel, the operator's ``spec``, the mesh, the direction): an eager call compiles once per
    operator description and input types, not per call (before: 5-7 compiles, 1-2 s per call
    on 4 CPU devices). The arrays (``consts``, ``rows``, ``vector``) are arguments, never
    baked in."""
    names = mesh_axes.names

    def local(c: Any, r: Any, v: Any) -> Any:
        out = kernel(spec, c, r, v)
        return jax.tree_util.tree_map(lambda p: jax.lax.psum(p, names), out) if transpose else out

    specs = _in_specs(consts, rows, vector, names, transpose)
    return _shard_rows(local, (consts, rows, vector), specs, P() if transpose else spec_at(0, names), mesh_axes)


register_cache(_sharded_program.clear_cache)
