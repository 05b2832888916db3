"""``RowOperator``: an implicit linear operator whose output rows are computed chunk by chunk."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import _budget
from .._axes import is_symbolic, symbolic_size_message
from .._budget import BudgetPlan
from .._progress import Progress, check_progress
from .._tree import zeros_of
from .._vmap import vmap
from . import kernels, row_layout, row_plan, row_sharding

__all__ = ["RowOperator", "TransposedRowOperator", "AbstractRowOperator"]


def _fmt(structs: Any) -> str:
    return str(jax.tree_util.tree_map(lambda s: f"{jnp.dtype(s.dtype).name}{list(s.shape)}", structs))


def _as_struct_tree(in_structure: Any) -> tuple[tuple, Any]:
    def to_struct(s: Any) -> jax.ShapeDtypeStruct:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise TypeError(f"RowOperator: `in_structure` leaves must be jax.ShapeDtypeStruct (or arrays), got {s!r}.")
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            raise TypeError(f"RowOperator: `in_structure` must describe float arrays, got dtype {s.dtype}.")
        return jax.ShapeDtypeStruct(tuple(s.shape), jnp.dtype(s.dtype))

    leaves, tree = jax.tree_util.tree_flatten(jax.tree_util.tree_map(to_struct, in_structure))
    return tuple(leaves), tree


def _check_rows(rows: Any) -> int:
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(rows)[0]
    if not leaves_with_paths:
        raise ValueError("RowOperator: `rows` must be a pytree with at least one array leaf.")
    first = None
    for path, leaf in leaves_with_paths:
        name = "rows" + jax.tree_util.keystr(path)
        if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
            raise ValueError(
                f"RowOperator: every leaf of `rows` needs a leading row axis; {name} is "
                f"{type(leaf).__name__} of shape {getattr(leaf, 'shape', ())}."
            )
        if first is None:
            first = (name, leaf.shape[0])
            _check_concrete_rows(name, first[1])
        elif leaf.shape[0] != first[1]:
            raise ValueError(
                f"RowOperator: all leaves of `rows` must share the leading (row) axis size: "
                f"{first[0]} has {first[1]} rows but {name} has {leaf.shape[0]}."
            )
    return first[1]


def _check_concrete_rows(name: str, n_rows: Any) -> None:
    """Refuse rows of symbolic length (``jax.export`` shape polymorphism): they cannot be chunked."""
    if is_symbolic(n_rows):
        raise ValueError(
            symbolic_size_message(
                "RowOperator",
                f"the rows are the leading axis of `rows` (its leaf {name})",
                n_rows,
                "or apply row_fn unchunked, as jax.vmap(row_fn, in_axes=(0, None))(rows, x) (and "
                "jax.linear_transpose of that for A^T y), which takes a symbolic size (RowOperator "
                "always chunks: it has no chunk_size=None)",
            )
        )


def _check_segment_key(segment_key: Any, rows: Any, n_rows: int, in_leaves: tuple) -> None:
    """Refuse a ``segment_key`` that does not name a 1-D integer leaf of a dict ``rows``, or an
    ``x`` whose leaves do not share a leading axis for it to index."""
    if segment_key is None:
        return
    if not isinstance(segment_key, str):
        raise TypeError(f"RowOperator: `segment_key` must be a str (a key of `rows`) or None, got {segment_key!r}.")
    if not isinstance(rows, dict):
        raise ValueError(
            f"RowOperator: `segment_key`={segment_key!r} needs `rows` to be a dict holding each row's "
            f"target index under that key; `rows` is a {type(rows).__name__}."
        )
    if segment_key not in rows:
        raise ValueError(
            f"RowOperator: `segment_key`={segment_key!r} is not a key of `rows` (keys: {sorted(map(str, rows))})."
        )
    leaf = rows[segment_key]
    if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.integer) or tuple(leaf.shape) != (n_rows,):
        raise ValueError(
            f"RowOperator: rows[{segment_key!r}] (the `segment_key`) must be an integer array of shape "
            f"({n_rows},), one target index per row; got {getattr(leaf, 'dtype', type(leaf).__name__)}"
            f"{list(getattr(leaf, 'shape', ()))}."
        )
    sizes = {tuple(s.shape[:1]) for s in in_leaves}
    if any(len(s.shape) == 0 for s in in_leaves) or len(sizes) != 1:
        raise ValueError(
            f"RowOperator: `segment_key` needs every leaf of `x` to have the same leading axis (the "
            f"one rows[{segment_key!r}] indexes); `in_structure` has shapes {[list(s.shape) for s in in_leaves]}."
        )


def _hash_or_explain(module: Any, hash_fields: Callable[[], int]) -> int:
    """An operator's hash (equinox's: of its fields), or, when a field is an array or a dict of
    them (always, for the rows), a ``TypeError`` saying how to jit its methods: ``jax.jit(A.mv)``
    hashes the bound method, hence the operator."""
    try:
        return hash_fields()
    except TypeError as err:
        name = type(module).__name__
        raise TypeError(
            f"{name} is not hashable (its rows and arrays are not), and jax.jit(A.mv) hashes the bound "
            f"method's operator. Jit a function that calls the method, jax.jit(lambda x: A.mv(x)); or "
            f"pass the operator as an argument, jax.jit(lambda A, x: A.mv(x))(A, x) (compiled once for "
            f"every operator of the same row_fn and shapes); or use equinox.filter_jit(A.mv)."
        ) from err


def _check_vector(vector: Any, expected: Any, what: str) -> None:
    got = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), vector)
    ok = jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected) and all(
        g.shape == e.shape and g.dtype == e.dtype
        for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected))
    )
    if not ok:
        raise ValueError(
            f"{what}: the input does not match the operator's input structure: expected "
            f"{_fmt(expected)}, got {_fmt(got)}."
        )


class AbstractRowOperator(lx.AbstractLinearOperator):
    """The interface of a row operator ``x -> [row_fn(row_i, x) for each row i]``.

    A new kind of row operator is one subclass. It provides ``rows`` (a pytree of arrays with a
    leading axis of ``n_rows``), ``tags``, ``chunk_size``, the per-row function ``row_fn``
    (linear in ``x``), ``in_structure()`` and two kernels: ``apply(x)`` (``A x``) and
    ``apply_transpose(y)`` (``A^T y``). Everything else is built on those: ``mv``, the
    transpose (a :class:`TransposedRowOperator` whose ``mv`` is ``apply_transpose``),
    ``out_structure``, ``as_matrix``, :func:`chunkop.check_linear`,
    :func:`chunkop.gram_diagonal`, :func:`chunkop.to_scipy` and the lineax registrations.
    :class:`RowOperator` is the chunked implementation.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, chunkop
        >>> class DenseRows(chunkop.AbstractRowOperator):  # y_i = w_i . x, dense kernels
        ...     rows: jax.Array
        ...     tags: frozenset = eqx.field(static=True, default=frozenset())
        ...     row_fn = property(lambda self: lambda row, x: jnp.dot(row, x))
        ...     chunk_size = property(lambda self: 16)
        ...     def in_structure(self):
        ...         return jax.ShapeDtypeStruct(self.rows.shape[1:], self.rows.dtype)
        ...     def apply(self, x):
        ...         return self.rows @ x
        ...     def apply_transpose(self, y):
        ...         return self.rows.T @ y
        >>> D = DenseRows(jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]))
        >>> D.T.mv(jnp.ones(3))
        Array([4., 7.], dtype=float32)
        >>> chunkop.gram_diagonal(D)
        Array([10., 21.], dtype=float32)
        >>> sorted(chunkop.check_linear(D))
        ['adjoint', 'matvec', 'superposition', 'zero']
    """

    rows: eqx.AbstractVar[Any]
    tags: eqx.AbstractVar[frozenset]

    def __hash__(self) -> int:
        return _hash_or_explain(self, super().__hash__)

    @property
    @abc.abstractmethod
    def row_fn(self) -> Callable:
        """The per-row function ``row_fn(row, x)`` (linear in ``x``)."""

    @property
    @abc.abstractmethod
    def chunk_size(self) -> int:
        """The number of rows computed at once."""

    @abc.abstractmethod
    def apply(self, vector: Any) -> Any:
        """The matvec kernel ``A x`` (``vector`` already checked against ``in_structure()``)."""

    @abc.abstractmethod
    def apply_transpose(self, vector: Any) -> Any:
        """The transposed kernel ``A^T y`` (``vector`` already checked against ``out_structure()``)."""

    @property
    def n_rows(self) -> int:
        """The number of rows (the size of the leading axis of every leaf of ``rows``)."""
        return jax.tree_util.tree_leaves(self.kernel_rows)[0].shape[0]

    @property
    def kernel_rows(self) -> Any:
        """The rows as the kernels hold them (``rows`` itself, unless a subclass reorders them)."""
        return self.rows

    def mv(self, vector: Any) -> Any:
        """``A x``: rows stacked along a leading axis of ``n_rows``.

        Args:
            vector: a pytree matching ``in_structure()``.

        Returns:
            A pytree matching ``out_structure()``.
        """
        _check_vector(vector, self.in_structure(), f"{type(self).__name__}.mv")
        return self.apply(vector)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> BudgetPlan:
        """The ``"auto"`` plan the operator was built with (``chunkop.plan``; ``args`` and
        ``kwargs`` are not needed).

        Raises:
            TypeError: when it was not built with ``chunk_size="auto"``.
        """
        raise _budget.not_planned(self)

    def transpose(self) -> TransposedRowOperator:
        """The transpose ``A^T`` (its own kernel, ``apply_transpose``); ``A.T.T`` is ``A``.

        Returns:
            A :class:`TransposedRowOperator` sharing this operator's rows.
        """
        return TransposedRowOperator(self)

    def out_structure(self) -> Any:
        """The structure of ``A x``: ``row_fn``'s output with a leading axis of ``n_rows``."""
        row0 = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.rows)
        per_row = jax.eval_shape(self.row_fn, row0, self.in_structure())
        structs = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct((self.n_rows,) + tuple(s.shape), s.dtype), per_row
        )
        return row_sharding.with_sharding(structs, self, rows=True)  # Explicit-mesh row sharding

    def as_matrix(self) -> jax.Array:
        """The dense ``(out_size, in_size)`` matrix, materialised one chunk of rows at a time.

        Returns:
            The matrix whose column ``j`` is ``self.mv`` of the ``j``-th basis vector (inputs
            and outputs flattened in ``jax.flatten_util.ravel_pytree`` order).
        """
        return _dense(self)

    def normal(self, damping: Any = 0.0) -> lx.AbstractLinearOperator:
        """The normal operator ``A^H A + damping * I`` on the input space, for ``lineax.CG``.

        Solving ``normal(damping) x = A^H b`` with ``lineax.CG`` from ``x = 0`` gives the
        least-squares solution (``damping > 0``: the Tikhonov-regularised one; ``damping = 0``
        and more unknowns than rows: the minimum-norm one, as ``lineax.Normal`` does). Every
        vector of the solve lives in the input space, replicated when the rows are sharded:
        unlike ``lineax.Normal``, which for a wide operator (fewer rows than unknowns) runs CG
        on row-space vectors, whose dot products JAX refuses when the rows are sharded over an
        Explicit mesh. Each CG step costs one ``mv`` and one ``T.mv``.

        Args:
            damping: a non-negative scalar (a float or a scalar array; traced values are not
                checked).

        Returns:
            A lineax operator tagged positive semidefinite (and symmetric for real dtypes).

        Example:
            >>> import jax, jax.numpy as jnp, lineax as lx, chunkop
            >>> rows = {"i": jnp.array([0, 1, 2, 0]), "w": jnp.array([1.0, 2.0, 3.0, 1.0])}
            >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
            ...                         jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
            >>> b = jnp.array([1.0, 4.0, 9.0, 1.0])
            >>> x = lx.linear_solve(A.normal(), A.T.mv(b), lx.CG(rtol=1e-6, atol=1e-6)).value
            >>> jnp.round(x, 4)
            Array([1., 2., 3.], dtype=float32)
        """
        if not isinstance(damping, jax.core.Tracer):
            value = np.asarray(damping)
            if value.ndim != 0 or not np.isreal(value) or not value >= 0:
                raise ValueError(
                    f"{type(self).__name__}.normal: `damping` must be a non-negative real scalar, got {damping!r}."
                )
        gram = lx.conj(self.transpose()) @ self
        if isinstance(damping, jax.core.Tracer) or float(np.asarray(damping)) != 0.0:
            gram = gram + damping * lx.IdentityLinearOperator(self.in_structure())
        real = not any(
            jnp.issubdtype(s.dtype, jnp.complexfloating)
            for s in jax.tree_util.tree_leaves((self.in_structure(), self.out_structure()))
        )
        tags = (lx.positive_semidefinite_tag, lx.symmetric_tag) if real else (lx.positive_semidefinite_tag,)
        return lx.TaggedLinearOperator(gram, tags)


class RowOperator(AbstractRowOperator):
    """A linear operator ``x -> [row_fn(row_i, x) for each row i]``, computed chunk by chunk.

    ``row_fn(row, x)`` must be linear in ``x`` (it may gather, e.g. ``x[row["idx"]]``, and compute
    non-linear weights from the row's data). ``rows`` is a pytree of arrays sharing a leading
    axis of ``n_rows``; its float leaves are differentiable. Nothing of size
    ``n_rows x row_length`` is ever materialised: the matvec, the transpose and all their
    derivatives are scans over chunks of ``chunk_size`` rows that recompute each chunk's
    weights (see the design note in ``docs/design.md``).

    It is a ``lineax.AbstractLinearOperator`` (an equinox Module): ``mv``, ``T``/``transpose``,
    ``as_matrix``, ``in_structure``, ``out_structure`` and the lineax queries work, so it can be
    passed to ``lineax.linear_solve`` (e.g. ``lineax.LSMR``, or ``lineax.Normal(lineax.CG(...))``).

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> x_struct = jax.ShapeDtypeStruct((5, 3), jnp.float32)
        >>> rows = {"idx": jnp.array([0, 4, 2, 2]), "scale": jnp.array([1.0, 2.0, 0.5, 3.0])}
        >>> row_fn = lambda row, x: row["scale"] * jnp.sum(x[row["idx"]])
        >>> A = chunkop.RowOperator(row_fn, rows, x_struct, chunk_size=2)
        >>> A.mv(jnp.ones((5, 3)))
        Array([3. , 6. , 1.5, 9. ], dtype=float32)
        >>> A.T.mv(jnp.ones(4)).shape
        (5, 3)
    """

    row_data: Any  # the rows the kernels run on: sorted by target in the windowed layout
    consts: tuple
    layout: Any  # row_layout.RowLayout (the windowed layout's permutation), or None (plain)
    spec: kernels.Spec = eqx.field(static=True)
    tags: frozenset = eqx.field(static=True)
    mesh_axes: Any = eqx.field(static=True, default=None)  # rows sharded over these (see row_sharding)
    out_sharding: str = eqx.field(static=True, default="rows")  # "rows" or "replicated"
    budget_plan: Any = eqx.field(static=True, default=None)  # chunk_size="auto": see chunkop.plan

    def __init__(
        self,
        row_fn: Callable[[Any, Any], Any],
        rows: Any,
        in_structure: Any,
        *,
        chunk_size: int | str = "auto",
        tags: object | Iterable[object] = (),
        progress: Progress = None,
        memory_budget: int | None = None,
        out_sharding: str = "rows",
        segment_key: str | None = None,
        layout: str = "auto",
    ) -> None:
        """Build the operator (arguments are checked, and ``row_fn`` is traced, here).

        Args:
            row_fn: ``row_fn(row, x) -> y_row``, linear in ``x``; ``row`` is one slice of
                ``rows``. It is traced once, here: the arrays it closes over (concrete or
                traced, e.g. a parameter under ``jax.grad``) become the operator's ``consts``,
                used by ``mv``, ``T.mv`` and all derivatives, and differentiable.
                (A non-linear ``row_fn`` would act as its linear part at ``x = 0``: check new
                operators with :func:`chunkop.check_linear`.)
            rows: pytree of arrays with a shared leading axis ``n_rows`` (per-row data).
            in_structure: pytree of ``jax.ShapeDtypeStruct`` (or arrays) describing ``x``.
            chunk_size: number of rows computed at once (a positive int), or ``"auto"`` (the
                default): the largest chunk whose compiled temp memory (``mv``, ``T.mv`` and
                their VJPs) fits ``memory_budget`` (see :func:`chunkop.plan`). On CPU with the
                default budget the 16 MiB throughput cap binds and the chunk comes from a
                compile-free estimate (building costs nothing); otherwise planning compiles
                these programs at a few chunk sizes when the operator is built (once per traced
                ``row_fn`` and shapes: the plan is cached);
                pass an int to skip it.
            tags: lineax tags (e.g. ``lineax.symmetric_tag``); unchecked, as in lineax.
            progress: as in :func:`chunkop.vmap`: every kernel (``mv``, ``T.mv``, their
                derivatives) reports its chunks from inside the compiled loop.
            memory_budget: bytes of temp memory for ``chunk_size="auto"``; None for half the
                device's free memory.
            out_sharding: with rows sharded over an Explicit mesh, how ``A x`` comes back:
                ``"rows"`` (the default) sharded like the rows, each device keeping its own rows
                (no collective); ``"replicated"``: gathered on every device (one all-gather of
                the ``n_rows`` outputs per ``mv``; ``T.mv`` takes replicated vectors and each
                device reads its own rows). lineax solvers that take dot products of row-space
                vectors (``lineax.Normal`` for fewer rows than unknowns, ``lineax.LSMR``) need
                ``"replicated"`` there: JAX refuses those dot products of row-sharded vectors on
                an Explicit mesh. No effect without sharded rows or on Auto meshes.
            segment_key: for ``T.mv``, the key of a dict ``rows`` whose integer leaf is each
                row's *target*, when ``row_fn`` reads ``x`` only at ``x[row[segment_key]]``
                (every leaf of ``x`` along its leading axis, as ``sky[row["pix"]]``). Given, the
                transpose sums each chunk's rows per target (the chunk sorted by target, a
                segmented scan) and writes each target once: no two rows add into one element
                at the same time, so an accelerator needs no contended atomic additions (XLA
                lowers a float32 scatter-add on GPU to a compare-and-swap loop), and the result
                is bitwise repeatable. ``row_fn`` is evaluated there on a one-slice ``x`` (shape
                ``(1, ...)``) with the target set to 0: check a new operator with
                :func:`chunkop.check_linear`, whose adjoint test fails if ``row_fn`` reads
                anything else. Targets outside ``[-n, n)`` add nothing. None (the default):
                ``jax.linear_transpose``'s scatter-add (the faster on CPU; see
                ``benchmarks/RESULTS.md``). ``mv`` and the derivatives w.r.t. ``rows`` and
                ``consts`` are unchanged.
            layout: how the kernels hold the rows. ``"windowed"``: sorted by target once, here,
                so that each chunk of rows reads one window of ``x``'s rows and every transpose
                (``A.T.mv``, and the transpose of ``A.mv`` that ``jax.grad`` runs) sums into that
                window instead of scattering every row into ``x`` (``docs/design.md``, "The
                windowed layout"). It needs ``row_fn`` to read ``x`` only as whole rows
                (``x[i]``, ``x[i:i + k]`` along the leading axis of each leaf) at starts
                computed from concrete row data; ``A x`` and ``A^T y`` stay in the user's row
                order (one permutation of ``n_rows`` values each, none when the rows come
                sorted: :attr:`row_order`). ``"plain"``: the rows as given, each chunk reading
                ``x`` where its rows point (a scatter-add of rows in the transpose).
                ``"auto"`` (the default): ``"windowed"`` where it applies and was measured to
                win on the platform (a TPU; a CPU from 2 MiB of the ``x`` leaves read, where a
                gather of rows no longer stays in cache), else ``"plain"``; always ``"plain"``
                with a ``segment_key``.
        """
        if not callable(row_fn):
            raise TypeError(f"RowOperator: `row_fn` must be callable, got {row_fn!r}.")
        chunk_size = _budget.check_chunk_size_or_auto(chunk_size, allow_none=False, where="RowOperator")
        if out_sharding not in ("rows", "replicated"):
            raise ValueError(f'RowOperator: `out_sharding` must be "rows" or "replicated", got {out_sharding!r}.')
        self.out_sharding = out_sharding
        n_rows = _check_rows(rows)
        in_leaves, in_tree = _as_struct_tree(in_structure)
        _check_segment_key(segment_key, rows, n_rows, in_leaves)
        progress = check_progress(progress, "RowOperator")
        _budget.check_budget_needs_auto(
            chunk_size, _budget.check_memory_budget(memory_budget, "RowOperator"), "RowOperator"
        )
        if layout not in ("auto", "windowed", "plain"):
            raise ValueError(f'RowOperator: `layout` must be "auto", "windowed" or "plain", got {layout!r}.')
        if layout == "windowed" and segment_key is not None:
            raise ValueError(
                "RowOperator: `segment_key` and layout='windowed' are two transposes: the windowed layout "
                "sums each chunk's rows into one window of x (no scatter at all); pass one of them."
            )
        if chunk_size == "auto" and n_rows == 0:
            chunk_size = 1  # nothing to plan: no row, no chunk
        self.mesh_axes = row_sharding.row_mesh(rows)
        x_struct = jax.tree_util.tree_unflatten(in_tree, list(in_leaves))

        # row_fn traced (and planned) in the context the kernels run it in (rows sharded over an
        # Explicit mesh: automatic axes); the layout sorted in the caller's
        traced = lambda: kernels.make_spec(row_fn, rows, x_struct, 1 if chunk_size == "auto" else chunk_size)
        spec, self.consts = row_sharding.traced_for_rows(traced, rows)
        spec = spec.at(spec.chunk_size, None, segment_key)
        windowed = _windowed(spec, self.consts, rows, n_rows, layout, segment_key, self.mesh_axes)
        self.row_data, self.layout, windows_at, self.budget_plan = rows, None, None, None
        if windowed is not None:  # "auto": planned on that one trace of row_fn and the windows
            order, targets, at, sorted_rows = windowed
            plan = None
            if chunk_size == "auto":
                key = row_layout.digest(targets)
                plan = row_sharding.traced_for_rows(
                    lambda: row_plan.plan_rows(spec, self.consts, sorted_rows, memory_budget, at, key), rows
                )
            chunk = chunk_size if plan is None else row_layout.preferred_chunk(at, plan.chunk or n_rows)
            if plan is not None and chunk != plan.chunk:
                plan = plan._replace(chunk=chunk)
            if row_layout.use_windows(layout, at(chunk), spec.in_leaves, chunk):
                self.row_data, self.layout, windows_at, self.budget_plan = sorted_rows, order, at, plan
        if self.layout is None and chunk_size == "auto":
            self.budget_plan = row_sharding.traced_for_rows(
                lambda: row_plan.plan_rows(spec, self.consts, rows, memory_budget), rows
            )
        if self.budget_plan is not None:
            chunk_size = self.budget_plan.chunk or n_rows
        windows = None if windows_at is None else windows_at(chunk_size)
        self.spec = spec.at(chunk_size, progress, windows=windows)  # (the transpose kept)
        self.tags = frozenset(tags) if isinstance(tags, Iterable) else frozenset((tags,))

    @property
    def rows(self) -> Any:
        """The row data, in the user's order (as given when the operator was built).

        In the windowed layout with rows that did not come sorted, the kernels hold them sorted
        (``row_data``), and this is a permutation of those. To replace row leaves keep the
        layout's order: ``eqx.tree_at(lambda A: A.row_data, A, A.layout.to_sorted(new_rows))``
        (or build a new operator).
        """
        if self.layout is None or self.layout.order is None:
            return self.row_data
        return row_sharding.map_rows(lambda m: m[1].to_user(m[0]), (self.row_data, self.layout))

    @property
    def kernel_rows(self) -> Any:
        """The rows as the kernels hold them: sorted by target in the windowed layout."""
        return self.row_data

    def with_rows(self, rows: Any) -> RowOperator:
        """This operator with new row values (a pytree like ``rows``, in the user's order): the same
        traced ``row_fn``, plan and layout, so no new trace, sort or compilation; differentiable
        in the new values (e.g. ``A.with_rows({**A.rows, "s": alpha * A.rows["s"]})``).

        The rows' targets (the values ``row_fn`` computes its reads of ``x`` from) must be those
        the operator was built with: checked where both are concrete; for others (traced under
        ``jax.jit``) build a new operator if they change.

        Args:
            rows: the new row pytree (same structure, shapes and dtypes).

        Returns:
            A :class:`RowOperator`.

        Raises:
            ValueError: a concrete target leaf with other values, or another structure.
        """
        old_leaves, tree = jax.tree_util.tree_flatten(self.rows)
        new_leaves = jax.tree_util.tree_leaves(rows)
        if jax.tree_util.tree_structure(rows) != tree or any(
            jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b)
            for a, b in zip(old_leaves, new_leaves)
        ):
            raise ValueError(
                "RowOperator.with_rows: the new rows must have the operator's row structure, shapes and "
                f"dtypes: expected {_fmt(self.rows)}, got {_fmt(rows)}."
            )
        if self.layout is None:
            return eqx.tree_at(lambda op: op.row_data, self, rows)
        for k in row_layout.target_leaves(self.spec.jaxpr, self.spec.reads):
            a, b = old_leaves[k], new_leaves[k]
            concrete = not isinstance(a, jax.core.Tracer) and not isinstance(b, jax.core.Tracer)
            if a is not b and concrete and not np.array_equal(np.asarray(a), np.asarray(b)):
                raise ValueError(
                    "RowOperator.with_rows: the new rows change the targets row_fn reads x at (row leaf "
                    f"{jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(rows)[0][k][0])}), which "
                    "the windowed layout sorted the rows by: build a new RowOperator."
                )
        sorted_rows = row_sharding.map_rows(lambda m: m[1].to_sorted(m[0]), (rows, self.layout))
        return eqx.tree_at(lambda op: op.row_data, self, sorted_rows)

    @property
    def row_order(self) -> jax.Array | None:
        """The windowed layout's order of the rows: ``rows[row_order]`` (each leaf) is sorted by
        target; None when the rows came sorted, or in the plain layout.

        Sorting a catalog once (its rows and its data) spares ``A x`` and ``A^T y`` their
        permutations (one of ``n_rows`` values each: 0.22 s at 54M lines on a TPU v5e):
        build the operator on ``rows[row_order]``, or use :meth:`in_sorted_order`. With rows
        sharded over devices the indices are local to each device's rows.
        """
        return None if self.layout is None else self.layout.order

    def in_sorted_order(self) -> RowOperator:
        """This operator on its rows in the windowed layout's order, ``rows[row_order]``: the same
        kernels and windows, without the permutations (``A x`` comes in that order, ``A^T`` takes
        vectors in it). Sort the data once (``y[A.row_order]``) and use this.

        Returns:
            A :class:`RowOperator` (this one when its rows came sorted, or in the plain layout).

        Example:
            >>> import jax, jax.numpy as jnp, chunkop
            >>> rows = {"i": jnp.array([3, 0, 2, 0, 1, 3]), "w": jnp.arange(1.0, 7.0)}
            >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
            ...                         jax.ShapeDtypeStruct((4,), jnp.float32), chunk_size=2,
            ...                         layout="windowed")
            >>> A.row_order.tolist()
            [1, 3, 4, 2, 0, 5]
            >>> x = jnp.arange(4.0)
            >>> A.in_sorted_order().mv(x).tolist() == A.mv(x)[A.row_order].tolist()
            True
        """
        if self.layout is None or self.layout.order is None:
            return self
        return eqx.tree_at(lambda op: op.layout, self, row_layout.RowLayout())

    @property
    def row_fn(self) -> Callable:
        """The per-row function ``row_fn(row, x)`` (linear in ``x``).

        It evaluates the ``row_fn`` traced when the operator was built, with this operator's
        ``consts`` (the arrays it closed over then).
        """
        return functools.partial(self.spec.row_fn, self.consts)

    @property
    def chunk_size(self) -> int:
        """The number of rows computed at once."""
        return self.spec.chunk_size

    def in_structure(self) -> Any:
        """The structure of ``x``: a pytree of ``jax.ShapeDtypeStruct``."""
        return row_sharding.with_sharding(self.spec.in_structure(), self, rows=False)

    def out_structure(self) -> Any:
        """The structure of ``A x``: ``row_fn``'s output with a leading axis of ``n_rows``
        (recorded when ``row_fn`` was traced, at construction)."""
        return row_sharding.with_sharding(self.spec.out_structure(self.n_rows), self, rows=True)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> BudgetPlan:
        """The ``"auto"`` plan the operator was built with (``chunkop.plan``).

        Raises:
            TypeError: when it was not built with ``chunk_size="auto"``.
        """
        if self.budget_plan is None:
            raise _budget.not_planned(self)
        return self.budget_plan

    def apply(self, vector: Any) -> Any:
        """The chunked matvec kernel (differentiable in ``rows``, ``consts`` and ``vector``)."""
        if is_symbolic(self.n_rows):  # rows given as an exported function's argument
            _check_rows(self.row_data)
        if (mesh_axes := row_sharding.operator_mesh(self)) is not None:  # rows sharded over devices
            kernel, rows = kernels.apply, self.row_data
            if self.layout is not None:
                kernel, rows = _in_order, (self.row_data, self.layout)
            out = row_sharding.sharded_apply(kernel, self.spec, self.consts, rows, vector, mesh_axes)
            return row_sharding.replicate(out, mesh_axes) if self.out_sharding == "replicated" else out
        if self.layout is not None:
            return kernels.apply_in_order(self.spec, self.consts, self.row_data, self.layout, vector)
        return kernels.apply(self.spec, self.consts, self.row_data, vector)

    def apply_transpose(self, vector: Any) -> Any:
        """The chunked transposed kernel (differentiable in ``rows``, ``consts`` and ``vector``)."""
        if is_symbolic(self.n_rows):
            _check_rows(self.row_data)
        if (mesh_axes := row_sharding.operator_mesh(self)) is not None:  # one all-reduce of the x-space result
            kernel, rows = kernels.apply_transpose, self.row_data
            if self.layout is not None:
                kernel, rows = _transpose_in_order, (self.row_data, self.layout)
            return row_sharding.sharded_apply(kernel, self.spec, self.consts, rows, vector, mesh_axes, transpose=True)
        if self.layout is not None:
            return kernels.apply_transpose_in_order(self.spec, self.consts, self.row_data, self.layout, vector)
        return kernels.apply_transpose(self.spec, self.consts, self.row_data, vector)


def _in_order(spec: kernels.Spec, consts: Any, rows_and_layout: tuple, x: Any) -> Any:
    """A device's ``A x`` in the windowed layout (its rows sorted, their layout beside them)."""
    return kernels.apply_in_order(spec, consts, *rows_and_layout, x)


def _transpose_in_order(spec: kernels.Spec, consts: Any, rows_and_layout: tuple, y: Any) -> Any:
    """A device's ``A^T y`` in the windowed layout."""
    return kernels.apply_transpose_in_order(spec, consts, *rows_and_layout, y)


def _windowed(
    spec: kernels.Spec, consts: tuple, rows: Any, n_rows: int, layout: str, segment_key: Any, mesh_axes: Any
) -> tuple | None:
    """The windowed layout of these ``n_rows`` rows, or None for the plain one (see ``RowOperator``'s
    ``layout``): ``(RowLayout, sorted targets, windows_at(chunk), sorted rows)``."""
    forced = layout == "windowed"
    if layout == "plain" or segment_key is not None:
        return None
    why = None
    if spec.reads is None:
        why = "`row_fn` reads `x` otherwise than as whole rows (x[i], x[i:i + k] along each leaf's leading axis)"
    elif any(s.shape and is_symbolic(s.shape[0]) for s in spec.in_leaves):
        why = "`x`'s leaves of concrete sizes (jax.export's symbolic sizes cannot be windowed)"
    if not forced and (why is not None or not row_layout.worth_sorting(spec.reads, spec.in_leaves, n_rows)):
        return None  # "auto": the plain layout, unsorted, where the platform's measurements say so
    if why is None:
        x_sizes = tuple(int(s.shape[0]) if s.shape else 0 for s in spec.in_leaves)
        targets = row_layout.row_targets(spec.jaxpr, spec.reads, consts, rows, x_sizes)
        if targets is None:
            why = "the rows' targets are traced (rows built under jax.jit or jax.vmap): they must be concrete"
    if why is not None:
        if forced:
            raise ValueError(f"RowOperator: layout='windowed' needs {why}; use layout='auto' or 'plain'.")
        return None
    shards = 1
    if mesh_axes is not None and targets.shape[0] % mesh_axes.n_shards == 0:
        shards = mesh_axes.n_shards
    order, targets = row_layout.build(targets, shards)
    windows_at = lambda chunk: row_layout.window_sizes(targets, spec.reads, x_sizes, chunk, shards)
    if order.order is not None:
        order = row_layout.RowLayout(*(row_layout.placed(a, rows) for a in (order.order, order.inverse)))
        rows = row_sharding.map_rows(lambda m: m[1].to_sorted(m[0]), (rows, order))
    return order, targets, windows_at, rows


class TransposedRowOperator(lx.AbstractLinearOperator):
    """``A^T`` for a row operator ``A``: ``y -> sum_i row_fn(row_i, .)^T y_i``.

    Built by ``A.T``; its ``mv`` is ``A``'s ``apply_transpose`` kernel (for a
    :class:`RowOperator`: a scan over chunks of rows, each chunk recomputing its weights and
    accumulating its ``jax.linear_transpose`` into the ``x`` space). It is differentiable like
    ``A.mv`` (w.r.t. ``y``, the float leaves of ``rows`` and the arrays ``row_fn`` closes over).

    Example:
        >>> import jax, jax.numpy as jnp, chunkop
        >>> rows = {"i": jnp.array([0, 2, 2]), "w": jnp.array([1.0, 2.0, 3.0])}
        >>> A = chunkop.RowOperator(lambda r, x: r["w"] * x[r["i"]], rows,
        ...                         jax.ShapeDtypeStruct((3,), jnp.float32), chunk_size=2)
        >>> A.T.mv(jnp.ones(3))
        Array([1., 0., 5.], dtype=float32)
        >>> A.T.T is A
        True
    """

    operator: AbstractRowOperator

    def __hash__(self) -> int:
        return _hash_or_explain(self, super().__hash__)

    @property
    def rows(self) -> Any:
        """The row data, shared with the original operator."""
        return self.operator.rows

    @property
    def kernel_rows(self) -> Any:
        """The rows as the original operator's kernels hold them."""
        return self.operator.kernel_rows

    @property
    def row_fn(self) -> Callable:
        """The original operator's ``row_fn``."""
        return self.operator.row_fn

    @property
    def chunk_size(self) -> int:
        """The original operator's chunk size."""
        return self.operator.chunk_size

    @property
    def n_rows(self) -> int:
        """The original operator's number of rows."""
        return self.operator.n_rows

    @property
    def tags(self) -> frozenset:
        """The original operator's tags, transposed (``lineax.transpose_tags``)."""
        return lx.transpose_tags(self.operator.tags)

    def apply(self, vector: Any) -> Any:
        """The kernel of ``A^T y``: the original operator's transposed kernel."""
        return self.operator.apply_transpose(vector)

    def apply_transpose(self, vector: Any) -> Any:
        """The kernel of ``(A^T)^T x = A x``: the original operator's matvec kernel."""
        return self.operator.apply(vector)

    def mv(self, vector: Any) -> Any:
        """``A^T y``.

        Args:
            vector: a pytree matching ``in_structure()`` (the original operator's output).

        Returns:
            A pytree matching ``out_structure()`` (the original operator's input).
        """
        _check_vector(vector, self.in_structure(), f"{type(self.operator).__name__}.T.mv")
        return self.operator.apply_transpose(vector)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> BudgetPlan:
        """The original operator's ``"auto"`` plan (``chunkop.plan``)."""
        return self.operator.plan_for(args, kwargs)

    def transpose(self) -> AbstractRowOperator:
        """The original operator.

        Returns:
            The row operator this is the transpose of (``A.T.T is A``).
        """
        return self.operator

    def in_structure(self) -> Any:
        """The structure of ``y``: the original operator's output structure."""
        return self.operator.out_structure()

    def out_structure(self) -> Any:
        """The structure of ``A^T y``: the original operator's input structure."""
        return self.operator.in_structure()

    def as_matrix(self) -> jax.Array:
        """The dense matrix: the transpose of the original operator's.

        Returns:
            ``self.transpose().as_matrix().T``.
        """
        return self.operator.as_matrix().T


def row_form(operator: Any, where: str) -> tuple[AbstractRowOperator, bool]:
    """``(A, transposed)`` for a row operator ``A`` or its transpose; ``TypeError`` otherwise."""
    if isinstance(operator, AbstractRowOperator):
        return operator, False
    if isinstance(operator, TransposedRowOperator):
        return operator.operator, True
    raise TypeError(
        f"{where}: `operator` must be a chunkop.RowOperator (or another AbstractRowOperator, or "
        f"its transpose), got {type(operator).__name__}."
    )


def linear_jacobian(f: Callable[[jax.Array], jax.Array], flat_x: jax.Array) -> jax.Array:
    """The matrix of the linear map ``f`` (flat vector -> flat vector), for real or complex dtypes.

    Reverse mode (one row of coefficients per output element) when it applies; complex inputs
    need ``holomorphic=True``, and a real input with a complex output needs forward mode.
    """
    if jnp.iscomplexobj(flat_x):
        return jax.jacrev(f, holomorphic=True)(flat_x)
    if jnp.issubdtype(jax.eval_shape(f, flat_x).dtype, jnp.complexfloating):
        return jax.jacfwd(f)(flat_x)
    return jax.jacrev(f)(flat_x)


def _dense(base: AbstractRowOperator) -> jax.Array:
    """Chunked dense materialisation (used by ``as_matrix``)."""
    x0 = zeros_of(base.in_structure())
    flat_x, unravel_x = ravel_pytree(x0)

    def row_matrix(row: Any, at: jax.Array) -> jax.Array:
        f = lambda flat: ravel_pytree(base.row_fn(row, unravel_x(flat)))[0]
        return linear_jacobian(f, at)  # (row_out_size, in_size); exact: f is linear

    # `flat_x` an argument, not a closure: with rows sharded over devices the vmap runs with the
    # mesh axes automatic (row_sharding.map_rows), which retypes its arguments only
    blocks = row_sharding.map_rows(vmap(row_matrix, in_axes=(0, None), chunk_size=base.chunk_size), base.rows, flat_x)
    if jax.tree_util.tree_structure(base.out_structure()).num_leaves != 1:
        # rows' outputs are pytrees: reorder from row-major blocks to ravel_pytree's leaf order
        mats = []
        per_row = jax.tree_util.tree_leaves(
            jax.eval_shape(base.row_fn, jax.tree_util.tree_map(lambda a: a[0], base.rows), x0)
        )
        offset = 0
        for leaf in per_row:
            size = int(np.prod(leaf.shape))
            mats.append(blocks[:, offset : offset + size, :].reshape(base.n_rows * size, flat_x.size))
            offset += size
        matrix = jnp.concatenate(mats, axis=0)
    else:
        matrix = blocks.reshape(base.n_rows * blocks.shape[1], flat_x.size)
    return matrix


# -- lineax: the operator's registrations with lineax's queries ------------------------------------
#
# Tag queries answer from the operator's (unchecked) tags, as lineax does for its own implicit
# operators; ``materialise`` and ``tridiagonal`` go through the chunked dense materialisation (small
# operators); ``diagonal`` evaluates each diagonal entry on its basis vector, a few rows at a time,
# without the ``n^2`` matrix. Importing this module registers them (as lineax's own operators).


@lx.linearise.register(AbstractRowOperator)
@lx.linearise.register(TransposedRowOperator)
def _(operator):
    return operator  # already linear, nothing to cache


@lx.materialise.register(AbstractRowOperator)
@lx.materialise.register(TransposedRowOperator)
def _(operator):
    matrix = operator.as_matrix()
    in_struct, out_struct = operator.in_structure(), operator.out_structure()
    in_leaves = jax.tree_util.tree_leaves(in_struct)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_struct)
    if len(in_leaves) == 1 and len(out_leaves) == 1 and in_leaves[0].ndim == out_leaves[0].ndim == 1:
        return lx.MatrixLinearOperator(matrix, operator.tags)
    blocks, r0 = [], 0
    for o in out_leaves:
        r1 = r0 + int(np.prod(o.shape))
        parts, c0 = [], 0
        for i in in_leaves:
            c1 = c0 + int(np.prod(i.shape))
            parts.append(matrix[r0:r1, c0:c1].reshape(tuple(o.shape) + tuple(i.shape)))
            c0 = c1
        blocks.append(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(in_struct), parts))
        r0 = r1
    return lx.PyTreeLinearOperator(jax.tree_util.tree_unflatten(out_tree, blocks), out_struct, operator.tags)


def _check_square(operator, name: str) -> None:
    if operator.in_size() != operator.out_size():
        raise ValueError(
            f"lineax.{name}: the operator is not square (out_size {operator.out_size()}, in_size {operator.in_size()})."
        )


def _row_diagonal(operator: AbstractRowOperator) -> jax.Array:
    """The diagonal of a square RowOperator, without its ``n^2`` matrix.

    Output element ``i`` (in ``ravel_pytree`` order) belongs to row ``r`` (element ``k`` of
    output leaf ``L``); the diagonal entry is that element of ``row_fn(row_r, e_i)``, with ``e_i``
    the ``i``-th basis vector of the input space. Each row evaluates its ``m`` elements on their
    ``m`` basis vectors, a few rows at a time: ``O(n_rows * m * in_size)`` time, and at most
    about ``2**22`` input-sized entries of memory at once (instead of ``out_size * in_size``).
    """
    x0 = zeros_of(operator.in_structure())
    flat_x, unravel = ravel_pytree(x0)
    per_row = [int(np.prod(s.shape[1:])) for s in jax.tree_util.tree_leaves(operator.out_structure())]
    n, m = operator.n_rows, sum(per_row)
    # element j of a row's flat output: leaf L(j), position k(j) in it; global index offset_L + r size_L + k
    leaf_offset = np.cumsum([0] + [n * size for size in per_row])[:-1]
    offset = np.concatenate([np.full(size, leaf_offset[i]) for i, size in enumerate(per_row)]).astype(np.int64)
    stride = np.concatenate([np.full(size, size) for size in per_row]).astype(np.int64)
    within = np.concatenate([np.arange(size) for size in per_row]).astype(np.int64)
    row_fn = operator.row_fn

    def diag_row(row, r):
        positions = jnp.asarray(offset) + r * jnp.asarray(stride) + jnp.asarray(within)

        def element(j, pos):
            basis = jnp.zeros(flat_x.shape, flat_x.dtype).at[pos].set(1)
            return ravel_pytree(row_fn(row, unravel(basis)))[0][j]

        return jax.vmap(element)(jnp.arange(m), positions)

    chunk = max(1, min(operator.chunk_size, 2**22 // max(m * flat_x.size, 1)))
    blocks = row_sharding.map_rows(  # (n, m); rows over devices: each device its own rows
        lambda rows_and_r: vmap(diag_row, chunk_size=chunk)(*rows_and_r), (operator.rows, jnp.arange(n))
    )
    parts, start = [], 0
    for size in per_row:
        parts.append(blocks[:, start : start + size].reshape(n * size))
        start += size
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


@lx.diagonal.register(AbstractRowOperator)
@lx.diagonal.register(TransposedRowOperator)
def _(operator):
    _check_square(operator, "diagonal")
    return _row_diagonal(row_form(operator, "lineax.diagonal")[0])  # (a transpose has the same diagonal)


@lx.tridiagonal.register(AbstractRowOperator)
@lx.tridiagonal.register(TransposedRowOperator)
def _(operator):
    _check_square(operator, "tridiagonal")
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix, -1), jnp.diagonal(matrix), jnp.diagonal(matrix, 1)


def _has_real_dtype(operator) -> bool:
    leaves = jax.tree_util.tree_leaves((operator.in_structure(), operator.out_structure()))
    return all(not jnp.issubdtype(s.dtype, jnp.complexfloating) for s in leaves)


@lx.is_symmetric.register(AbstractRowOperator)
@lx.is_symmetric.register(TransposedRowOperator)
def _(operator):
    tags = operator.tags
    if lx.symmetric_tag in tags or lx.diagonal_tag in tags:
        return True
    semidefinite = lx.positive_semidefinite_tag in tags or lx.negative_semidefinite_tag in tags
    return semidefinite and _has_real_dtype(operator)


def _tag_query(query, *tags):
    @query.register(AbstractRowOperator)
    @query.register(TransposedRowOperator)
    def _(operator):
        return any(tag in operator.tags for tag in tags)


_tag_query(lx.is_diagonal, lx.diagonal_tag)
_tag_query(lx.is_tridiagonal, lx.tridiagonal_tag, lx.diagonal_tag)
_tag_query(lx.has_unit_diagonal, lx.unit_diagonal_tag)
_tag_query(lx.is_lower_triangular, lx.lower_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_upper_triangular, lx.upper_triangular_tag, lx.diagonal_tag)
_tag_query(lx.is_positive_semidefinite, lx.positive_semidefinite_tag)
_tag_query(lx.is_negative_semidefinite, lx.negative_semidefinite_tag)


@lx.conj.register(AbstractRowOperator)
def _(operator):
    if _has_real_dtype(operator):
        return operator
    row_fn = operator.row_fn
    return RowOperator(
        lambda row, x: jax.tree_util.tree_map(jnp.conj, row_fn(row, jax.tree_util.tree_map(jnp.conj, x))),
        operator.rows,
        operator.in_structure(),
        chunk_size=operator.chunk_size,
        tags=operator.tags,
        out_sharding=getattr(operator, "out_sharding", "rows"),
    )


@lx.conj.register(TransposedRowOperator)
def _(operator):
    return lx.conj(operator.operator).transpose()
