"""Compiled temp memory of ``RowOperator`` does not grow with ``n_rows x row_length``.

Nothing is executed: each function is lowered on ``jax.ShapeDtypeStruct`` inputs and compiled,
and XLA's ``memory_analysis().temp_size_in_bytes`` is compared between 16384 and 262144 lines of
sight on a ``20000 x 256`` sky in chunks of 4096. Per line, the chunked kernels may only hold
O(1) scalars (the residual, the output before its reshape, and, when the chunk does not divide
``n``, one copy of the rows); the unchunked ``jax.vmap`` reference holds the ``n x K`` weights,
which this test checks too, so that it can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import temp_bytes
from operator_registry import make_los

NPIX, K, CHUNK = 20000, 256, 4096
N_SMALL, N_BIG = 16384, 262144
MiB = 2**20
LOS = make_los(n=1, npix=NPIX, k=K, chunk=CHUNK)  # the registry's line-of-sight operator, at scale
X = LOS.in_structure


def rows_struct(n):
    return jax.eval_shape(lambda: make_los(n=n, npix=NPIX, k=K).rows)  # (nothing is computed)


def vec(n):
    return jax.ShapeDtypeStruct((n,), jnp.float32)


def functions(chunked, chunk=CHUNK):
    def mv(rows, x):
        return LOS.op(rows=rows, chunk=chunk).mv(x) if chunked else LOS.ref_mv(x, rows=rows)

    def rmv(rows, y):
        return LOS.op(rows=rows, chunk=chunk).T.mv(y) if chunked else LOS.ref_T(y, rows=rows)

    def loss(rows, x, b):
        return jnp.sum((mv(rows, x) - b) ** 2)

    def grad_x(rows, x, b):
        return jax.grad(loss, argnums=1)(rows, x, b)

    def grad_s(rows, x, b):
        return jax.grad(lambda s: loss({**rows, "s": s}, x, b))(rows["s"])

    def hvp_x(rows, x, b, v):
        return jax.jvp(lambda x: grad_x(rows, x, b), (x,), (v,))[1]

    def grad_T(rows, y, x):  # a loss through the transpose, w.r.t. y and s
        return jax.grad(lambda y, s: jnp.sum((rmv({**rows, "s": s}, y) - x) ** 2), argnums=(0, 1))(y, rows["s"])

    return {
        "mv": (mv, lambda n: (rows_struct(n), X)),
        "T": (rmv, lambda n: (rows_struct(n), vec(n))),
        "grad_x": (grad_x, lambda n: (rows_struct(n), X, vec(n))),
        "grad_s": (grad_s, lambda n: (rows_struct(n), X, vec(n))),
        "hvp_x": (hvp_x, lambda n: (rows_struct(n), X, vec(n), X)),
        "grad_T": (grad_T, lambda n: (rows_struct(n), vec(n), X)),
    }


NAMES = ["mv", "T", "grad_x", "grad_s", "hvp_x", "grad_T"]


@pytest.mark.parametrize("name", NAMES)
def test_chunked_temp_memory_does_not_grow_with_n_times_k(name):
    fn, args = functions(True)[name]
    small, big = temp_bytes(fn, *args(N_SMALL)), temp_bytes(fn, *args(N_BIG))
    growth = big - small
    per_line = 4 * 4  # a few float32 per line (e.g. the residual); the weights would be K * 4
    assert growth <= (N_BIG - N_SMALL) * per_line + 1 * MiB, (
        f"{name}: temp grew {small / MiB:.2f} -> {big / MiB:.2f} MiB"
    )
    # and it is bounded by a few chunks of weights and x-sized buffers (a cotangent of the sky,
    # for grad_T), nowhere near the unchunked n x K (1 GiB here)
    assert big <= 8 * CHUNK * K * 4 + 2 * NPIX * K * 4 + N_BIG * per_line, f"{name}: {big / MiB:.2f} MiB"


@pytest.mark.parametrize("name", ["mv", "grad_x", "grad_s"])
def test_chunk_not_dividing_n_still_does_not_grow_with_n_times_k(name):
    fn, args = functions(True)[name]
    n_odd = N_BIG + 1000
    growth = temp_bytes(fn, *args(n_odd)) - temp_bytes(fn, *args(N_SMALL))
    # copies of the rows (3 x 4 bytes, sliced off before the reshape into chunks) and of the
    # residual/output (4 bytes) per line: measured ~30 bytes per line; the weights are K * 4 = 1 KiB
    assert growth <= (n_odd - N_SMALL) * 12 * 4 + 1 * MiB, f"{name}: grew {growth / MiB:.2f} MiB"


@pytest.mark.parametrize("name", NAMES)
def test_unchunked_reference_does_grow(name):
    """The measurement can fail: ``jax.vmap`` holds ``n x K`` weights (or gathered sky values)."""
    fn, args = functions(False)[name]
    growth = temp_bytes(fn, *args(N_BIG)) - temp_bytes(fn, *args(N_SMALL))
    assert growth >= (N_BIG - N_SMALL) * K * 4, f"{name}: reference grew only {growth / MiB:.2f} MiB"


def test_temp_memory_scales_with_the_chunk():
    """The chunked temp is a few chunks of weights: doubling the chunk adds at least one chunk."""
    t1 = temp_bytes(functions(True, CHUNK)["grad_s"][0], *functions(True)["grad_s"][1](N_SMALL))
    t2 = temp_bytes(functions(True, 2 * CHUNK)["grad_s"][0], *functions(True)["grad_s"][1](N_SMALL))
    assert t2 - t1 >= CHUNK * K * 4, f"{t1 / MiB:.2f} -> {t2 / MiB:.2f} MiB"
