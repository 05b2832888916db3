"""Calibration of the NIFTy.re example over many truths: how often is the truth's column covered?

    python examples/astro_los/nifty_calibration.py [--seeds 0-19] [--methods mgvi,hmc,mgvi128]
                                                   [--hmc-iters N] [--out FILE] [--figure PNG]

One truth says little about a posterior's error bars: the 48 columns of the ``tiny`` size share
one radial mode, so a single truth's coverage jumps by tens of percent with it, for every method,
the exact posterior included (``docs/nifty.md``). A posterior is calibrated when the truths drawn
from its prior land inside its intervals as often as their nominal probability *on average over
those truths*. This script draws one truth per seed from the model's own prior (``nifty_vi.py
--size tiny --seed S``: its truth, lines and data) and, for each, runs

* ``mgvi``: the example as it is (``nifty_vi.run``, MGVI, default settings and sample seed: 32
  samples, mirrored, in the last iteration);
* ``mgvi128``: the same with 128 samples in the last iteration (``--final-samples 64``), whose
  standard deviations scatter half as much from one draw of the samples to the next;
* ``hmc``: the exact posterior up to the chain (``nifty_reference.py``: Gauss-Newton MAP, then
  HMC in the Laplace-whitened coordinates; the spectrum at its truth, as the default prior has it).

Per method it reports the column's 2-sigma coverage per truth, how many truths reach 80% of their
pixels, and the pooled z-scores ``(truth - mean) / std`` of all columns of all truths: within 1 and
2 sigma (68% and 95% for a calibrated Gaussian posterior), their mean and their std (0 and 1).
Results go to ``--out`` (default ``examples/astro_los/nifty_calibration.json``, the committed file
that ``docs/nifty.md`` quotes), written after every truth; a rerun with the same ``--out`` keeps
the entries it does not recompute (``--seeds 0 --methods mgvi`` reruns one entry; an empty
``--methods ''`` only redraws ``--figure``, ``docs/img/nifty_calibration.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nifty_reference
import nifty_vi

HERE = os.path.dirname(os.path.abspath(__file__))
LABELS = {"mgvi": "MGVI, 32 samples", "mgvi128": "MGVI, 128 samples", "hmc": "HMC"}
KEYS = ("column_within_2std", "column_within_1std", "log_sky_within_2std", "measured_within_2std", "column_z")


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def one_truth(seed: int, method: str, hmc_iters: int) -> dict:
    """The coverage figures of ``method`` (``"mgvi"``, ``"mgvi128"`` or ``"hmc"``) for the truth of ``seed``."""
    t0 = time.perf_counter()
    if method in ("mgvi", "mgvi128"):
        final = 64 if method == "mgvi128" else None
        r = nifty_vi.run("tiny", None, seed=seed, final_samples=final, figures=False, verbose=False)
        extra = {"chi2_per_line": r["chi2_per_line"], "reduced_chi2_data": r["reduced_chi2_data"]}
        extra["kl_converged"] = sum(e["kl_converged"] for e in r["kl_history"])
    elif method == "hmc":
        D = nifty_reference.Dense.of(nifty_vi.make_setup("tiny", seed=seed))
        lap, x_map, L = nifty_reference.laplace(D)
        r = nifty_reference.hmc(D, x_map, L, hmc_iters)
        extra = {"acceptance": r["acceptance"], "map_converged": lap["map_converged"]}
        extra["laplace_column_within_2std"] = lap["column_within_2std"]
    else:
        raise ValueError(f"method: expected 'mgvi', 'mgvi128' or 'hmc', got {method!r}")
    return {**{k: r[k] for k in KEYS}, **extra, "seconds": round(time.perf_counter() - t0, 1)}


def summary(per_seed: dict[str, dict]) -> dict:
    """Pooled figures of one method over the truths in ``per_seed``."""
    cov = np.array([e["column_within_2std"] for e in per_seed.values()])
    z = np.concatenate([e["column_z"] for e in per_seed.values()])
    zt = np.array([np.mean(e["column_z"]) for e in per_seed.values()])
    return {
        "truths": len(cov),
        "truths_with_column_within_2std_at_least_80pct": int(np.sum(cov >= 0.8)),
        "column_within_2std_per_truth_median": float(np.median(cov)),
        "column_within_2std_per_truth_min": float(cov.min()),
        "pooled_column_within_1std": float(np.mean(np.abs(z) < 1)),
        "pooled_column_within_2std": float(np.mean(np.abs(z) < 2)),
        "pooled_column_z_mean": float(z.mean()),
        # the columns of one truth share its radial mode: the truths, not the pixels, are the
        # independent draws, so the mean's standard error is that of the per-truth means
        "pooled_column_z_mean_standard_error": float(np.std(zt, ddof=1) / np.sqrt(len(zt))) if len(zt) > 1 else None,
        "pooled_column_z_std": float(z.std()),
        "pooled_log_sky_within_2std": float(np.mean([e["log_sky_within_2std"] for e in per_seed.values()])),
        "pooled_measured_within_2std": float(np.mean([e["measured_within_2std"] for e in per_seed.values()])),
    }


def plot(res: dict, path: str) -> None:
    """Per-truth column coverage of MGVI against the exact posterior (HMC), and the pooled
    z-scores of every column of every truth against the standard normal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = res["per_seed"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    a1.plot([0, 100], [0, 100], color="0.7", lw=1)
    a1.axhline(80, color="tab:red", lw=0.8, ls=":")
    n_truths = 0
    for m, marker in (("mgvi", "o"), ("mgvi128", "x")):
        both = sorted(set(ps.get(m, {})) & set(ps.get("hmc", {})), key=int)
        if not both:
            continue
        n_truths = max(n_truths, len(both))
        x = [ps["hmc"][k]["column_within_2std"] * 100 for k in both]
        y = [ps[m][k]["column_within_2std"] * 100 for k in both]
        a1.scatter(x, y, s=22, marker=marker, label=f"{LABELS[m]} ({len(both)} truths)")
        for k, xi, yi in zip(both, x, y):  # the truths below 80%, once per point that stands apart
            y32 = ps["mgvi"].get(k, {}).get("column_within_2std", 2.0) * 100
            if min(xi, yi) < 80 and (m == "mgvi" or abs(yi - y32) > 10):
                a1.annotate(f"seed {k}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
    a1.legend(fontsize=8, loc="upper left")
    a1.set(
        xlabel="exact posterior (HMC): % of columns within 2 sigma",
        ylabel="MGVI: % of columns within 2 sigma",
        title=f"one point per truth ({n_truths} truths drawn from the prior)",
        xlim=(0, 102),
        ylim=(0, 102),
    )
    grid = np.linspace(-5, 5, 201)
    for m in ("mgvi", "mgvi128", "hmc"):
        if m in ps:
            z = np.concatenate([e["column_z"] for e in ps[m].values()])
            s = res["summary"][m]
            a2.hist(
                z,
                bins=np.linspace(-5, 5, 26),
                density=True,
                histtype="step",
                lw=1.5,
                label=f"{LABELS[m]} ({s['truths']} truths): "
                f"{s['pooled_column_within_2std']:.1%} within 2 sigma, "
                f"{s['pooled_column_within_1std']:.1%} within 1",
            )
    a2.plot(grid, np.exp(-0.5 * grid**2) / np.sqrt(2 * np.pi), color="k", lw=1, label="N(0, 1): 95.4%, 68.3%")
    a2.set(
        xlabel="z of the column: (truth - posterior mean) / posterior std",
        ylabel="density",
        title="every column of every truth",
    )
    a2.legend(fontsize=8, loc="upper left")
    fig.suptitle("NIFTy.re example, size tiny (48 pixels x 12 distance bins, 1500 lines, 10% noise)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0-19", help="truths: e.g. 0-19 or 0,3,5-7")
    p.add_argument("--methods", default="mgvi,hmc,mgvi128")
    p.add_argument("--hmc-iters", type=int, default=2000)
    p.add_argument("--out", default=os.path.join(HERE, "nifty_calibration.json"))
    p.add_argument("--figure", default=None, help="write the calibration figure (PNG) here")
    a = p.parse_args(argv)
    res: dict = {"size": "tiny", "prior": "default", "noise": 0.1, "hmc_iters": a.hmc_iters, "per_seed": {}}
    if os.path.exists(a.out):
        with open(a.out) as f:
            res = json.load(f)
    for seed in _seeds(a.seeds):
        for method in filter(None, a.methods.split(",")):
            e = one_truth(seed, method, a.hmc_iters)
            res["per_seed"].setdefault(method, {})[str(seed)] = e
            res["summary"] = {m: summary(v) for m, v in res["per_seed"].items()}
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
            print(
                f"seed {seed:3d} {method}: column within 2 sigma {e['column_within_2std']:.0%}, "
                f"log-sky {e['log_sky_within_2std']:.0%}, measured {e['measured_within_2std']:.0%} "
                f"({e['seconds']:.0f} s)",
                flush=True,
            )
    for m, s in res["summary"].items():
        print(f"{m}: " + ", ".join(f"{k} {v:.3g}" for k, v in s.items() if v is not None), flush=True)
    if a.figure:
        plot(res, a.figure)
    return res


if __name__ == "__main__":
    main()
