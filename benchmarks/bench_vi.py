"""Variational-inference benchmark: an MGVI-style loop on the LOS model, RowOperator vs jax.vmap response.

Usage::

    python benchmarks/bench_vi.py            # 3 alternating runs per method (a few minutes, 2-core CPU)
    python benchmarks/bench_vi.py --quick    # one small run per method
    python benchmarks/bench_vi.py --out DIR  # also write vi.json under DIR
    python benchmarks/bench_vi.py --layout plain  # the chunkop response in RowOperator's plain layout

This is how astrophysics reconstruction pipelines (NIFTy.re's ``optimize_kl``, MGVI) use a
response operator: the response sits inside a forward model, samples are ``jax.vmap``-ed, the
metric ``J^T N^-1 J + 1`` is applied through ``jax.jvp``/``jax.vjp`` of the whole model inside
conjugate-gradient solves, and the mean is updated by Newton-CG. The model here:

* latent ``xi`` of shape ``(n_pix, n_bins)`` with a standard normal prior;
* sky ``s(xi) = exp(mu + sigma * xi @ S)`` with ``S`` a fixed smoothing of the radial axis;
* data ``d = R s(xi_true) + n``, ``n ~ N(0, sigma_n^2)``, ``R`` the LOS response
  (``examples/astro_los/los.py``): either ``chunkop.RowOperator.mv`` (chunked; its transpose and
  derivatives are chunked too), or ``los_vmap`` (plain ``jax.vmap`` over all lines, which
  materialises the ``n_los x n_bins`` weights).

One MGVI iteration at the mean ``m``: draw ``n_samples / 2`` residuals
``delta = M^-1 (J^T N^-1/2 eta_1 + eta_2)`` (CG, ``--cg-sample`` steps, vmapped over samples),
form antithetic samples ``m +- delta``, then one Newton-CG step on the sample-averaged KL
(gradient by ``jax.grad`` vmapped over samples; metric by jvp/vjp vmapped over samples, averaged;
``--cg-newton`` CG steps) with a halving line search.

Each run is a fresh subprocess (so compilation is included, as a user sees it); methods alternate
(A B A B ...) so load from other processes hits both alike. Reported: the whole run's wall time
(compile included), the time of the first iteration (mostly compilation) and of the later ones,
and the final KL estimate, which must agree between the methods (same arithmetic up to float
summation order).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples" / "astro_los"))

SIZES = {
    # n_pix, n_bins, n_los, chunk, n_samples, mgvi iterations, cg steps (samples, newton)
    "quick": dict(n_pix=500, n_bins=32, n_los=8192, chunk=2048, n_samples=2, iters=2, cg_sample=8, cg_newton=5),
    "full": dict(n_pix=2000, n_bins=64, n_los=65536, chunk=4096, n_samples=4, iters=4, cg_sample=20, cg_newton=10),
}


def _cg(matvec, b, n_steps):
    """``n_steps`` of conjugate gradients on ``matvec(x) = b`` from 0 (fixed count: same work for all)."""
    import jax
    import jax.numpy as jnp

    def dot(a, c):
        return jnp.vdot(a, c).real

    def step(_, state):
        x, r, p, rr = state
        ap = matvec(p)
        alpha = rr / jnp.maximum(dot(p, ap), 1e-30)
        x, r = x + alpha * p, r - alpha * ap
        rr_new = dot(r, r)
        return x, r, r + (rr_new / jnp.maximum(rr, 1e-30)) * p, rr_new

    x0 = jnp.zeros_like(b)
    return jax.lax.fori_loop(0, n_steps, step, (x0, b, b, dot(b, b)))[0]


def run(method: str, size: str, seed: int = 0) -> dict:
    """One whole MGVI run with the given response; returns timings and the final KL estimate."""
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import los

    cfg = SIZES[size]
    n_pix, n_bins, n_los = cfg["n_pix"], cfg["n_bins"], cfg["n_los"]
    rng = np.random.default_rng(seed)
    edges = los.bin_edges(n_bins)
    idx = rng.integers(0, n_pix, n_los)
    d = rng.uniform(60.0, 1600.0, n_los)
    s = rng.uniform(0.05, 0.3, n_los)
    if method == "chunkop":
        layout = os.environ.get("BENCH_VI_LAYOUT", "auto")  # (--layout: the chunkop response's layout)
        A = los.make_los_operator(idx, d, s, n_pix=n_pix, edges=edges, chunk_size=cfg["chunk"], layout=layout)
        response = A.mv
    elif method == "jax.vmap":
        idx_j, d_j, s_j = jnp.asarray(idx, jnp.int32), jnp.asarray(d, jnp.float32), jnp.asarray(s, jnp.float32)

        def response(sky):
            return los.los_vmap(idx_j, d_j, s_j, sky, edges)
    else:
        raise ValueError(method)

    k = np.arange(n_bins)
    smooth = np.exp(-0.5 * ((k[:, None] - k[None, :]) / 3.0) ** 2)
    smooth = jnp.asarray(smooth / np.sqrt((smooth**2).sum(0, keepdims=True)), jnp.float32)
    mu, sigma, sigma_n = -7.0, 1.0, 1e-5

    def signal(xi):
        return jnp.exp(mu + sigma * xi @ smooth)

    def forward(xi):
        return response(signal(xi))

    xi_true = jnp.asarray(rng.normal(size=(n_pix, n_bins)), jnp.float32)
    data = forward(xi_true) + sigma_n * jnp.asarray(rng.normal(size=n_los), jnp.float32)

    def energy(xi):  # -log posterior (up to a constant)
        r = (forward(xi) - data) / sigma_n
        return 0.5 * jnp.vdot(r, r) + 0.5 * jnp.vdot(xi, xi)

    def metric(at, v):  # (J^T N^-1 J + 1) v at `at`
        _, jv = jax.jvp(forward, (at,), (v,))
        _, vjp = jax.vjp(forward, at)
        return vjp(jv / sigma_n**2)[0] + v

    @jax.jit
    def draw_residuals(mean, key):
        def one(key):
            k1, k2 = jax.random.split(key)
            eta1 = jax.random.normal(k1, (n_los,), jnp.float32)
            eta2 = jax.random.normal(k2, mean.shape, jnp.float32)
            _, vjp = jax.vjp(forward, mean)
            rhs = vjp(eta1 / sigma_n)[0] + eta2
            return _cg(lambda v: metric(mean, v), rhs, cfg["cg_sample"])

        return jax.vmap(one)(jax.random.split(key, cfg["n_samples"] // 2))

    @jax.jit
    def newton_step(mean, residuals):
        samples = jnp.concatenate([residuals, -residuals])  # antithetic: mean +- delta

        def kl(m):
            return jnp.mean(jax.vmap(lambda r: energy(m + r))(samples))

        value, grad = jax.value_and_grad(kl)(mean)

        def avg_metric(v):
            return jnp.mean(jax.vmap(lambda r: metric(mean + r, v))(samples), axis=0)

        direction = _cg(avg_metric, -grad, cfg["cg_newton"])

        def try_step(state, _):
            step, best = state
            new = kl(mean + step * direction)
            return (jnp.where(new < best, step, step / 2), jnp.minimum(new, best)), None

        (step, new_value), _ = jax.lax.scan(try_step, (jnp.float32(1.0), value), None, length=3)
        accept = new_value < value
        return jnp.where(accept, mean + step * direction, mean), jnp.where(accept, new_value, value)

    mean = jnp.zeros((n_pix, n_bins), jnp.float32)
    key = jax.random.key(seed)
    iter_times, kls = [], []
    for _ in range(cfg["iters"]):
        t0 = time.perf_counter()
        key, sub = jax.random.split(key)
        mean, value = newton_step(mean, draw_residuals(mean, sub))
        value.block_until_ready()
        iter_times.append(time.perf_counter() - t0)
        kls.append(float(value))
    rel_err = float(jnp.linalg.norm(mean - xi_true) / jnp.linalg.norm(xi_true))
    return {
        "method": method,
        "size": size,
        "total_s": time.perf_counter() - t_start,
        "first_iteration_s": iter_times[0],
        "later_iterations_s": iter_times[1:],
        "kl": kls,
        "latent_rel_error": rel_err,
    }


def _subprocess_run(method: str, size: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--single", method, "--size", size],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--layout", default=None, help="the chunkop response's RowOperator layout= (default auto)")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        os.environ["BENCH_VI_LAYOUT"] = args.layout  # (the runs' subprocesses inherit it)
    if args.single:
        print(json.dumps(run(args.single, args.size)))
        return
    size = "quick" if args.quick else "full"
    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()
    runs: dict[str, list] = {"chunkop": [], "jax.vmap": []}
    for r in range(repeats):
        for method in ("chunkop", "jax.vmap") if r % 2 == 0 else ("jax.vmap", "chunkop"):
            res = _subprocess_run(method, size)
            runs[method].append(res)
            print(
                f"{method:9s} total {res['total_s']:6.1f} s  first iteration {res['first_iteration_s']:6.1f} s  "
                f"later {np.median(res['later_iterations_s']) if res['later_iterations_s'] else float('nan'):6.2f} s"
                f"  KL {res['kl'][-1]:.6g}  latent error {res['latent_rel_error']:.4f}",
                flush=True,
            )
    load_after = os.getloadavg()
    med = {m: statistics.median(x["total_s"] for x in v) for m, v in runs.items()}
    warm = {m: statistics.median(t for x in v for t in x["later_iterations_s"]) for m, v in runs.items()}
    kl_c, kl_v = runs["chunkop"][0]["kl"][-1], runs["jax.vmap"][0]["kl"][-1]
    summary = {
        "size": SIZES[size],
        "ratio_total_chunkop_over_vmap": med["chunkop"] / med["jax.vmap"],
        "ratio_warm_iteration": warm["chunkop"] / warm["jax.vmap"],
        "median_total_s": med,
        "median_warm_iteration_s": warm,
        "final_kl_relative_difference": abs(kl_c - kl_v) / abs(kl_v),
        "load_average_before_after": [load_before, load_after],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "runs": runs,
    }
    print(
        f"\nwhole run (compile included), chunkop / jax.vmap: {summary['ratio_total_chunkop_over_vmap']:.2f}x; "
        f"warm iteration: {summary['ratio_warm_iteration']:.2f}x; final KL relative difference "
        f"{summary['final_kl_relative_difference']:.2e}; load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vi.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
