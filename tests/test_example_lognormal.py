"""The astro example's positive prior (examples/astro_los/lognormal.py) against dense float64 references.

* the log field's prior covariance against one built here from the model's definition;
* the energy from the per-pixel statistics against the lines' own chi2 (dense response matrix);
* the mode (zero gradient of the dense energy) and the linearised Laplace sd of every bin and column
  against the dense Gauss-Newton metric's inverse;
* ``reconstruct.py --prior``: the choice, its record and its fallback.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "astro_los"))
import field3d
import lognormal
import reconstruct
from test_example_field3d import _dense_lines, _latent_statistics, _small_catalog

# (the last, field3d's sky-wide sd floor, is the Gaussian field's alone: the log field's sd is the same in every bin)
THETA = np.array([-1.0, -0.5, 0.3, np.log(0.4), np.log(0.3), np.log(1.5), np.log(1.5), np.log(300.0), 0.5, 0.3])


def _dense_log_covariance(edges: np.ndarray, theta: np.ndarray, shape: tuple) -> np.ndarray:
    """``Cov(s)`` over (bin, pixel) in :func:`lognormal.log_sky`'s order: ``C_r (x) K_xy`` plus the
    sky-wide mode's ``C_r0 (x) 11^T``, ``C_r = ln(1 + amp^2) R(ell_r, q^2)``, ``C_r0 = ln(1 + amp0^2)
    R(ell_r)``, ``K_xy`` the unit-variance periodic spectrum without its zero mode."""
    log_amp, log_amp0, log_ell, log_slope, log_ell_r, q2 = theta[3:9]
    r = np.sqrt(edges[:-1] * edges[1:])
    dr = np.abs(r[:, None] - r[None, :])
    long = np.exp(-dr / np.exp(log_ell_r))
    Cr = np.log1p(np.exp(2 * log_amp)) * (long + q2 * np.exp(-dr / field3d.SHORT_PC)) / (1 + q2)
    Cr0 = np.log1p(np.exp(2 * log_amp0)) * long
    nx, ny = shape
    n = nx * ny
    k2 = np.fft.fftfreq(nx)[:, None] ** 2 + np.fft.fftfreq(ny)[None, :] ** 2
    raw = (1 + (2 * np.pi * np.exp(log_ell)) ** 2 * k2) ** -np.exp(log_slope)
    raw[0, 0] = 0.0
    kfun = np.real(np.fft.ifft2(raw / (raw.sum() / n)))
    ix, iy = np.divmod(np.arange(n), ny)
    Kxy = kfun[(ix[:, None] - ix[None, :]) % nx, (iy[:, None] - iy[None, :]) % ny]
    return np.kron(Cr, Kxy) + np.kron(Cr0, np.ones((n, n)))


@pytest.fixture(scope="module")
def small():
    nx, ny, nb = 4, 3, 12
    cat = _small_catalog(np.random.default_rng(7), nx, ny, nb, 400, np.exp(-1.0))
    rad, data = _latent_statistics(cat)
    return cat, rad, data, (nx, ny)


def test_prior_energy_mode_and_sd_match_the_dense_model(small):
    cat, rad, data, shape = small
    nb, n = cat.n_bins, cat.n_pix
    A = _dense_lines(cat)
    iv = 1.0 / cat.sigma.astype(np.float64) ** 2
    fns = np.stack([np.diff(cat.edges), 1 / cat.edges[:-1] - 1 / cat.edges[1:]])
    with jax.enable_x64(True):
        P = lognormal.prior(THETA, rad, shape)
        D, t = jnp.asarray(data.D, jnp.float64), jnp.asarray(data.t, jnp.float64)
        zero = jnp.zeros((nb, *shape))
        # the prior: log_sky is linear in xi, its covariance the model's
        Jl = np.asarray(jax.jacfwd(lambda x: lognormal.log_sky(P, x).ravel())(zero)).reshape(nb * n, nb * n)
        np.testing.assert_allclose(Jl @ Jl.T, _dense_log_covariance(cat.edges, THETA, shape), atol=1e-10)
        np.testing.assert_allclose(np.asarray(lognormal.log_sky(P, zero))[:, 0, 0], np.asarray(P["m"]), rtol=1e-12)

        def sky_rows(x):  # (n_pix * n_bins,) in the dense response's order: pixel-major
            return jnp.exp(lognormal.log_sky(P, x)).reshape(nb, -1).T.ravel()

        def dense_energy(x):
            res = cat.y - A @ sky_rows(x)
            return 0.5 * jnp.sum(x**2) + 0.5 * jnp.sum(iv * res**2)

        rng = np.random.default_rng(0)
        for scale in (0.0, 0.3):
            xi = jnp.asarray(scale * rng.standard_normal((nb, *shape)))
            got = float(lognormal.energy(P, D, t, xi)) + 0.5 * float(data.yy)
            # (the statistics are float32 sums: relative 1e-6 of the chi2's size)
            assert got == pytest.approx(float(dense_energy(xi)), rel=1e-5), scale
        mode, path = lognormal.map_estimate(P, D, t, shape, nb)
        assert path[-1][1] < path[0][0] and len(path) < lognormal.NEWTON_STEPS
        g = np.asarray(jax.grad(dense_energy)(mode))
        g0 = np.asarray(jax.grad(dense_energy)(zero))
        assert np.linalg.norm(g) < 1e-3 * np.linalg.norm(g0)
        # the linearised Laplace covariance at the mode: Js M^-1 Js^T, M = I + Jsky^T A^T N^-1 A Jsky
        Js = np.asarray(jax.jacfwd(sky_rows)(mode)).reshape(n * nb, nb * n)
        M = np.eye(nb * n) + Js.T @ A.T @ (iv[:, None] * A) @ Js
        cov = Js @ np.linalg.solve(M, Js.T)
        F = np.kron(np.eye(n), fns)
        std_ref = np.sqrt(np.diag(cov)).reshape(n, nb)
        fsd_ref = np.sqrt(np.diag(F @ cov @ F.T)).reshape(n, -1)
        post = lognormal.posterior(THETA, data, rad, fns, pairs=256)
        smode = np.asarray(sky_rows(mode)).reshape(n, nb)
    np.testing.assert_allclose(post["mean"], smode, rtol=1e-5)
    np.testing.assert_allclose(post["fmean"], smode @ fns.T, rtol=1e-5)
    # 256 mirrored pairs: ~4.4% sampling error per sd (as field3d's test of its own samples)
    np.testing.assert_allclose(post["std"], std_ref, rtol=0.18)
    np.testing.assert_allclose(post["fstd"], fsd_ref, rtol=0.18)
    assert abs(np.mean(post["std"] / std_ref) - 1) < 0.03
    assert abs(np.mean(post["fstd"] / fsd_ref) - 1) < 0.03
    assert np.all(post["mean"] > 0)  # a positive field
    # the lines' chi2 from the statistics, against the dense residual of the mode
    dense_chi2 = float(np.sum(iv * (cat.y - A @ smode.ravel()) ** 2))
    # (yy - 2 t.u + u D u cancels: the float32 statistics' rounding is ~1e-7 of yy, here 390x the chi2)
    tol = 1e-6 * float(data.yy)
    assert post["chi2"] == pytest.approx(dense_chi2, abs=tol) and tol < 1e-2 * dense_chi2
    assert lognormal.line_chi2(data, rad.V, smode) == pytest.approx(dense_chi2, abs=tol)
    assert post["converged"]


def test_the_start_is_the_ridge_solution_and_the_mode_is_the_same_from_it(small, monkeypatch):
    cat, rad, data, shape = small
    nb = cat.n_bins
    with jax.enable_x64(True):
        P = lognormal.prior(THETA, rad, shape)
        D, t = jnp.asarray(data.D, jnp.float64), jnp.asarray(data.t, jnp.float64)
        rng = np.random.default_rng(3)
        sky = jnp.asarray(np.exp(np.asarray(lognormal.log_sky(P, jnp.asarray(rng.standard_normal((nb, *shape)))))))
        sky = sky.at[0, 0, 0].set(-1.0)  # a Gaussian map may dip below zero: floored, never a NaN
        floor = jnp.exp(P["m"] - 2 * P["sd"])[:, None, None]
        y = jnp.log(jnp.maximum(sky, floor)) - P["m"][:, None, None]

        def ridge(x):  # what start() minimises, written out
            s = lognormal.log_sky(P, x) - P["m"][:, None, None]
            return 0.5 * jnp.sum(x**2) + 0.5 / lognormal.START_SD**2 * jnp.sum((s - y) ** 2)

        xi0 = lognormal.start(P, sky)
        assert np.all(np.isfinite(np.asarray(xi0)))
        g = np.asarray(jax.grad(ridge)(xi0))
        assert np.linalg.norm(g) < 1e-9 * np.linalg.norm(np.asarray(jax.grad(ridge)(jnp.zeros_like(xi0))))
        # the mode does not depend on where it is sought from (to the 0.5-nat stop's accuracy)
        m0, _ = lognormal.map_estimate(P, D, t, shape, nb)
        m1, path = lognormal.map_estimate(P, D, t, shape, nb, xi0)
        assert lognormal.settled(path)
        grad = jax.grad(lambda x: lognormal.energy(P, D, t, x))
        assert np.linalg.norm(grad(m1)) < 1e-3 * np.linalg.norm(grad(jnp.zeros_like(m1)))
        np.testing.assert_allclose(np.exp(lognormal.log_sky(P, m1)), np.exp(lognormal.log_sky(P, m0)), rtol=5e-3)
        # a CG budget ends the search: the direction that passes it is the last
        monkeypatch.setattr(lognormal, "NEWTON_CG_BUDGET", 1)
        _, short = lognormal.map_estimate(P, D, t, shape, nb)
        assert len(short) == 1 and lognormal.cg_steps(short) == short[0][2] >= 1


def test_posterior_refuses_a_coarsened_grid_too_many_cells_or_a_bad_start(small, monkeypatch):
    cat, rad, data, _ = small
    fns = np.diff(cat.edges)[None]
    coarse = field3d.Data(D=data.D, t=data.t, yy=data.yy, log_norm=data.log_norm, grid=field3d.grid_for(4, 3, 4))
    assert coarse.grid.factor > 1
    with jax.enable_x64(True), pytest.raises(ValueError, match=r"holds the whole sky.*blocks of 2 x 2"):
        lognormal.posterior(THETA, coarse, rad, fns)
    good = np.ones((cat.n_pix, cat.n_bins))
    with (
        jax.enable_x64(True),
        pytest.raises(ValueError, match=r"start_sky: expected .* \(12, 12\) map, got shape \(12, 11\)"),
    ):
        lognormal.posterior(THETA, data, rad, fns, start_sky=good[:, :-1])
    with jax.enable_x64(True), pytest.raises(ValueError, match=r"start_sky: .* with non-finite values"):
        lognormal.posterior(THETA, data, rad, fns, start_sky=np.where(good > 0, np.nan, good))
    monkeypatch.setattr(lognormal, "MAX_CELLS", cat.n_pix * cat.n_bins - 1)
    with jax.enable_x64(True), pytest.raises(ValueError, match="at most 143 cells"):
        lognormal.posterior(THETA, data, rad, fns)


def test_the_prior_choice_is_recorded_and_falls_back(small, monkeypatch):
    cat, rad, data, _ = small
    fns = np.stack([np.diff(cat.edges), 1 / cat.edges[:-1] - 1 / cat.edges[1:]])
    kept = {"data": data, "rad": rad, "theta": THETA, "functionals": fns}
    n, nb = cat.n_pix, cat.n_bins
    r = {k: np.zeros((n, nb)) for k in ("mean", "std")} | {"timings": {}}
    m = cat.n_los
    assert reconstruct._with_prior(r, kept, "gaussian", 8, m)["prior"] == {"name": "gaussian", "why": "asked"}
    got = reconstruct._with_prior(r, kept, "auto", 8, m)
    assert got["prior"]["name"] == "lognormal" and got["mean"].shape == (n, nb) and got["column_std"].shape == (n,)
    assert len(got["prior"]["sample_cg_steps"]) == 4  # 8 samples asked: 4 mirrored pairs
    # (an empty sky's chi2 is the data's own: the log-normal mode fits better)
    assert got["prior"]["chi2_per_line"] < got["prior"]["gaussian_chi2_per_line"] and "warning" not in got["prior"]
    # a mode that fits the lines worse than the Gaussian map: "auto" keeps the Gaussian one, drawing no samples
    with monkeypatch.context() as mp:
        mp.setattr(reconstruct, "CHI2_SD", -1e9)
        worse = reconstruct._with_prior(r, kept, "auto", 8, m)
        assert worse["prior"]["name"] == "gaussian" and worse["mean"] is r["mean"]
        assert "fits the lines worse" in worse["prior"]["why"] and worse["prior"]["lognormal"]["converged"]
        asked = reconstruct._with_prior(r, kept, "lognormal", 8, m)
        assert asked["prior"]["name"] == "lognormal" and "fits the lines worse" in asked["prior"]["warning"]
    # a mode not reached (one Gauss-Newton step allowed)
    with monkeypatch.context() as mp:
        mp.setattr(lognormal, "NEWTON_STEPS", 1)
        unreached = reconstruct._with_prior(r, kept, "auto", 8, m)
        assert unreached["prior"]["name"] == "gaussian" and "not reached in 1 Gauss-Newton" in unreached["prior"]["why"]
        assert not unreached["prior"]["lognormal"]["converged"]
    monkeypatch.setattr(lognormal, "MAX_CELLS", n * nb - 1)
    assert reconstruct._with_prior(r, kept, "auto", 8, m)["prior"]["name"] == "gaussian"
    with pytest.raises(ValueError, match="prior must be one of"):
        reconstruct.reconstruct_standard(cat, prior="normal")


def test_docstring_example_passes():
    import doctest

    failed, attempted = doctest.testmod(lognormal, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted >= 1 and failed == 0


def test_a_poor_mode_asked_for_is_kept_with_a_warning_and_auto_says_why(small, monkeypatch):
    # the whole run on the small catalog, the mode cut at one Gauss-Newton step: "lognormal" keeps it
    # and its summary warns; "auto" keeps the Gaussian field and its summary's prior record says why
    cat = small[0]
    monkeypatch.setattr(lognormal, "NEWTON_STEPS", 1)
    asked = reconstruct.reconstruct_standard(cat, samples=4, figures=False, prior="lognormal")["summary"]
    assert asked["prior"]["name"] == "lognormal" and not asked["prior"]["converged"]
    assert any("log-normal prior was asked for, but its mode was not reached" in w for w in asked["warnings"])
    rec = reconstruct.reconstruct_standard(cat, samples=4, figures=False, prior="auto")
    auto = rec["summary"]
    assert auto["prior"]["name"] == "gaussian" and "not reached in 1 Gauss-Newton" in auto["prior"]["why"]
    assert not any("log-normal" in w for w in auto["warnings"])
    # the Gaussian map kept is made a density (field3d.nonnegative), its columns those of the map written
    assert set(auto["prior"]["nonnegative"]) == {"pixels", "cells", "seconds"}
    assert np.all(rec["mean"] >= 0) and auto["negative_density"]["cells"] == 0
    np.testing.assert_allclose(rec["column"], rec["mean"].astype(np.float64) @ np.diff(cat.edges), rtol=1e-12)
    # beyond what the whole sky holds, the map stays the posterior mean and the prior record says why
    monkeypatch.setattr(lognormal, "MAX_CELLS", cat.n_pix * cat.n_bins - 1)
    big = reconstruct.reconstruct_standard(cat, samples=4, figures=False, prior="gaussian")["summary"]
    assert "at most" in big["prior"]["nonnegative"] and "cells" in big["negative_density"]
