"""Train a tiny NeRF on a procedural scene; every step takes the gradient of a FULL-image loss.

    python examples/nerf/train.py [--steps N] [--samples S] [--res R] [--chunk C] [--out DIR] [--tiny]

Each step renders every ray of one training view (res*res rays, ``--samples`` points each)
and differentiates the mean squared error of the whole image. The loss is a ``chunkop.sum``
over rays, ``--chunk`` rays at a time, each chunk rematerialised in the backward pass, so the
step's memory is bounded by ``chunk * samples`` MLP evaluations rather than by the image.

Outputs (in ``--out``, default ``outputs/nerf/``): ``heldout.png`` (held-out views: NeRF vs
ground truth), ``psnr.png`` (PSNR curve), ``memory.png`` (compiled temp memory of the training
step vs samples per ray for jax.vmap, jax.lax.map(batch_size) and chunkop) and
``results.json`` (the numbers). The PSNR reported is measured on held-out camera poses that
are never trained on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nerf


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300; --tiny: 40)")
    p.add_argument("--samples", type=int, default=None, help="samples per ray for training (default 48)")
    p.add_argument("--res", type=int, default=None, help="image height = width (default 64, up to ~100)")
    p.add_argument("--chunk", type=int, default=None, help="rays per chunk (default 1024)")
    p.add_argument("--out", default="outputs/nerf", help="output folder (default outputs/nerf)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run at tiny size")
    p.add_argument("--views", type=int, default=None, help="training views (default 32)")
    p.add_argument("--heldout", type=int, default=4, help="held-out views (default 4)")
    p.add_argument("--lr", type=float, default=2e-2, help="Adam learning rate (decays x0.1 over the run)")
    p.add_argument("--width", type=int, default=None, help="MLP width (default 64)")
    p.add_argument("--eval-every", type=int, default=None, help="held-out evaluation period (steps)")
    p.add_argument(
        "--mem-samples",
        default=None,
        help="comma-separated samples per ray for the memory table (default 64,128,256,640)",
    )
    p.add_argument("--no-mem", action="store_true", help="skip the memory table")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    tiny = a.tiny
    defaults = dict(
        steps=40 if tiny else 300,
        samples=16 if tiny else 48,
        res=16 if tiny else 64,
        chunk=64 if tiny else 1024,
        views=8 if tiny else 32,
        width=32 if tiny else 64,
        eval_every=10 if tiny else 25,
        mem_samples="16,32,64" if tiny else "64,128,256,640",
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.mem_samples = [int(s) for s in str(a.mem_samples).split(",") if s]
    return a


def save_heldout_png(path, preds, truths, res, psnrs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(preds)
    fig, axes = plt.subplots(2, n, figsize=(2.6 * n, 5.4), squeeze=False)
    for k in range(n):
        axes[0, k].imshow(np.clip(preds[k].reshape(res, res, 3), 0, 1))
        axes[0, k].set_title(f"NeRF, held-out view {k}\n{psnrs[k]:.2f} dB", fontsize=9)
        axes[1, k].imshow(truths[k].reshape(res, res, 3))
        axes[1, k].set_title("ground truth", fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_psnr_png(path, train_hist, eval_hist):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    s, v = zip(*train_hist)
    ax.plot(s, v, lw=0.7, alpha=0.6, label="training view (stratified samples)")
    s, v = zip(*eval_hist)
    ax.plot(s, v, "o-", ms=3, label="held-out views (mean)")
    ax.axhline(20, color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("PSNR (dB)")
    ax.set_title("Tiny NeRF, full-image gradient per step (chunkop.sum over rays)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_memory_png(path, table, samples, res, chunk):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in table.items():
        ax.plot(samples, [row[str(s)] / 2**20 for s in samples], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(samples, [str(s) for s in samples])
    ax.set_xlabel("samples per ray")
    ax.set_ylabel("compiled temp memory of the training step (MiB)")
    ax.set_title(f"{res}x{res} rays per step, chunk {chunk} rays", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_table(base: nerf.Config, samples_list, point_budget: int) -> dict:
    """Temp bytes of the compiled training step (no execution) per method and samples per ray."""
    rows = {
        "jax.vmap": ("vmap", lambda s: base.chunk),
        f"jax.lax.map(batch_size={base.chunk})": ("lax.map", lambda s: base.chunk),
        f"chunkop.sum(chunk_size={base.chunk})": ("chunkop", lambda s: base.chunk),
        f"chunkop.sum(chunk_size={point_budget}//samples)": ("chunkop", lambda s: max(1, point_budget // s)),
    }
    table = {}
    for name, (method, chunk_of) in rows.items():
        table[name] = {}
        for s in samples_list:
            cfg = nerf.dataclasses.replace(base, samples=s, chunk=chunk_of(s))
            t = time.perf_counter()
            table[name][str(s)] = nerf.step_temp_bytes(cfg, method)
            print(
                f"  {name:<40s} samples={s:<4d} temp={table[name][str(s)] / 2**20:9.1f} MiB"
                f"  (compiled in {time.perf_counter() - t:.1f}s)",
                flush=True,
            )
    return table


def main(argv=None):
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    cfg = nerf.Config(res=a.res, samples=a.samples, chunk=a.chunk, width=a.width)
    print(f"config: {cfg}  steps={a.steps} lr={a.lr} views={a.views} held-out={a.heldout}", flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)

    t0 = time.perf_counter()
    train = nerf.make_dataset(a.views, a.res, background=cfg.background)
    test = nerf.make_dataset(a.heldout, a.res, held_out=True, background=cfg.background)
    base_mse = np.mean((test.images - train.images.mean((0, 1))) ** 2)
    print(
        f"scene: {a.views} training + {a.heldout} held-out views of {a.res}x{a.res} "
        f"({time.perf_counter() - t0:.2f}s); predicting the mean colour scores "
        f"{nerf.psnr(base_mse):.2f} dB on the held-out views",
        flush=True,
    )

    opt = nerf.make_optimizer(a.lr, a.steps)
    params = nerf.init_mlp(jax.random.key(a.seed), cfg)
    opt_state = opt.init(params)
    step = nerf.make_train_step(cfg, opt, "chunkop")
    render = jax.jit(functools.partial(nerf.render_rays, cfg=cfg, method="chunkop"))

    def evaluate(params):
        preds = [np.asarray(render(params, o, d)) for o, d in zip(test.origins, test.dirs)]
        mses = [np.mean((p - t) ** 2) for p, t in zip(preds, test.images)]
        return preds, [nerf.psnr(m) for m in mses]

    rng = np.random.default_rng(a.seed)
    key = jax.random.key(a.seed + 1)
    train_hist, eval_hist = [], []
    order = []
    t_start, cpu_start = time.perf_counter(), time.process_time()
    reached = None  # (step, seconds) when the held-out PSNR first reached 20 dB
    for i in range(1, a.steps + 1):
        if not order:
            order = list(rng.permutation(a.views))
        v = order.pop()
        params, opt_state, loss = step(
            params, opt_state, train.origins[v], train.dirs[v], train.images[v], jax.random.fold_in(key, i)
        )
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {i}")
        train_hist.append((i, nerf.psnr(loss)))
        if i % a.eval_every == 0 or i == a.steps or i == 1:
            _, ps = evaluate(params)
            eval_hist.append((i, float(np.mean(ps))))
            if reached is None and np.mean(ps) >= 20.0:
                reached = (i, time.perf_counter() - t_start)
            print(
                f"step {i:5d}  loss {loss:.5f}  train PSNR {nerf.psnr(loss):6.2f} dB  "
                f"held-out PSNR {np.mean(ps):6.2f} dB  time {time.perf_counter() - t_start:7.1f}s",
                flush=True,
            )
    train_time = time.perf_counter() - t_start
    cpu_time = time.process_time() - cpu_start
    preds, ps = evaluate(params)
    final = float(np.mean(ps))
    print(
        f"done: {a.steps} steps in {train_time:.1f}s wall, {cpu_time:.1f} CPU-s on {os.cpu_count()} "
        f"cores (incl. compilation and evaluations); held-out PSNR {final:.2f} dB "
        f"(per view: {', '.join(f'{p:.2f}' for p in ps)})",
        flush=True,
    )
    if reached:
        print(f"held-out PSNR first >= 20 dB at step {reached[0]} ({reached[1]:.1f}s)", flush=True)

    save_heldout_png(os.path.join(a.out, "heldout.png"), preds, test.images, a.res, ps)
    save_psnr_png(os.path.join(a.out, "psnr.png"), train_hist, eval_hist)
    results = dict(
        config=nerf.dataclasses.asdict(cfg),
        steps=a.steps,
        lr=a.lr,
        train_seconds=train_time,
        train_cpu_seconds=cpu_time,
        cpu_count=os.cpu_count(),
        reached_20db=dict(step=reached[0], seconds=reached[1]) if reached else None,
        heldout_psnr=final,
        heldout_psnr_per_view=ps,
        mean_colour_baseline_psnr=nerf.psnr(base_mse),
        eval_history=eval_hist,
    )
    written = ["heldout.png", "psnr.png"]

    if not a.no_mem:
        point_budget = cfg.chunk * min(a.mem_samples)
        print(
            f"memory of the training step ({a.res}x{a.res} rays, width {cfg.width}), compiled only, nothing executed:",
            flush=True,
        )
        table = memory_table(cfg, a.mem_samples, point_budget)
        save_memory_png(os.path.join(a.out, "memory.png"), table, a.mem_samples, a.res, cfg.chunk)
        results["memory_temp_bytes"] = table
        written.append("memory.png")
        head = f"| {'training step temp memory (MiB)':<40s} | " + " | ".join(f"S={s:<5d}" for s in a.mem_samples) + " |"
        print(head)
        print("|" + "-" * (len(head) - 2) + "|")
        for name, row in table.items():
            print(f"| {name:<40s} | " + " | ".join(f"{row[str(s)] / 2**20:7.1f}" for s in a.mem_samples) + " |")

    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    written.append("results.json")
    out = os.path.abspath(a.out)
    print(f"wrote {', '.join(written)} to {out}", flush=True)
    return results


if __name__ == "__main__":
    main()
