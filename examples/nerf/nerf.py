"""A tiny NeRF in JAX whose full-image loss is computed in chunks of rays with ``chunkop``.

Importable pieces (used by ``train.py`` and ``tests/test_example_nerf.py``):

* the procedural scene: :func:`camera_poses`, :func:`camera_rays`, :func:`render_scene`
  (analytic ray casting of a few Lambertian spheres and boxes, in numpy: no downloads);
* the model: :func:`positional_encoding`, :func:`init_mlp`, :func:`mlp`;
* rendering: :func:`sample_ts` (stratified sampling along a ray), :func:`render_ray`
  (volume rendering with alpha compositing), :func:`render_rays` (an image, chunked or not);
* losses: :func:`image_loss` (the full-image mean squared error, with ``chunkop.sum`` over
  rays, ``jax.lax.map`` or plain ``jax.vmap``) and :func:`make_train_step`.

Everything is a pure function of a ``Config``; parameters are a list of ``(W, b)`` pairs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import chunkop


@dataclasses.dataclass(frozen=True)
class Config:
    """Static settings of the model, the sampler and the renderer (hashable: a jit static)."""

    res: int = 64  # image height = width, in pixels
    samples: int = 48  # samples per ray (stratified)
    near: float = 2.2  # ray segment [near, far] that covers the scene from every camera
    far: float = 5.8
    n_freqs: int = 6  # positional-encoding frequencies for (x, y, z)
    width: int = 64  # MLP width
    depth: int = 3  # hidden layers
    chunk: int = 1024  # rays per chunk (chunkop / lax.map batch size)
    background: float = 0.0  # colour of rays that leave the scene (the procedural scene's sky)
    density_bias: float = 2.0  # density = scale * softplus(raw - bias): starts thin, not foggy
    density_scale: float = 10.0


# ==============================================================================================
# The procedural scene: analytic ray casting (numpy), the ground truth.

CAMERA_RADIUS = 4.0
FOV_DEG = 40.0
LIGHT = np.array([0.5, -0.4, 0.8]) / np.linalg.norm([0.5, -0.4, 0.8])
AMBIENT = 0.25

#: (centre, radius, albedo)
SPHERES = (
    ((0.0, 0.0, 0.55), 0.55, (0.90, 0.20, 0.15)),
    ((0.85, -0.55, 0.30), 0.30, (0.15, 0.45, 0.95)),
    ((-0.75, 0.70, 0.40), 0.40, (0.95, 0.85, 0.20)),
)
#: (lower corner, upper corner, albedo); the first one is a flat slab the objects stand on.
BOXES = (
    ((-1.2, -1.2, -0.12), (1.2, 1.2, 0.0), (0.80, 0.80, 0.80)),
    ((-0.95, -0.95, 0.0), (-0.35, -0.35, 0.6), (0.20, 0.80, 0.30)),
    ((0.45, 0.35, 0.0), (0.95, 0.85, 0.35), (0.75, 0.35, 0.85)),
)


def look_at(eye: np.ndarray, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """Camera-to-world 3x4 matrix (OpenGL convention: the camera looks down its -z axis)."""
    eye = np.asarray(eye, np.float64)
    fwd = np.asarray(target, np.float64) - eye
    fwd /= np.linalg.norm(fwd)
    right = np.cross(fwd, up)
    right /= np.linalg.norm(right)
    true_up = np.cross(right, fwd)
    return np.stack([right, true_up, -fwd, eye], axis=1)


def camera_poses(n: int, *, held_out: bool = False, radius: float = CAMERA_RADIUS) -> np.ndarray:
    """``n`` camera-to-world matrices (n, 3, 4) on the upper part of a sphere, looking at 0.

    Training poses lie on a golden-angle spiral (elevation 15..65 degrees); held-out poses
    (``held_out=True``) sit at azimuths and elevations that the spiral does not visit.
    """
    i = np.arange(n) + 0.5
    if held_out:
        az = 2 * np.pi * (i / n) + 0.37
        el = np.deg2rad(np.full(n, 32.0) + 18.0 * np.sin(2.1 * i))
    else:
        az = i * np.pi * (3.0 - np.sqrt(5.0))  # golden angle
        el = np.deg2rad(15.0 + 50.0 * i / n)
    eyes = radius * np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], -1)
    return np.stack([look_at(e) for e in eyes])


def focal_length(res: int) -> float:
    return 0.5 * res / np.tan(0.5 * np.deg2rad(FOV_DEG))


def camera_rays(c2w: np.ndarray, res: int) -> tuple[np.ndarray, np.ndarray]:
    """Origins and unit directions (res*res, 3) through the pixel centres, row-major."""
    f = focal_length(res)
    j, i = np.meshgrid(np.arange(res) + 0.5, np.arange(res) + 0.5, indexing="ij")
    dirs_cam = np.stack([(i - 0.5 * res) / f, -(j - 0.5 * res) / f, -np.ones_like(i)], -1)
    dirs = dirs_cam.reshape(-1, 3) @ c2w[:, :3].T
    dirs /= np.linalg.norm(dirs, axis=-1, keepdims=True)
    origins = np.broadcast_to(c2w[:, 3], dirs.shape)
    return origins.astype(np.float32), dirs.astype(np.float32)


def _hit_spheres(o, d):
    best_t = np.full(len(o), np.inf)
    normal = np.zeros_like(o)
    albedo = np.zeros_like(o)
    for c, r, a in SPHERES:
        oc = o - np.asarray(c)
        b = np.sum(oc * d, -1)
        disc = b * b - (np.sum(oc * oc, -1) - r * r)
        t = -b - np.sqrt(np.maximum(disc, 0.0))
        hit = (disc > 0) & (t > 1e-4) & (t < best_t)
        best_t = np.where(hit, t, best_t)
        p = o + t[:, None] * d
        normal = np.where(hit[:, None], (p - np.asarray(c)) / r, normal)
        albedo = np.where(hit[:, None], np.asarray(a), albedo)
    return best_t, normal, albedo


def _hit_boxes(o, d, best_t, normal, albedo):
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = 1.0 / d
    for lo, hi, a in BOXES:
        lo, hi = np.asarray(lo), np.asarray(hi)
        t0, t1 = (lo - o) * inv, (hi - o) * inv
        tmin, tmax = np.minimum(t0, t1), np.maximum(t0, t1)
        t_in, t_out = tmin.max(-1), tmax.min(-1)
        hit = (t_in <= t_out) & (t_in > 1e-4) & (t_in < best_t)
        axis = tmin.argmax(-1)  # the slab entered last gives the face normal
        n = np.zeros_like(o)
        n[np.arange(len(o)), axis] = -np.sign(d[np.arange(len(o)), axis])
        best_t = np.where(hit, t_in, best_t)
        normal = np.where(hit[:, None], n, normal)
        albedo = np.where(hit[:, None], np.asarray(a), albedo)
    return best_t, normal, albedo


def render_scene(origins: np.ndarray, dirs: np.ndarray, background: float = 0.0) -> np.ndarray:
    """Ground-truth colours (n, 3) in [0, 1]: nearest hit, Lambert + ambient, hard shadows."""
    o, d = origins.astype(np.float64), dirs.astype(np.float64)
    t, n, a = _hit_spheres(o, d)
    t, n, a = _hit_boxes(o, d, t, n, a)
    hit = np.isfinite(t)
    p = o + np.where(hit, t, 0.0)[:, None] * d
    # shadow rays towards the (directional) light
    light = np.broadcast_to(LIGHT, p.shape)
    ts, _, _ = _hit_spheres(p + 1e-3 * n, light)
    ts, _, _ = _hit_boxes(p + 1e-3 * n, light, ts, np.zeros_like(n), np.zeros_like(n))
    lit = ~np.isfinite(ts)
    shade = AMBIENT + (1 - AMBIENT) * np.clip(np.sum(n * LIGHT, -1), 0.0, 1.0) * lit
    rgb = np.where(hit[:, None], a * shade[:, None], background)
    return np.clip(rgb, 0.0, 1.0).astype(np.float32)


class Dataset(NamedTuple):
    origins: np.ndarray  # (views, res*res, 3)
    dirs: np.ndarray  # (views, res*res, 3)
    images: np.ndarray  # (views, res*res, 3)


def make_dataset(n_views: int, res: int, *, held_out: bool = False, background: float = 0.0) -> Dataset:
    os_, ds, ims = [], [], []
    for c2w in camera_poses(n_views, held_out=held_out):
        o, d = camera_rays(c2w, res)
        os_.append(o)
        ds.append(d)
        ims.append(render_scene(o, d, background))
    return Dataset(np.stack(os_), np.stack(ds), np.stack(ims))


# ==============================================================================================
# The model.


def positional_encoding(x: jax.Array, n_freqs: int) -> jax.Array:
    """``[x, sin(2^k pi x), cos(2^k pi x)]_{k < n_freqs}`` along the last axis (3 -> 3 + 6 n_freqs)."""
    scales = (2.0 ** jnp.arange(n_freqs)) * jnp.pi
    xb = (x[..., None, :] * scales[:, None]).reshape(x.shape[:-1] + (-1,))
    return jnp.concatenate([x, jnp.sin(xb), jnp.cos(xb)], -1)


def init_mlp(key: jax.Array, cfg: Config) -> list[tuple[jax.Array, jax.Array]]:
    """He-initialised MLP: PE(x) -> ``depth`` ReLU layers of ``width`` -> (density, r, g, b)."""
    sizes = [3 + 6 * cfg.n_freqs] + [cfg.width] * cfg.depth + [4]
    params = []
    for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        w = jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m)
        params.append((w, jnp.zeros(n)))
    w_out, b_out = params[-1]
    params[-1] = (w_out * 0.1, b_out)  # start near "empty, grey" space
    return params


def mlp(params, x: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Density (...,) >= 0 and colour (..., 3) in (0, 1) at points x (..., 3)."""
    h = positional_encoding(x, cfg.n_freqs)
    for w, b in params[:-1]:
        h = jax.nn.relu(h @ w + b)
    w, b = params[-1]
    out = h @ w + b
    sigma = jax.nn.softplus(out[..., 0] - cfg.density_bias) * cfg.density_scale
    rgb = jax.nn.sigmoid(out[..., 1:])
    return sigma, rgb


# ==============================================================================================
# Rendering one ray: stratified samples, volume rendering with alpha compositing.


def sample_ts(u: jax.Array, cfg: Config) -> jax.Array:
    """Sample depths: one per bin of [near, far] cut into ``samples`` bins, at offset u in [0,1)."""
    bins = jnp.arange(cfg.samples, dtype=jnp.float32)
    return cfg.near + (cfg.far - cfg.near) * (bins + u) / cfg.samples


def composite(sigma: jax.Array, rgb: jax.Array, ts: jax.Array, cfg: Config) -> jax.Array:
    """Alpha compositing front to back: sum_i T_i alpha_i c_i + T_final * background."""
    deltas = jnp.diff(ts, append=cfg.far)
    deltas = jnp.maximum(deltas, 1e-4)
    alpha = 1.0 - jnp.exp(-sigma * deltas)
    trans = jnp.exp(-jnp.cumsum(jnp.concatenate([jnp.zeros(1), sigma[:-1] * deltas[:-1]])))
    weights = alpha * trans
    return weights @ rgb + (1.0 - weights.sum()) * cfg.background


def render_ray(params, origin: jax.Array, direction: jax.Array, u: jax.Array, cfg: Config) -> jax.Array:
    """Colour (3,) of one ray; ``u`` (samples,) are the stratified offsets (0.5: bin midpoints)."""
    ts = sample_ts(u, cfg)
    pts = origin + ts[:, None] * direction
    sigma, rgb = mlp(params, pts, cfg)
    return composite(sigma, rgb, ts, cfg)


def ray_offsets(key: jax.Array | None, index: jax.Array, cfg: Config) -> jax.Array:
    """Stratified offsets for ray ``index``: uniform per bin from ``fold_in(key, index)``; midpoints if key is None.

    Drawn per ray inside the mapped function so that no (rays, samples) array is an input.
    """
    if key is None:
        return jnp.full((cfg.samples,), 0.5)
    return jax.random.uniform(jax.random.fold_in(key, index), (cfg.samples,))


# ==============================================================================================
# Images and losses, three ways: chunkop, jax.lax.map(batch_size), plain jax.vmap.

METHODS = ("chunkop", "lax.map", "vmap")


def render_rays(params, origins, dirs, cfg: Config, *, key=None, method: str = "chunkop") -> jax.Array:
    """Colours (n, 3) of rays (n, 3); ``chunkop.vmap`` over rays, ``cfg.chunk`` at a time."""

    def one(p, o, d, i):
        return render_ray(p, o, d, ray_offsets(key, i, cfg), cfg)

    idx = jnp.arange(origins.shape[0])
    in_axes = (None, 0, 0, 0)
    if method == "chunkop":
        return chunkop.vmap(one, in_axes, chunk_size=cfg.chunk)(params, origins, dirs, idx)
    if method == "lax.map":
        return jax.lax.map(lambda a: one(params, *a), (origins, dirs, idx), batch_size=cfg.chunk)
    if method == "vmap":
        return jax.vmap(one, in_axes)(params, origins, dirs, idx)
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def image_loss(params, origins, dirs, target, key, cfg: Config, method: str = "chunkop") -> jax.Array:
    """Mean squared error over every pixel and channel of a full image (n rays).

    ``chunkop``: ``chunkop.sum`` of the per-ray squared error, so under ``grad`` only one chunk
    of rays (``cfg.chunk * cfg.samples`` MLP evaluations) is live at a time. ``lax.map`` and
    ``vmap`` render every ray (per-ray errors) and then average.
    """

    def sq_err(p, o, d, t, i):
        rgb = render_ray(p, o, d, ray_offsets(key, i, cfg), cfg)
        return jnp.sum((rgb - t) ** 2)

    n = origins.shape[0]
    idx = jnp.arange(n)
    if method == "chunkop":
        total = chunkop.sum(sq_err, in_axes=(None, 0, 0, 0, 0), chunk_size=cfg.chunk)(
            params, origins, dirs, target, idx
        )
    elif method == "lax.map":
        errs = jax.lax.map(lambda a: sq_err(params, *a), (origins, dirs, target, idx), batch_size=cfg.chunk)
        total = errs.sum()
    elif method == "vmap":
        total = jax.vmap(sq_err, in_axes=(None, 0, 0, 0, 0))(params, origins, dirs, target, idx).sum()
    else:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    return total / (3 * n)


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    schedule = optax.exponential_decay(lr, transition_steps=max(steps, 1), decay_rate=0.1)
    return optax.adam(schedule)


def make_train_step(cfg: Config, opt: optax.GradientTransformation, method: str = "chunkop") -> Callable:
    """``step(params, opt_state, origins, dirs, target, key) -> (params, opt_state, loss)``, jitted.

    One step = the gradient of the full-image loss of one view (every ray of it).
    """

    @jax.jit
    def step(params, opt_state, origins, dirs, target, key):
        loss, grads = jax.value_and_grad(image_loss)(params, origins, dirs, target, key, cfg, method)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def psnr(mse) -> float:
    return float(-10.0 * np.log10(float(mse)))


def step_temp_bytes(cfg: Config, method: str, opt: optax.GradientTransformation | None = None) -> int:
    """Compiled temp memory of one training step (lowered on ShapeDtypeStructs: nothing runs)."""
    opt = opt or make_optimizer(1e-3, 1)
    n = cfg.res * cfg.res
    params = jax.eval_shape(functools.partial(init_mlp, cfg=cfg), jax.random.key(0))
    opt_state = jax.eval_shape(opt.init, params)
    rays = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = make_train_step(cfg, opt, method)
    compiled = step.lower(params, opt_state, rays, rays, rays, key).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)
