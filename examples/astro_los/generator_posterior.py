"""What can any map get from a catalog? The truth's own generator as the prior, its posterior sampled.

    python examples/astro_los/generator_posterior.py [--family NAME ...] [--samples 8]
        [--maxiter N] [--seed S] [--dtype float64|float32] [--no-map] [--wall field|fixed|white] [--out FILE]

A diagnostic, never part of a reconstruction. ``hyper_oracle.py`` asks how well the example's prior
could do with its hyperparameters tuned on the truth; this asks what the catalog holds: it
reconstructs a truth family's catalog with that family's own generator as the prior (its functional
form and every constant it draws with), so only the generator's random draws, its white noise, are
unknown. Averaged over the skies that generator draws, that posterior's mean is the best map any
method can give in squared error; on one sky its MAP and its samples' mean estimate it. Where it
misses a bar, no prior learned from the catalog should be expected to meet it; where it meets one the
example misses, the catalog holds what the example's prior does not take. Three skies the example
misses the 0.6x bar on (or sits on it), each white noise pushed through a known map (written here in JAX):

* ``local_bubble`` (``families.py``): a 2-D field for the density's level and one for the bubble wall's
  distance, each a power-law transform of white noise (``families._powerlaw_field``), through
  ``families._bubble``'s wall and shell; 2 x 3072 unknowns;
* ``lognormal_3d`` (``families.py``): a 3-D log-normal field, one power-law plane-of-sky field per bin
  mixed along the line by an exponential correlation of 100 pc; 96 x 3072 unknowns;
* ``clustered_stars`` (``outside_skies.py``): a 3-D log-normal field, white noise on the generator's
  padded 5 pc grid through its Gaussian filter, interpolated and averaged over each bin as the
  generator does; 2.4M unknowns. Its MAP (the mode in the white noise) sits below the posterior
  mean wherever the lines leave the field free (the log-normal's median, not its mean).

The lines are measured by ``los.make_los_operator`` (float64; ``--dtype float32`` on a TPU) on the
catalog the family writes (seed 0), with its noise. Posterior samples by randomize-then-optimize:
each sample is the mode of the posterior given the data and the prior's mean both perturbed by their
own noise (exact for a linear model, close to the posterior for a mildly non-linear one); their mean
is scored as ``reconstruct.evaluate`` scores a map (``hyper_oracle.ratio``: the sky's error weighted
by bin length over the oracle's), and so is the unperturbed mode (the MAP). The generator's fields
are normalised to unit sd by their realised sd; here by their expected one (fed the generator's own
noise, the model gives its truth within 0.06x the oracle's error: a test).

Writes ``--out`` (default ``outputs/generator_posterior.json``); session 36's runs are gathered in
``benchmarks/results/astro_generator_posterior.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families
import hyper_oracle
import los
import outside_skies
import reconstruct
from catalog import load_catalog

FAMILIES = ("local_bubble", "lognormal_3d", "clustered_stars")


def _powerlaw_filter(nx: int, ny: int, knee: float, slope: float) -> np.ndarray:
    """``families._powerlaw_field``'s Fourier amplitude, divided by the field's expected sd."""
    amp = families._powerlaw_amplitude(nx, ny, knee, slope)
    return amp / np.sqrt(np.mean(amp**2))


#: ``local_bubble``'s wall in :func:`bubble_model`: the generator's (a smooth field over the sky), at its
#: median everywhere, or free in each pixel (the same sd, no plane-of-sky correlation): what each piece
#: of the generator's knowledge is worth
WALLS = ("field", "fixed", "white")


def bubble_model(nx: int, ny: int, edges: np.ndarray, wall: str = "field"):
    """``local_bubble``'s generator as a function of its white noise ``(2, nx * ny)``: ``(n_pix, n_bins)``.

    ``wall``: one of :data:`WALLS`; ``"fixed"`` ignores the second row of the noise."""
    if wall not in WALLS:
        raise ValueError(f"wall must be one of {WALLS}, got {wall!r}")
    r = jnp.asarray(np.sqrt(edges[:-1] * edges[1:]))
    fg = jnp.asarray(_powerlaw_filter(nx, ny, 0.04, 1.8))
    fw = jnp.ones((nx, ny)) if wall == "white" else jnp.asarray(_powerlaw_filter(nx, ny, 0.05, 2.0))

    def field(xi, filt):
        return jnp.fft.ifft2(jnp.fft.fft2(xi.reshape(nx, ny)) * filt).real.reshape(-1)

    def sky(xi):
        g = 0.3 * field(xi[0], fg)
        shift = jnp.zeros(nx * ny) if wall == "fixed" else 0.25 * field(xi[1], fw)
        bubble = families._bubble(r[None, :], 90.0 * jnp.exp(shift), 8.0, xp=jnp)
        return bubble * jnp.exp(-r / 600.0)[None, :] * jnp.exp(g)[:, None]

    return sky, (2, nx * ny)


def lognormal3d_model(nx: int, ny: int, edges: np.ndarray):
    """``lognormal_3d``'s generator as a function of its white noise ``(n_bins, nx * ny)``: one power-law
    plane-of-sky field per bin, mixed along the line by the exponential correlation's Cholesky factor."""
    r = np.sqrt(edges[:-1] * edges[1:])
    chol = jnp.asarray(families._radial_mixing(r))
    filt = jnp.asarray(_powerlaw_filter(nx, ny, 0.06, 1.8))
    base = jnp.asarray(families.base_profile("lognormal_3d", r))

    def sky(xi):
        lateral = jnp.fft.ifft2(jnp.fft.fft2(xi.reshape(r.size, nx, ny)) * filt).real.reshape(r.size, -1).T
        return base[None, :] * jnp.exp(0.5 * lateral @ chol.T)

    return sky, (r.size, nx * ny)


def clustered_model(nx: int, ny: int, edges: np.ndarray):
    """``clustered_stars``' generator as a function of its white noise on the padded grid."""
    corr_px, dr, corr_r, sd = 2.0, 5.0, 50.0, 0.6
    nr = int(np.ceil((edges[-1] + 10) / dr)) + 1
    pp, pr = int(np.ceil(4 * corr_px)) + 2, int(np.ceil(4 * corr_r / dr)) + 2
    shape = (nx + 2 * pp, ny + 2 * pp, nr + 2 * pr)
    kx = np.fft.fftfreq(shape[0])[:, None, None]
    ky = np.fft.fftfreq(shape[1])[None, :, None]
    kr = np.fft.fftfreq(shape[2])[None, None, :]
    sx, sr = corr_px / np.sqrt(2), corr_r / dr / np.sqrt(2)
    filt = np.exp(-((2 * np.pi) ** 2) * ((kx**2 + ky**2) * sx**2 + kr**2 * sr**2) / 2)
    filt = filt / np.sqrt(np.mean(filt**2))
    filt_r = jnp.asarray(filt[:, :, : shape[2] // 2 + 1])
    # the generator's bin average: 16 linear sub-samples per bin, linear interpolation on the 5 pc grid
    nsub, nb = outside_skies.NSUB, edges.size - 1
    t = (np.arange(nsub) + 0.5) / nsub
    rs = (edges[:-1, None] + t[None, :] * np.diff(edges)[:, None]).reshape(-1)
    pos = np.clip(rs / dr, 0, nr - 1.000001)
    i0 = np.floor(pos).astype(int)
    w = pos - i0
    interp = np.zeros((rs.size, nr))
    interp[np.arange(rs.size), i0] = 1 - w
    interp[np.arange(rs.size), i0 + 1] = w
    interp = jnp.asarray(interp)
    base = jnp.asarray(np.exp(-rs / 600.0))

    def sky(xi):
        g = jnp.fft.irfftn(jnp.fft.rfftn(xi) * filt_r, s=shape)[pp : pp + nx, pp : pp + ny, pr : pr + nr]
        gi = g.reshape(nx * ny, nr) @ interp.T  # (n_pix, nb * nsub)
        rho = base[None, :] * jnp.exp(sd * gi - sd**2 / 2)
        return rho.reshape(nx * ny, nb, nsub).mean(axis=2)

    return sky, shape


def write_catalog(name: str, out: str, size: str = "default") -> tuple[str, str]:
    """The family's catalog and truth, seed 0, as ``families.py`` / ``outside_skies.py`` write them
    (``size``: ``families.GRIDS``' key, for ``families.py``'s skies; the outside skies have one grid)."""
    if name in families.FAMILIES:
        return families.write_family(name, out, size)
    return outside_skies.make_family(name, out, 0)


def posterior(
    name: str,
    samples: int,
    maxiter: int,
    seed: int = 0,
    size: str = "default",
    dtype: str = "float64",
    with_map: bool = True,
    wall: str = "field",
) -> dict:
    """The MAP and ``samples`` randomize-then-optimize samples of ``name``'s generator posterior.

    Args:
        name: one of :data:`FAMILIES`.
        samples: how many posterior samples (0: the MAP alone).
        maxiter: L-BFGS-B's iterations per mode.
        seed: the samples' random numbers (the catalog is always seed 0's).
        size: ``families.GRIDS``' key (``local_bubble`` only).
        dtype: ``"float64"`` (on the CPU) or ``"float32"`` (an accelerator's FFTs).
        with_map: find the MAP first and start each sample there; without, the samples start at
            the prior's mean and ``"map"`` is the prior's mean.
        wall: ``local_bubble``'s wall, one of :data:`WALLS` (:func:`bubble_model`).

    Returns:
        ``{"unknowns", "map": {"ratio", "chi2_per_line", "iterations", "seconds", "converged"},
        "prior_mean_ratio", "map_near_share"}``, and with samples ``"sample_mean"`` and
        ``"sample_ratios"``; a ratio is ``hyper_oracle.ratio``'s (``"prior_mean_ratio"``: the sky of
        zero noise, the prior's mean in the noise), ``"map_near_share"`` the MAP's share of error in
        front of ``reconstruct.NEAR_PC``.

    Example:
        >>> r = posterior("local_bubble", samples=0, maxiter=50, size="tiny")  # doctest: +SKIP
        >>> r["map"]["ratio"] < r["prior_mean_ratio"]  # doctest: +SKIP
        True
    """
    if name not in FAMILIES:
        raise ValueError(f"name must be one of {FAMILIES}, got {name!r}")
    if wall not in WALLS:
        raise ValueError(f"wall must be one of {WALLS}, got {wall!r}")
    if wall != "field" and name != "local_bubble":
        raise ValueError(f"wall applies to local_bubble only, got wall={wall!r} for {name!r}")
    with tempfile.TemporaryDirectory() as tmp:
        cat_path, truth_path = write_catalog(name, tmp, size)
        cat = load_catalog(cat_path)
        truth = np.load(truth_path)["sky"].astype(np.float64)
    with jax.enable_x64(dtype == "float64"):
        return _posterior(name, cat, truth, samples, maxiter, seed, jnp.dtype(dtype), with_map, wall)


def _posterior(
    name: str, cat, truth: np.ndarray, samples: int, maxiter: int, seed: int, dtype, with_map: bool, wall: str
) -> dict:
    if name == "local_bubble":
        sky_of, shape = bubble_model(cat.nx, cat.ny, cat.edges, wall)
    else:
        make = lognormal3d_model if name == "lognormal_3d" else clustered_model
        sky_of, shape = make(cat.nx, cat.ny, cat.edges)
    A = los.make_los_operator(
        cat.pix,
        cat.d,
        cat.s,
        n_pix=cat.nx * cat.ny,
        edges=cat.edges,
        chunk_size=min(8192, cat.n_los),
        dtype=dtype,
        response="standard",
    )
    y, sigma = jnp.asarray(cat.y, dtype), jnp.asarray(cat.sigma, dtype)
    n = int(np.prod(shape))

    @jax.jit
    def loss(x, y_obs, xi0):
        xi = x.reshape(shape)
        res = (y_obs - A.mv(sky_of(xi))) / sigma
        return 0.5 * jnp.sum(res**2) + 0.5 * jnp.sum((xi - xi0) ** 2)

    grad = jax.jit(jax.value_and_grad(loss))
    chi2 = jax.jit(lambda x: jnp.mean(((y - A.mv(sky_of(x.reshape(shape)))) / sigma) ** 2))
    db = np.diff(cat.edges)
    near = np.sqrt(cat.edges[:-1] * cat.edges[1:]) < reconstruct.NEAR_PC
    score = lambda m: hyper_oracle.ratio(m, truth, db, near)[0]

    def mode(y_obs, xi0, x0):
        fun = lambda x: tuple(np.asarray(v, np.float64) for v in grad(jnp.asarray(x, dtype), y_obs, xi0))
        t0 = time.time()
        r = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", options=dict(maxiter=maxiter, maxcor=20))
        return r.x, {"iterations": int(r.nit), "seconds": time.time() - t0, "converged": bool(r.success)}

    zero = jnp.zeros(shape, dtype)
    if not with_map:  # the samples alone, each started from the prior's mean
        x_map, info = np.zeros(n), {"iterations": 0, "seconds": 0.0, "converged": False}
    else:
        x_map, info = mode(y, zero, np.zeros(n))
    m_map = np.asarray(sky_of(jnp.asarray(x_map, dtype).reshape(shape)), np.float64)
    map_ratio, near_share = hyper_oracle.ratio(m_map, truth, db, near)
    out = {
        "unknowns": n,
        "map": {"ratio": map_ratio, "chi2_per_line": float(chi2(jnp.asarray(x_map, dtype))), **info},
        "prior_mean_ratio": score(np.asarray(sky_of(zero))),
        "map_near_share": near_share,
    }
    print(f"{name}: MAP {out['map']}", flush=True)
    rng = np.random.default_rng(seed)
    draws, own, sample_info = [], [], []
    for i in range(samples):
        y_i = y + sigma * jnp.asarray(rng.standard_normal(cat.n_los), dtype)
        xi0 = jnp.asarray(rng.standard_normal(shape), dtype)
        x_i, info = mode(y_i, xi0, x_map)
        draws.append(np.asarray(sky_of(jnp.asarray(x_i, dtype).reshape(shape)), np.float64))
        sample_info.append(info)
        own.append(score(draws[-1]))
        running = score(np.mean(draws, axis=0))
        print(f"  sample {i}: {info}, its own ratio {own[-1]:.4f}, the mean so far {running:.4f}", flush=True)
    if draws:  # (the last running mean is the mean of all)
        out["sample_mean"] = {"ratio": running, "samples": samples, "modes": sample_info}
        out["sample_ratios"] = own
    return out


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--maxiter", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0, help="the samples' random numbers (the catalog is seed 0's)")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="float32 on a TPU")
    p.add_argument("--wall", default="field", choices=WALLS, help="local_bubble's wall (bubble_model)")
    p.add_argument("--no-map", action="store_true", help="the samples alone, each from the prior's mean")
    p.add_argument("--size", default="default", choices=sorted(families.GRIDS), help="local_bubble's grid")
    p.add_argument("--out", default="outputs/generator_posterior.json")
    a = p.parse_args(argv)
    res = {
        "load": os.getloadavg(),
        "samples": a.samples,
        "maxiter": a.maxiter,
        "seed": a.seed,
        "size": a.size,
        "dtype": a.dtype,
        "wall": a.wall,
        "device": str(jax.devices()[0]),
        "families": {},
    }
    for name in a.family:
        t0 = time.time()
        res["families"][name] = posterior(
            name,
            a.samples,
            a.maxiter,
            seed=a.seed,
            size=a.size,
            dtype=a.dtype,
            with_map=not a.no_map,
            wall=a.wall if name == "local_bubble" else "field",
        ) | {"seconds": time.time() - t0}
    res["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
