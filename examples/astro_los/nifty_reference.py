"""Reference posteriors for the tiny NIFTy.re problem of ``nifty_vi.py``: is MGVI's coverage the model's?

    python examples/astro_los/nifty_reference.py [--prior default|inferred|wide] [--noise F] [--seed S]
                                                 [--checks linear,laplace,hmc] [--hmc-iters N] [--out FILE]

All three hold the spectrum's hyperparameters at their true values and work on the 576 excitations
``sky xi`` of the ``tiny`` size with dense float64 linear algebra (a few seconds each, HMC a minute
or two):

* ``linear``: the model linearised at the truth, ``y = F(xi_t) + J (xi - xi_t) + noise``, a linear
  Gaussian problem with the same operator, prior and noise. Its exact posterior ``(1 + J^T J /
  sigma^2)^-1`` against MGVI run on it with the example's ``optimize_kl`` settings: coverage of the
  truth's column, measured combination and log-sky (linear functionals, so exact Gaussians), and the
  ratio of MGVI's to the exact posterior std. MGVI is exact on a linear problem up to sampling noise.
  Also: the reduced chi^2 of the data when that exact Gaussian's samples are pushed through the
  nonlinear model (1 if the model is linear over the posterior's width).
* ``laplace``: the nonlinear model's MAP (Gauss-Newton) and the Laplace posterior there, 200
  mirrored samples pushed through the nonlinear sky and the example's ``posterior_stats``. Two
  numbers say how Gaussian the posterior is: the reduced chi^2 of the data over the Laplace samples
  (1 if the posterior is Gaussian in the latent space; MGVI's KL pays for every unit above) and the
  truth's squared distance from the MAP in the Laplace metric per dimension (1 for a Gaussian).
* ``hmc``: Hamiltonian Monte Carlo on the nonlinear posterior, in the coordinates whitened by the
  Laplace posterior (step size adapted in the first quarter, 20 leapfrog steps): the exact
  posterior's coverage, up to the chain's length.

Used by ``docs/nifty.md`` ("Why the first version was over-confident").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nifty.re as jft
import nifty_vi


@dataclasses.dataclass
class Dense:
    """The problem in the excitations ``sky xi`` (flattened), the hyperparameters at their truth."""

    S: nifty_vi.Setup
    x_t: np.ndarray  # the truth's excitations, float64
    fwd: object  # x -> data, jitted
    jac: object  # x -> d data / d x, jitted
    sky: object  # x -> sky, jitted
    vsky: object  # (n, x) -> (n, sky), jitted

    @classmethod
    def of(cls, S: nifty_vi.Setup) -> Dense:
        tree = S.xi_true.tree
        shape = tree["sky xi"].shape

        def sky(x):
            return S.sky({**tree, "sky xi": x.reshape(shape)})

        def fwd(x):
            return S.A.mv(sky(x))

        x_t = np.asarray(tree["sky xi"], np.float64).reshape(-1)
        return cls(S, x_t, jax.jit(fwd), jax.jit(jax.jacfwd(fwd)), jax.jit(sky), jax.jit(jax.vmap(sky)))

    @property
    def n(self) -> int:
        return self.x_t.size

    def f64(self, fn, x):
        return np.asarray(fn(jnp.asarray(x, jnp.float32)), np.float64)

    def metric(self, x) -> tuple[np.ndarray, np.ndarray]:
        J = self.f64(self.jac, x)
        return J, np.eye(self.n) + J.T @ J / self.S.sigma**2

    def energy(self, x) -> float:
        r = (np.asarray(self.S.y, np.float64) - self.f64(self.fwd, x)) / self.S.sigma
        return 0.5 * r @ r + 0.5 * x @ x

    def stats(self, xs: np.ndarray) -> dict:
        """Coverage of the truth by the samples ``xs`` through the example's ``posterior_stats``."""
        st = nifty_vi.posterior_stats(self.S, self.vsky(jnp.asarray(xs, jnp.float32)))
        z_log = np.asarray(st["log_sky_z"])
        return {
            **nifty_vi.column_coverage(st),
            "log_sky_within_2std": float(np.mean(np.abs(z_log) < 2)),
            "per_bin_log_sky_within_2std": [round(float(c), 3) for c in np.mean(np.abs(z_log) < 2, 0)],
            "per_bin_mean_z": [round(float(c), 2) for c in z_log.mean(0)],
        }


def _mirrored(center: np.ndarray, L: np.ndarray, n_pairs: int, rng: np.random.Generator) -> np.ndarray:
    e = L @ rng.standard_normal((center.size, n_pairs))
    return np.concatenate([center[:, None] + e, center[:, None] - e], 1).T


def linear_check(D: Dense) -> dict:
    """Exact posterior of the model linearised at the truth, and MGVI (the example's settings) on it."""
    S, x_t, n = D.S, D.x_t, D.n
    J, P = D.metric(x_t)
    Jsky = D.f64(jax.jit(jax.jacfwd(D.sky)), x_t)  # (n_pix, n_bins, n)
    sky_t = np.asarray(S.sky_true, np.float64)
    y_t = D.f64(D.fwd, x_t)
    y = np.asarray(S.y, np.float64)
    C = np.linalg.inv(P)
    C = 0.5 * (C + C.T)
    m = C @ (J.T @ (y - y_t + J @ x_t) / S.sigma**2)
    v = nifty_vi.measured_weights(S.edges)
    funcs = {  # linear functionals of the linearised sky: (value at the truth, gradient)
        "column": (sky_t.sum(-1), Jsky.sum(1)),
        "measured": (sky_t @ v, np.einsum("pkn,k->pn", Jsky, v)),
        "log_sky": (np.log(sky_t).reshape(-1), (Jsky / sky_t[..., None]).reshape(-1, n)),
    }

    def cover(mean_x, sd_of):
        out = {}
        for k, (_, G) in funcs.items():
            z = (G @ (x_t - mean_x)) / sd_of(G)
            out[k] = float(np.mean(np.abs(z) < 2))
        return out

    # the linear problem's exact posterior pushed through the nonlinear model: how far it is off the data
    xs_lin = _mirrored(m, np.linalg.cholesky(C), 100, np.random.default_rng(1))
    chi2_nl = float(np.mean(((D.f64(jax.vmap(D.fwd), xs_lin) - y) / S.sigma) ** 2))
    exact_sd = {k: np.sqrt(np.einsum("in,nm,im->i", G, C, G)) for k, (_, G) in funcs.items()}
    exact = cover(m, lambda G: np.sqrt(np.einsum("in,nm,im->i", G, C, G)))

    shape = S.xi_true.tree["sky xi"].shape
    xi_t = S.xi_true.tree["sky xi"]
    y_t32 = jnp.asarray(y_t, jnp.float32)

    class Linearised(jft.Model):
        def __init__(self):
            super().__init__(domain={"sky xi": jft.ShapeWithDtype(shape, jnp.float32)})

        def init(self, key):  # standard normal excitations, as the example's model
            return {"sky xi": jax.random.normal(key, shape, jnp.float32)}

        def __call__(self, p):
            p = p.tree if isinstance(p, jft.Vector) else p
            dx = (p["sky xi"] - xi_t).reshape(-1)
            return jax.jvp(lambda x: S.A.mv(D.sky(x)), (jnp.asarray(x_t, jnp.float32),), (dx,))[1] + y_t32

    inv = 1.0 / S.sigma
    lh = jft.Gaussian(S.y, noise_cov_inv=lambda r: inv**2 * r, noise_std_inv=lambda r: inv * r).amend(Linearised())
    key, k0 = jax.random.split(jax.random.key(S.size.nx + 7))
    xi0 = jax.tree_util.tree_map(lambda a: 0.1 * a, jft.Vector(lh.init(k0)))
    cg = nifty_vi.CountingCG()
    smp, _ = jft.optimize_kl(lh, xi0, key=key, odir=None, **nifty_vi.optimize_kl_settings(S.size, n, cg))
    xs = np.asarray(smp.samples.tree["sky xi"], np.float64).reshape(len(smp), n)
    mm = xs.mean(0)
    mgvi = cover(mm, lambda G: (xs @ G.T).std(0, ddof=1))
    ratio = {k: float(np.median((xs @ G.T).std(0, ddof=1) / exact_sd[k])) for k, (_, G) in funcs.items()}
    d = xs - mm
    return {
        "exact_within_2std": exact,
        "reduced_chi2_data_of_exact_linear_samples_through_the_nonlinear_model": chi2_nl,
        "mgvi_within_2std": mgvi,
        "mgvi_over_exact_std_median": ratio,
        "mgvi_mean_offset_in_exact_sigmas_rms": float(np.sqrt((mm - m) @ P @ (mm - m) / n)),
        "mgvi_residual_dPd_per_dim": float(np.mean(np.einsum("sn,nm,sm->s", d, P, d)) / n),
        "mgvi_samples": len(smp),
        "sample_cg_converged": f"{sum(c[1] for c in cg.calls)}/{len(cg.calls)}",
    }


def laplace(D: Dense, max_steps: int = 200) -> tuple[dict, np.ndarray, np.ndarray]:
    """Gauss-Newton MAP from the truth (with backtracking), the Laplace posterior there."""
    x = D.x_t.copy()
    y = np.asarray(D.S.y, np.float64)
    converged, n_steps = False, 0
    while n_steps < max_steps and not converged:
        n_steps += 1
        J, P = D.metric(x)
        step = np.linalg.solve(P, J.T @ (y - D.f64(D.fwd, x)) / D.S.sigma**2 - x)
        e0, t = D.energy(x), 1.0
        while D.energy(x + t * step) > e0 and t > 1e-4:
            t /= 2
        x = x + t * step
        converged = bool(np.abs(step).max() < 1e-4)  # the full Gauss-Newton step, not the damped one
    J, P = D.metric(x)
    C = np.linalg.inv(P)
    L = np.linalg.cholesky(0.5 * (C + C.T))
    xs = _mirrored(x, L, 100, np.random.default_rng(0))
    chi2 = float(np.mean(((D.f64(jax.vmap(D.fwd), xs) - y) / D.S.sigma) ** 2))
    dx = D.x_t - x
    out = {
        "gauss_newton_steps": n_steps,
        "map_converged": converged,
        "reduced_chi2_data_over_laplace_samples": chi2,
        "truth_distance_per_dim": float(dx @ P @ dx / D.n),
        "energy_truth_minus_map": D.energy(D.x_t) - D.energy(x),
        **D.stats(xs),
    }
    return out, x, L


def hmc(D: Dense, x_map: np.ndarray, L: np.ndarray, n_iter: int = 2000, n_leap: int = 20) -> dict:
    """HMC in ``x = x_map + L z`` (identity mass); the first quarter adapts the step size and is dropped."""
    S = D.S
    Lj, mj = jnp.asarray(L, jnp.float32), jnp.asarray(x_map, jnp.float32)

    def U(z):
        x = mj + Lj @ z
        r = (S.y - S.A.mv(D.sky(x))) / S.sigma
        return 0.5 * jnp.sum(r * r) + 0.5 * jnp.sum(x * x)

    gU = jax.grad(U)

    @jax.jit
    def step(z, key, eps):
        k1, k2, k3 = jax.random.split(key, 3)
        p = jax.random.normal(k1, z.shape)
        e = eps * jax.random.uniform(k3, minval=0.8, maxval=1.2)

        def leap(c, _):
            zz, pp = c
            pp = pp - 0.5 * e * gU(zz)
            zz = zz + e * pp
            return (zz, pp - 0.5 * e * gU(zz)), None

        (z1, p1), _ = jax.lax.scan(leap, (z, p), None, length=n_leap)
        h0, h1 = U(z) + 0.5 * p @ p, U(z1) + 0.5 * p1 @ p1
        acc = jnp.where(jnp.isfinite(h1), jnp.exp(jnp.minimum(0.0, h0 - h1)), 0.0)
        return jnp.where(jax.random.uniform(k2) < acc, z1, z), acc

    z, eps, key = jnp.zeros(D.n, jnp.float32), 0.1, jax.random.key(101)
    kept, acc = [], []
    for i in range(n_iter):
        key, k = jax.random.split(key)
        z, a = step(z, k, eps)
        if i < n_iter // 4:
            eps *= float(np.exp(0.05 * (float(a) - 0.75)))
        else:
            kept.append(np.asarray(z, np.float64))
            acc.append(float(a))
    zs = np.array(kept)
    xs = x_map[None] + zs @ L.T
    q = len(xs) // 2
    halves = [D.stats(h[:: max(1, len(h) // 200)])["column_within_2std"] for h in (xs[:q], xs[q:])]
    return {
        "iterations": n_iter,
        "kept": len(xs),
        "acceptance": float(np.mean(acc)),
        "step_size": eps,
        "column_within_2std_halves": halves,
        **D.stats(xs[:: max(1, len(xs) // 400)]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prior", default="default", choices=sorted(nifty_vi.PRIORS))
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checks", default="linear,laplace,hmc")
    p.add_argument("--hmc-iters", type=int, default=2000)
    p.add_argument("--out", default=None, help="write the results as JSON")
    a = p.parse_args(argv)
    S = nifty_vi.make_setup("tiny", seed=a.seed, noise=a.noise, prior=a.prior)
    D = Dense.of(S)
    res: dict = {"prior": a.prior, "noise": a.noise, "seed": a.seed}
    checks = a.checks.split(",")
    for name in checks:
        t0 = time.perf_counter()
        if name == "linear":
            res["linear"] = linear_check(D)
        elif name == "laplace" or (name == "hmc" and "laplace" not in res):
            res["laplace"], x_map, L = laplace(D)
        if name == "hmc":
            res["hmc"] = hmc(D, x_map, L, a.hmc_iters)
        res.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: res.get(name, res.get("laplace"))}, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
