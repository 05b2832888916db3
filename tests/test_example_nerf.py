"""Smoke tests of examples/nerf: chunked rendering and gradients equal jax.vmap's; training runs."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from conftest import assert_tree_allclose

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NERF_DIR = os.path.join(HERE, "..", "examples", "nerf")


def _load(name):
    if NERF_DIR not in sys.path:
        sys.path.insert(0, NERF_DIR)
    spec = importlib.util.spec_from_file_location(name, os.path.join(NERF_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


nerf = _load("nerf")

# 7x7 = 49 rays in chunks of 10: four full chunks and a remainder of 9.
CFG = nerf.Config(res=7, samples=8, width=16, depth=2, n_freqs=3, chunk=10)
# The longest sum in one ray: the MLP's first layer (the 3 + 6 n_freqs encoded inputs; the
# samples' compositing sums 8). A loss sums over the rays, its gradient over every sample.
RAY_TERMS = 3 + 6 * CFG.n_freqs


_render = jax.jit(
    lambda p, o, d, key, method: nerf.render_rays(p, o, d, CFG, key=key, method=method),
    static_argnames="method",
)
_loss_and_grad = jax.jit(jax.value_and_grad(nerf.image_loss), static_argnums=(5, 6))


@pytest.fixture(scope="module")
def data():
    ds = nerf.make_dataset(2, CFG.res)
    params = nerf.init_mlp(jax.random.key(0), CFG)
    return ds, params


def test_scene_and_image_shape(data):
    ds, params = data
    n = CFG.res * CFG.res
    assert ds.images.shape == (2, n, 3) and ds.origins.shape == ds.dirs.shape == (2, n, 3)
    assert ds.images.min() >= 0.0 and ds.images.max() <= 1.0
    assert (ds.images.sum(-1) > 0).any() and (ds.images.sum(-1) == 0).any()  # objects and sky
    np.testing.assert_allclose(np.linalg.norm(ds.dirs, axis=-1), 1.0, rtol=1e-5)
    img = _render(params, ds.origins[0], ds.dirs[0], None, "chunkop")
    assert img.shape == (n, 3) and bool(jnp.all(jnp.isfinite(img)))


def test_chunked_rendering_equals_vmap(data):
    ds, params = data
    key = jax.random.key(3)  # stratified (random) samples, drawn per ray: identical in all methods
    o, d = ds.origins[0], ds.dirs[0]
    ref = _render(params, o, d, key, "vmap")
    out = _render(params, o, d, key, "chunkop")
    assert_tree_allclose(out, ref, n_terms=RAY_TERMS)


def test_chunked_loss_and_grad_equal_vmap(data):
    ds, params = data
    key = jax.random.key(4)
    args = (ds.origins[1], ds.dirs[1], ds.images[1], key, CFG)
    ref_l, ref_g = _loss_and_grad(params, *args, "vmap")
    loss, grad = _loss_and_grad(params, *args, "chunkop")
    # the loss sums the rays' squared errors r^2: an error d in a colour moves it by 2 r d, so
    # relative to the loss the colours' rounding weighs 2 sum|r rgb| / sum r^2 (the condition)
    rgb = np.asarray(_render(params, *args[:2], key, "vmap"), np.float64)
    r = rgb - np.asarray(args[2], np.float64)
    condition = 2 * np.sum(np.abs(r * rgb)) / np.sum(r**2)
    n_rays = args[0].shape[0]
    assert_tree_allclose(loss, ref_l, n_terms=n_rays + RAY_TERMS, condition=condition)
    assert_tree_allclose(grad, ref_g, n_terms=n_rays * CFG.samples + RAY_TERMS)  # over every sample


def test_training_steps_decrease_loss(data):
    # train.py's step is make_train_step (jit of this plus the update; run by test_train_cli_tiny)
    ds, params = data
    opt = nerf.make_optimizer(2e-2, 100)
    state = opt.init(params)
    args = (ds.origins[0], ds.dirs[0], ds.images[0], jax.random.key(5), CFG, "chunkop")
    losses = []
    for _ in range(12):  # the same view and samples each step: the loss must go down
        loss, grad = _loss_and_grad(params, *args)
        updates, state = opt.update(grad, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0]


def test_train_cli_tiny(tmp_path):
    train = _load("train")
    res = train.main(["--tiny", "--res", "8", "--steps", "3", "--no-mem", "--out", str(tmp_path)])
    assert np.isfinite(res["heldout_psnr"])
    for f in ("heldout.png", "psnr.png", "results.json"):
        assert (tmp_path / f).is_file(), f
