"""The sorted-once, windowed row layout of a ``RowOperator``: a transpose without a scatter of rows.

``A^T y`` of an operator whose rows read ``x[t_i]`` is a sum of every row's weighted slice into
``x[t_i]``: a scatter-add of ``n_rows`` rows, which an accelerator runs slowly (a TPU serialises
it: 7.0 s for 54 million lines of 516 bins on a v5e, 44 times the cost of computing the weights).
When the rows are sorted by their targets ``t_i``, the rows of one chunk read a contiguous
*window* of ``x``: ``W`` rows from the smallest target of the chunk. Each chunk then slices its
window once (``lax.dynamic_slice``) and reads its rows from the window, and the transpose of
that (JAX's own, for ``jax.grad``; ``jax.linear_transpose``'s, for ``A.T.mv``) sums the chunk's
weighted rows into the window and writes the window back once (``dynamic_update_slice`` of the
carried ``x``-space sum, in place): no scatter of ``n_rows`` rows.

**When** (:func:`find_reads`): ``row_fn`` reads ``x`` only through ``dynamic_slice`` equations
that take whole rows along the leading axis (``x[i]``, ``x[i:i + k]``, on any leaf of ``x``), at
starts computed from the row data (and the arrays ``row_fn`` closes over), and those values are
concrete when the operator is built (:func:`row_targets`). Otherwise the operator keeps the
plain layout.

**Build** (:func:`build`): one stable sort of the rows by the first read's start, kept as the
permutation ``order`` (sorted row ``k`` is the user's row ``order[k]``) and its ``inverse``; the
kernels run on the sorted rows, and ``A x`` is put back in the user's order, ``A^T y`` taken in
it (:func:`permute`: one permutation of ``n_rows`` values, whose transpose is the inverse one). Rows that
are already sorted keep their order: no permutation at all. The window size ``W`` of each read
leaf is static (the widest span of a chunk, for the chunk plan); each chunk's window start is
computed from its rows (so it needs no stored array).

**Reading a window** (:func:`read_window`): by a gather (``jnp.take``) or by a one-hot
``(rows, W)`` matrix product at full float32 precision, which a TPU runs on its matrix unit; the
platform chooses when the program is lowered (``jax.lax.platform_dependent``), from the measured
table :data:`PLATFORMS`. Both are exact (one non-zero term per row) and deterministic: no atomic
additions, bitwise repeatable.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr
from .._chunking import make_plan
from .._trace import clamped_start, evaluate

__all__ = [
    "PLATFORMS",
    "Reads",
    "RowLayout",
    "find_reads",
    "row_targets",
    "window_sizes",
    "use_windows",
    "read_bytes",
    "worth_sorting",
    "platform",
    "preferred_chunk",
    "build",
    "permute",
    "read_window",
    "window_starts",
    "placed",
    "target_leaves",
    "digest",
]

_tu = jax.tree_util


@dataclasses.dataclass(frozen=True)
class Platform:
    """What was measured on a platform (``benchmarks/RESULTS.md``, "Windowed rows").

    Attributes:
        windows: whether ``layout="auto"`` sorts the rows and reads windows there.
        onehot_max: the largest window read by a one-hot matrix product (larger ones by a
            gather); ``"auto"`` chunks no larger than keeps the windows within it (down to
            ``MIN_ONEHOT_CHUNK`` rows).
        max_window_per_row: ``"auto"`` keeps the windows only while they hold at most this many
            rows of ``x`` per row of a chunk (None: any) ...
        unaligned: ... or, whatever their size, when a read leaf's rows have a last axis that is
            not a multiple of this (0: never): where the platform stores such an array with
            another axis minor, so that reading its rows one by one first copies all of ``x``.
        min_x_bytes: ``"auto"`` keeps the plain layout, without sorting the rows or compiling
            the windowed programs, while the leaves of ``x`` that ``row_fn`` reads hold fewer
            bytes than this: where a gather of rows from ``x`` stays in cache, windows gain
            little and their first call costs more ...
        min_rows: ... and, where given, the rows are fewer than this (None: the bytes alone
            decide): where the plain layout's scatter of a few rows is fast, the windows' compile
            in the first call outweighs what they gain per call.
    """

    windows: bool
    onehot_max: int = 0
    max_window_per_row: float | None = None
    unaligned: int = 0
    min_x_bytes: int = 0
    min_rows: int | None = None


# Measured (benchmarks/explore_window.py, bench_layout.py; benchmarks/RESULTS.md, "Windowed
# rows"). TPU v5e, 54M lines of a 786432 x 516 sky (69 lines per pixel), chunks of 4096: windows
# of 64-72 rows read by a one-hot product took the transpose from 7065 to 362 ms and the matvec
# from 959 to 323 ms (sorted lines; a gather from the window instead: 927 / 560 ms). At 132400
# lines (0.17 per pixel, windows of 20368 rows, 5 per line): over 516 bins (an array XLA:TPU
# stores with the pixel axis minor, {0,1}, so that the plain layout first copies all of x, 1.9
# GiB) the windows won every product (mv 6.6-7.4 vs 8.6 ms, T 21.8 vs 27.0, grad 28.2 vs 34.5);
# over 512 bins they lost the matvec (5.5 vs 2.8 ms) and won the rest (T 16.4 vs 19.3); the
# one-hot product lost there (56 vs 6.3 ms). Between 0.016 and 5 window rows per line the TPU
# was not measured: 1 is the bound. 2-core CPU, 128 bins, chunks of 4096: the windows won from 2
# lines per pixel (windows of half a chunk: mv 0.81x, T 1.03x, grad 0.90x the plain layout's
# time; at 5, 20 and 70 lines per pixel 0.79-0.90x everywhere) and lost below (1 line per pixel:
# T 1.7x; 0.2: 2.3x). The sky's size on the CPU (bench_layout.py, results/layout_small_sky/, 1M
# lines): at 0.5-1 MB of x the windows took 0.93-1.02x the plain layout's time warm, at 5-10 MB
# 0.85-0.94x, at 51-102 MB 0.54-0.92x; a NIFTy.re client on a 0.5 MB sky (bench_vi.py) ran 1.16x
# jax.vmap with them and 1.06x without (their sort and compile in its first call): 2 MiB is the
# bound. TPU v5e, data_on's latent operators in the astro example (benchmarks/explore_small_catalog.py,
# results/tpu/small_catalog_s30_*): x of 3072 x 24 (0.3 MB) and 3072 x 24 x 24 (7.1 MB) floats under
# 131072 lines, where the unaligned rule chose windows: their first call took 28-30 s (the rows'
# permutation compiled in 8.6 + 10.1 s, the windowed transpose in 10.5 s) for the plain layout's
# 0.5-1.1 s, and ran 4x slower (0.126 vs 0.031 s); x of 4.7 MB, 113 MB and 453 MB under 1M-2M lines:
# the windows' first calls 27-32 s (plain: 2.1-2.3 s) and, warm, A^T of the 4.7 MB x 2x faster
# (5.4 vs 11 ms) and data_on's two operators with the 113 and 453 MB x windowed as fast as plain
# (0.153 vs 0.150 s, 0.316 vs 0.309 s). So on a TPU "auto" keeps the plain layout below 32 MiB of
# x and 2M rows; the 54M-line job's operators (a 1.6 GB sky, whose windows won; latent fields under
# passes of 4.1M lines) keep the windows they ran with. GPUs were never measured: the plain layout
# there (layout="windowed" forces the windows, read by a gather).
PLATFORMS: dict[str, Platform] = {
    "tpu": Platform(
        windows=True, onehot_max=128, max_window_per_row=1.0, unaligned=128, min_x_bytes=32 << 20, min_rows=2 << 20
    ),
    "cpu": Platform(windows=True, max_window_per_row=0.6, min_x_bytes=2 << 20),
}
MIN_ONEHOT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Reads:
    """Where ``row_fn`` reads ``x`` (static; found in its trace by :func:`find_reads`).

    Attributes:
        eqns: positions of the reading ``dynamic_slice`` equations in the jaxpr's equations.
        leaves: the ``x`` leaf each of them reads.
        sizes: how many rows each of them takes.
        n_rows_leaves: how many of the jaxpr's inputs are row leaves (``x``'s follow).
    """

    eqns: tuple[int, ...]
    leaves: tuple[int, ...]
    sizes: tuple[int, ...]
    n_rows_leaves: int

    @property
    def read_leaves(self) -> tuple[int, ...]:
        """The ``x`` leaves read, each once, in order."""
        return tuple(sorted(set(self.leaves)))


def _takes_whole_rows(eqn: Any) -> bool:
    """A ``dynamic_slice`` whose every axis but the leading one is taken whole."""
    if eqn.primitive.name != "dynamic_slice":
        return False
    shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
    return len(shape) >= 1 and tuple(sizes[1:]) == tuple(shape[1:])


def find_reads(jaxpr: Any, n_rows_leaves: int) -> Reads | None:
    """The reads of ``x`` in ``row_fn``'s jaxpr, when every use of ``x`` is one: None otherwise.

    Every use of an ``x`` leaf must be as the operand of a top-level ``dynamic_slice`` that takes
    whole rows (``x[i]``, ``x[i:i + k]``), whose starts depend on no value read from ``x``. (A
    read inside an inner ``jit``, a reduction over ``x``, ``x`` returned as it is: the plain
    layout.)
    """
    x_vars = list(jaxpr.invars[n_rows_leaves:])
    position = {v: j for j, v in enumerate(x_vars)}
    eqns, leaves, sizes = [], [], []
    from_x: set = set()  # values computed from a read of x
    for k, eqn in enumerate(jaxpr.eqns):
        uses = [i for i, v in enumerate(eqn.invars) if not isinstance(v, _jaxpr.Literal) and v in position]
        if uses:
            starts_from_x = any(not isinstance(v, _jaxpr.Literal) and v in from_x for v in eqn.invars[1:])
            if uses != [0] or not _takes_whole_rows(eqn) or starts_from_x:
                return None
            eqns.append(k)
            leaves.append(position[eqn.invars[0]])
            sizes.append(int(eqn.params["slice_sizes"][0]))
            from_x.update(eqn.outvars)
        elif any(not isinstance(v, _jaxpr.Literal) and v in from_x for v in eqn.invars):
            from_x.update(eqn.outvars)
    if not eqns or any(not isinstance(v, _jaxpr.Literal) and v in position for v in jaxpr.outvars):
        return None
    return Reads(tuple(eqns), tuple(leaves), tuple(sizes), n_rows_leaves)


def _start_inputs(jaxpr: Any, reads: Reads) -> set:
    """The jaxpr's inputs (constants and row leaves) that the reads' starts are computed from."""
    needed = {jaxpr.eqns[k].invars[1] for k in reads.eqns}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, _jaxpr.Literal))
    return needed


def target_leaves(jaxpr: Any, reads: Reads) -> list[int]:
    """The positions, among the row leaves, of those the reads' starts are computed from."""
    needed = _start_inputs(jaxpr, reads)
    return [k for k, v in enumerate(jaxpr.invars[: reads.n_rows_leaves]) if v in needed]


def _starts_of_row(jaxpr: Any, reads: Reads, consts: list, row_leaves: list) -> list:
    """Each read's start for one row, as ``row_fn`` computes it: only the equations the starts
    depend on are evaluated (``x`` is never read, the weights never computed)."""
    needed = _start_inputs(jaxpr, reads)
    starts = {id(jaxpr.eqns[k]): k for k in reads.eqns}
    found: dict[int, Any] = {}

    def rule(eqn: Any, invals: list) -> list | None:
        if id(eqn) in starts:
            found[starts[id(eqn)]] = invals[1]
        elif any(v in needed for v in eqn.outvars):
            return None
        return [None] * len(eqn.outvars)  # (a value nothing reads)

    x_leaves = [None] * (len(jaxpr.invars) - reads.n_rows_leaves)
    evaluate(jaxpr, consts, [*row_leaves, *x_leaves], rule)
    return [found[k] for k in reads.eqns]


def row_targets(jaxpr: Any, reads: Reads, consts: tuple, rows: Any, x_sizes: tuple) -> np.ndarray | None:
    """Every row's read starts, clamped as ``dynamic_slice`` clamps them: ``(n_rows, reads)``
    int64; None when they are not concrete (computed from a traced row leaf or constant)."""
    row_leaves = _tu.tree_leaves(rows)
    inputs = [*jaxpr.constvars, *jaxpr.invars[: reads.n_rows_leaves]]
    values = [*consts, *row_leaves]
    needed = _start_inputs(jaxpr, reads)
    if any(isinstance(val, jax.core.Tracer) for v, val in zip(inputs, values) if v in needed):
        return None
    # what the starts do not depend on (weights, traced parameters) as zeros: all concrete, so
    # the starts are computed now, also while an enclosing jax.jit traces the operator's build
    # on the host (whatever mesh the rows are sharded over: the targets are plain integers)
    values = [np.asarray(val) if v in needed else None for v, val in zip(inputs, values)]
    k = len(consts)
    with _jaxpr.eval_context():
        starts = jax.jit(jax.vmap(lambda c, r: _starts_of_row(jaxpr, reads, c, r), (None, 0)))(values[:k], values[k:])
    cols = []
    for s, leaf, size in zip(starts, reads.leaves, reads.sizes):
        hi = x_sizes[leaf] - size
        cols.append(np.clip(np.asarray(s).astype(np.int64), 0, hi))
    return np.stack(cols, axis=1)


def _chunk_bounds(n: int, chunk: int) -> np.ndarray:
    """Where each chunk of the plan for ``n`` rows in chunks of ``chunk`` begins."""
    plan = make_plan(n, chunk)
    return np.arange(plan.n_full + (1 if plan.rem else 0), dtype=np.int64) * plan.chunk


def window_sizes(targets: np.ndarray, reads: Reads, x_sizes: tuple, chunk: int, shards: int = 1) -> tuple:
    """The window of each ``x`` leaf (rows; 0 for a leaf not read) that holds every chunk's reads,
    for sorted ``targets`` cut by the chunk plan (per shard of ``n / shards`` rows)."""
    n = targets.shape[0] // shards
    bounds = _chunk_bounds(n, chunk)
    out = [0] * len(x_sizes)
    for leaf in reads.read_leaves:
        cols = [j for j, lf in enumerate(reads.leaves) if lf == leaf]
        lo = targets[:, cols].min(axis=1)
        hi = (targets[:, cols] + np.asarray(reads.sizes)[cols]).max(axis=1)
        span = 0
        for s in range(shards):
            part = slice(s * n, (s + 1) * n)
            if n:
                span = max(
                    span, int((np.maximum.reduceat(hi[part], bounds) - np.minimum.reduceat(lo[part], bounds)).max())
                )
        span = -(-max(span, 1) // 8) * 8  # a multiple of 8 rows (one TPU tile)
        out[leaf] = min(span, x_sizes[leaf])
    return tuple(out)


def platform() -> Platform:
    """What was measured on the default backend's platform (:data:`PLATFORMS`; none: no windows)."""
    return PLATFORMS.get(jax.default_backend(), Platform(windows=False))


def read_bytes(reads: Reads, x_leaves: tuple) -> int:
    """The bytes of the leaves of ``x`` that ``row_fn`` reads (each once)."""
    return sum(int(np.prod(x_leaves[i].shape)) * np.dtype(x_leaves[i].dtype).itemsize for i in set(reads.leaves))


def worth_sorting(reads: Reads, x_leaves: tuple, n_rows: int) -> bool:
    """Whether ``layout="auto"`` sorts the ``n_rows`` rows at all on this platform (before the
    windows are known, :func:`use_windows`): it reads windows, and ``x``'s leaves read are not
    below its ``min_x_bytes`` or the rows not below its ``min_rows``."""
    measured = platform()
    small = read_bytes(reads, x_leaves) < measured.min_x_bytes
    few = measured.min_rows is None or n_rows < measured.min_rows
    return measured.windows and not (small and few)


def use_windows(layout: str, windows: tuple, x_leaves: tuple, chunk: int) -> bool:
    """Whether ``layout`` keeps the windowed layout at these windows and chunk: forced
    (``"windowed"``), or (``"auto"``) some window is smaller than its leaf of ``x`` (one as large
    as ``x`` reads all of it per chunk) and they are within the platform's measured bound."""
    if layout == "windowed":
        return True
    measured = platform()
    if not any(0 < w < s.shape[0] for w, s in zip(windows, x_leaves)):
        return False
    unaligned = measured.unaligned and any(
        w and len(s.shape) > 1 and s.shape[-1] % measured.unaligned for w, s in zip(windows, x_leaves)
    )
    bound = measured.max_window_per_row
    return bool(unaligned) or bound is None or sum(windows) <= bound * chunk


def preferred_chunk(windows_at: Callable, chunk: int) -> int:
    """``chunk``, or, where the platform reads small windows by a one-hot product
    (:data:`PLATFORMS`), the largest of ``chunk / 2**k`` (at least :data:`MIN_ONEHOT_CHUNK`)
    whose windows are that small: the product's cost grows with chunk times window."""
    limit = platform().onehot_max
    if not limit or max(windows_at(chunk)) <= limit:
        return chunk
    c = chunk
    while c // 2 >= MIN_ONEHOT_CHUNK:
        c //= 2
        if max(windows_at(c)) <= limit:
            return c
    return chunk


def digest(targets: np.ndarray) -> str:
    """A key for plans made on these sorted targets (the windows at every chunk depend on them)."""
    return hashlib.blake2b(np.ascontiguousarray(targets).tobytes(), digest_size=16).hexdigest()


class RowLayout(eqx.Module):
    """The permutation between the user's rows and the sorted rows the kernels run on.

    Attributes:
        order: ``order[k]`` is the user's index of sorted row ``k`` (int32), or None when the
            rows were already sorted (no permutation).
        inverse: ``inverse[order[k]] == k``, or None.
    """

    order: Any = None
    inverse: Any = None

    def to_user(self, tree: Any) -> Any:
        """Row-space values of the sorted rows (leading axis), in the user's order."""
        if self.order is None:
            return tree
        return _tu.tree_map(lambda v: permute(v, self.order, self.inverse), tree)

    def to_sorted(self, tree: Any) -> Any:
        """Row-space values in the user's order, in the sorted rows' order."""
        if self.order is None:
            return tree
        return _tu.tree_map(lambda v: permute(v, self.inverse, self.order), tree)


def build(targets: np.ndarray, shards: int = 1) -> tuple[RowLayout, np.ndarray]:
    """The layout of rows with these ``targets`` (``(n_rows, reads)``): a stable sort by the
    first read's target, within each of ``shards`` equal shards of the rows (indices local to a
    shard); and the targets in sorted order."""
    n = targets.shape[0] // shards
    key = targets[:, 0].reshape(shards, n)
    if np.all(key[:, 1:] >= key[:, :-1]):
        return RowLayout(), targets
    order = np.argsort(key, axis=1, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    np.put_along_axis(inverse, order, np.arange(n, dtype=np.int32)[None, :], axis=1)
    sorted_targets = np.take_along_axis(targets.reshape(shards, n, -1), order[..., None].astype(np.int64), axis=1)
    return RowLayout(order.reshape(-1), inverse.reshape(-1)), sorted_targets.reshape(targets.shape)


def placed(order: np.ndarray, rows: Any) -> jax.Array:
    """``order`` (an integer array along the rows) as a JAX array placed like the rows: sharded
    along its axis as the first row leaf is along the rows, when that leaf is a sharded array."""
    leaf = _tu.tree_leaves(rows)[0]
    sharding = getattr(leaf, "sharding", None)
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)
        and isinstance(sharding, jax.sharding.NamedSharding)
    ):
        spec = tuple(sharding.spec)[:1]
        return jax.device_put(order, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec)))
    return jnp.asarray(order)


# -- the permutation of row-space vectors -------------------------------------------------------


def permute(v: jax.Array, dest: jax.Array, src: jax.Array) -> jax.Array:
    """``v``'s leading axis permuted: element ``j`` goes to ``dest[j]`` (so element ``k`` of the
    result is ``v[src[k]]``, ``src`` the inverse of ``dest``).

    One primitive (``chunkop_permute``) with its rules in JAX's tables: linear in ``v``, its
    transpose the inverse permutation (``permute(ct, src, dest)``), its tangent the same
    permutation, batched along any axis of ``v``. How it runs is chosen per platform when the
    program is lowered (:func:`_permute_by`): on a TPU a vector is sorted by ``dest``
    (``lax.sort_key_val``: 54M scalars in 223 ms on a v5e, where a scatter took 465 ms and a
    gather 671 ms; ``benchmarks/results/tpu/permute_tpu_54000000.md``); elsewhere, and for rows
    of more than one value, a scatter with unique indices. Exact either way (a permutation).

    Example:
        >>> dest = jnp.array([2, 0, 1]); src = jnp.array([1, 2, 0])
        >>> permute(jnp.array([10.0, 20.0, 30.0]), dest, src).tolist()
        [20.0, 30.0, 10.0]
    """
    return _permute_p.bind(v, dest, src)


def _by_scatter(v: jax.Array, dest: jax.Array, src: jax.Array) -> jax.Array:
    return jnp.zeros_like(v).at[dest].set(v, unique_indices=True, mode="promise_in_bounds")


def _by_sort(v: jax.Array, dest: jax.Array, src: jax.Array) -> jax.Array:
    return jax.lax.sort_key_val(dest, v)[1]


def _permute_by(v: jax.Array, dest: jax.Array, src: jax.Array) -> jax.Array:
    """The permutation as the platform runs it fastest (measured: :func:`permute`)."""
    if v.ndim != 1:
        return _by_scatter(v, dest, src)
    return jax.lax.platform_dependent(v, dest, src, tpu=_by_sort, default=_by_scatter)


def _permute_jvp(primals: tuple, tangents: tuple) -> tuple:
    v, dest, src = primals
    dv = tangents[0]
    out = permute(v, dest, src)
    return out, dv if _jaxpr.is_symbolic_zero(dv) else permute(dv, dest, src)


def _permute_transpose(ct: Any, v: Any, dest: jax.Array, src: jax.Array) -> list:
    if _jaxpr.is_symbolic_zero(ct):
        return [None, None, None]
    return [permute(ct, src, dest), None, None]


def _permute_batch(args: tuple, dims: tuple) -> tuple:
    v, dest, src = args
    bv, bd, bs = dims
    if bd is None and bs is None:  # one permutation of the leading axis, the batch beside it
        v = jnp.moveaxis(v, bv, 1)
        return permute(v, dest, src), 1
    return jax.vmap(_permute_by, in_axes=dims)(v, dest, src), 0


_permute_p = _jaxpr.define_primitive(
    "chunkop_permute",
    impl=jax.jit(_permute_by),
    abstract_eval=lambda v, dest, src: v,
    lowering=_jaxpr.lower_fun(_permute_by, multiple_results=False),
    jvp=_permute_jvp,
    transpose=_permute_transpose,
    batch=_permute_batch,
)


# -- reading a window ----------------------------------------------------------------------------


def _take(win: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.take(win, rows, axis=0, mode="clip")


def _onehot(win: jax.Array, rows: jax.Array) -> jax.Array:
    """The rows of ``win`` at ``rows`` as a one-hot matrix product (full float32 precision)."""
    picks = (rows[:, None] == jnp.arange(win.shape[0], dtype=rows.dtype)[None, :]).astype(win.dtype)
    flat = win.reshape(win.shape[0], -1)
    out = jnp.matmul(picks, flat, precision=jax.lax.Precision.HIGHEST, preferred_element_type=flat.dtype)
    return out.reshape(rows.shape + win.shape[1:])


def read_window(win: jax.Array, local: jax.Array, size: int) -> jax.Array:
    """``size`` rows of the window ``win`` from row ``local`` (in range): what the read of ``x``
    gives. On a TPU by a one-hot product for windows of at most ``PLATFORMS["tpu"].onehot_max``
    rows, elsewhere (and for larger windows) by a gather (:data:`PLATFORMS`)."""
    rows = local + jnp.arange(size, dtype=jnp.int32)
    if win.shape[0] > PLATFORMS["tpu"].onehot_max:
        return _take(win, rows)
    return jax.lax.platform_dependent(win, rows, tpu=_onehot, default=_take)


def window_starts(jaxpr: Any, reads: Reads, windows: tuple, x_sizes: tuple, consts: list, rows_c: Any) -> list:
    """Each read leaf's window start for one chunk of sorted rows: the chunk's smallest target
    (clamped so the window fits in ``x``), computed from the rows as ``row_fn`` computes them."""
    starts = jax.vmap(lambda r: _starts_of_row(jaxpr, reads, consts, r))(_tu.tree_leaves(rows_c))
    out = []
    for leaf in reads.read_leaves:
        lows = [
            jnp.min(clamped_start(s, x_sizes[leaf] - size))
            for s, lf, size in zip(starts, reads.leaves, reads.sizes)
            if lf == leaf
        ]
        out.append(jnp.minimum(jnp.min(jnp.stack(lows)), x_sizes[leaf] - windows[leaf]))
    return out
