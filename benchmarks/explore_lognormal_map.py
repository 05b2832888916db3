"""What a positive prior gains where the Gaussian 3-D prior misses the sky bar (issue #41): a log-normal mode.

    python benchmarks/explore_lognormal_map.py [--family NAME ...] [--pairs N] [--out FILE]

For each truth family (``families.py``, default size, catalogs written afresh from the same seeds) it
runs the example's reconstruction (``field3d.reconstruct``: the Gaussian field about a smooth mean
profile, every hyperparameter from the catalog) and keeps what its posterior was solved from
(``keep=``), then puts ``lognormal.py``'s positive field on the same statistics and the same learned
hyperparameters (moments matched; nothing tuned on the truth): its mode (``lognormal.map_estimate``)
and Laplace samples at the mode (``lognormal.laplace_deviation``), their columns both pushed through
``exp`` and linearised at the mode (``lognormal.posterior`` reports the latter).

Scores as the families' table scores a map: the sky's error weighted by bin length over the oracle's
(``hyper_oracle.ratio``), chi2 per line (from the statistics), the distance-integrated column's error
and the share of columns within 2 sd, beside the Gaussian prior's on the same catalog. Writes ``--out``
(default ``benchmarks/results/explore_lognormal_map.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "astro_los"))
import families
import field3d
import hyper_oracle
import lognormal
import reconstruct
from catalog import load_catalog


def one(name: str, pairs: int, log=print) -> dict:
    """One family: the Gaussian reconstruction, then the log-normal MAP and its samples, scored."""
    with tempfile.TemporaryDirectory() as tmp:
        cat_path, truth_path = families.write_family(name, tmp, "default")
        cat = load_catalog(cat_path)
        sky = np.load(truth_path)["sky"].astype(np.float64)
    db = np.diff(cat.edges)
    near = cat.centres < reconstruct.NEAR_PC
    col_t = sky @ db
    kept: dict = {}
    t0 = time.perf_counter()
    rec = field3d.reconstruct(cat, "standard", samples=32, log=lambda m: None, keep=kept)
    gauss = {
        "ratio": hyper_oracle.ratio(rec["mean"], sky, db, near)[0],
        "column_err": float(np.linalg.norm(rec["column"] - col_t) / np.linalg.norm(col_t)),
        "column_within_2sd": float(np.mean(np.abs(rec["column"] - col_t) < 2 * rec["column_std"])),
        "seconds": time.perf_counter() - t0,
    }
    with jax.enable_x64(True):
        d = kept["data"]
        D, t = jnp.asarray(d.D, jnp.float64), jnp.asarray(d.t, jnp.float64)
        shape = d.grid.shape
        P = lognormal.prior(np.asarray(kept["theta"]), kept["rad"], shape)
        t1 = time.perf_counter()
        xi, path = lognormal.map_estimate(P, D, t, shape, cat.n_bins)
        root = lognormal.psd_root(D)
        keys = jax.random.split(jax.random.key(1), pairs)
        devs = [lognormal.laplace_deviation(P, D, root, xi, k) for k in keys]
        base = lognormal.log_sky(P, xi)
        smap = np.asarray(jnp.exp(base)).reshape(cat.n_bins, -1).T
        u = lognormal.seen(P, xi)
        chi2 = float(d.yy) - 2 * float(jnp.sum(t * u)) + float(jnp.einsum("pi,pij,pj->", u, D, u))
        zero = lognormal.log_sky(P, jnp.zeros_like(xi))
        exp_cols, lin_cols = [], []
        for dev, _ in devs:
            ds = lognormal.log_sky(P, dev) - zero  # (the field is linear in xi: its deviation)
            for sgn in (1.0, -1.0):
                exp_cols.append(np.asarray(jnp.exp(base + sgn * ds)).reshape(cat.n_bins, -1).T @ db)
                lin_cols.append(np.asarray(jnp.exp(base) * (1.0 + sgn * ds)).reshape(cat.n_bins, -1).T @ db)
        exp_cols, lin_cols = np.array(exp_cols), np.array(lin_cols)
        col_map = smap @ db
        res = {
            "gauss": gauss,
            "map_ratio": hyper_oracle.ratio(smap, sky, db, near)[0],
            "map_chi2_per_line": chi2 / cat.n_los,
            "map_column_err": float(np.linalg.norm(col_map - col_t) / np.linalg.norm(col_t)),
            "laplace_exp_column_err": float(np.linalg.norm(exp_cols.mean(0) - col_t) / np.linalg.norm(col_t)),
            "laplace_exp_column_within_2sd": float(np.mean(np.abs(exp_cols.mean(0) - col_t) < 2 * exp_cols.std(0))),
            "laplace_linear_column_within_2sd": float(np.mean(np.abs(col_map - col_t) < 2 * lin_cols.std(0))),
            "column_sd_over_gauss_median": float(np.median(lin_cols.std(0) / rec["column_std"])),
            "newton_steps": len(path),
            "newton_path": path,
            "sample_cg_steps": [int(k) for _, k in devs],
            "seconds": time.perf_counter() - t1,
        }
    log(
        f"{name}: Gaussian {gauss['ratio']:.4f}x the oracle, log-normal MAP {res['map_ratio']:.4f}x "
        f"(chi2/line {res['map_chi2_per_line']:.3f}, {len(path)} Newton steps, {res['seconds']:.0f}s); "
        f"columns within 2 sd: Gaussian {100 * gauss['column_within_2sd']:.1f}%, "
        f"Laplace exp {100 * res['laplace_exp_column_within_2sd']:.1f}%, "
        f"linearised {100 * res['laplace_linear_column_within_2sd']:.1f}%"
    )
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", nargs="*", default=list(families.FAMILIES), choices=families.FAMILIES)
    p.add_argument("--pairs", type=int, default=4, help="Laplace sample pairs (default 4)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "explore_lognormal_map.json"))
    a = p.parse_args(argv)
    families.record(a.out, {"jax": jax.__version__, "pairs": a.pairs}, a.family, lambda name: one(name, a.pairs))


if __name__ == "__main__":
    main()
