"""The registry of ``RowOperator`` test problems, as lineax's tests keep one for its operators.

``make_operators`` lists factories; each returns a :class:`Case`, from which a test gets the
chunked operator and the references it compares with. Every generic operator test runs over
the whole list::

    @pytest.mark.parametrize("make_operator", make_operators, ids=OPERATOR_IDS)
    def test_something(make_operator):
        case = make_operator()
        A, x, y, M = case.op(), case.x(), case.y(), case.dense()

A case's row function ``make_row_fn(p)`` and rows ``make_rows(p)`` depend on a parameter ``p``
(a pytree of float arrays) that enters through the rows, through the row function's closure,
or both, so that derivatives w.r.t. ``p`` test both routes. The references are ``jax.vmap`` of
the row function (``ref_mv``), its ``jax.linear_transpose`` (``ref_T``) and the dense matrix
(``dense``, in ``ravel_pytree`` order).

The default chunks are chosen so that the list runs every chunk plan of ``_chunking.make_plan``:
a scan of full chunks and a remainder, a scan of equal chunks (the chunk divides ``n_rows``),
and a single chunk (the chunk is ``n_rows`` or more; no scan).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import chunkop

NPIX, K, N = 7, 4, 10
CHUNK = 4  # two full chunks and a remainder of 2


@functools.lru_cache
def edges(k: int = K) -> jax.Array:
    """The ``k + 1`` distance-bin edges ``geomspace(40, 1700)``: a concrete array, also when first
    asked for inside a trace (a constant of the program, not ops to compile)."""
    with jax.ensure_compile_time_eval():
        return jnp.geomspace(40.0, 1700.0, k + 1).astype(jnp.float32)


BOUNDS = edges(K)


def los_weights(r: dict, bounds: jax.Array = BOUNDS) -> jax.Array:
    """Extinction-like weights of one line of sight: differences of a profile at the bin edges."""
    bounds = bounds.astype(r["d"].dtype)
    return -jnp.diff(jnp.exp(-(r["d"] - bounds) / (r["d"] * r["s"] * bounds)))


def los_row(r: dict, x: jax.Array) -> jax.Array:
    """The canonical row: the weighted distance bins (``x.shape[-1]`` of them) of pixel ``idx``."""
    bounds = edges(x.shape[-1])
    return jnp.dot(los_weights(r, bounds), x[r["idx"]])


def make_los_rows(n: int = N, npix: int = NPIX, seed: int = 0, dtype: Any = np.float32) -> dict:
    """Line-of-sight rows: pixel index, distance ``d``, uncertainty ``s``."""
    rng = np.random.default_rng(seed)
    return {
        "idx": jnp.asarray(rng.integers(0, npix, n), dtype=jnp.int32),
        "d": jnp.asarray(rng.uniform(200.0, 1500.0, n), dtype=dtype),
        "s": jnp.asarray(rng.uniform(0.01, 0.05, n), dtype=dtype),
    }


def rand(*shape: int, seed: int = 0, dtype: Any = np.float32) -> jax.Array:
    """Standard normal values (complex for a complex ``dtype``)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.complexfloating):
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), dtype=dtype)
    return jnp.asarray(rng.normal(size=shape), dtype=dtype)


def rand_like(structure: Any, seed: int) -> Any:
    """:func:`rand` values in the shapes and dtypes of a pytree of arrays or structures."""
    leaves, tree = jax.tree_util.tree_flatten(structure)
    return jax.tree_util.tree_unflatten(
        tree, [rand(*s.shape, seed=seed + i, dtype=s.dtype) for i, s in enumerate(leaves)]
    )


def dense_matrix(row_fn: Callable, rows: Any, in_structure: Any) -> jax.Array:
    """The matrix of ``x -> jax.vmap(row_fn, (0, None))(rows, x)``, in ``ravel_pytree`` order
    (outputs rows, inputs columns), from its images of the basis vectors.

    Not jitted: called eagerly, its operations are compiled once per shape and reused by every
    later call (a jitted version would compile afresh for each new ``row_fn``); inside a test's
    own ``jax.jit`` it is traced into that program."""
    flat, unravel = ravel_pytree(jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), in_structure))
    image = lambda e: ravel_pytree(jax.vmap(row_fn, (0, None))(rows, unravel(e)))[0]
    return jax.vmap(image)(jnp.eye(flat.size, dtype=flat.dtype)).T


def longest_sum(matrix: Any) -> int:
    """The longest sum in ``matrix @ x`` or ``matrix.T @ y``: the most nonzeros in a row or a
    column (what a chunked product and its reference may order differently: the ``n_terms``
    of ``conftest.assert_tree_allclose``)."""
    nonzero = np.asarray(matrix) != 0
    return int(max(nonzero.sum(0).max(initial=1), nonzero.sum(1).max(initial=1)))


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """A test problem: ``make_row_fn(p)`` is the row function, ``make_rows(p)`` the rows."""

    name: str
    make_row_fn: Callable[[Any], Callable]
    make_rows: Callable[[Any], Any]
    in_structure: Any
    p: Any  # the parameter's value
    chunk: int = CHUNK
    options: dict = dataclasses.field(default_factory=dict)  # more RowOperator arguments

    @property
    def row_fn(self) -> Callable:
        return self.make_row_fn(self.p)

    @property
    def rows(self) -> Any:
        return self.make_rows(self.p)

    def op(self, p: Any = None, *, chunk: int | None = None, rows: Any = None, **kw: Any) -> chunkop.RowOperator:
        """The chunked operator at parameter ``p`` (the case's own by default); ``rows``, when
        given, replace ``make_rows(p)`` (e.g. abstract or batched rows)."""
        p = self.p if p is None else p
        rows = self.make_rows(p) if rows is None else rows
        return chunkop.RowOperator(
            self.make_row_fn(p),
            rows,
            self.in_structure,
            chunk_size=self.chunk if chunk is None else chunk,
            **{**self.options, **kw},
        )

    def ref_mv(self, x: Any, p: Any = None, *, rows: Any = None) -> Any:
        """The unchunked reference of ``A.mv``: ``jax.vmap`` of the row function."""
        p = self.p if p is None else p
        rows = self.make_rows(p) if rows is None else rows
        return jax.vmap(self.make_row_fn(p), (0, None))(rows, x)

    def ref_T(self, y: Any, p: Any = None, *, rows: Any = None) -> Any:
        """The unchunked reference of ``A.T.mv``: ``jax.linear_transpose`` of :meth:`ref_mv`."""
        return jax.linear_transpose(lambda v: self.ref_mv(v, p, rows=rows), self.in_structure)(y)[0]

    def out_structure(self) -> Any:
        return jax.eval_shape(self.ref_mv, self.in_structure)

    def x(self, seed: int = 1) -> Any:
        """An example input vector."""
        return rand_like(self.in_structure, seed)

    def y(self, seed: int = 2) -> Any:
        """An example output-space vector (the input of ``A.T.mv``)."""
        return rand_like(self.out_structure(), seed)

    def dense(self, p: Any = None) -> jax.Array:
        """The reference matrix (see :func:`dense_matrix`)."""
        p = self.p if p is None else p
        return dense_matrix(self.make_row_fn(p), self.make_rows(p), self.in_structure)


STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)
ROWS = make_los_rows()


# -- the factories ------------------------------------------------------------------------------


def make_los(n: int = N, npix: int = NPIX, k: int = K, chunk: int = CHUNK, seed: int = 0, dtype: Any = np.float32):
    """The canonical line-of-sight problem; ``p`` (the distances and scales) enters through the rows.

    Any size (``tests/test_memory_operator.py`` compiles it at 262144 rows on a 20000 x 256 sky).
    """
    rows = make_los_rows(n, npix, seed, dtype)
    return Case(
        "los",
        lambda p: los_row,
        lambda p: {"idx": rows["idx"], "d": p["d"], "s": p["s"]},
        jax.ShapeDtypeStruct((npix, k), dtype),
        {"d": rows["d"], "s": rows["s"]},
        chunk,
    )


def make_well_conditioned(n: int = 60, npix: int = 5, k: int = 3, chunk: int = 9, seed: int = 0):
    """A least-squares problem for the solvers: each row's weights times a random O(1) gain per
    bin, so that rows through the same pixel are not nearly parallel (condition number < 100) and
    the matrix is O(1) (lineax's CG declares a breakdown when the operator's scale is tiny).
    ``p``: every float leaf of the rows. 60 rows in chunks of 9: 6 full chunks and a remainder."""
    rows = make_los_rows(n, npix, seed)
    rng = np.random.default_rng(seed)
    rng.integers(0, npix, n), rng.uniform(size=n), rng.uniform(size=n)  # skip make_los_rows' draws
    gain = jnp.asarray(rng.normal(size=(n, k)) * 5.0, dtype=jnp.float32)
    bounds = edges(k)

    def row_fn(r, x):
        return jnp.dot(los_weights(r, bounds) * r["g"], x[r["idx"]])

    return Case(
        "well_conditioned",
        lambda p: row_fn,
        lambda p: {"idx": rows["idx"], **p},
        jax.ShapeDtypeStruct((npix, k), jnp.float32),
        {"d": rows["d"], "s": rows["s"], "g": gain},
        chunk,
    )


def well_conditioned_squared_row_fn(r, x):
    """``x -> row_fn(r, x) `` with the weights squared: ``gram_diagonal``'s fast path."""
    return jnp.dot((los_weights(r, edges(x.shape[-1])) * r["g"]) ** 2, x[r["idx"]])


PSTRUCT = {"a": STRUCT, "b": jax.ShapeDtypeStruct((NPIX,), jnp.float32)}


def make_pytree():
    """Pytree input, pytree output of mixed per-row shapes (a scalar, a vector, a ``K x K``
    matrix); ``p`` enters through the rows (``w``, non-linearly) and the closure (``c``).
    Chunks of 5 divide the 10 rows."""
    w = rand(N, K, seed=30)

    def make_row_fn(p):
        def row_fn(r, x):
            xa = x["a"][r["idx"]]
            return {
                "p": jnp.dot(jnp.tanh(r["w"]) * los_weights(r), xa) + p["c"] * x["b"][r["idx"]],
                "q": jnp.stack([r["s"] * x["b"][0], jnp.sum(xa), p["c"] ** 2 * xa[1]]),
                "r": r["w"][:, None] * xa[None, :],
            }

        return row_fn

    return Case("pytree", make_row_fn, lambda p: {**ROWS, "w": p["w"]}, PSTRUCT, {"w": w, "c": jnp.float32(0.7)}, 5)


def make_vector_out():
    """A ``(3,)`` output per row, one entry reading the same input element for every row (a full
    column of the matrix); ``p`` enters through the rows. Chunks of 3: a remainder of 1."""

    def row_fn(r, x):
        xa = x[r["idx"]]
        return jnp.stack([jnp.dot(r["w"], xa), r["v"] * xa[0], jnp.sum(xa) - x[0, 1]])

    rows = {"idx": ROWS["idx"], "w": rand(N, K, seed=3)}
    return Case("vector_out", lambda p: row_fn, lambda p: {**rows, "v": p["v"]}, STRUCT, {"v": rand(N, seed=4)}, 3)


def make_complex():
    """A complex input and complex weights (their phase closed over)."""

    def make_row_fn(p):
        def row_fn(r, x):
            return jnp.dot(los_weights(r) * jnp.exp(1j * p["phase"]), x[r["idx"]])

        return row_fn

    struct = jax.ShapeDtypeStruct((NPIX, K), jnp.complex64)
    return Case("complex", make_row_fn, lambda p: ROWS, struct, {"phase": jnp.linspace(0.0, 1.0, K, dtype=jnp.float32)})


def make_complex_out():
    """A real input and complex outputs: ``as_matrix`` is the complex coefficient matrix. The
    rows are a single array (the phases, ``p``). Chunks of 16 >= 10 rows: one chunk."""
    row_fn = lambda ph, x: jnp.exp(1j * ph) * jnp.sum(x[1]) + ph * x[2, 0]
    return Case("complex_out", lambda p: row_fn, lambda p: p, STRUCT, rand(N, seed=10), 16)


def make_closed_arrays():
    """Closes over arrays: a per-pixel gain (indexed per row) and the bin edges."""

    def make_row_fn(p):
        def row_fn(r, x):
            return p["gain"][r["idx"]] * jnp.dot(los_weights(r, p["bounds"]), x[r["idx"]])

        return row_fn

    gain = jnp.linspace(0.5, 2.0, NPIX, dtype=jnp.float32)
    return Case("closed_arrays", make_row_fn, lambda p: ROWS, STRUCT, {"gain": gain, "bounds": BOUNDS})


def make_closed_scalar():
    """Closes over a scalar (a tracer when differentiated), used non-linearly. Chunks of 3."""

    def make_row_fn(p):
        scale = p["scale"]
        return lambda r, x: scale * los_row(r, x) + scale**2 * x[r["idx"], 0]

    return Case("closed_scalar", make_row_fn, lambda p: ROWS, STRUCT, {"scale": jnp.float32(1.5)}, 3)


def make_int_rows():
    """Int-only rows: every float comes from the closure. Chunks of 3."""

    def make_row_fn(p):
        return lambda r, x: p["w"][r["k"]] * x[r["idx"], r["k"]]

    rows = {"idx": ROWS["idx"], "k": jnp.arange(N, dtype=jnp.int32) % K}
    return Case(
        "int_rows", make_row_fn, lambda p: rows, STRUCT, {"w": jnp.asarray([1.0, -2.0, 0.5, 3.0], jnp.float32)}, 3
    )


def make_tuple_rows():
    """Rows as a tuple ``(idx, d, s)`` instead of a dict. Chunks of 5 divide the rows."""
    row_fn = lambda r, x: los_row({"idx": r[0], "d": r[1], "s": r[2]}, x)
    return Case("tuple_rows", lambda p: row_fn, lambda p: (ROWS["idx"], p[0], p[1]), STRUCT, (ROWS["d"], ROWS["s"]), 5)


def make_array_rows():
    """Rows as one ``(n, K)`` array of dense weights, all on pixel 0: the transpose fills one row
    of the sky and zeros elsewhere. One chunk."""
    row_fn = lambda w, x: w @ x[0]
    return Case("array_rows", lambda p: row_fn, lambda p: p, STRUCT, jax.vmap(los_weights)(ROWS), 16)


def make_square(n: int = 6, chunk: int = 4):
    """A square operator on a 1-D input (``n`` rows, ``n`` unknowns), so that it may carry
    symmetric and triangular tags and has a diagonal: each row gathers three random entries and
    adds twice its own; ``p`` (the gather weights) enters through the rows. Any size
    (``lineax.diagonal`` is measured at 8192 rows)."""
    rng = np.random.default_rng(0)
    rows = {"i": jnp.asarray(rng.integers(0, n, (n, 3)), jnp.int32), "r": jnp.arange(n, dtype=jnp.int32)}
    row_fn = lambda r, x: jnp.dot(r["w"], x[r["i"]]) + 2.0 * x[r["r"]]
    w = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    return Case(
        "square", lambda p: row_fn, lambda p: {**rows, "w": p}, jax.ShapeDtypeStruct((n,), jnp.float32), w, chunk
    )


def make_segment():
    """``segment_key="idx"``: ``T.mv`` sums each chunk's rows per target and writes each target
    once. Many rows per target (13 rows on 4 pixels, one a negative index counting from the
    end), an ``x`` of two leaves sharing the indexed axis; ``p`` enters through the rows (``d``,
    ``s``) and the closure (``c``). Chunks of 5: two full chunks and a remainder of 3."""
    rng = np.random.default_rng(7)
    n, npix = 13, 4
    base = make_los_rows(n, npix, seed=7)
    idx = jnp.asarray(np.where(rng.uniform(size=n) < 0.2, -1, rng.integers(0, npix, n)), jnp.int32)

    def make_row_fn(p):
        def row_fn(r, x):
            return jnp.dot(los_weights(r), x["sky"][r["idx"]]) + p["c"] * r["d"] * 1e-3 * x["gain"][r["idx"]]

        return row_fn

    struct = {"sky": jax.ShapeDtypeStruct((npix, K), jnp.float32), "gain": jax.ShapeDtypeStruct((npix,), jnp.float32)}
    return Case(
        "segment",
        make_row_fn,
        lambda p: {"idx": idx, "d": p["d"], "s": p["s"]},
        struct,
        {"d": base["d"], "s": base["s"], "c": jnp.float32(0.8)},
        5,
        {"segment_key": "idx"},
    )


def make_windowed(
    n: int = 53,
    npix: int = 40,
    chunk: int = 8,
    targets: str = "random",
    read: str = "row",
    seed: int = 5,
    k: int = K,
) -> Case:
    """``layout="windowed"``: the rows sorted once by target, each chunk reading one window of
    ``x``. ``n`` lines over a wider sky than their chunks span (53 rows in chunks of 8: six full
    chunks and a remainder of 5), so that the windows are smaller than ``x``, straddle chunks
    and differ per chunk; ``p`` (the distances and scales) enters through the rows. ``targets``:
    ``random``, ``sorted``, ``skewed`` (most rows on two pixels), ``one`` (every row on one
    pixel) or ``out_of_range`` (negative indices counting from the end, and beyond either end,
    which ``x[i]`` clamps). ``read``: ``row`` (``x[i]``), ``slice`` (``x[i:i + 2]`` summed) or
    ``two`` (two reads, ``x[i]`` and ``x[i // 2]``)."""
    rng = np.random.default_rng(seed)
    base = make_los_rows(n, npix, seed)
    idx = {
        "random": lambda: rng.integers(0, npix, n),
        "sorted": lambda: np.sort(rng.integers(0, npix, n)),
        "skewed": lambda: np.where(rng.uniform(size=n) < 0.8, rng.integers(3, 5, n), rng.integers(0, npix, n)),
        "one": lambda: np.full(n, 7),
        "out_of_range": lambda: rng.choice([-1, -3, -npix - 4, npix, npix + 9, 0, 5, 20], n),
    }[targets]()
    idx = jnp.asarray(idx, jnp.int32)

    def row_fn(r, x):
        w = los_weights(r, edges(x.shape[-1]))
        if read == "slice":
            return jnp.dot(w, jax.lax.dynamic_slice_in_dim(x, r["idx"], 2).sum(0))
        if read == "two":
            return jnp.dot(w, x[r["idx"]]) - 0.5 * jnp.dot(w, x[r["idx"] // 2])
        return jnp.dot(w, x[r["idx"]])

    return Case(
        f"windowed_{targets}_{read}",
        lambda p: row_fn,
        lambda p: {"idx": idx, "d": p["d"], "s": p["s"]},
        jax.ShapeDtypeStruct((npix, k), jnp.float32),
        {"d": base["d"], "s": base["s"]},
        chunk,
        {"layout": "windowed"},
    )


def _windowed_twin(make: Callable[[], Case]) -> Callable[[], Case]:
    """``make``'s case with ``layout="windowed"`` forced (on its small sky a window may hold
    every row of ``x``: the kernels still read it as a window)."""

    def twin() -> Case:
        case = make()
        return dataclasses.replace(case, name=f"{case.name}_windowed", options={**case.options, "layout": "windowed"})

    twin.__name__ = f"{make.__name__}_windowed"
    return twin


make_operators: list[Callable[[], Case]] = [
    make_los,
    make_well_conditioned,
    make_pytree,
    make_vector_out,
    make_complex,
    make_complex_out,
    make_closed_arrays,
    make_closed_scalar,
    make_int_rows,
    make_tuple_rows,
    make_array_rows,
    make_square,
    make_segment,
    make_windowed,
    functools.partial(make_windowed, targets="skewed", read="slice"),
    functools.partial(make_windowed, targets="out_of_range", read="two"),
    *(_windowed_twin(m) for m in (make_los, make_well_conditioned, make_complex, make_closed_arrays, make_tuple_rows)),
]
OPERATOR_IDS = [make().name for make in make_operators]
