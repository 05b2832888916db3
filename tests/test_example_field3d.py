"""The astro example's standard response and its 3-D prior (examples/astro_los: los.py, field3d.py).

* the standard response's weights against the formula written here in float64 NumPy/SciPy;
* the realistic star draws (counts growing as ``d^2``);
* the catalog's ``response`` entry;
* the 3-D prior's posterior (mean and the column's sd, from samples) against a dense float64 Gaussian
  posterior built here from the model's definition (Kronecker covariance, dense response matrix);
* the CLI on a tiny catalog: outputs (``column_std.npy`` included), fit and coverage.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from scipy.special import erfc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "astro_los"))
import catalog
import field3d
import los
import reconstruct


def _standard_reference(d: np.ndarray, s: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``w_k = (b_{k+1} - b_k) * erfc((ln sqrt(b_k b_{k+1}) - ln d) / (sqrt(2) s / d)) / 2`` in float64."""
    d, s = np.asarray(d, np.float64)[:, None], np.asarray(s, np.float64)[:, None]
    r = np.sqrt(b[:-1] * b[1:])[None, :]
    return (b[1:] - b[:-1])[None, :] * 0.5 * erfc((np.log(r) - np.log(d)) / (np.sqrt(2.0) * s / d))


def test_standard_weights_match_the_formula_in_float64():
    rng = np.random.default_rng(3)
    b = los.bin_edges(40)
    pix, d, s = los.draw_stars(400, 10, rng)
    ref = _standard_reference(d, s, b)
    w32 = np.asarray(los.standard_weights(jnp.asarray(d), jnp.asarray(s), b))
    assert w32.dtype == np.float32 and w32.shape == (400, 40)
    np.testing.assert_allclose(w32, ref, rtol=2e-5, atol=2e-6 * ref.max())
    with jax.enable_x64(True):
        w64 = np.asarray(los.response_weights(np.asarray(d, np.float64), np.asarray(s, np.float64), b, "standard"))
    np.testing.assert_allclose(w64, ref, rtol=1e-12, atol=0)
    # the operator with this response is the dense matrix of these weights
    x = rng.standard_normal((10, 40)).astype(np.float32)
    A = los.make_los_operator(pix, d, s, n_pix=10, edges=b, chunk_size=128, response="standard")
    np.testing.assert_allclose(np.asarray(A.mv(jnp.asarray(x))), np.sum(ref * x[pix], 1), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="response must be one of"):
        los.response_weights(d, s, b, "other")


def test_stars_are_uniform_in_volume():
    # counts ~ d^2 between the edges: P(d < x) = (x^3 - lo^3) / (hi^3 - lo^3); Kolmogorov-Smirnov at 1e-3
    from scipy.stats import kstest

    _, d, s = los.draw_stars(20_000, 5, np.random.default_rng(0))
    lo, hi = los.R_MIN, los.R_MAX
    assert kstest(d.astype(np.float64), lambda x: (x**3 - lo**3) / (hi**3 - lo**3)).pvalue > 1e-3
    assert np.all((s > 0) & (s < 0.3 * d))


def test_catalog_response_entry(tmp_path):
    kw = dict(pix=[0, 1], d=[100.0, 200.0], s=[10.0, 20.0], y=[1.0, 2.0], sigma=[0.1, 0.1], nx=2, ny=1)
    kw["edges"] = [40.0, 500.0, 1700.0]
    cat = catalog.write_catalog(tmp_path / "a.npz", **kw, response="seed")
    assert catalog.load_catalog(tmp_path / "a.npz").response == "seed" == cat.response
    assert catalog.write_catalog(tmp_path / "b.npz", **kw).response is None
    assert reconstruct.resolve_response(catalog.load_catalog(tmp_path / "b.npz"), None) == "standard"
    with pytest.raises(ValueError, match="measured with 'seed'"):
        reconstruct.resolve_response(cat, "standard")
    with pytest.raises(catalog.CatalogError, match="field 'response'"):
        catalog.write_catalog(tmp_path / "c.npz", **kw, response="linear")
    # s is the distance's sd in pc under the standard response: a fraction of d, or a wrong unit, is flagged
    assert reconstruct.s_warnings(cat) == []  # s = 0.1 d
    (w,) = reconstruct.s_warnings(catalog.validate_catalog({**kw, "s": [0.1, 0.1]}))
    assert "fraction of d" in w
    (w,) = reconstruct.s_warnings(catalog.validate_catalog({**kw, "s": [1e3, 2e3]}))
    assert "right unit" in w
    with pytest.raises(catalog.CatalogError, match="field 's'"):
        catalog.validate_catalog({**kw, "s": [10.0, 0.0]})


def _dense_prior(edges: np.ndarray, theta: np.ndarray, grid_shape: tuple, plane: bool = True):
    """The model's prior in float64, densely: ``mu`` (``n_bins``) and the covariance of ``f`` over
    (pixel, bin), ``K_xy (x) Sigma_r`` on the non-zero plane-of-sky modes plus the sky-wide mode
    ``(amp0 / amp)^2 11^T (x) Sigma_r0`` (``Sigma_r0``: the long radial correlation alone, its sd
    ``amp (mu + floor exp(a))``); with
    ``plane=False`` the pixels independent but for the sky-wide mode (``pixelwise_evidence``'s model)."""
    a, b, c, log_amp, log_amp0, log_ell, log_slope, log_ell_r, q2, floor = theta
    r, db = np.sqrt(edges[:-1] * edges[1:]), np.diff(edges)
    t = (2 * r - edges[0] - edges[-1]) / (edges[-1] - edges[0])  # the distance on [-1, 1]
    shape = b * t + c * t**2
    mu = np.exp(a + shape) / (np.sum(db * np.exp(shape)) / np.sum(db))
    sig = np.exp(log_amp) * mu
    dr = np.abs(r[:, None] - r[None, :])
    long = np.exp(-dr / np.exp(log_ell_r))
    Sr = sig[:, None] * (long + q2 * np.exp(-dr / field3d.SHORT_PC)) / (1 + q2) * sig[None, :]
    sig0 = np.exp(log_amp) * (mu + floor * np.exp(a))
    Sr0 = sig0[:, None] * long * sig0[None, :]
    nx, ny = grid_shape
    n = nx * ny
    if plane:
        k2 = np.fft.fftfreq(nx)[:, None] ** 2 + np.fft.fftfreq(ny)[None, :] ** 2
        raw = (1 + (2 * np.pi * np.exp(log_ell)) ** 2 * k2) ** -np.exp(log_slope)
        raw[0, 0] = 0.0
        power = raw / (raw.sum() / n)  # unit pointwise variance of the non-zero modes
        kfun = np.real(np.fft.ifft2(power))  # the covariance as a function of the (periodic) displacement
        ix, iy = np.divmod(np.arange(n), ny)
        Kxy = kfun[(ix[:, None] - ix[None, :]) % nx, (iy[:, None] - iy[None, :]) % ny]
    else:
        Kxy = np.eye(n)
    return mu, np.kron(Kxy, Sr) + np.exp(2 * (log_amp0 - log_amp)) * np.kron(np.ones((n, n)), Sr0)


def _small_catalog(rng, nx: int, ny: int, nb: int, n: int, level: float):
    """``n`` stars on an ``nx x ny`` sky of ``nb`` bins, the sky ``level`` times a log-normal field,
    5% noise (a catalog the dense references can hold)."""
    edges = los.bin_edges(nb)
    pix, d, s = los.draw_stars(n, nx * ny, rng)
    W = _standard_reference(d, s, edges)
    y0 = np.sum(W * (level * np.exp(0.3 * rng.standard_normal((nx * ny, nb))))[pix], 1)
    sigma = np.full(n, 0.05 * np.sqrt(np.mean(y0**2)))
    y = y0 + sigma * rng.standard_normal(n)
    return catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=y, sigma=sigma, nx=nx, ny=ny, edges=edges))


def _dense_lines(cat) -> np.ndarray:
    """The response as a dense ``(n_lines, n_pix * n_bins)`` matrix, the weights in float64."""
    W = _standard_reference(cat.d, cat.s, cat.edges)
    A = np.zeros((cat.n_los, cat.n_pix * cat.n_bins))
    for k in range(cat.n_bins):
        A[np.arange(cat.n_los), cat.pix * cat.n_bins + k] = W[:, k]
    return A


def _latent_statistics(cat):
    """``(rad, data)`` of ``cat`` with every radial vector kept (no truncation), every pixel latent
    (float64 where ``field3d`` wants it: use them under ``jax.enable_x64``)."""
    V, _ = field3d.radial_basis(cat, "standard")
    g, _, _ = field3d.compress_lines(cat, V, "standard")
    with jax.enable_x64(True):
        return field3d.Radial.of(cat.edges, V), field3d.data_on(cat, g, field3d.grid_for(cat.nx, cat.ny, 10**6))


def _dense_posterior(cat, theta: np.ndarray, grid_shape: tuple, fns: np.ndarray):
    """The model's posterior in float64, densely (:func:`_dense_prior`)."""
    n = grid_shape[0] * grid_shape[1]
    mu, Cf = _dense_prior(cat.edges, theta, grid_shape)
    A = _dense_lines(cat)
    Nv = cat.sigma.astype(np.float64) ** 2
    S = A @ Cf @ A.T + np.diag(Nv)
    CA = Cf @ A.T
    mean = np.tile(mu, n) + CA @ np.linalg.solve(S, cat.y - A @ np.tile(mu, n))
    cov = Cf - CA @ np.linalg.solve(S, CA.T)
    F = np.kron(np.eye(n), fns)  # (n * m, n * n_bins): the functionals per pixel
    fsd = np.sqrt(np.diag(F @ cov @ F.T)).reshape(n, -1)
    return mean.reshape(n, -1), np.sqrt(np.diag(cov)).reshape(n, -1), fsd


def test_posterior_matches_dense_gaussian():
    # a 4 x 3 sky, 12 bins, all radial vectors kept (no truncation): the latent-space solve, the
    # recovery of the sky from the data-seen field and the samples' column sd are those of the model
    nx, ny, nb = 4, 3, 12
    cat = _small_catalog(np.random.default_rng(7), nx, ny, nb, 400, np.exp(-1.0))
    edges = cat.edges
    theta = np.array([-1.0, -0.5, 0.3, np.log(0.4), np.log(0.3), np.log(1.5), np.log(1.5), np.log(300.0), 0.5, 0.3])
    fns = np.stack([np.diff(edges), 1 / edges[:-1] - 1 / edges[1:]])
    mean_ref, std_ref, fsd_ref = _dense_posterior(cat, theta, (nx, ny), fns)

    rad, data = _latent_statistics(cat)
    with jax.enable_x64(True):
        post = field3d.posterior(theta, data, rad, fns, pairs=256, tol=1e-4)
    scale = np.abs(mean_ref).max()
    np.testing.assert_allclose(post["mean"], mean_ref, rtol=0, atol=2e-3 * scale)
    np.testing.assert_allclose(post["prior_sd"] ** 2, np.diag(_dense_prior(edges, theta, (nx, ny))[1])[:nb], rtol=1e-9)
    # sd from 256 mirrored pairs (a ~4.4% sampling error each: 4 of those) plus the analytic unseen
    # part; unbiased on average (measured: mean ratios 0.990 and 1.007)
    np.testing.assert_allclose(post["std"], std_ref, rtol=0.18)
    np.testing.assert_allclose(post["fstd"], fsd_ref, rtol=0.18)
    assert abs(np.mean(post["std"] / std_ref) - 1) < 0.03
    assert abs(np.mean(post["fstd"] / fsd_ref) - 1) < 0.03


def test_pixelwise_evidence_matches_dense_gaussian():
    # the exact log evidence of the model without plane-of-sky correlation (independent pixels and the
    # sky-wide mode, its own radial correlation) from the per-pixel statistics: that of the dense
    # Gaussian y ~ N(A mu, A C A^T + N), all radial vectors kept
    nx, ny, nb, n = 3, 2, 10, 150
    cat = _small_catalog(np.random.default_rng(11), nx, ny, nb, n, 0.4)
    A = _dense_lines(cat)
    rad, data = _latent_statistics(cat)
    for q2, floor in ((0.0, 0.0), (0.8, 0.0), (0.8, 0.5)):
        theta = np.array([-1.0, -0.5, 0.3, np.log(0.4), np.log(1.2), np.log(1.5), np.log(1.5), np.log(300.0), q2])
        theta = np.append(theta, floor)
        mu, Cf = _dense_prior(cat.edges, theta, (nx, ny), plane=False)
        S = A @ Cf @ A.T + np.diag(cat.sigma.astype(np.float64) ** 2)
        res = cat.y - A @ np.tile(mu, nx * ny)
        ref = -0.5 * (res @ np.linalg.solve(S, res) + np.linalg.slogdet(S)[1] + n * np.log(2 * np.pi))
        with jax.enable_x64(True):
            got = float(field3d.pixelwise_evidence(jnp.asarray(theta), data, rad) - field3d.hyperprior(theta))
        # (float32 sums of the statistics: 1e-3 measured; the sky-wide mode given the short component
        # too is 0.09 off at q2 = 0.8)
        assert got == pytest.approx(ref, abs=0.01), (q2, floor)


def test_nonnegative_is_each_pixels_constrained_optimum():
    # the map made a density: per pixel argmin_{x >= 0} (x - m)^T Q (x - m), Q = Sigma^-1 + V D_p V^T,
    # held to the KKT conditions (an exact certificate for a convex QP) with Sigma from the dense float64
    # prior, and to L-BFGS-B's optimum
    from scipy.optimize import minimize

    nx, ny, nb, n = 3, 2, 10, 150
    cat = _small_catalog(np.random.default_rng(3), nx, ny, nb, n, 0.4)
    rad, data = _latent_statistics(cat)
    theta = np.array([-1.0, -0.5, 0.3, np.log(0.4), np.log(1.2), np.log(1.5), np.log(1.5), np.log(300.0), 0.8, 0.3])
    mu, Cf = _dense_prior(cat.edges, theta, (nx, ny), plane=False)
    S = Cf[:nb, :nb]  # one pixel's bins: the field's and the sky-wide mode's
    mean = mu + 0.6 * np.random.default_rng(4).standard_normal((nx * ny, nb)) * np.sqrt(np.diag(S))
    mean[0] = np.abs(mean[0])  # one pixel already a density: returned as it is
    sky, info = field3d.nonnegative(mean, theta, data, rad)
    assert info["pixels"] == int(np.sum(np.any(mean < 0, 1))) >= 4 and info["cells"] == int(np.sum(mean < 0))
    assert np.array_equal(sky[0], mean[0]) and np.all(sky >= 0) and sky.dtype == mean.dtype
    V = np.asarray(rad.V, np.float64)
    for p in range(1, nx * ny):
        Q = np.linalg.inv(S) + V @ np.asarray(data.D[p], np.float64) @ V.T
        g = Q @ (sky[p] - mean[p])
        scale = np.abs(Q).max() * np.abs(mean[p]).max()
        free = sky[p] > 0
        assert np.all(np.abs(g[free]) <= 1e-9 * scale) and np.all(g[~free] >= -1e-9 * scale), p
        f = lambda x, p=p, Q=Q: (0.5 * (x - mean[p]) @ Q @ (x - mean[p]), Q @ (x - mean[p]))
        ref = minimize(f, np.maximum(mean[p], 0), jac=True, method="L-BFGS-B", bounds=[(0, None)] * nb)
        assert f(sky[p])[0] <= ref.fun * (1 + 1e-6) + 1e-12
    coarse = field3d.Data(D=data.D, t=data.t, yy=data.yy, log_norm=data.log_norm, grid=field3d.grid_for(nx, ny, 2))
    with pytest.raises(ValueError, match="coarsened 2-fold"):
        field3d.nonnegative(mean, theta, coarse, rad)
    with pytest.raises(ValueError, match=r"mean: expected .* \(6, 10\), got \(6, 9\)"):
        field3d.nonnegative(mean[:, 1:], theta, data, rad)


@pytest.fixture(scope="module")
def tiny_standard(tmp_path_factory):
    out = tmp_path_factory.mktemp("standard")
    cat_path = str(out / "catalog.npz")
    reconstruct.main(["--size", "tiny", "--write-catalog", cat_path])
    summ = reconstruct.main(
        ["--data", cat_path, "--truth", reconstruct.truth_path(cat_path), "--out", str(out / "rec"), "--samples", "16"]
    )
    return out / "rec", summ, catalog.load_catalog(cat_path)


def test_tiny_standard_reconstruction_from_the_cli(tiny_standard):
    rec, summ, cat = tiny_standard
    assert summ["response"] == "standard" and cat.response == "standard"
    mean, std = np.load(rec / "posterior_mean.npy"), np.load(rec / "posterior_std.npy")
    col_std = np.load(rec / "column_std.npy")
    assert mean.shape == std.shape == (cat.n_pix, cat.n_bins) and col_std.shape == (cat.n_pix,)
    assert np.all(np.isfinite(col_std)) and np.all(col_std > 0)
    assert json.loads((rec / "summary.json").read_text())["chi2_per_line"] == summ["chi2_per_line"]
    m = summ["evaluation"]
    assert 0.8 <= m["chi2_per_line"] <= 1.3
    # the truth's columns within 2 posterior sd, and errors well below the oracle radial profile's
    assert m["column_within_2sd"] >= 0.8
    assert m["rel_err_column"] <= 0.2 * m["rel_err_column_oracle"]
    assert m["rel_err_sky_db"] <= 0.8 * m["rel_err_sky_db_oracle"]
    # the error split by distance range covers every bin once
    assert sum(b["share_of_error"] for b in m["sky_db_by_distance"]) == pytest.approx(1.0, rel=1e-9)
    # the column's sd is the samples' sd of the column: not the sum of the bins' sd (correlations count)
    db = np.diff(cat.edges)
    assert np.all(col_std < 1.001 * (std @ db))
    # `a` stays at the lines' best log-quadratic level (the centre of its bounds) through both stages:
    # learned, it ran off along a ridge with the sky-wide mode at 54M lines (field3d.PIXEL_FREE)
    h = summ["hyperparameters"]
    assert "a" not in field3d.PIXEL_FREE and h["names"][0] == "a"
    assert h["theta"][0] == pytest.approx(np.mean(h["bounds"][0]), abs=1e-9)
    assert h["fit"]["pixelwise_theta"][0] == h["theta"][0]
    # the negative share recorded is that of the map written (the tiny run keeps the log-normal
    # field's, positive: no warning)
    nd = summ["negative_density"]
    assert nd == reconstruct.negative_density(mean, std, db)
    assert nd["mass"] <= reconstruct.NEGATIVE_MASS
    assert not any("density is negative" in w for w in summ["warnings"])


def test_negative_density_counts_every_block_against_numpy():
    # more pixels than one block (65536 rows), negative cells in both blocks
    rng = np.random.default_rng(5)
    m = rng.normal(1.0, 1.0, (70001, 3))
    s = rng.uniform(0.1, 1.0, m.shape)
    db = np.array([1.0, 2.0, 4.0])
    nd = reconstruct.negative_density(m.astype(np.float32), s.astype(np.float32), db)
    m, s = m.astype(np.float32).astype(np.float64), s.astype(np.float32).astype(np.float64)
    assert nd["cells"] == pytest.approx(np.mean(m < 0), rel=1e-12)
    assert nd["mass"] == pytest.approx(-np.sum(np.minimum(m, 0) * db) / np.sum(np.maximum(m, 0) * db), rel=1e-9)
    assert nd["beyond_2sd"] == pytest.approx(np.mean(m + 2 * s < 0), rel=1e-12)
    assert 0 < nd["beyond_2sd"] < nd["cells"]


def test_negative_warning_names_the_shares_above_its_threshold():
    assert reconstruct.negative_warnings({"cells": 0.2, "mass": reconstruct.NEGATIVE_MASS, "beyond_2sd": 0.1}) == []
    (w,) = reconstruct.negative_warnings({"cells": 0.0473, "mass": 0.0555, "beyond_2sd": 0.0})
    assert "negative in 4.7% of its cells, 5.5% of its mass" in w and "0.00% of the cells" in w


def test_hyper_oracle_resolves_the_learned_map_and_never_does_worse():
    # hyper_oracle.py (a diagnostic) solves the posterior again from what field3d.reconstruct(keep=)
    # hands back: at the learned theta that is the reconstruction's own map, and the search starts there
    import hyper_oracle

    r = hyper_oracle.tune("compact_clouds", "tiny", evals=12, log=lambda m: None)
    assert r["learned_ratio_resolved"] == pytest.approx(r["learned_ratio"], rel=1e-6)
    assert r["tuned_ratio"] <= r["learned_ratio"] and 1 < r["solves"] <= 14
    assert 0.0 <= r["tuned_near_share"] <= 1.0 and len(r["tuned_theta"]) == len(field3d.NAMES)


def test_hyper_oracle_outside_takes_outside_skies_catalogs(monkeypatch):
    # --outside: the catalog and truth come from outside_skies.make_family (here a tiny family in its
    # place: the outside skies' 131072 lines are a benchmark's), and the search runs on them
    import families
    import hyper_oracle
    import outside_skies

    asked = []

    def make_family(name, out, seed=0):
        asked.append(name)
        return families.write_family("compact_clouds", out, "tiny")

    monkeypatch.setattr(outside_skies, "make_family", make_family)
    r = hyper_oracle.tune("far_ring", "default", evals=4, log=lambda m: None, outside=True)
    assert asked == ["far_ring"]
    assert r["learned_ratio_resolved"] == pytest.approx(r["learned_ratio"], rel=1e-6) and r["solves"] <= 6


def test_bounded_compression_keeps_the_leading_vectors_exactly(monkeypatch):
    # many lines: compress_lines computes MAX_BASIS radial vectors per line, not all n_bins; the
    # leading columns, w . 1, and truncate's choice and errors are those of the full compression
    rng = np.random.default_rng(5)
    b = los.bin_edges(40)
    pix, d, s = los.draw_stars(3000, 12, rng)
    y = np.asarray(np.sum(_standard_reference(d, s, b), 1)) * (1 + 0.05 * rng.standard_normal(3000))
    sigma = np.full(3000, 0.05 * np.sqrt(np.mean(y**2)))
    cat = catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=y, sigma=sigma, nx=4, ny=3, edges=b))
    V, _ = field3d.radial_basis(cat, "standard")
    assert field3d.basis_kept(cat.n_los, cat.n_bins) == 40
    g, w1, stats = field3d.compress_lines(cat, V, "standard", chunk=512)
    monkeypatch.setattr(field3d, "COMPRESS_BYTES", 3000 * 40 * 4 - 1)
    monkeypatch.setattr(field3d, "MAX_BASIS", 12)
    keep = field3d.basis_kept(cat.n_los, cat.n_bins)
    assert keep == 12
    g12, w1_12, stats12 = field3d.compress_lines(cat, V[:, :keep], "standard", chunk=512)
    np.testing.assert_allclose(g12, g[:, :keep], rtol=1e-5, atol=1e-6 * np.abs(g).max())
    np.testing.assert_array_equal(w1_12, w1)
    # the errors of keeping J < 12 vectors: from the 28 dropped coefficients, or from the residual
    # beyond the 12 kept; the same up to float32 rounding
    np.testing.assert_allclose(stats12[:, :-1], stats[:, : keep - 1], rtol=2e-3)
    # w . 1 computed per line equals the full basis' g V^T 1 (what _level used before), and so the level
    m_full = g.astype(np.float64) @ (V.T @ np.ones(40))
    np.testing.assert_allclose(w1, m_full, rtol=1e-4)
    level = field3d._level(cat, m_full)
    assert field3d._level(cat, w1) == pytest.approx(level, rel=1e-4)
    J, trunc = field3d.truncate(stats, cat.n_los, level)
    J12, trunc12 = field3d.truncate(stats12, cat.n_los, level)
    assert J == J12 <= keep
    assert trunc12["max_sigma"] == pytest.approx(trunc["max_sigma"], rel=2e-3)
    assert trunc12["rms_sigma"] == pytest.approx(trunc["rms_sigma"], rel=2e-3)


def test_truncation_errors_match_float64_residuals(monkeypatch):
    # compress_lines' measurements against |w - V_J V_J^T w| / sigma from the float64 formula, for a
    # complete basis and a partial one (lines split over blocks, the last one partial); float32
    # cancellation in |w|^2 - |g_J|^2 would err by ~1e-3 |w| / sigma, more than the small errors here
    rng = np.random.default_rng(8)
    b = los.bin_edges(48)
    pix, d, s = los.draw_stars(2500, 9, rng)
    W = _standard_reference(d, s, b)
    y = W.sum(1) * (1 + 0.02 * rng.standard_normal(2500))
    sigma = 0.02 * y + 0.01 * rng.random(2500) * y.mean()
    cat = catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=y, sigma=sigma, nx=3, ny=3, edges=b))
    V, _ = field3d.radial_basis(cat, "standard")
    monkeypatch.setattr(field3d, "COMPRESS_BYTES", 1024 * 128 * 4)  # blocks of 1024 lines
    measured = {}
    for K in (48, 10):
        _, _, stats = field3d.compress_lines(cat, V[:, :K], "standard", chunk=256)
        e = np.stack([np.linalg.norm(W - (W @ V[:, :J]) @ V[:, :J].T, axis=1) / sigma for J in range(1, K + 1)], 1)
        big = e.max(0) > 1e-4 * np.abs(W).max() / sigma.min()  # (below: float32 rounding of the weights)
        assert big[: K // 2].all()
        np.testing.assert_allclose(stats[0][big], e.max(0)[big], rtol=1e-3)
        np.testing.assert_allclose(stats[1][big], np.sum(e**2, 0)[big], rtol=2e-3)
        measured[K] = stats, e
    stats48, e48 = measured[48]
    level = 0.999 * field3d.TRUNCATION / e48.max(0)[5]  # the float64 errors keep 6 vectors or fewer
    J, trunc = field3d.truncate(stats48, cat.n_los, level)
    worst = level * e48.max(0)
    assert J == np.flatnonzero(worst <= field3d.TRUNCATION)[0] + 1 <= 6
    assert trunc["max_sigma"] == pytest.approx(worst[J - 1], rel=1e-3)
    assert trunc["rms_sigma"] == pytest.approx(level * np.sqrt(np.mean(e48[:, J - 1] ** 2)), rel=2e-3)


def test_mean_profile_from_sums_is_the_fit_from_every_line(monkeypatch):
    # beyond EXACT_PROFILE_LINES the mean profile's Gauss-Newton steps come from the catalog's J x J
    # sums, not from every line's prediction: the same fit (normal equations instead of lstsq) and
    # the profile that generated the lines, where the basis keeps every vector
    rng = np.random.default_rng(11)
    b = los.bin_edges(30)
    pix, d, s = los.draw_stars(4000, 6, rng)
    rad_t = (2 * np.sqrt(b[:-1] * b[1:]) - b[0] - b[-1]) / (b[-1] - b[0])
    truth = np.exp(-0.7 - 0.8 * rad_t + 0.4 * rad_t**2)
    y0 = _standard_reference(d, s, b) @ truth
    sigma = np.full(4000, 0.02 * np.sqrt(np.mean(y0**2)))
    y = y0 + sigma * rng.standard_normal(4000)
    cat = catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=y, sigma=sigma, nx=3, ny=2, edges=b))
    V, _ = field3d.radial_basis(cat, "standard")
    g, _, _ = field3d.compress_lines(cat, V, "standard", chunk=512)
    with jax.enable_x64(True):
        rad = field3d.Radial.of(b, V)
        exact = field3d.mean_profile_fit(cat, g, rad)
        monkeypatch.setattr(field3d, "EXACT_PROFILE_LINES", 0)
        summed = field3d.mean_profile_fit(cat, g, rad)
        mu = np.asarray(field3d.profile(jnp.asarray(summed), rad))
    np.testing.assert_allclose(summed, exact, rtol=1e-6, atol=1e-6)
    db = np.diff(b)
    assert np.sum(np.abs(mu - truth) * db) < 0.05 * np.sum(truth * db)  # the generating profile, to noise


def test_profile_vectors_hold_the_mean_profile_family_for_every_line():
    # the mean profile is shared by every line: with_profile_vectors adds mu0 t^i to the basis, so a
    # profile mu0 (c0 + c1 t + c2 t^2) is predicted as the weights themselves predict it (float64
    # reference), where the truncated basis alone errs by many noise sd pooled over the lines
    rng = np.random.default_rng(4)
    b = los.bin_edges(40)
    pix, d, s = los.draw_stars(3000, 12, rng)
    rad_t = (2 * np.sqrt(b[:-1] * b[1:]) - b[0] - b[-1]) / (b[-1] - b[0])
    W = _standard_reference(d, s, b)
    y = W @ np.exp(-0.5 - 1.2 * rad_t + 0.5 * rad_t**2)
    sigma = np.full(3000, 0.01 * np.sqrt(np.mean(y**2)))
    cat = catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=y, sigma=sigma, nx=4, ny=3, edges=b))
    V, _ = field3d.radial_basis(cat, "standard")
    J = 5  # a truncation's few leading vectors
    V = V[:, :J]
    g, _, _ = field3d.compress_lines(cat, V, "standard", chunk=512)
    Va, ga = field3d.with_profile_vectors(cat, V, g, "standard", chunk=512)
    assert Va.shape == (40, J + field3d.PROFILE_VECTORS) and ga.shape == (3000, J + field3d.PROFILE_VECTORS)
    np.testing.assert_allclose(Va.T @ Va, np.eye(Va.shape[1]), atol=1e-10)
    np.testing.assert_array_equal(Va[:, :J], V)
    with jax.enable_x64(True):
        rad = field3d.Radial.of(b, V)
        mu0 = np.asarray(field3d.profile(jnp.asarray(field3d.mean_profile_fit(cat, g, rad)), rad))
    v = mu0 * (1.0 + 0.3 * rad_t - 0.2 * rad_t**2)
    pooled = lambda V_, g_: np.sqrt(np.sum(((W @ v - g_.astype(np.float64) @ (V_.T @ v)) / sigma) ** 2))
    assert pooled(V, g) > 5.0  # the truncated basis alone: a bias of several noise sd
    assert pooled(Va, ga) < 0.05 * pooled(V, g) and pooled(Va, ga) < 1.0
    # a basis that keeps every vector holds the family already: nothing is added
    V_all, _ = field3d.radial_basis(cat, "standard")
    g_all, _, _ = field3d.compress_lines(cat, V_all, "standard", chunk=512)
    V2, g2 = field3d.with_profile_vectors(cat, V_all, g_all, "standard", chunk=512)
    assert V2.shape == (40, 40) and g2.shape == (3000, 40)


def _solve_inputs(grid, D: np.ndarray, t: np.ndarray, n_bins: int, pairs: int, rng) -> tuple:
    """:func:`field3d.solve_all`'s arguments after ``theta`` (``data, rad, noise, z0``) for the
    statistics ``D`` (``(n_lat, J, J)``), ``t`` (``(n_lat, J)``) on ``grid``, a random orthonormal
    basis of ``n_bins`` bins; call under ``jax.enable_x64``."""
    V = np.linalg.qr(rng.standard_normal((n_bins, D.shape[-1])))[0]
    rad = field3d.Radial.of(los.bin_edges(n_bins), V)
    data = field3d.Data(
        D=jnp.asarray(D, jnp.float32),
        t=jnp.asarray(t, jnp.float32),
        yy=jnp.asarray(0.0),
        log_norm=jnp.asarray(0.0),
        grid=grid,
    )
    return data, rad, field3d.draw_noise(data, jax.random.key(0), pairs), field3d.zeros(data, 1 + pairs)


@pytest.mark.parametrize("J, pairs", [(7, 4), (12, 1), (19, 4)])
@pytest.mark.parametrize("batched", [False, True])
def test_posterior_bytes_bounds_the_compiled_solves(J, pairs, batched):
    # the latent grid and the solves' batch are chosen by posterior_bytes: a bound on XLA's
    # compiled memory of the solves (arguments, temporaries, outputs), and not a loose one
    grid = field3d.Grid(40, 30, 1)
    D, t = np.zeros((grid.size, J, J), np.float32), np.zeros((grid.size, J), np.float32)
    with jax.enable_x64(True):
        args = _solve_inputs(grid, D, t, 30, pairs, np.random.default_rng(0))
        batch = 1 + pairs if batched else 1
        m = (
            field3d.solve_all.lower(jnp.zeros(len(field3d.NAMES)), *args, iters=10, tol=0.01, batch=batch)
            .compile()
            .memory_analysis()
        )
    used = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    bound = field3d.posterior_bytes(grid.size, J, pairs, batched)
    assert used <= bound <= 1.6 * used


def test_the_posterior_grid_and_batch_follow_the_budget():
    # every pixel when the solves fit one at a time; all at once where they fit together
    assert field3d.posterior_grid(1024, 768, 19, 4).factor == 1  # the users' grid at 54M lines: 3.5 GiB
    assert field3d.solve_batch(1024 * 768, 19, 4) == 5  # together: 5.0 GiB
    assert field3d.posterior_grid(1024, 768, 24, 4).factor == 1  # 4.7 GiB ...
    assert field3d.solve_batch(1024 * 768, 24, 4) == 1  # ... but together 6.7 GiB
    grid = field3d.posterior_grid(1024, 768, 32, 4)  # 7.0 GiB on every pixel
    assert grid.factor == 2 and field3d.posterior_bytes(grid.size, 32, 4) <= field3d.POSTERIOR_BYTES
    # the batch changes the steps' order, not the answer
    rng = np.random.default_rng(1)
    grid = field3d.Grid(12, 8, 1)
    J, pairs = 5, 2
    A = rng.standard_normal((grid.size, J, J)).astype(np.float32)
    D, t = np.einsum("pij,pkj->pik", A, A), rng.standard_normal((grid.size, J)).astype(np.float32)
    with jax.enable_x64(True):
        args = (
            jnp.asarray([0.0, 0.0, 0.0, -1.0, -1.0, 1.0, 0.7, 6.0, 0.5]),
            *_solve_inputs(grid, D, t, 24, pairs, rng),
        )
        one = field3d.solve_all(*args, iters=200, tol=1e-6, batch=1)
        together = field3d.solve_all(*args, iters=200, tol=1e-6, batch=1 + pairs)
    np.testing.assert_allclose(
        np.asarray(one[0]), np.asarray(together[0]), rtol=0, atol=2e-4 * float(jnp.max(jnp.abs(one[0])))
    )
    # each solve stops at its own tolerance either way (a batch runs as long as its slowest)
    np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(together[1]))


def test_layout_reaches_every_operator_over_the_lines(tmp_path, monkeypatch):
    # --layout is an argument passed down, not a module setting: every RowOperator the run builds
    # (the generator's, the demos', the latent statistics', the fit check's) gets it
    import chunkop

    made = []
    real = chunkop.RowOperator

    def recording(*args, **kwargs):
        made.append(kwargs.get("layout", "auto"))
        return real(*args, **kwargs)

    monkeypatch.setattr(chunkop, "RowOperator", recording)
    res = reconstruct.main(
        ["--size", "tiny", "--layout", "plain", "--no-figures", "--no-fit-s", "--samples", "2", "--out", str(tmp_path)]
    )
    assert res["layout"] == "plain"
    assert len(made) >= 5 and set(made) == {"plain"}
    made.clear()
    reconstruct.main(["--size", "tiny", "--write-catalog", str(tmp_path / "c.npz")])  # the default: "auto"
    assert made and set(made) == {"auto"}


def test_no_demos_skips_the_measurements_not_the_reconstruction(tmp_path):
    args = ["--size", "tiny", "--no-figures", "--no-fit-s", "--samples", "2"]
    full = reconstruct.main([*args, "--out", str(tmp_path / "full")])
    lean = reconstruct.main([*args, "--no-demos", "--out", str(tmp_path / "lean")])
    assert "matvec_s" in full["timings"] and full["memory"]
    assert "matvec_s" not in lean["timings"] and lean["memory"] == {} and "check_linear" not in lean
    assert lean["metrics"] == full["metrics"]  # the same catalog, the same reconstruction


def test_n_los_sets_the_synthetic_lines_only(tmp_path, capsys):
    P = los.make_problem("tiny", n_los=2048)
    assert P.n_los == 2048 and (P.nx, P.ny, P.n_bins) == (12, 8, 24)
    with pytest.raises(ValueError, match="n_los must be a positive number of lines"):
        los.make_problem("tiny", n_los=0)
    with pytest.raises(SystemExit):
        reconstruct.main(["--data", str(tmp_path / "c.npz"), "--n-los", "10"])
    assert "--n-los applies to the synthetic run" in capsys.readouterr().err
    path = str(tmp_path / "cat.npz")
    reconstruct.main(["--size", "tiny", "--n-los", "1500", "--write-catalog", path])
    cat = catalog.load_catalog(path)
    assert cat.n_los == 1500 and cat.name == "synthetic-tiny-1500"


def test_nearest_psd_replaces_only_the_matrices_indefinite_beyond_rounding():
    rng = np.random.default_rng(2)
    G = rng.standard_normal((7, 5, 3))
    with jax.enable_x64(True):
        D = jnp.asarray(G @ np.swapaxes(G, 1, 2))  # rank 3: two zero eigenvalues each
        P, n = field3d.nearest_psd(D, block=3)
        assert n == 0 and np.array_equal(np.asarray(P), np.asarray(D))
        E = D.at[::2].add(-1e-3 * jnp.eye(5))  # four indefinite, as one float32 pass over thousands of lines left some
        E = E.at[1].add(-1e-9 * jnp.eye(5))  # ... and one at the rounding level: kept
        P, n = field3d.nearest_psd(E, block=4)
    P, E = np.asarray(P), np.asarray(E)
    w, Q = np.linalg.eigh(E[::2])
    assert n == 4
    np.testing.assert_allclose(P[::2], (Q * np.maximum(w, 0)[:, None, :]) @ np.swapaxes(Q, 1, 2), atol=1e-12)
    assert np.array_equal(P[1::2], E[1::2])
    assert np.linalg.eigvalsh(P[::2]).min() > -1e-12 and w.min() < -9e-4


def test_nearest_psd_keeps_the_weak_directions_of_float32_sums():
    """Float32 ``D_p`` semi-definite to rounding come back bitwise: the directions few lines measure
    (here eigenvalues down to 1e-8 of the largest) keep their curvature. A projection of every one in
    float32 (the control: what the accelerator's path did) moves it by 1e-4 of itself, the 54M run's
    loss."""
    rng = np.random.default_rng(5)
    n, J, lines = 64, 19, 69
    G = rng.standard_normal((n, lines, J)) * np.logspace(0, -4, J)
    D64 = np.einsum("nli,nlj->nij", G, G)
    D32 = jnp.asarray(D64, jnp.float32)
    w, Q = np.linalg.eigh(D64)
    weak = Q[:, :, :4]

    def weak_err(P):
        got = np.einsum("nik,nij,njk->nk", weak, np.asarray(P, np.float64), weak)
        return np.max(np.abs(got - w[:, :4]) / w[:, :4])

    P, _ = field3d.nearest_psd(D32, block=24)
    assert P.dtype == jnp.float32 and np.array_equal(np.asarray(P), np.asarray(D32))
    assert weak_err(P) < 1e-6
    assert weak_err(field3d._psd_block(D32, field3d.INDEFINITE)[0]) > 1e-5  # the control: float32 eigh and product


def test_bounded_newton_step():
    rng = np.random.default_rng(4)
    Q = np.linalg.qr(rng.standard_normal((4, 4)))[0]
    g = rng.standard_normal(4)
    # concave, small gradient: Newton's step exactly
    H = -(Q * np.array([1.0, 3.0, 10.0, 100.0])) @ Q.T
    small = 0.05 * g
    np.testing.assert_allclose(field3d._bounded_newton_step(H, small), -np.linalg.solve(H, small), rtol=1e-10)
    # a flat direction (curvature 1e-6 of the largest): the step keeps to the bound in its largest
    # coordinate, and is the Levenberg-Marquardt step of one mu > 0 in every direction
    H = -(Q * np.array([1e-4, 3.0, 10.0, 100.0])) @ Q.T
    step = field3d._bounded_newton_step(H, g, bound=0.5)
    assert np.max(np.abs(step)) == pytest.approx(0.5, rel=1e-9)
    c, s = Q.T @ g, Q.T @ step
    mu = c / s - np.array([1e-4, 3.0, 10.0, 100.0])
    assert mu.min() > 0 and np.ptp(mu) < 1e-6 * mu.mean()
    # not concave: still an ascent direction, along |curvature|
    H = (Q * np.array([-2.0, 1.0, -5.0, 3.0])) @ Q.T
    step = field3d._bounded_newton_step(H, 0.01 * g)
    np.testing.assert_allclose(Q.T @ step, (Q.T @ (0.01 * g)) / np.array([2.0, 1.0, 5.0, 3.0]), rtol=1e-10)
    assert step @ g > 0


def test_projected_step_holds_the_coordinates_pushed_out_of_the_box():
    # a concave quadratic whose optimum lies outside the box in the first coordinate: the step holds
    # that coordinate and is Newton's on the other, given the first at its bound
    H = -np.array([[1.0, 0.95], [0.95, 1.0]])
    m = np.array([-1.0, 2.0])
    x, lo, hi = np.array([0.0, 1.8]), np.array([0.0, -10.0]), np.array([10.0, 10.0])
    g = H @ (x - m)
    assert g[0] < 0  # (pushing out through the lower bound)
    step = field3d._projected_step(H, g, x, lo, hi)
    assert step[0] == 0.0
    assert x[1] + step[1] == pytest.approx(m[1] - 0.95 * (x[0] - m[0]), rel=1e-9)  # (0.75 < bound 1)
    # inside the box, or pushed inwards at a bound, every coordinate moves as in the unconstrained step
    for x in (np.array([0.5, 0.3]), np.array([0.0, 0.0])):
        g = H @ (x - m)
        full = field3d._bounded_newton_step(H, g)
        held = field3d._projected_step(H, g, x, lo, hi)
        if x[0] == 0.0:
            assert g[0] > 0
        np.testing.assert_allclose(held, full, rtol=1e-12)


def test_pixel_evidence_fit_reaches_the_box_constrained_optimum(monkeypatch):
    # the fit over PIXEL_FREE with the evidence replaced by a concave function whose optimum lies
    # beyond q2's and floor's bound 0: it ends where L-BFGS-B does (clipping the whole Newton step
    # instead of holding q2 stopped short: 23 nats below the optimum on steep_profile)
    free = field3d.PIXEL_FREE
    idx = np.array([field3d.NAMES.index(n) for n in free])
    rng = np.random.default_rng(3)
    Q = np.linalg.qr(rng.standard_normal((idx.size, idx.size)))[0]
    A = Q @ np.diag([1e4, 3e3, 1e3, 50.0, 5.0, 1.0, 0.5]) @ Q.T
    m = 0.5 * rng.standard_normal(idx.size)
    m[free.index("q2")] = -3.0
    m[free.index("floor")] = -3.0
    bounds = [(-5.0, 5.0)] * len(field3d.NAMES)
    bounds[field3d.NAMES.index("q2")] = (0.0, 10.0)
    bounds[field3d.NAMES.index("floor")] = (0.0, 10.0)

    def toy(theta, data, rad):
        d = theta[idx] - m
        return -0.5 * d @ (jnp.asarray(A) @ d)

    monkeypatch.setattr(field3d, "pixelwise_evidence", toy)
    theta0 = np.zeros(len(field3d.NAMES))
    theta0[field3d.NAMES.index("q2")] = 0.1
    theta0[field3d.NAMES.index("floor")] = 0.1
    with jax.enable_x64(True):
        got = field3d._pixel_evidence_fit(None, None, theta0, bounds, free, log=lambda *_: None)[idx]
    ref = scipy.optimize.minimize(
        lambda x: 0.5 * (x - m) @ A @ (x - m),
        theta0[idx],
        jac=lambda x: A @ (x - m),
        method="L-BFGS-B",
        bounds=[bounds[i] for i in idx],
        options={"ftol": 1e-15, "gtol": 1e-12},
    ).x
    assert got[free.index("q2")] == 0.0 and got[free.index("floor")] == 0.0
    np.testing.assert_allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("module, examples", [("field3d", 4), ("hyper_oracle", 1)])
def test_example_docstring_examples_pass(module, examples):
    # the modules' docstring examples (blocks, radial_correlation, at_bounds, ratio, ...) are part of their docs
    import doctest
    import importlib

    mod = importlib.import_module(module)
    failed, attempted = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted >= examples and failed == 0


def test_hyper_oracle_ratio_is_evaluates_figure():
    # the diagnostic's score is the families' table's: evaluate's weighted sky error over the oracle's,
    # and the share of error in the ranges in front of NEAR_PC
    import hyper_oracle

    rng = np.random.default_rng(7)
    b = los.bin_edges(24)
    pix, d, s = los.draw_stars(200, 12, rng)
    cat = catalog.validate_catalog(dict(pix=pix, d=d, s=s, y=np.ones(200), sigma=np.ones(200), nx=4, ny=3, edges=b))
    sky = rng.lognormal(size=(12, 24)).astype(np.float32)
    mean = (sky * rng.lognormal(0.0, 0.3, size=sky.shape)).astype(np.float32)
    rec = {"mean": mean, "column": mean @ np.diff(b), "wcolumn": mean @ (1 / b[:-1] - 1 / b[1:])}
    m = reconstruct.evaluate(cat, rec | {"summary": {"chi2_per_line": 1.0}}, sky)["metrics"]
    got, near_share = hyper_oracle.ratio(mean, sky, np.diff(b), cat.centres < reconstruct.NEAR_PC)
    assert got == pytest.approx(m["rel_err_sky_db"] / m["rel_err_sky_db_oracle"], rel=1e-6)
    shares = [r["share_of_error"] for r in m["sky_db_by_distance"] if r["range_pc"][1] <= reconstruct.NEAR_PC]
    assert len(shares) == 2 and near_share == pytest.approx(sum(shares), rel=1e-6)


def test_blocks_cover_the_range_once_in_whole_multiples():
    for n, block, multiple in [(10, 7, 3), (1, 5, 4), (12, 12, 4), (100, 3, 8), (0, 4, 2)]:
        got = list(field3d.blocks(n, block, multiple))
        assert np.array_equal(np.concatenate([np.arange(n)[b] for b in got] or [np.arange(0)]), np.arange(n))
        assert all((b.stop - b.start) % multiple == 0 for b in got[:-1])
        assert all(b.stop - b.start == max(multiple, block // multiple * multiple) for b in got[:-1])


def test_q2_at_zero_is_not_a_bound_warning(monkeypatch):
    # q2 = 0 is the model without the short radial component; at its upper bound it is reported
    bounds = [(-1.0, 1.0)] * len(field3d.NAMES)
    bounds[field3d.NAMES.index("q2")] = (0.0, 10.0)
    theta = np.zeros(len(field3d.NAMES))
    assert field3d.at_bounds(theta, bounds) == []
    theta[field3d.NAMES.index("q2")] = 10.0
    theta[field3d.NAMES.index("a")] = -1.0
    assert field3d.at_bounds(theta, bounds) == ["a", "q2"]
    # the table, not the name: an answer at the upper bound is not reported either
    monkeypatch.setitem(field3d.ANSWER_BOUNDS, "q2", (True, True))
    assert field3d.at_bounds(theta, bounds) == ["a"]
    monkeypatch.setitem(field3d.ANSWER_BOUNDS, "q2", (False, False))
    theta[field3d.NAMES.index("q2")] = 0.0
    assert field3d.at_bounds(theta, bounds) == ["a", "q2"]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_line_passes_lower_at_float32_matmul_precision(platform):
    # a TPU's default matmul precision is one bfloat16 pass (~3 digits): summed over ~3300 lines per
    # pixel, the statistics D_p came out indefinite at 54M lines. Every dot of the compression pass
    # and of the statistics' transposes is lowered for the accelerator at HIGHEST (float32).
    import re

    rng = np.random.default_rng(6)
    b = los.bin_edges(24)
    V = np.linalg.qr(rng.standard_normal((24, 5)))[0]
    rows = {k: jax.ShapeDtypeStruct((256,), jnp.float32) for k in ("d", "s", "sigma")}
    g = rng.standard_normal((300, 5)).astype(np.float32)
    A = field3d.latent_operator(g, rng.integers(0, 7, 300), 7, chunk=64, layout="plain")
    lowered = {
        "compression": jax.export.export(jax.jit(field3d._compress_pass(b, V, "standard", 64)), platforms=[platform])(
            rows
        ),
        "statistics": jax.export.export(jax.jit(field3d._transposed), platforms=[platform])(
            A, jnp.ones(300, jnp.float32)
        ),
    }
    for name, exp in lowered.items():
        dots = re.findall(r"stablehlo.dot_general[^\n]*", exp.mlir_module())
        assert dots, name
        assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots), (name, dots)


def test_data_on_adds_its_blocks_in_float64(monkeypatch):
    # 50000 lines a latent pixel in one float32 pass lose the low digits of D_p's running sums (at
    # 13.24M lines, 4310 a pixel, that left D_p indefinite and the evidence NaN); passes of
    # LINES_PER_PASS lines a pixel, added in float64, leave only the final rounding to float32
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    n, J = 200_000, 3
    g = rng.normal(size=(n, J)).astype(np.float32)
    sigma, y = rng.uniform(0.5, 2.0, n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    cat = SimpleNamespace(pix=rng.integers(0, 4, n), sigma=sigma, y=y)
    grid = field3d.grid_for(2, 2, 4)
    iv, g64 = 1 / cat.sigma.astype(np.float64) ** 2, g.astype(np.float64)
    D_ref, t_ref = np.zeros((4, J, J)), np.zeros((4, J))
    np.add.at(D_ref, cat.pix, iv[:, None, None] * g64[:, :, None] * g64[:, None, :])
    np.add.at(t_ref, cat.pix, (iv * cat.y)[:, None] * g64)

    def errors(lines_per_pass: int) -> tuple:
        monkeypatch.setattr(field3d, "LINES_PER_PASS", lines_per_pass)
        d = field3d.data_on(cat, g, grid, chunk=1024, layout="plain")
        assert d.D.dtype == d.t.dtype == np.float32
        return (
            np.abs(np.asarray(d.D, np.float64) - D_ref).max() / np.abs(D_ref).max(),
            np.abs(np.asarray(d.t, np.float64) - t_ref).max() / np.abs(t_ref).max(),
        )

    one_pass, blocks = errors(10**9), errors(256)
    assert one_pass[0] > 1e-6  # (measured 1.1e-5: the setting shows the loss)
    assert blocks[0] < 3e-7 and blocks[1] < 3e-6  # (measured 6.7e-8 and 3.2e-7)


def _generator_noise(module, name: str, shapes: list) -> list:
    """The white noise a family's generator draws first, from its own seed-0 stream."""
    rng = np.random.default_rng([0, module.FAMILIES.index(name)])
    return [rng.standard_normal(s) for s in shapes]


def test_generator_posterior_models_are_the_generators():
    # generator_posterior.py (a diagnostic) writes each sky's generator as a function of its white
    # noise; fed the noise the generator drew, it must give the generator's truth (up to the fields'
    # sd: realised there, expected here), and another draw must not
    import families
    import generator_posterior as gp
    import hyper_oracle
    import outside_skies

    edges = families._edges(96)
    truth = families.family_sky("local_bubble", 64, 48, edges, np.random.default_rng([0, 4]))
    xi = np.stack([w.reshape(-1) for w in _generator_noise(families, "local_bubble", [(64, 48), (64, 48)])])
    sky_of, shape = gp.bubble_model(64, 48, edges)
    assert shape == (2, 64 * 48)
    db, near = np.diff(edges), np.zeros(96, bool)
    score = lambda m, t, db: hyper_oracle.ratio(m, t, db, near)[0]
    assert score(np.asarray(sky_of(jnp.asarray(xi))), truth, db) < 0.06
    other = np.asarray(sky_of(jnp.asarray(np.roll(xi, 7, axis=1))))  # another draw: far from this truth
    assert score(other, truth, db) > 0.5
    # the ablations: the wall at its median ignores the wall's noise; a white wall moves one pixel alone
    fixed, _ = gp.bubble_model(64, 48, edges, wall="fixed")
    np.testing.assert_array_equal(fixed(jnp.asarray(xi)), fixed(jnp.asarray(xi * [[1.0], [0.0]])))
    white, _ = gp.bubble_model(64, 48, edges, wall="white")
    kick = np.zeros_like(xi)
    kick[1, 100] = 1.0
    change = np.abs(np.asarray(white(jnp.asarray(xi + kick))) - np.asarray(white(jnp.asarray(xi))))
    moved = np.max(change, axis=1) > 1e-3 * change.max()  # (beyond the FFT's rounding)
    assert np.flatnonzero(moved).tolist() == [100]
    with pytest.raises(ValueError, match="wall must be one of"):
        gp.bubble_model(64, 48, edges, wall="smooth")
    with pytest.raises(ValueError, match="wall applies to local_bubble only"):  # (before any catalog is written)
        gp.posterior("clustered_stars", samples=0, maxiter=1, wall="white")
    with pytest.raises(ValueError, match="name must be one of"):
        gp.posterior("far_ring", samples=0, maxiter=1)

    truth = families.family_sky("lognormal_3d", 64, 48, edges, np.random.default_rng([0, 7]))
    sky_of, shape = gp.lognormal3d_model(64, 48, edges)
    xi = np.stack([w.reshape(-1) for w in _generator_noise(families, "lognormal_3d", [(64, 48)] * 96)])
    assert shape == xi.shape == (96, 64 * 48)
    assert score(np.asarray(sky_of(jnp.asarray(xi))), truth, db) < 0.08

    e2 = outside_skies.DEFAULT_GRID["edges"]
    rng = np.random.default_rng([0, outside_skies.FAMILIES.index("clustered_stars")])
    truth = outside_skies.sky_clustered_stars(rng, 64, 48, e2)
    sky_of, shape = gp.clustered_model(64, 48, e2)
    (w,) = _generator_noise(outside_skies, "clustered_stars", [shape])
    assert score(np.asarray(jax.jit(sky_of)(jnp.asarray(w))), truth, np.diff(e2)) < 0.06


def test_generator_posterior_reads_the_catalog_on_a_tiny_bubble():
    # the generator's prior on the tiny local_bubble catalog: the MAP fits the lines and is far
    # closer to the truth than the prior's mean; a sample is drawn and scored; float32 stays the default
    import generator_posterior as gp

    r = gp.posterior("local_bubble", samples=1, maxiter=150, size="tiny")
    assert r["unknowns"] == 2 * 12 * 8
    assert 0.8 <= r["map"]["chi2_per_line"] <= 1.3
    assert r["map"]["ratio"] < 0.5 * r["prior_mean_ratio"]
    assert len(r["sample_ratios"]) == 1 and r["sample_mean"]["ratio"] == r["sample_ratios"][0]
    assert r["sample_ratios"][0] < r["prior_mean_ratio"]
    assert jnp.zeros(1).dtype == jnp.float32


def test_generator_posterior_cli_passes_each_option(tmp_path):
    # the CLI's record is posterior()'s with the same options (--wall reached it only after a fix)
    import generator_posterior as gp

    out = tmp_path / "gp.json"
    args = ["--family", "local_bubble", "--size", "tiny", "--samples", "0", "--maxiter", "20", "--out", str(out)]
    rec = gp.main([*args, "--wall", "fixed", "--seed", "3"])
    assert json.loads(out.read_text())["wall"] == "fixed" and rec["seed"] == 3
    fixed = gp.posterior("local_bubble", samples=0, maxiter=20, size="tiny", wall="fixed")
    field = gp.posterior("local_bubble", samples=0, maxiter=20, size="tiny")
    assert rec["families"]["local_bubble"]["map"]["ratio"] == fixed["map"]["ratio"] != field["map"]["ratio"]
    args[5] = "1"  # one sample: --seed reaches it
    rec = gp.main([*args, "--seed", "3"])
    assert (
        rec["families"]["local_bubble"]["sample_ratios"]
        == gp.posterior("local_bubble", samples=1, maxiter=20, size="tiny", seed=3)["sample_ratios"]
        != gp.posterior("local_bubble", samples=1, maxiter=20, size="tiny", seed=0)["sample_ratios"]
    )
