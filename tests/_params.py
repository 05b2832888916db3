"""Parameter grids: every value, or every pair of values, in the default run; the rest under ``-m slow``.

Most of the suite's time is XLA compiling one program per parameter combination. A grid over
several axes keeps in the default run a small set of combinations that covers every value of every
axis (``strength=1``) or every pair of values of every two axes (``strength=2``, for axes whose
values interact); the other combinations repeat those code paths with other parameters and are
marked ``slow``: ``pytest -m ""`` runs the whole product.

Example:
    >>> rows = grid(["rev", "fwd"], [0, 1, 2], strength=1)
    >>> [p.values for p in rows if not p.marks]
    [('rev', 0), ('rev', 2), ('fwd', 1)]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest


def _covered(row: tuple, strength: int) -> set:
    return {tuple((axis, row[axis]) for axis in axes) for axes in itertools.combinations(range(len(row)), strength)}


def grid(
    *axes: Sequence,
    strength: int = 2,
    keep: Callable[..., bool] | None = None,
    ids: Callable[[object], str] | None = None,
) -> list:
    """``pytest.param`` rows for the product of ``axes``, in product order.

    Args:
        *axes: the values of each parameter (two or more axes).
        strength: 1 to keep every value of every axis in the default run, 2 every pair of values
            of every two axes. The kept rows are chosen greedily (most uncovered values or pairs
            first, the earlier row on ties), so the choice is deterministic.
        keep: ``keep(*values)`` true for rows the default run keeps whatever they cover (e.g.
            every transform at a chunk size that leaves a remainder).
        ids: a function giving a value's id; the row's id joins them with ``-`` (pytest's own ids
            when None).

    Returns:
        One ``pytest.param`` per combination; those the default run does not need are marked
        ``slow``.
    """
    if len(axes) < 2 or not 1 <= strength <= len(axes):
        raise ValueError(f"grid: needs two or more axes and 1 <= strength <= {len(axes)}, got {len(axes)}, {strength}")
    indices = list(itertools.product(*(range(len(a)) for a in axes)))
    covers = {row: _covered(row, strength) for row in indices}
    needed = set().union(*covers.values())
    kept = {row for row in indices if keep is not None and keep(*(axis[i] for axis, i in zip(axes, row)))}
    for row in kept:
        needed -= covers[row]
    while needed:
        best = max(indices, key=lambda row: len(covers[row] & needed))  # the first of equals
        kept.add(best)
        needed -= covers[best]
    params = []
    for row in indices:
        values = tuple(axis[i] for axis, i in zip(axes, row))
        marks = [] if row in kept else [pytest.mark.slow]
        row_id = "-".join(ids(v) for v in values) if ids is not None else None
        params.append(pytest.param(*values, marks=marks, id=row_id))
    return params
