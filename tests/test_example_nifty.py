"""The NIFTy.re example (examples/astro_los/nifty_vi.py) at its 'tiny' size.

The likelihood built with the chunked ``RowOperator`` response must give the same energy,
gradient and MGVI metric (applied to one tangent and, as ``optimize_kl`` does, vmapped over
several) as the same likelihood with the plain ``jax.vmap`` response ``los.los_vmap``; and a
short MGVI run must write its figure and beat the prior on the measured column. Skipped when
NIFTy.re (the ``nifty`` extra) is not installed.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jft = pytest.importorskip("nifty.re")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "astro_los"))
import nifty_vi  # noqa: E402

from conftest import assert_tree_allclose  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    # chunk 256 does not divide the 1500 lines: the remainder chunk is exercised too
    return nifty_vi.make_setup("tiny", seed=3, chunk=256)


def _random_position(lh, key):
    return jft.Vector(lh.init(key))


def test_chunked_response_matches_vmap_response(setup):
    lh, ref = setup.likelihood("chunkop"), setup.likelihood("vmap")
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = _random_position(lh, k1)
    t = _random_position(lh, k2)
    # the forward models agree with each other and the data are of the model's order
    y_chunk, y_ref = lh.forward(x), ref.forward(x)
    np.testing.assert_allclose(y_chunk, y_ref, rtol=2e-5, atol=1e-6 * float(jnp.abs(y_ref).max()))
    np.testing.assert_allclose(lh(x), ref(x), rtol=1e-5)

    grad, grad_ref = jax.jit(jax.grad(lh))(x), jax.jit(jax.grad(ref))(x)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grad_ref))
    assert scale > 0
    assert_tree_allclose(grad, grad_ref, rtol=1e-4, atol=1e-5 * scale)

    metric = jax.jit(lh.metric)(x, t)
    metric_ref = jax.jit(ref.metric)(x, t)
    scale = max(float(jnp.abs(m).max()) for m in jax.tree_util.tree_leaves(metric_ref))
    assert scale > 0
    assert_tree_allclose(metric, metric_ref, rtol=1e-4, atol=1e-5 * scale)

    # MGVI applies the metric to samples under jax.vmap
    ts = jax.vmap(lambda k: _random_position(lh, k))(jax.random.split(k3, 3))
    vm = jax.jit(jax.vmap(lh.metric, in_axes=(None, 0)))(x, ts)
    vm_ref = jax.jit(jax.vmap(ref.metric, in_axes=(None, 0)))(x, ts)
    assert_tree_allclose(vm, vm_ref, rtol=1e-4, atol=1e-5 * scale)


def test_metric_is_the_gauss_newton_matrix(setup):
    """The likelihood part of the MGVI metric: ``metric(x, t) = J^T N^-1 J t``, ``J`` the response's Jacobian."""
    lh = setup.likelihood("chunkop")
    x = _random_position(lh, jax.random.key(5))
    t = _random_position(lh, jax.random.key(6))
    _, jt = jax.jvp(lh.forward, (x,), (t,))
    _, vjp = jax.vjp(lh.forward, x)
    (expected,) = vjp(jt / setup.sigma**2)
    got = lh.metric(x, t)
    scale = max(float(jnp.abs(m).max()) for m in jax.tree_util.tree_leaves(expected))
    assert_tree_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)


def test_bad_response_name(setup):
    with pytest.raises(ValueError, match="response must be"):
        setup.likelihood("dense")


def test_mgvi_run_tiny(tmp_path):
    results = nifty_vi.run("tiny", str(tmp_path), seed=0)
    assert (tmp_path / "posterior.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["n_samples"] == 2 * nifty_vi.SIZES["tiny"].samples  # mirrored samples
    assert saved["iterations"] == nifty_vi.SIZES["tiny"].iters
    for key in ("rel_err_sky", "rel_err_column", "chi2_per_line"):
        assert np.isfinite(results[key])
    # the data measure the column: the posterior mean is far closer to it than the prior is
    assert results["rel_err_column"] < 0.6 * results["rel_err_column_prior"]
    assert results["rel_err_sky"] < results["rel_err_sky_prior"]
