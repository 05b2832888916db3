"""``chunkop.check_linear`` on float32 operators whose pairings cancel (issue #26, finding 5).

For random vectors the adjoint test's pairings ``<A x, y>`` and ``<x, A^T y>`` are sums of
terms of random sign: they cancel by ``kappa = sum |terms| / |sum|`` (about ``sqrt(n_rows)``,
and far more for an unlucky draw), while rounding grows with ``sum |terms|``. A CT-like
projector (parallel rays through a grid, bilinear samples, those outside the grid masked) and
a differential one (each row the difference of two rays 2e-3 pixel apart, as in differential
phase-contrast CT: its rows cancel internally, so ``A x`` and ``A^T y`` carry float32 rounding
of ~1e-5) are correct float32 operators; the tolerance scales with ``kappa`` so they pass, and
the message names float32 rounding and ``rtol=`` when that is what a failure looks like. The
wrong transposes (antilinear ``row_fn``\\s, out-of-range indices, a projector that reads past
the grid) still fail; the non-linear ``row_fn``\\s are in ``test_operator_errors.py``'s table,
a wrong subclass kernel in ``test_operator_abstract.py``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import eps
from operator_registry import NPIX, ROWS, K, los_weights, make_square

import chunkop
from chunkop._operator.checks import _adjoint_tolerance, _passing_rtol, _random_like, default_rtol

G, N_ANGLES, N_DET, N_SAMPLES = 32, 45, 32, 64  # 1440 rays of 64 samples through a 32 x 32 grid


def parallel_beam(h: float | None = None, *, mask: bool = True, chunk: int = 512) -> chunkop.RowOperator:
    """A parallel-beam projector on a ``G x G`` grid (pixel units, pixel ``(i, j)`` at ``(i, j)``).

    The rows hold each ray's start (relative to the grid centre, computed in float64) and
    direction; ``row_fn`` sums bilinear samples along it. ``mask``: samples' corners outside the
    grid get weight 0 (else they are read past the edge: clamped by the gather, dropped by the
    transpose). ``h``: each row is instead ``(ray(s + h/2) - ray(s - h/2)) / h``, the derivative
    across the ray by a centred difference.
    """
    theta, s = np.meshgrid(
        np.linspace(0.0, np.pi, N_ANGLES, endpoint=False),
        (np.arange(N_DET) - (N_DET - 1) / 2) * G / N_DET,
        indexing="ij",
    )
    direction = np.stack([np.cos(theta), np.sin(theta)], -1).reshape(-1, 2)
    normal = np.stack([-np.sin(theta), np.cos(theta)], -1).reshape(-1, 2)
    length = G * np.sqrt(2.0)
    rows = {
        "start": jnp.asarray(s.reshape(-1, 1) * normal - length / 2 * direction, jnp.float32),
        "direction": jnp.asarray(direction, jnp.float32),
        "normal": jnp.asarray(normal, jnp.float32),
    }
    step, centre = length / N_SAMPLES, (G - 1) / 2

    def ray(points: jax.Array, x: jax.Array) -> jax.Array:
        corner = jnp.floor(points).astype(jnp.int32)
        frac = points - corner
        total = jnp.zeros((), x.dtype)
        for di in (0, 1):
            for dj in (0, 1):
                i, j = corner[:, 0] + di, corner[:, 1] + dj
                w = (frac[:, 0] if di else 1 - frac[:, 0]) * (frac[:, 1] if dj else 1 - frac[:, 1])
                if mask:
                    w = jnp.where((i >= 0) & (i < G) & (j >= 0) & (j < G), w, 0.0)
                    i, j = jnp.clip(i, 0, G - 1), jnp.clip(j, 0, G - 1)
                total = total + jnp.sum(w * x[i, j])
        return step * total

    def row_fn(r: dict, x: jax.Array) -> jax.Array:
        t = (jnp.arange(N_SAMPLES, dtype=jnp.float32) + 0.5) * step
        points = r["start"] + t[:, None] * r["direction"] + centre
        if h is None:
            return ray(points, x)
        return (ray(points + 0.5 * h * r["normal"], x) - ray(points - 0.5 * h * r["normal"], x)) / h

    return chunkop.RowOperator(row_fn, rows, jax.ShapeDtypeStruct((G, G), jnp.float32), chunk_size=chunk)


@pytest.fixture(scope="module")
def projector() -> chunkop.RowOperator:
    return parallel_beam()


@pytest.fixture(scope="module")
def differential() -> chunkop.RowOperator:
    return parallel_beam(h=2e-3)


def pairings(A: chunkop.RowOperator, key: jax.Array) -> tuple[float, float]:
    """The adjoint test's relative error and cancellation on ``check_linear``'s own vectors."""
    k1, _, k3 = jax.random.split(key, 3)
    x, y = _random_like(k1, A.in_structure()), _random_like(k3, A.out_structure())
    p, q = A.mv(x) * y, x * A.T.mv(y)
    lhs, rhs = float(jnp.sum(p)), float(jnp.sum(q))
    cancellation = float(jnp.sum(jnp.abs(p)) + jnp.sum(jnp.abs(q))) / (abs(lhs) + abs(rhs))
    return abs(lhs - rhs) / (abs(lhs) + abs(rhs)), cancellation


def test_ct_projector_with_heavy_cancellation_passes(projector):
    rtol = default_rtol(jnp.float32)
    cancellations = []
    for k in range(4):
        errors = chunkop.check_linear(projector, key=jax.random.key(k))
        relative, cancellation = pairings(projector, jax.random.key(k))
        cancellations.append(cancellation)
        assert errors["adjoint"] == pytest.approx(relative, rel=0.5, abs=eps(np.float32)), (errors, relative)
        assert errors["adjoint"] <= _adjoint_tolerance(rtol, cancellation)
        assert max(errors["zero"], errors["superposition"], errors["matvec"]) <= rtol
    assert max(cancellations) > 50, cancellations  # heavy: ~sqrt(1440 rays) and beyond


def test_float32_rounding_of_a_differential_projector_passes(differential):
    """The default key's pairings cancel ~770-fold; the rows' own cancellation puts ~1e-5 of
    rounding in ``A x`` and ``A^T y``: the relative error exceeds the unscaled float32 tolerance
    (which failed this correct operator) but is rounding, ~20 eps of the terms' absolute sum."""
    rtol = default_rtol(jnp.float32)
    relative, cancellation = pairings(differential, jax.random.key(0))
    assert relative > 2 * rtol and cancellation > 100, (relative, cancellation)
    assert relative / cancellation < 1000 * eps(np.float32)
    errors = chunkop.check_linear(differential)
    assert errors["adjoint"] == pytest.approx(relative, rel=0.5)
    assert errors["superposition"] < rtol / 2  # the rows' rounding, within the tolerance


def test_failure_from_rounding_names_float32_and_rtol(differential):
    """An unlucky draw: key 591's pairings cancel ~5e4-fold (found by scanning 4000 keys in
    float64 on the dense matrix; typical is ~40), so the differential projector's ~30 eps of
    rounding is a relative error of ~0.2, past the 1% the tolerance grows to. The message says
    it is float32 rounding and gives another key or an ``rtol=`` that passes."""
    key = jax.random.key(591)
    relative, cancellation = pairings(differential, key)
    assert cancellation > 1e4 and relative / cancellation < 1000 * eps(np.float32), (relative, cancellation)
    with pytest.raises(
        ValueError, match=r"Likely float32 rounding, not a bug.*try another key=, or pass rtol="
    ) as info:
        chunkop.check_linear(differential, key=key)
    message = str(info.value)
    assert "sum|terms|/|sum|" in message and "float64" in message
    suggested = float(re.search(r"pass rtol=([0-9.e+-]+) ", message).group(1))
    chunkop.check_linear(differential, key=key, rtol=suggested)
    chunkop.check_linear(differential, key=jax.random.key(592))  # another key


@pytest.mark.parametrize("error, cancellation", [(3e-4, 20.0), (5e-3, 1e3), (0.2, 5e4), (1e-6, 1.0)])
def test_suggested_rtol_passes(error, cancellation):
    suggested = _passing_rtol(error, cancellation)
    assert _adjoint_tolerance(suggested, cancellation) >= error
    assert _adjoint_tolerance(suggested / 2.2, cancellation) < error  # about twice the least


def test_tolerance_grows_with_cancellation_to_one_percent_in_float32_and_not_in_bfloat16():
    f32, bf16 = default_rtol(jnp.float32), default_rtol(jnp.bfloat16)
    assert _adjoint_tolerance(f32, 1.0) == f32
    assert _adjoint_tolerance(f32, 10.0) == pytest.approx(10 * f32)
    assert _adjoint_tolerance(f32, 1e4) == 0.01
    # bfloat16's sqrt(eps) already exceeds 1%: no growth, so its adjoint test keeps its reach
    assert _adjoint_tolerance(bf16, 100.0) == bf16


# -- what must still fail -------------------------------------------------------------------------

COMPLEX = jax.ShapeDtypeStruct((NPIX, K), jnp.complex64)


@pytest.mark.parametrize(
    "row_fn",
    [
        lambda r, x: jnp.dot(los_weights(r) * (1 + 0.5j), jnp.conj(x[r["idx"]])),
        lambda r, x: jnp.dot(los_weights(r), jnp.real(x[r["idx"]])).astype(jnp.complex64),
    ],
    ids=["conj", "real_part"],
)
def test_antilinear_row_fn_fails(row_fn):
    """Real-linear but not complex-linear: superposition (real coefficients) passes, the
    adjoint pairing does not, and the message names it."""
    A = chunkop.RowOperator(row_fn, ROWS, COMPLEX, chunk_size=4)
    with pytest.raises(ValueError, match=r"<A x, y>.*not complex-linear in the complex x \(conj\(x\)"):
        chunkop.check_linear(A)


def test_out_of_range_indices_on_a_share_of_the_rows_fail():
    """40 of 2000 rows gather past the end (the pairings cancel ~24-fold: the tolerance grows
    to ~3e-3, the error is 0.04)."""
    B = make_square(2000, 128).op()
    rows = dict(B.rows, i=B.rows["i"].at[:40, 1].add(2000))
    A = chunkop.RowOperator(B.row_fn, rows, B.in_structure(), chunk_size=128)
    with pytest.raises(ValueError, match=r"A likely cause: gather indices out of range.*clamps them"):
        chunkop.check_linear(A)


def test_projector_reading_past_the_grid_fails():
    """Without the mask, the samples' corners past the grid's last row or column are clamped by
    the gather and dropped by the transpose."""
    with pytest.raises(ValueError, match=r"<A x, y>.*gather indices out of range"):
        chunkop.check_linear(parallel_beam(mask=False))
