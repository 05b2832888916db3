"""The chunked kernels behind :class:`chunkop.RowOperator`, and their derivative rules.

An operator is ``y_i = row_fn(row_i, x)`` for ``i < n_rows``, linear in ``x``. ``row_fn`` is
traced once, when the operator is built, into a :class:`Spec` (its jaxpr: static) and the
arrays it closes over, ``consts`` (dynamic: leaves of the operator, differentiable like
``rows``). Every kernel evaluates that jaxpr with the operator's current ``consts``, so the
matvec, the transpose and all derivatives see the same values, and compiled kernels are shared
by operators whose ``row_fn`` traced to the same jaxpr (see :func:`make_spec`).

The kernels, each a ``jax.lax.scan`` over chunks of rows with a ``jax.checkpoint``-ed body (so
weights computed from the row data are recomputed, never stored for all rows):

- :func:`forward` ``(consts, rows, x)``: the matvec. Per chunk, the vmapped ``row_fn`` is
  linearised at ``x = 0`` (exact: it is linear) into ``fn(x, *weights)``, where ``weights``
  (gather indices, weights) are computed once per chunk from the chunk's rows, which the chunk
  loop first passes through :func:`chunkop._chunking.fusion_barrier` (on CPU);
- :func:`backward` ``(consts, rows, y)``: the transpose, ``jax.linear_transpose`` of the same
  ``fn`` applied to the chunk of ``y`` and summed into the ``x`` space;
- :func:`forward_dparams` / :func:`backward_dparams`: their derivatives w.r.t. the float
  leaves of ``consts`` and ``rows`` (bilinear in ``(dparams, x)`` / ``(dparams, y)``).

:func:`apply` and :func:`apply_transpose` wrap ``forward`` and ``backward`` in
``jax.custom_jvp`` whose rules use the same kernels: ``d(A x) = A dx + (dA/dparams) x``.

Precision: every sum over chunks (the transpose, and the reverse-mode sums of cotangents of
``x`` and ``consts`` over chunks) accumulates in at least float32 and returns the input dtype:
unmapped operands enter the scan widened (:func:`chunkop._chunking.widen`) and are narrowed back inside the body,
so the scan's transpose accumulates their cotangents in the wide dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr
from .._cache import register_cache
from .._chunking import make_plan, stack_chunks, sum_chunks
from .._fingerprint import Uncacheable, setting_key
from .._progress import Progress
from .._trace import clamped_start, eval_traced, trace_program
from .._tree import dtype_of as _dtype
from .._tree import is_float as _is_float
from .._tree import zeros_of as _zeros
from . import row_layout

__all__ = ["Spec", "make_spec", "apply", "apply_transpose", "apply_in_order", "apply_transpose_in_order"]

_tu = jax.tree_util


# -- the static description of an operator ------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """The static part of an operator: ``row_fn``'s jaxpr and the structures around it.

    Hashable, and passed as a static argument of the jitted kernels. Two specs are equal when
    their ``key`` is (the traced program's key, :func:`chunkop._trace.trace_program`: the jaxpr's
    structural fingerprint, whose constants are variables, plus the structures): then they compute the same function of
    ``(consts, row, x)``, and share compiled kernels. A jaxpr that cannot be fingerprinted gets
    no key: its spec is equal only to itself.
    """

    jaxpr: Any = dataclasses.field(
        repr=False
    )  # open jaxpr: constvars = the closed-over arrays; invars = row leaves, x leaves
    chunk_size: int
    in_leaves: tuple  # ShapeDtypeStructs of x's leaves
    in_tree: Any  # x's treedef
    row_tree: Any  # a row's treedef
    out_tree: Any  # a row's output treedef
    fingerprint: Any = dataclasses.field(default=None, repr=False)  # the traced program's key (Traced.key), or None
    progress: Progress = dataclasses.field(default=None, repr=False)  # reported by every kernel's loop
    out_leaves: tuple = dataclasses.field(default=(), repr=False)  # ShapeDtypeStructs of one row's output leaves
    segment_key: Any = None  # the rows' target key: T.mv sums per target (see _segment_transpose_chunk)
    reads: Any = None  # row_layout.Reads: where row_fn reads x (None: not only whole rows)
    windows: Any = None  # the windowed layout: rows per window of each x leaf (None: the plain layout)

    @functools.cached_property
    def key(self) -> Any:
        """The jaxpr's fingerprint, the chunk size, the structures and the progress setting (None
        when the jaxpr or the setting cannot be keyed)."""
        if self.fingerprint is None:
            return None
        try:
            progress_key = setting_key(self.progress)
        except Uncacheable:
            return None
        return (
            self.fingerprint,
            self.chunk_size,
            self.in_leaves,
            self.in_tree,
            self.row_tree,
            self.out_tree,
            progress_key,
            self.segment_key,
            self.reads,
            self.windows,
        )

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, Spec) and self.key is not None and self.key == other.key

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        """The hash, computed once: a static argument of every kernel call, hashed by ``jax.jit``
        on each (the key is a deep tuple: 2 us a hash)."""
        return hash(self.key) if self.key is not None else id(self)

    def in_structure(self) -> Any:
        """``x``'s structure: a pytree of ``jax.ShapeDtypeStruct``."""
        return _tu.tree_unflatten(self.in_tree, list(self.in_leaves))

    def out_structure(self, n_rows: int) -> Any:
        """The output's structure for ``n_rows`` rows (known since the trace: no evaluation)."""
        leaves = [jax.ShapeDtypeStruct((n_rows, *o.shape), o.dtype) for o in self.out_leaves]
        return _tu.tree_unflatten(self.out_tree, leaves)

    def row_fn(self, consts: Any, row: Any, x: Any, take_rows: bool = True, starts: Any = None) -> Any:
        """``row_fn(row, x)``, evaluated from the jaxpr with these ``consts`` (``take_rows``:
        see :func:`chunkop._trace.eval_traced`). With ``starts`` (the windowed layout: one
        window start per read leaf, :meth:`window_starts`), ``x``'s read leaves are those
        windows (:meth:`windows_of`), each read from its window."""
        row_leaves = _tu.tree_structure(row) == self.row_tree and _tu.tree_leaves(row)
        if row_leaves is False:
            raise ValueError(f"RowOperator: a row has structure {_tu.tree_structure(row)}, expected {self.row_tree}.")
        reads = None if starts is None else self._window_reads(starts)
        out = eval_traced(self.jaxpr, list(consts), *row_leaves, *_tu.tree_leaves(x), take_rows=take_rows, reads=reads)
        return _tu.tree_unflatten(self.out_tree, out)

    def _window_reads(self, starts: list) -> dict:
        """The windowed layout's reads: ``{equation: fn(window, start)}`` (see ``row_fn``)."""
        at = {leaf: w for leaf, w in zip(self.reads.read_leaves, starts)}

        def read(leaf: int, size: int) -> Callable:
            hi = self.in_leaves[leaf].shape[0] - size
            return lambda win, start: row_layout.read_window(win, clamped_start(start, hi) - at[leaf], size)

        return {k: read(leaf, size) for k, leaf, size in zip(self.reads.eqns, self.reads.leaves, self.reads.sizes)}

    def window_starts(self, consts: Any, rows_c: Any) -> list | None:
        """The windowed layout's window starts for one chunk of (sorted) rows (None: plain layout)."""
        if self.windows is None:
            return None
        sizes = tuple(s.shape[0] for s in self.in_leaves)
        return row_layout.window_starts(self.jaxpr, self.reads, self.windows, sizes, list(consts), rows_c)

    def windows_of(self, x: Any, starts: list | None) -> Any:
        """``x`` as the windowed layout's kernels read it: each read leaf's window at ``starts``
        (``lax.dynamic_slice``, so its transpose adds into that window of ``x``); ``x`` itself
        when ``starts`` is None. A leaf that is never read becomes an empty array."""
        if starts is None:
            return x
        at = dict(zip(self.reads.read_leaves, starts))
        leaves = [
            jax.lax.dynamic_slice_in_dim(v, at[j], self.windows[j], axis=0) if j in at else v[:0]
            for j, v in enumerate(_tu.tree_leaves(x))
        ]
        return _tu.tree_unflatten(self.in_tree, leaves)

    def window_structure(self, starts: list | None) -> Any:
        """The structure :meth:`windows_of` gives (``in_structure()`` when ``starts`` is None)."""
        if starts is None:
            return self.in_structure()
        return jax.eval_shape(lambda: self.windows_of(_zeros(self.in_structure()), starts))

    @functools.cached_property
    def calls_custom_vjp(self) -> bool:
        """Whether ``row_fn`` calls a ``jax.custom_vjp`` function (at any depth)."""
        return _jaxpr.has_eqn(self.jaxpr, _jaxpr.is_custom_vjp)

    def vrow_fn(self, consts: Any, rows_c: Any, x: Any, starts: list | None = None) -> Any:
        """``row_fn`` over a chunk of rows (vmapped over the rows only); with ``starts``, ``x``
        is the chunk's windows (:meth:`windows_of`)."""
        return jax.vmap(lambda row: self.row_fn(consts, row, x, starts=starts))(rows_c)

    def at(self, chunk_size: int, progress: Progress = None, segment_key: Any = ..., windows: Any = ...) -> Spec:
        """The same traced ``row_fn`` at another chunk size, progress setting, transpose
        (``segment_key``, see :func:`backward`) and layout (``windows``: rows per window of each
        ``x`` leaf, None for the plain layout); the last two kept unless given. No new trace."""
        if segment_key is ...:
            segment_key = self.segment_key
        if windows is ...:
            windows = self.windows
        if (chunk_size, segment_key, windows) == (self.chunk_size, self.segment_key, self.windows) and (
            progress is self.progress
        ):
            return self
        return dataclasses.replace(
            self, chunk_size=chunk_size, progress=progress, segment_key=segment_key, windows=windows
        )


def make_spec(
    row_fn: Callable, rows: Any, in_structure: Any, chunk_size: int, progress: Progress = None
) -> tuple[Spec, tuple]:
    """Trace ``row_fn`` on one row and ``x``: its :class:`Spec`, and the arrays it closes over.

    Where ``row_fn`` needs them (in Python control flow and shapes), operations on concrete
    closed-over values only are computed while tracing, as under ``jax.vmap``. Every array
    constant of the trace (a closed-over ``jax.Array``, NumPy array or tracer, one such a
    folded operation computed, or one an inner ``jax.jit`` closes over, at any depth:
    :func:`chunkop._trace.trace`) is returned in ``consts``, to be stored as a leaf of the
    operator: never in the static spec, so kernels compiled for one operator serve every
    operator whose ``row_fn`` traces alike.
    """
    row0 = _tu.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], jnp.result_type(a)), rows)
    in_leaves, in_tree = _tu.tree_flatten(in_structure)
    # the transforms' traced program: inner jits' constants (at any depth) hoisted into consts
    # as well; operations on concrete closed-over values computed only where row_fn needs them
    # (in Python control flow, in a shape), as jax.vmap does: folding would turn the scalars of
    # row_fn's indexing (bounds, starts) into constants, leaves of the operator typed on the mesh
    # of the context they ran in.
    traced = trace_program(row_fn, row0, in_structure, fold="needed")
    jaxpr, out_shape = traced.jaxpr, traced.out_shapes
    row_tree = _tu.tree_structure(row0)
    if _stops_gradient_of_x(jaxpr, set(jaxpr.invars[len(_tu.tree_leaves(row0)) :])):
        raise ValueError(
            "RowOperator: `row_fn` applies `jax.lax.stop_gradient` to `x` (or to a value computed from "
            "it). The operator is applied through its linear part in `x` (`jax.linearize`, "
            "`jax.linear_transpose`), which `stop_gradient` hides: `mv` would be zero and `T.mv` has "
            "no transpose. Remove the `stop_gradient` on `x` (the operator's derivatives w.r.t. its "
            "rows and closed-over arrays are exact), or apply it only to weights computed from the row."
        )
    out_tree = _tu.tree_structure(out_shape)
    out_leaves = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in _tu.tree_leaves(out_shape))
    reads = row_layout.find_reads(jaxpr, len(_tu.tree_leaves(row0)))
    spec = Spec(jaxpr, chunk_size, tuple(in_leaves), in_tree, row_tree, out_tree, traced.key, progress, out_leaves)
    return dataclasses.replace(spec, reads=reads), tuple(traced.consts)


def _stops_gradient_of_x(jaxpr: Any, depends: set) -> bool:
    """Whether a ``stop_gradient`` in ``jaxpr`` (or a sub-jaxpr) reads a value that depends on
    the variables in ``depends``."""
    for eqn, subs in _jaxpr.dependent_eqns(jaxpr, depends):
        if eqn.primitive.name == "stop_gradient" or any(_stops_gradient_of_x(sub, d) for sub, d in subs):
            return True
    return False


# -- the chunk loop -------------------------------------------------------------------------------


def _chunk_loop(per_chunk: Callable, mapped: Any, unmapped: Any, spec: Spec, sum_like: Any = None) -> Any:
    """Run ``per_chunk(chunk, unmapped)`` over chunks of ``spec.chunk_size`` rows of ``mapped``.

    Stacks the per-chunk outputs (leading axis ``n_rows``), or, with ``sum_like`` (a pytree of
    ``ShapeDtypeStruct``), sums them (in at least float32) into ``sum_like``'s structure and
    dtypes. The loop is the transforms' (:func:`chunkop._chunking.stack_chunks` /
    :func:`~chunkop._chunking.sum_chunks`: a checkpointed scan over full chunks, read without a
    copy, plus one remainder call, with ``unmapped`` entering widened; see the module docstring).
    """
    leaves, tree = _tu.tree_flatten(mapped)
    plan = make_plan(leaves[0].shape[0], spec.chunk_size)
    run = lambda chunk, unmapped, m: per_chunk(_tu.tree_unflatten(tree, chunk), unmapped)
    if sum_like is not None:
        return sum_chunks(run, leaves, plan, True, _zeros(sum_like), spec.progress, unmapped=unmapped)
    out_tree: list = []

    def stacked(chunk: list, unmapped: Any, m: int) -> tuple[list, list]:
        out_leaves, treedef = _tu.tree_flatten(run(chunk, unmapped, m))
        out_tree.append(treedef)
        return out_leaves, []

    out, _ = stack_chunks(stacked, leaves, plan, True, progress=spec.progress, unmapped=unmapped)
    return _tu.tree_unflatten(out_tree[0], out)


# -- the kernels ----------------------------------------------------------------------------------


def _linear_parts(spec: Spec, consts: Any, rows_c: Any, starts: list | None = None) -> tuple[Callable, list]:
    """One chunk's linear map ``x -> vmap(row_fn)(rows_c, x)`` as ``(fn, weights)``: ``fn(x, *weights)``.

    ``weights`` are what the map needs besides ``x`` (gather indices, the weights computed from
    the row data), computed once per chunk. With ``starts`` (the windowed layout) the map's
    input is the chunk's windows of ``x`` (:meth:`Spec.windows_of`).
    """
    x0 = _zeros(spec.window_structure(starts))
    _, f_jvp = jax.linearize(lambda v: spec.vrow_fn(consts, rows_c, v, starts), x0)
    fn, weights = jax.closure_convert(f_jvp, x0)
    return fn, weights


def _chunk_map(spec: Spec, consts: Any, rows_c: Any, split: bool = True) -> Callable:
    """One chunk's linear map of ``x`` (its windows read, in the windowed layout).

    ``split=False`` (when differentiated w.r.t. the parameters) evaluates ``row_fn`` directly,
    not its linear parts.
    """
    starts = spec.window_starts(consts, rows_c)
    if split:
        fn, weights = _linear_parts(spec, consts, rows_c, starts)
        return lambda v: fn(spec.windows_of(v, starts), *weights)
    return lambda v: spec.vrow_fn(consts, rows_c, spec.windows_of(v, starts), starts)


def _transpose_chunk(spec: Spec, consts: Any, rows_c: Any, y_c: Any, split: bool = True) -> Any:
    """``A_c^T y_c`` for one chunk of rows: the transpose of the vmapped ``row_fn``.

    ``split=False`` (when differentiated w.r.t. the parameters) transposes ``row_fn`` directly.
    In the windowed layout the transpose of the window's ``dynamic_slice`` adds the chunk's
    rows into its window: the chunk loop's running sum is updated in that window only.
    """
    (ct,) = jax.linear_transpose(_chunk_map(spec, consts, rows_c, split), spec.in_structure())(y_c)
    return ct


def _segment_sums(starts: jax.Array, values: Any) -> Any:
    """Inclusive sums of ``values`` (leaves with a leading axis) within runs that begin where
    ``starts`` is True: a segmented ``jax.lax.associative_scan`` (each run summed in a tree
    order of its own elements only, the same order on every run of the program)."""

    def combine(a: tuple, b: tuple) -> tuple:
        (a_start, a_val), (b_start, b_val) = a, b
        keep = lambda va, vb: jnp.where(b_start.reshape(b_start.shape + (1,) * (vb.ndim - 1)), vb, va + vb)
        return a_start | b_start, _tu.tree_map(keep, a_val, b_val)

    return jax.lax.associative_scan(combine, (starts, values))[1]


def _segment_transpose_chunk(spec: Spec, consts: Any, rows_c: Any, y_c: Any) -> Any:
    """``A_c^T y_c`` for one chunk, written once per target: no two rows add into one element.

    ``row_fn`` reads ``x`` only at ``x[row[key]]`` (``key = spec.segment_key``; every leaf of
    ``x`` along its leading axis): so each row's part of the transpose is one slice of ``x``,
    the transpose of ``row_fn`` on a one-slice ``x`` read at index 0. The chunk's rows are
    sorted by target (a stable sort of ``chunk_size`` integers), each target's slices summed by
    a segmented scan, and each sum written at its target by a scatter whose indices are unique
    (``unique_indices=True``: an accelerator needs no atomic additions, and no thread waits on
    another). Targets outside ``[-n, n)`` (``n`` the leading size of ``x``) contribute nothing.
    """
    key = spec.segment_key
    in_struct = spec.in_structure()
    n = spec.in_leaves[0].shape[0]
    targets = rows_c[key].astype(jnp.promote_types(rows_c[key].dtype, jnp.int32))  # room for t + n
    size = targets.shape[0]
    targets = jnp.where(targets < 0, targets + n, targets)  # x[t] counts a negative t from the end
    order = jnp.argsort(targets, stable=True)
    targets = targets[order]
    rows_s, y_s = _tu.tree_map(lambda a: jnp.take(a, order, axis=0), (rows_c, y_c))
    local_rows, row_axes = rows_s.copy(), rows_s.copy()  # the rows' own dict type
    for k in row_axes:
        row_axes[k] = None if k == key else 0
    local_rows[key] = jnp.zeros((), rows_c[key].dtype)  # every row reads slice 0 ...
    local_x = _tu.tree_map(lambda s: jax.ShapeDtypeStruct((size, 1, *s.shape[1:]), s.dtype), in_struct)

    def per_row(v: Any) -> Any:  # ... of its own one-slice x (read as sliced: its transpose
        # writes each row's own slice, a scatter with unique indices)
        row_fn = functools.partial(spec.row_fn, take_rows=False)
        return jax.vmap(row_fn, (None, row_axes, 0))(consts, local_rows, v)

    (slices,) = jax.linear_transpose(per_row, local_x)(y_s)
    slices = _tu.tree_map(lambda a: a[:, 0], slices)
    change = targets[1:] != targets[:-1]
    edge = jnp.ones((1,), bool)
    sums = _segment_sums(jnp.concatenate([edge, change]), slices)  # runs start where the target changes
    valid = jnp.concatenate([change, edge]) & (targets >= 0) & (targets < n)  # each run's last row, on the grid
    where = jnp.where(valid, targets, n + jnp.arange(size, dtype=targets.dtype))  # unique; the rest dropped
    return _tu.tree_map(lambda z, v: z.at[where].add(v, mode="drop", unique_indices=True), _zeros(in_struct), sums)


def _tangent(primal: Any, tangent: Any) -> Any:
    """A full tangent for ``primal``: ``tangent``'s leaves, float0 zeros where it has ``None``."""
    return _tu.tree_map(
        lambda p, t: np.zeros(np.shape(p), jax.dtypes.float0) if t is None else t,
        primal,
        tangent,
        is_leaf=lambda t: t is None,
    )


def _jvp(spec: Spec, fn: Callable, primals: tuple, tangents: tuple) -> Any:
    """The JVP ``d fn(primals) . tangents`` of a function built from ``spec.row_fn``.

    ``jax.jvp``; except where ``row_fn`` calls a ``jax.custom_vjp`` function under JAX's
    ``jax_custom_vjp3``. That flag refuses forward mode through such a function, and JAX 0.10
    cannot ``jax.linearize`` it either (nor batch ``linear_call``), so there the JVP is the
    transpose of ``fn``'s VJP: JAX transposes it back to that VJP when the operator is
    differentiated in reverse mode. It needs the ``custom_vjp``'s backward rule to be linear in
    its cotangent (transposable); one that is not (e.g. clipping the cotangent) gets an error
    that says so.
    """
    if not (_jaxpr.custom_vjp3() and spec.calls_custom_vjp):
        return jax.jvp(fn, primals, tangents)[1]
    leaves, tree = _tu.tree_flatten(primals)
    floats = [i for i, p in enumerate(leaves) if _is_float(p)]

    def of_floats(*float_leaves: Any) -> Any:
        full = list(leaves)
        for i, p in zip(floats, float_leaves):
            full[i] = p
        return fn(*_tu.tree_unflatten(tree, full))

    out, vjp_fn = jax.vjp(of_floats, *(leaves[i] for i in floats))
    tangent_leaves = _tu.tree_leaves(tangents)
    try:
        return jax.linear_transpose(vjp_fn, out)(tuple(tangent_leaves[i] for i in floats))[0]
    except NotImplementedError as e:
        raise NotImplementedError(
            "RowOperator: differentiating w.r.t. `rows` or the arrays `row_fn` closes over, where"
            " `row_fn` calls a jax.custom_vjp function, needs (under JAX's jax_custom_vjp3) that"
            " function's backward rule to be linear in its cotangent: chunkop transposes it, since"
            f" JAX 0.10 offers no forward mode through it. Transposing it failed: {e}. Derivatives"
            " w.r.t. the operator's input work either way, as does everything with the flag off."
        ) from e


def forward(spec: Spec, consts: Any, rows: Any, x: Any) -> Any:
    """``y_i = row_fn(row_i, x)``, stacked over rows."""

    def per_chunk(rows_c: Any, unmapped: Any) -> Any:
        consts, x = unmapped
        return _chunk_map(spec, consts, rows_c)(x)

    return _chunk_loop(per_chunk, rows, (consts, x), spec)


def backward(spec: Spec, consts: Any, rows: Any, y: Any) -> Any:
    """``A^T y``: the transposed ``row_fn`` summed over rows, chunk by chunk (wide accumulator).

    Each chunk's transpose is ``jax.linear_transpose``'s (a scatter-add of every row into the
    ``x`` space), or, for an operator built with a ``segment_key``, a sum per target written
    once per target (:func:`_segment_transpose_chunk`).
    """

    def per_chunk(chunk: Any, consts: Any) -> Any:
        rows_c, y_c = chunk
        if spec.segment_key is not None:
            return _segment_transpose_chunk(spec, consts, rows_c, y_c)
        return _transpose_chunk(spec, consts, rows_c, y_c)

    return _chunk_loop(per_chunk, (rows, y), consts, spec, sum_like=spec.in_structure())


def forward_dparams(spec: Spec, consts: Any, rows: Any, dconsts: Any, drows: Any, x: Any) -> Any:
    """``d/d(consts, rows) [row_fn(row_i, x)] . (dconsts, drow_i)``, stacked over rows.

    ``dconsts``/``drows`` hold tangents for the float leaves and ``None`` for the others.
    """

    def per_chunk(chunk: Any, unmapped: Any) -> Any:
        rows_c, drows_c = chunk
        consts, dconsts, x = unmapped
        tangents = (_tangent(consts, dconsts), _tangent(rows_c, drows_c))
        starts = spec.window_starts(consts, rows_c)  # (from integer row data: no tangent)
        v = spec.windows_of(x, starts)
        return _jvp(spec, lambda c, r: spec.vrow_fn(c, r, v, starts), (consts, rows_c), tangents)

    return _chunk_loop(per_chunk, (rows, drows), (consts, dconsts, x), spec)


def backward_dparams(spec: Spec, consts: Any, rows: Any, dconsts: Any, drows: Any, y: Any) -> Any:
    """``d/d(consts, rows) [A^T y] . (dconsts, drows)``, summed in the ``x`` space."""

    def per_chunk(chunk: Any, unmapped: Any) -> Any:
        rows_c, drows_c, y_c = chunk
        consts, dconsts = unmapped
        tangents = (_tangent(consts, dconsts), _tangent(rows_c, drows_c))
        return _jvp(spec, lambda c, r: _transpose_chunk(spec, c, r, y_c, split=False), (consts, rows_c), tangents)

    return _chunk_loop(per_chunk, (rows, drows, y), (consts, dconsts), spec, sum_like=spec.in_structure())


# -- custom_jvp wrappers ------------------------------------------------------------------------


def _is_zero(t: Any) -> bool:
    return _jaxpr.is_symbolic_zero(t)


def _float_tangents(primal: Any, tangent: Any) -> tuple[Any, bool]:
    """Tangents of ``primal``'s float leaves (zeros for symbolic zeros), ``None`` for the others;
    and whether any of them is non-zero."""
    nonzero = []

    def one(p: Any, t: Any) -> Any:
        if not _is_float(p):
            return None
        if _is_zero(t):
            return jnp.zeros(np.shape(p), _dtype(p))
        nonzero.append(True)
        return t

    out = _tu.tree_map(one, primal, tangent, is_leaf=_is_zero)
    return out, bool(nonzero)


def _linear_rule(kernel_dparams: Callable, self_fn: Callable) -> Callable:
    """The JVP rule of ``v -> kernel(consts, rows, v)``: ``kernel(dv) + kernel_dparams(dparams, v)``."""

    def rule(spec: Spec, primals: tuple, tangents: tuple) -> tuple:
        consts, rows, v = primals
        dconsts, drows, dv = tangents
        out = self_fn(spec, consts, rows, v)
        terms = []
        if not all(_is_zero(t) for t in _tu.tree_leaves(dv, is_leaf=_is_zero)):
            dv = _tu.tree_map(
                lambda t, p: jnp.zeros(np.shape(p), _dtype(p)) if _is_zero(t) else t, dv, v, is_leaf=_is_zero
            )
            terms.append(self_fn(spec, consts, rows, dv))
        dconsts, c_nonzero = _float_tangents(consts, dconsts)
        drows, r_nonzero = _float_tangents(rows, drows)
        if c_nonzero or r_nonzero:
            terms.append(kernel_dparams(spec, consts, rows, dconsts, drows, v))
        if not terms:
            return out, _tu.tree_map(jnp.zeros_like, out)
        return out, functools.reduce(lambda a, b: _tu.tree_map(jnp.add, a, b), terms)

    return rule


@functools.partial(jax.jit, static_argnums=(0,))
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply(spec: Spec, consts: Any, rows: Any, x: Any) -> Any:
    """The matvec ``A(consts, rows) x`` (chunked; differentiable in all three to any order)."""
    return forward(spec, consts, rows, x)


@functools.partial(jax.jit, static_argnums=(0,))
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply_transpose(spec: Spec, consts: Any, rows: Any, y: Any) -> Any:
    """The transposed matvec ``A(consts, rows)^T y`` (chunked; differentiable to any order)."""
    return backward(spec, consts, rows, y)


apply.__wrapped__.defjvp(_linear_rule(forward_dparams, apply), symbolic_zeros=True)
apply_transpose.__wrapped__.defjvp(_linear_rule(backward_dparams, apply_transpose), symbolic_zeros=True)


@functools.partial(jax.jit, static_argnums=(0,))
def apply_in_order(spec: Spec, consts: Any, rows: Any, layout: row_layout.RowLayout, x: Any) -> Any:
    """``A x`` in the user's row order: :func:`apply` on the sorted rows, permuted back
    (:meth:`row_layout.RowLayout.to_user`)."""
    return layout.to_user(apply(spec, consts, rows, x))


@functools.partial(jax.jit, static_argnums=(0,))
def apply_transpose_in_order(spec: Spec, consts: Any, rows: Any, layout: row_layout.RowLayout, y: Any) -> Any:
    """``A^T y`` for ``y`` in the user's row order: :func:`apply_transpose` of ``y`` permuted
    into the sorted rows' order (:meth:`row_layout.RowLayout.to_sorted`)."""
    return apply_transpose(spec, consts, rows, layout.to_sorted(y))


for _kernel in (apply, apply_transpose, apply_in_order, apply_transpose_in_order):
    register_cache(_kernel.clear_cache)  # chunkop.clear_caches() drops their compiled programs too
