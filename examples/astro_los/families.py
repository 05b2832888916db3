"""Truth families the example's generator (``los.make_problem``) does not draw, written as catalogs.

    python examples/astro_los/families.py [--size tiny|default] [--out DIR] [--family NAME ...] [--run]
        [--references oracle scale2x] [--response standard|seed] [--with-default] [--prior auto|gaussian|lognormal]

Each family writes ``DIR/NAME.npz`` (a catalog in the documented format, ``catalog.py``) and
``DIR/NAME.truth.npz`` (the true sky, ``sky``: ``(nx * ny, n_bins)``). ``--run`` then reconstructs
each one through ``reconstruct.py --data NAME.npz --truth NAME.truth.npz --out DIR/NAME`` and writes
``DIR/families_results.json`` (every family's summary and figures against the truth);
``--references oracle scale2x`` also reconstructs each one given a reference radial profile
(``--profile``): the truth's mean profile, and the family's density law with its scale doubled.

This code shares nothing with the example's generator but the instrument (``los.make_los_operator``
with ``--response``: ``standard``, the default, or ``seed``, the users' weights): its own sky models,
plane-of-sky fields, line draws and heteroscedastic noise (2% of each line's signal plus a floor).
With the standard response the lines are the stars of a magnitude-limited catalog (distances with
counts growing as ``d^2`` out to the far edge, ``s / d`` uniform between 0.05 and 0.2); with the
seed response, the earlier toy draws (distances log-uniform, ``s / d`` the same). The families:

* ``steep_profile``: density ``1 / (1 + (r / 200 pc)^2)`` (half the generator's scale) times a
  log-normal field with a power-law spectrum;
* ``compact_clouds``: an exponential disc ``exp(-r / 500 pc)``, a weak field, and 60 compact dense
  clouds (1-2.5 pixels across, 0.1 in ``ln r``, 3-10x the local density);
* ``sheet_edge``: a slowly falling density ``(1 + r / 100 pc)^-1/2`` and a dense sheet between 150
  and 250 pc covering the sky left of a sharp straight edge;
* ``steep_disc_fine``: a steeper disc ``exp(-r / 150 pc)`` and a fine field (correlation ~2 pixels);
* ``local_bubble``: a nearly empty bubble (3% of the density) out to a wall whose distance varies
  over the sky (60-140 pc), a dense shell just beyond it, then ``exp(-r / 600 pc)``;
* ``two_arms``: two dense layers along every line (at 300 and 1100 pc) over a thin floor;
* ``thin_sheet``: ``exp(-r / 800 pc)`` times a field, and a sheet 30 pc thick (400-430 pc, 6x the
  density) over a disc on the sky with a sharp edge (the issue's thin sheet, farther out);
* ``lognormal_3d``: ``exp(-r / 700 pc)`` times a 3-D log-normal field (sd 0.5 in ``ln`` density,
  exponential correlation of 100 pc along the line, a power-law spectrum on the sky): the kind of
  prior the published maps assume, not this example's Gaussian one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lognormal
import los
from catalog import write_catalog

FAMILIES = (
    "steep_profile",
    "compact_clouds",
    "sheet_edge",
    "steep_disc_fine",
    "local_bubble",
    "two_arms",
    "thin_sheet",
    "lognormal_3d",
)
REFERENCES = ("oracle", "scale2x")
GRIDS = {"tiny": (12, 8, 24, 6_000), "default": (64, 48, 96, 131_072)}


def _edges(n_bins: int) -> np.ndarray:
    return np.exp(np.linspace(np.log(40.0), np.log(1700.0), n_bins + 1))


def _powerlaw_amplitude(nx: int, ny: int, knee: float, slope: float) -> np.ndarray:
    """:func:`_powerlaw_field`'s Fourier amplitude ``(knee^2 + k^2)^(-slope / 2)``, 0 at ``k = 0``."""
    kx, ky = np.fft.fftfreq(nx)[:, None], np.fft.fftfreq(ny)[None, :]
    amp = (knee**2 + kx**2 + ky**2) ** (-slope / 2)
    amp[0, 0] = 0.0
    return amp


def _powerlaw_field(rng, nx: int, ny: int, knee: float, slope: float) -> np.ndarray:
    """Unit-sd Gaussian field with power ``(knee^2 + k^2)^-slope`` (k in cycles per pixel)."""
    amp = _powerlaw_amplitude(nx, ny, knee, slope)
    f = np.fft.ifft2(np.fft.fft2(rng.standard_normal((nx, ny))) * amp).real
    return (f / f.std()).reshape(-1)


def base_profile(name: str, r: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """A family's radial density law (before its field, clouds or sheet), its length scale
    multiplied by ``scale``: ``scale=2`` is a reference model whose scale is twice the truth's."""
    if name == "steep_profile":
        return 1.0 / (1.0 + (r / (200.0 * scale)) ** 2)
    if name == "compact_clouds":
        return np.exp(-r / (500.0 * scale))
    if name == "sheet_edge":
        return (1.0 + r / (100.0 * scale)) ** -0.5
    if name == "steep_disc_fine":
        return np.exp(-r / (150.0 * scale))
    if name == "local_bubble":  # the wall at its median distance, 90 pc
        return _bubble(r[None, :], np.array([90.0 * scale]), 8.0 * scale)[0] * np.exp(-r / (600.0 * scale))
    if name == "two_arms":
        return (
            0.1
            + np.exp(-0.5 * ((r - 300.0 * scale) / (60.0 * scale)) ** 2)
            + 0.7 * np.exp(-0.5 * ((r - 1100.0 * scale) / (150.0 * scale)) ** 2)
        )
    if name == "thin_sheet":
        return np.exp(-r / (800.0 * scale))
    if name == "lognormal_3d":
        return np.exp(-r / (700.0 * scale))
    raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")


def _bubble(r: np.ndarray, wall: np.ndarray, width: float, xp=np) -> np.ndarray:
    """``(n_pix, n_bins)``: 3% of the density inside ``wall`` (pc, per pixel), then a dense shell
    (``xp``: the array module, ``jax.numpy`` for a differentiable copy)."""
    inside = 0.03 + 0.97 / (1.0 + xp.exp(-(r - wall[:, None]) / width))
    return inside * (1.0 + 3.0 * xp.exp(-0.5 * ((r - wall[:, None] - 15.0 * width / 8.0) / (1.5 * width)) ** 2))


def reference_profile(kind: str, name: str, truth_sky: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """A reference radial profile for ``reconstruct.py --profile``: ``"oracle"``, the truth's mean
    over pixels per bin (what the oracle baseline knows); ``"scale2x"``, the family's density law
    with its length scale doubled (an external model that is wrong by a factor 2)."""
    if kind == "oracle":
        import reconstruct  # (the CLI: imported only when a reference is made)

        return reconstruct.oracle_profile(truth_sky)
    if kind == "scale2x":
        return base_profile(name, np.sqrt(edges[:-1] * edges[1:]), 2.0)
    raise ValueError(f"unknown reference {kind!r}; one of {REFERENCES}")


def _radial_mixing(r: np.ndarray) -> np.ndarray:
    """``lognormal_3d``'s mixing along the line: the Cholesky factor of ``exp(-|r - r'| / 100 pc)``."""
    return np.linalg.cholesky(np.exp(-np.abs(r[:, None] - r[None, :]) / 100.0) + 1e-9 * np.eye(r.size))


def family_sky(name: str, nx: int, ny: int, edges: np.ndarray, rng) -> np.ndarray:
    """The true sky ``(nx * ny, n_bins)`` float32 of a family."""
    r = np.sqrt(edges[:-1] * edges[1:])
    lr = np.log(r)
    ix, iy = np.divmod(np.arange(nx * ny), ny)
    if name == "steep_profile":
        g = 0.45 * _powerlaw_field(rng, nx, ny, knee=0.03, slope=1.8)
        sky = base_profile(name, r)[None, :] * np.exp(g)[:, None]
    elif name == "compact_clouds":
        g = 0.2 * _powerlaw_field(rng, nx, ny, knee=0.05, slope=2.0)
        sky = base_profile(name, r)[None, :] * np.exp(g)[:, None]
        scale = max(nx, ny) / 64.0
        for _ in range(60):
            cx, cy = rng.uniform(0, nx), rng.uniform(0, ny)
            w = rng.uniform(0.5, 1.25) * scale
            lc = rng.uniform(np.log(50.0), np.log(1000.0))
            blob = np.exp(-0.5 * ((ix - cx) ** 2 + (iy - cy) ** 2) / w**2)[:, None]
            blob = blob * np.exp(-0.5 * ((lr - lc) / 0.1) ** 2)[None, :]
            sky = sky * (1.0 + rng.uniform(2.0, 9.0) * blob)
    elif name == "sheet_edge":
        g = 0.25 * _powerlaw_field(rng, nx, ny, knee=0.04, slope=2.0)
        base = base_profile(name, r)
        edge_x = 0.55 * nx + 0.15 * (iy - ny / 2)  # a straight, slanted edge
        covered = (ix < edge_x).astype(float)[:, None]
        sheet = ((r > 150.0) & (r < 250.0)).astype(float)[None, :]
        sky = base[None, :] * np.exp(g)[:, None] * (1.0 + 4.0 * covered * sheet)
    elif name == "steep_disc_fine":
        g = 0.6 * _powerlaw_field(rng, nx, ny, knee=0.08, slope=1.5)
        sky = base_profile(name, r)[None, :] * np.exp(g)[:, None]
    elif name == "local_bubble":
        g = 0.3 * _powerlaw_field(rng, nx, ny, knee=0.04, slope=1.8)
        wall = 90.0 * np.exp(0.25 * _powerlaw_field(rng, nx, ny, knee=0.05, slope=2.0))
        sky = _bubble(r[None, :], wall, 8.0) * np.exp(-r / 600.0)[None, :] * np.exp(g)[:, None]
    elif name == "two_arms":
        g = 0.35 * _powerlaw_field(rng, nx, ny, knee=0.03, slope=1.6)
        sky = base_profile(name, r)[None, :] * np.exp(g)[:, None]
    elif name == "thin_sheet":
        g = 0.25 * _powerlaw_field(rng, nx, ny, knee=0.04, slope=2.0)
        covered = ((ix - 0.3 * nx) ** 2 + (iy - 0.5 * ny) ** 2 < (0.35 * nx) ** 2).astype(float)[:, None]
        sheet = ((r > 400.0) & (r < 430.0)).astype(float)[None, :]
        sky = base_profile(name, r)[None, :] * np.exp(g)[:, None] * (1.0 + 5.0 * covered * sheet)
    elif name == "lognormal_3d":
        Lr = _radial_mixing(r)
        lateral = np.stack([_powerlaw_field(rng, nx, ny, knee=0.06, slope=1.8) for _ in r], 1)  # (n_pix, n_bins)
        sky = base_profile(name, r)[None, :] * np.exp(0.5 * lateral @ Lr.T)
    else:
        raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")
    return sky.astype(np.float32)


def write_family(
    name: str, out: str, size: str = "default", seed: int = 0, response: str = "standard", n_los: int | None = None
) -> tuple[str, str]:
    """Write ``out/NAME.npz`` (catalog, seen through ``response``) and ``out/NAME.truth.npz``; returns both paths.
    ``n_los`` (default: ``size``'s) changes the number of stars only: the truth is drawn first, the same for any."""
    if response not in los.RESPONSES:
        raise ValueError(f"response must be one of {los.RESPONSES}, got {response!r}")
    if n_los is not None and n_los < 1:
        raise ValueError(f"n_los must be a positive number of lines, got {n_los}")
    nx, ny, n_bins, size_los = GRIDS[size]
    n_los = size_los if n_los is None else n_los
    rng = np.random.default_rng([seed, FAMILIES.index(name)])
    edges = _edges(n_bins)
    sky = family_sky(name, nx, ny, edges, rng)
    pix = rng.integers(0, nx * ny, n_los)
    if response == "standard":  # uniform in volume: counts ~ d^2
        d = np.cbrt(rng.uniform(40.0**3, 1700.0**3, n_los)).astype(np.float32)
    else:
        d = np.exp(rng.uniform(np.log(40.0), np.log(1700.0), n_los)).astype(np.float32)
    s = (rng.uniform(0.05, 0.2, n_los) * d).astype(np.float32)
    A = los.make_los_operator(pix, d, s, n_pix=nx * ny, edges=edges, chunk_size=min(8192, n_los), response=response)
    y_clean = np.asarray(jax.jit(lambda A, x: A.mv(x))(A, jnp.asarray(sky)), np.float64)
    sigma = 0.02 * np.sqrt(y_clean**2 + (0.1 * np.sqrt(np.mean(y_clean**2))) ** 2)
    y = y_clean + sigma * rng.standard_normal(n_los)
    os.makedirs(out, exist_ok=True)
    cat_path, truth_path = os.path.join(out, f"{name}.npz"), os.path.join(out, f"{name}.truth.npz")
    write_catalog(
        cat_path, pix=pix, d=d, s=s, y=y, sigma=sigma, nx=nx, ny=ny, edges=edges, name=name, response=response
    )
    np.savez(truth_path, sky=sky)
    return cat_path, truth_path


def record(out: str, header: dict, names: list, per_family: Callable[[str], dict]) -> dict:
    """A diagnostic's record over truth families: ``header`` with the machine's load before and
    after, ``per_family(name)`` for each of ``names`` under ``"families"``; written to ``out`` as JSON."""
    res = dict(header, load=os.getloadavg())
    res["families"] = {name: per_family(name) for name in names}
    res["load_after"] = os.getloadavg()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="default", choices=sorted(GRIDS))
    p.add_argument("--out", default="outputs/astro_families")
    p.add_argument("--family", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--run", action="store_true", help="reconstruct each family and write families_results.json")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument(
        "--lines", type=int, default=None, help="stars per catalog (default: --size's); the truths stay the same"
    )
    p.add_argument("--response", default="standard", choices=los.RESPONSES, help="the instrument (default standard)")
    p.add_argument(
        "--references",
        nargs="*",
        default=[],
        choices=REFERENCES,
        help="with --run: also reconstruct each family given these reference profiles (reconstruct.py --profile, "
        "written as NAME.REF.npy; results under NAME_REF): 'oracle', the truth's mean radial profile (what the "
        "oracle baseline knows); 'scale2x', the family's density law with its length scale doubled",
    )
    p.add_argument(
        "--with-default",
        action="store_true",
        help="with --run: also run the built-in synthetic job of --size (reconstruct.py --size SIZE --response "
        "RESPONSE, out DIR/default) and record it first, as 'default (synthetic)'",
    )
    p.add_argument(
        "--prior",
        default="auto",
        choices=lognormal.PRIORS,
        help="with --run: the standard response's prior (reconstruct.py --prior; default auto)",
    )
    a = p.parse_args(argv)
    results = {}
    if a.run and a.with_default:
        import reconstruct

        res = reconstruct.run(
            a.size, out=os.path.join(a.out, "default"), samples=a.samples, response=a.response, prior=a.prior
        )
        results["default (synthetic)"] = res["summary"]
    for name in a.family:
        cat_path, truth_path = write_family(name, a.out, a.size, response=a.response, n_los=a.lines)
        print(f"wrote {cat_path} and {truth_path}", flush=True)
        if a.run:
            import reconstruct

            args = ["--data", cat_path, "--truth", truth_path, "--samples", str(a.samples), "--response", a.response]
            args += ["--prior", a.prior]
            results[name] = reconstruct.main([*args, "--out", os.path.join(a.out, name)])
            for ref in a.references:
                profile_path = os.path.join(a.out, f"{name}.{ref}.npy")
                truth = np.load(truth_path)["sky"]
                np.save(profile_path, reference_profile(ref, name, truth, _edges(GRIDS[a.size][2])))
                out = os.path.join(a.out, f"{name}_{ref}")
                results[f"{name}_{ref}"] = reconstruct.main([*args, "--profile", profile_path, "--out", out])
    if a.run:
        with open(os.path.join(a.out, "families_results.json"), "w") as f:
            json.dump(
                {"size": a.size, "lines": a.lines, "response": a.response, "prior": a.prior, "families": results},
                f,
                indent=1,
                default=float,
            )
    return results


if __name__ == "__main__":
    main()
