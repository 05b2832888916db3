"""The line-of-sight catalog: the file a user gives ``reconstruct.py --data``.

One ``.npz`` file (``numpy.savez``) with these entries:

==========  ===============  ==========================================================================
entry       shape, dtype     meaning
==========  ===============  ==========================================================================
``pix``     ``(n,)`` int     plane-of-sky pixel of each line, ``pix = ix * ny + iy`` on the ``(nx, ny)``
                             grid (``0 <= ix < nx``, ``0 <= iy < ny``)
``d``       ``(n,)`` float   distance of the line's source, pc (``> 0``)
``s``       ``(n,)`` float   the distance uncertainty of the line's source (``> 0``); its meaning
                             depends on the response (below)
``y``       ``(n,)`` float   the measured line-of-sight integral (finite)
``sigma``   ``(n,)`` float   the Gaussian noise standard deviation of ``y`` (``> 0``)
``nx``      scalar int       plane-of-sky grid size along x (``>= 1``)
``ny``      scalar int       plane-of-sky grid size along y (``>= 1``)
``edges``   ``(n_bins + 1,)``  radial bin edges in pc, positive and strictly increasing
==========  ===============  ==========================================================================

Optional: ``name`` (a string) and ``response`` (a string, ``"standard"`` or ``"seed"``: the response the
``y`` were measured through; ``reconstruct.py --response`` must agree with it; absent: ``"standard"``,
or ``--response``'s value). Nothing else is read: the reconstruction sees only these arrays.

What ``s`` means under each response (``los.py``):

* ``"standard"`` (the published 3-D dust maps'): ``s`` is the standard deviation, in pc, of the source's
  distance, taken as lognormal with median ``d`` and log-sd ``s / d``; the line measures
  ``y = sum_k sky[pix, k] (b_{k+1} - b_k) S(sqrt(b_k b_{k+1}))`` with ``S(r) = erfc((ln r - ln d) /
  (sqrt(2) s / d)) / 2``, the density integrated up to the source averaged over its distance;
* ``"seed"`` (the users' first formula): ``s`` is the parameter of ``w = -diff(exp(-(d - b) / (d s b)))``
  (the users' catalogs have ``s = 0.1 d``).
:func:`load_catalog` validates every field and raises :class:`CatalogError` naming the field, what was
expected and (for per-line fields) the first offending line.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

FORMAT = "chunkop-los-catalog/1"
LINE_FIELDS = ("pix", "d", "s", "y", "sigma")
RESPONSES = ("standard", "seed")  # the same as los.RESPONSES (this module imports nothing of the example)
REQUIRED = (*LINE_FIELDS, "nx", "ny", "edges")

__all__ = ["FORMAT", "Catalog", "CatalogError", "load_catalog", "validate_catalog", "write_catalog"]


class CatalogError(ValueError):
    """A catalog field is missing or invalid (the message names the field and what was expected)."""


@dataclasses.dataclass(frozen=True)
class Catalog:
    pix: np.ndarray  # (n,) int32
    d: np.ndarray  # (n,) float32, pc
    s: np.ndarray  # (n,) float32
    y: np.ndarray  # (n,) float32
    sigma: np.ndarray  # (n,) float32
    nx: int
    ny: int
    edges: np.ndarray  # (n_bins + 1,) float64, pc
    name: str = ""
    response: str | None = None  # the catalog's own ``response`` entry, if any

    @property
    def n_los(self) -> int:
        return int(self.pix.size)

    @property
    def n_pix(self) -> int:
        return self.nx * self.ny

    @property
    def n_bins(self) -> int:
        return int(self.edges.size - 1)

    @property
    def centres(self) -> np.ndarray:
        return np.sqrt(self.edges[:-1] * self.edges[1:])


def _first_bad(mask: np.ndarray) -> str:
    bad = np.flatnonzero(mask)
    return f"{bad.size} line(s), first at line {int(bad[0])}"


def _int_scalar(name: str, v: Any) -> int:
    a = np.asarray(v)
    if a.ndim != 0 or not (np.issubdtype(a.dtype, np.integer) or (np.issubdtype(a.dtype, np.floating) and a == int(a))):
        raise CatalogError(f"field {name!r}: expected a scalar integer >= 1, got {a.dtype} of shape {a.shape}")
    if int(a) < 1:
        raise CatalogError(f"field {name!r}: expected a scalar integer >= 1, got {int(a)}")
    return int(a)


def validate_catalog(fields: dict) -> Catalog:
    """Check a dict of the catalog's arrays (see the module docstring) and return a :class:`Catalog`.

    Raises:
        CatalogError: a field is missing, has the wrong shape or type, a length differing from ``pix``'s,
            NaN or infinite values, a pixel index outside the ``nx * ny`` grid, non-increasing or
            non-positive edges, or a non-positive ``d``, ``s`` or ``sigma``.
    """
    missing = [k for k in REQUIRED if k not in fields]
    if missing:
        raise CatalogError(
            f"catalog is missing field(s) {missing}; a catalog has {list(REQUIRED)} (see examples/astro_los/catalog.py)"
        )
    nx, ny = _int_scalar("nx", fields["nx"]), _int_scalar("ny", fields["ny"])
    edges = np.asarray(fields["edges"])
    if edges.ndim != 1 or edges.size < 2 or not np.issubdtype(edges.dtype, np.number):
        raise CatalogError(
            f"field 'edges': expected a 1-D array of >= 2 radial bin edges in pc, got shape {edges.shape}"
        )
    edges = edges.astype(np.float64)
    if not np.all(np.isfinite(edges)):
        raise CatalogError("field 'edges': expected finite values, got NaN or inf")
    if edges[0] <= 0 or np.any(np.diff(edges) <= 0):
        raise CatalogError("field 'edges': expected positive, strictly increasing bin edges (pc)")
    pix = np.asarray(fields["pix"])
    if pix.ndim != 1 or pix.size == 0:
        raise CatalogError(f"field 'pix': expected a non-empty 1-D array (one entry per line), got shape {pix.shape}")
    n = pix.size
    if not np.issubdtype(pix.dtype, np.integer):
        raise CatalogError(f"field 'pix': expected integers (pix = ix * ny + iy), got dtype {pix.dtype}")
    out = {}
    for k in ("d", "s", "y", "sigma"):
        a = np.asarray(fields[k])
        if a.ndim != 1 or a.size != n:
            raise CatalogError(f"field {k!r}: expected shape ({n},) like 'pix' (one entry per line), got {a.shape}")
        if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
            raise CatalogError(f"field {k!r}: expected real numbers, got dtype {a.dtype}")
        a = a.astype(np.float64)
        if not np.all(np.isfinite(a)):
            raise CatalogError(f"field {k!r}: expected finite values, got NaN or inf in {_first_bad(~np.isfinite(a))}")
        if k != "y" and np.any(a <= 0):
            raise CatalogError(f"field {k!r}: expected values > 0, got {a[a <= 0][0]:g} in {_first_bad(a <= 0)}")
        out[k] = a.astype(np.float32)
    outside = (pix < 0) | (pix >= nx * ny)
    if np.any(outside):
        raise CatalogError(
            f"field 'pix': expected indices in [0, nx * ny) = [0, {nx * ny}) on the ({nx}, {ny}) grid, "
            f"got {int(pix[outside][0])} in {_first_bad(outside)}"
        )
    name = str(np.asarray(fields["name"])) if "name" in fields else ""
    response = fields.get("response")
    if response is not None:
        response = str(np.asarray(response))
        if response not in RESPONSES:
            raise CatalogError(f"field 'response': expected one of {list(RESPONSES)}, got {response!r}")
    return Catalog(pix=pix.astype(np.int32), nx=nx, ny=ny, edges=edges, name=name, response=response, **out)


def load_catalog(path: str | os.PathLike) -> Catalog:
    """Read and validate a catalog ``.npz`` (raises :class:`CatalogError`, or ``FileNotFoundError``)."""
    with np.load(path, allow_pickle=False) as f:
        return validate_catalog({k: f[k] for k in f.files})


def write_catalog(
    path: str | os.PathLike, *, pix, d, s, y, sigma, nx, ny, edges, name: str = "", response: str | None = None
) -> Catalog:
    """Validate and write a catalog ``.npz``; returns the validated :class:`Catalog`.

    ``response``: written as the catalog's ``response`` entry when given (``"standard"`` or ``"seed"``).
    """
    cat = validate_catalog(
        {
            "pix": np.asarray(pix),
            "d": np.asarray(d),
            "s": np.asarray(s),
            "y": np.asarray(y),
            "sigma": np.broadcast_to(np.asarray(sigma, np.float32), np.shape(pix)),
            "nx": nx,
            "ny": ny,
            "edges": np.asarray(edges),
            "name": name,
            **({} if response is None else {"response": response}),
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(
        path,
        format=FORMAT,
        pix=cat.pix,
        d=cat.d,
        s=cat.s,
        y=cat.y,
        sigma=cat.sigma,
        nx=np.int64(cat.nx),
        ny=np.int64(cat.ny),
        edges=cat.edges,
        name=cat.name,
        **({} if cat.response is None else {"response": cat.response}),
    )
    return cat
