"""Argument checking for the chunked transforms: ``chunk_size``, ``in_axes``, ``out_axes``.

Everything here runs before any tracing, so bad input fails with a message that names the
argument (``args[1]['w']``, ``kwargs['b']``) and says what was expected.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _jaxpr

__all__ = [
    "check_chunk_size",
    "check_axis_size",
    "check_in_axes_spec",
    "check_out_axes_spec",
    "flat_in_axes",
    "flat_out_axes",
    "mapped_size",
    "is_array_leaf",
    "check_remat",
    "replace_at",
    "uses_vmappables",
]


def replace_at(seq: Sequence[Any], positions: Sequence[int], values: Sequence[Any]) -> list:
    """A copy of ``seq`` as a list, with ``values`` put at ``positions`` (pairwise).

    How a function of some arguments (or leaves) is called with the others held fixed.

    Example:
        >>> replace_at(["a", "b", "c"], [0, 2], ["x", "z"])
        ['x', 'b', 'z']
    """
    out = list(seq)
    for i, v in zip(positions, values):
        out[i] = v
    return out


def check_chunk_size(chunk_size: Any, *, allow_none: bool = True, where: str = "chunkop") -> int | None:
    """Validate ``chunk_size``: ``None`` (when allowed) or a positive Python/NumPy integer."""
    if chunk_size is None:
        if allow_none:
            return None
        raise TypeError(f"{where}: `chunk_size` is required and must be a positive int, got None.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(
            f"{where}: `chunk_size` must be a positive int{' or None' if allow_none else ''}, "
            f"got {chunk_size!r} of type {type(chunk_size).__name__}."
        )
    if chunk_size <= 0:
        raise ValueError(f"{where}: `chunk_size` must be a positive int, got {int(chunk_size)}.")
    return int(chunk_size)


def check_axis_size(axis_size: Any, where: str = "chunkop") -> int | None:
    """Validate ``axis_size``: ``None`` or a non-negative Python/NumPy integer."""
    if axis_size is None:
        return None
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)):
        raise TypeError(
            f"{where}: `axis_size` must be a non-negative int or None, got {axis_size!r} of type "
            f"{type(axis_size).__name__}."
        )
    if axis_size < 0:
        raise ValueError(f"{where}: `axis_size` must be a non-negative int, got {int(axis_size)}.")
    return int(axis_size)


def check_remat(remat: Any, where: str = "chunkop") -> Any:
    """Validate ``remat``: True, False, or a ``jax.checkpoint`` policy (tried on one primitive)."""
    if isinstance(remat, bool):
        return remat
    bad = TypeError(
        f"{where}: `remat` must be True, False or a checkpoint policy such as "
        f"jax.checkpoint_policies.dots_saveable, got {remat!r}."
    )
    if not callable(remat):
        raise bad
    aval = jax.core.ShapedArray((), np.dtype(np.float32))
    try:  # a policy is called as policy(primitive, *input_avals, **params) -> bool (or a Saveable)
        answer = remat(jax.lax.add_p, aval, aval)
    except Exception as e:  # noqa: BLE001
        raise TypeError(
            f"{where}: `remat`={remat!r} is not a usable checkpoint policy: calling it as "
            f"policy(primitive, *avals, **params) raised {type(e).__name__}: {e}"
        ) from None
    if not isinstance(answer, (bool, np.bool_)) and not _jaxpr.is_checkpoint_answer(answer):
        raise TypeError(
            f"{where}: `remat`={remat!r} is not a checkpoint policy: policy(primitive, *avals) "
            f"returned {answer!r}, expected a bool."
        )
    return remat


def _as_int_axes(spec: Any) -> Any:
    """NumPy integer leaves as Python ints (``jax.vmap`` rejects NumPy ints; chunkop takes them)."""
    return jax.tree_util.tree_map(
        lambda a: int(a) if isinstance(a, np.integer) else a, spec, is_leaf=lambda a: a is None
    )


def _is_none(x: Any) -> bool:
    return x is None


def _check_axis_leaves(spec: Any, name: str, where: str) -> None:
    for leaf in jax.tree_util.tree_leaves(spec, is_leaf=_is_none):
        if leaf is None:
            continue
        if isinstance(leaf, bool) or not isinstance(leaf, (int, np.integer)):
            raise TypeError(
                f"{where}: every leaf of `{name}` must be an int or None, got {leaf!r} "
                f"of type {type(leaf).__name__} in {name}={spec!r}."
            )


def uses_vmappables(*trees: Any) -> bool:
    """Whether a leaf of ``trees`` (axes specs, arguments) is a registered vmappable value or spec
    (:func:`chunkop._jaxpr.is_vmappable`): such calls run as ``jax.vmap``, unchunked."""
    if not _jaxpr.vmappables_registered():
        return False
    return any(_jaxpr.is_vmappable(x) for t in trees for x in jax.tree_util.tree_leaves(t, is_leaf=_jaxpr.is_vmappable))


def check_in_axes_spec(in_axes: Any, where: str = "chunkop.vmap") -> Any:
    """Check the type of ``in_axes`` at wrap time; lists become tuples (as in ``jax.vmap``)."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if uses_vmappables(in_axes):  # a registered spec type: jax.vmap checks it
        return in_axes
    if not (in_axes is None or isinstance(in_axes, (int, np.integer, tuple))) or isinstance(in_axes, bool):
        raise TypeError(
            f"{where}: `in_axes` must be an int, None, or a tuple/list with one entry per positional "
            f"argument, got {in_axes!r} of type {type(in_axes).__name__}."
        )
    _check_axis_leaves(in_axes, "in_axes", where)
    return _as_int_axes(in_axes)


def check_out_axes_spec(out_axes: Any, where: str = "chunkop.vmap") -> Any:
    """Check that every leaf of ``out_axes`` is an int or None."""
    if uses_vmappables(out_axes):  # a registered spec type: jax.vmap checks it
        return out_axes
    _check_axis_leaves(out_axes, "out_axes", where)
    return _as_int_axes(out_axes)


def _broadcast_prefix(prefix: Any, tree: Any) -> list[Any]:
    """The leaves of ``prefix`` (None counts as a leaf) repeated over the leaves of ``tree``."""
    result: list[Any] = []

    def add(axis: Any, subtree: Any) -> None:
        result.extend([axis] * len(jax.tree_util.tree_leaves(subtree)))

    jax.tree_util.tree_map(add, prefix, tree, is_leaf=_is_none)
    return result


def is_array_leaf(x: Any) -> bool:
    """Whether a leaf is array-like: a JAX/NumPy array, a NumPy scalar or a Python number."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _ndim(x: Any) -> int:
    return int(np.ndim(x)) if not isinstance(x, jax.Array) else x.ndim


def flat_in_axes(
    in_axes: Any, args: tuple, kwargs: dict, where: str = "chunkop.vmap", arg_names: tuple[str, ...] = ()
) -> tuple[list[Any], Any, list[int | None], list[str]]:
    """Resolve ``in_axes`` against a call's arguments.

    ``arg_names`` names the positional arguments in messages (``xs['s']`` rather than
    ``args[0]['s']``), for transforms whose arguments have names of their own.

    Returns:
        ``(leaves, treedef, axes, paths)``: the leaves of ``(args, kwargs)``, their treedef,
        each leaf's mapped axis (non-negative, or None) and a printable path per leaf.
    """
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        raise ValueError(
            f"{where}: `in_axes` is a tuple of {len(in_axes)} entries, but the function was called "
            f"with {len(args)} positional arguments; give one entry per positional argument "
            f"(or a single int/None for all)."
        )
    try:
        arg_axes = _broadcast_prefix(in_axes, args)
    except ValueError as e:
        raise ValueError(
            f"{where}: `in_axes` must be a tree prefix of the positional arguments, but "
            f"in_axes={in_axes!r} does not match arguments of structure "
            f"{jax.tree_util.tree_structure(args)}. Details: {e}"
        ) from None
    kwarg_axes = [0] * len(jax.tree_util.tree_leaves(kwargs))
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_with_paths]
    paths = []
    for path, _ in leaves_with_paths:
        if path[0].idx == 0 and len(path) > 1 and path[1].idx < len(arg_names):
            paths.append(arg_names[path[1].idx] + jax.tree_util.keystr(path[2:]))
            continue
        head = "args" if path[0].idx == 0 else "kwargs"
        paths.append(head + jax.tree_util.keystr(path[1:]))
    axes: list[int | None] = []
    for axis, leaf, path in zip(arg_axes + kwarg_axes, leaves, paths):
        if axis is None:
            axes.append(None)
            continue
        if not is_array_leaf(leaf):
            raise TypeError(
                f"{where}: argument {path} is mapped (axis {axis}) but is a "
                f"{type(leaf).__name__}, not an array; map arrays only"
                + ("." if arg_names else ", or give it in_axes=None.")
            )
        ndim = _ndim(leaf)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{where}: in_axes asks to map argument {path} along axis {axis}, but it has rank "
                f"{ndim} (shape {tuple(np.shape(leaf))}); the axis must be in [{-ndim}, {ndim})."
                + (" Pass in_axes=None for unmapped scalars." if ndim == 0 else "")
            )
        axes.append(operator.index(axis) % ndim)
    return leaves, treedef, axes, paths


def is_symbolic(size: Any) -> bool:
    """Whether an axis size is symbolic (``jax.export`` shape polymorphism), not an integer."""
    return not isinstance(size, (int, np.integer))


def _same_size(a: Any, b: Any) -> bool:
    """``a == b`` for sizes that may be symbolic (a comparison JAX cannot decide counts as unequal)."""
    try:
        return bool(a == b)
    except jax.errors.InconclusiveDimensionOperation:
        return False


def mapped_size(
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    paths: Sequence[str],
    axis_size: int | None,
    where: str = "chunkop.vmap",
    *,
    chunked: bool | None = None,
) -> Any:
    """The common size of the mapped axis, with an error naming the arguments that disagree.

    A symbolic size (``jax.export.symbolic_shape``) cannot be split into chunks: a call that
    chunks (``chunked=True``) gets an error naming the argument and the fix (``chunk_size=None``);
    one that does not (``chunked=False``: ``chunk_size=None``, exactly ``jax.vmap``) gets the
    symbolic size back, as ``jax.vmap`` takes it. Not saying (``None``, the default) is refused
    like a chunked call, with a fix that does not assume the caller can pass ``chunk_size=None``.

    Returns:
        The size: an ``int``, or a symbolic dimension when ``chunked`` is False.
    """
    first: tuple[str, int, Any] | None = None
    for leaf, axis, path in zip(leaves, axes, paths):
        if axis is None:
            continue
        size = np.shape(leaf)[axis]
        if is_symbolic(size):
            if chunked is not False:
                raise ValueError(_symbolic_message(where, path, axis, size, chunked))
        else:
            size = int(size)
        if first is None:
            first = (path, axis, size)
        elif not _same_size(size, first[2]):
            raise ValueError(
                f"{where}: mapped arguments have different sizes along the mapped axis: "
                f"{first[0]} has size {first[2]} along axis {first[1]}, but {path} has size "
                f"{size} along axis {axis}."
            )
    if first is None:
        if axis_size is None:
            raise ValueError(f"{where}: no argument is mapped (all in_axes are None), so `axis_size` must be given.")
        return int(axis_size)
    if axis_size is not None and not _same_size(int(axis_size), first[2]):
        raise ValueError(
            f"{where}: `axis_size`={axis_size} does not match the mapped size {first[2]} of "
            f"argument {first[0]} along axis {first[1]}."
        )
    return first[2]


def _symbolic_message(where: str, path: str, axis: int, size: Any, chunked: bool | None) -> str:
    fix = (
        "or use chunk_size=None (exactly jax.vmap, no chunking), which takes a symbolic size"
        if chunked
        else "or call the unchunked JAX transform (jax.vmap, jax.lax.map), which takes a symbolic size"
    )
    return symbolic_size_message(where, f"argument {path} is mapped along axis {axis}", size, fix)


def symbolic_size_message(where: str, what: str, size: Any, fix: str) -> str:
    """The error for a chunked axis of symbolic size (``jax.export`` shape polymorphism).

    Args:
        where: the caller (``chunkop.vmap``, ``RowOperator``).
        what: the axis, named for the user (``argument args[0] is mapped along axis 0``).
        size: its symbolic size.
        fix: what works instead, after "Export with a concrete size for this axis, ".
    """
    return (
        f"{where}: {what}, which has the symbolic size "
        f"{size} (jax.export shape polymorphism); chunking needs a concrete size to split the axis "
        f"into chunks (the number of chunks is a static loop length). Export with a concrete size "
        f"for this axis (symbolic sizes elsewhere are fine), {fix}."
    )


def flat_out_axes(out_axes: Any, out_tree: Any, where: str = "chunkop.vmap") -> list[int | None]:
    """Broadcast ``out_axes`` to the leaves of a per-example output, normalising negatives.

    ``out_tree`` holds per-example shapes (no mapped axis); an axis ``a`` indexes the output
    with the mapped axis inserted, so it must lie in ``[-(rank + 1), rank + 1)``.
    """
    try:
        axes = _broadcast_prefix(out_axes, out_tree)
    except ValueError as e:
        raise ValueError(
            f"{where}: `out_axes` must be a tree prefix of the function's output, but "
            f"out_axes={out_axes!r} does not match an output of structure "
            f"{jax.tree_util.tree_structure(out_tree)}. Details: {e}"
        ) from None
    leaves = jax.tree_util.tree_leaves(out_tree)
    result: list[int | None] = []
    for axis, leaf in zip(axes, leaves):
        if axis is None:
            result.append(None)
            continue
        ndim = len(leaf.shape) + 1  # with the mapped axis
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{where}: out_axes={axis} is out of range for an output of per-example shape "
                f"{tuple(leaf.shape)}; it must be in [{-ndim}, {ndim})."
            )
        result.append(axis % ndim)
    return result
