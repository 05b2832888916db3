"""What ``progress=`` costs: a chunk loop timed with progress off, a callable and ``True``.

    python benchmarks/bench_progress.py [--chunks 200] [--chunk 512] [--forward-chunk 1024]
                                        [--dim 128] [--repeats 25] [--workloads grad,forward]
                                        [--out benchmarks/results]

Workloads (a two-layer tanh MLP per example, ``--chunks`` chunks; on an idle 2-core CPU each
chunk takes about 1 ms in both):

- ``grad``: ``jit(grad)`` of ``chunkop.sum`` over chunks of ``--chunk`` examples (the issue's
  case: the backward loop reports);
- ``forward``: ``jit`` of ``chunkop.vmap`` over chunks of ``--forward-chunk`` examples (the
  forward loop reports).

Variants:

- ``off``: ``progress=None``;
- ``callable``: ``progress=lambda k, n: None``;
- ``bar``: ``progress=True``, stderr sent to ``/dev/null`` (not a terminal: plain lines);
- ``callable-few``: a callable with ``MAX_REPORTS = 2`` (4 host callbacks per loop instead of
  22), to tell the host callbacks' cost from the rest of the tap's;
- ``previous``, for reference: the implementation before this change (an ordered
  ``debug_callback`` after every chunk, forcing the forward loop under ``grad``), loaded from git.

Every function is compiled first, then all are timed round-robin (interleaved, the order
reversing every round) so that load from other processes hits them alike; min and median per
variant and their ratios to ``off``. Writes ``OUT/progress.json`` with the machine's load
(``uptime``) before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import chunkop
import chunkop._chunking as _chunking
import chunkop._progress as _progress

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = "36bc6e3"  # the last commit with the per-chunk ordered debug_callback
FEW = 2  # MAX_REPORTS of the variant "callable-few" (4 host callbacks per loop)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"uptime failed: {e}"


def previous_progress_hook():
    """``progress_hook`` of the implementation before this change (git), or None."""
    try:
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{PREVIOUS}:src/chunkop/_progress.py"], capture_output=True, text=True
        )
        if src.returncode != 0 or "ordered=True" not in src.stdout:
            return None
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(src.stdout)
        spec = importlib.util.spec_from_file_location("_previous_progress", f.name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        os.unlink(f.name)
        return mod.progress_hook
    except Exception:  # noqa: BLE001
        return None


def mlp(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.tanh(x @ w) @ w).sum()


def build(args: argparse.Namespace) -> tuple[dict, tuple]:
    w = jnp.full((args.dim, args.dim), 0.01)
    xs = {
        "grad": jax.random.normal(jax.random.key(0), (args.chunks * args.chunk, args.dim)),
        "forward": jax.random.normal(jax.random.key(0), (args.chunks * args.forward_chunk, args.dim)),
    }
    old_hook = previous_progress_hook()
    fns = {}
    for workload in args.workloads.split(","):
        for variant in ("off", "callable", "bar", "callable-few", "previous"):
            if variant == "previous" and old_hook is None:
                continue
            progress = {"off": None, "bar": True}.get(variant, lambda k, n: None)  # a new callable each
            if workload == "grad":
                fn = jax.jit(jax.grad(chunkop.sum(mlp, in_axes=(None, 0), chunk_size=args.chunk, progress=progress)))
            else:
                fn = jax.jit(chunkop.vmap(mlp, in_axes=(None, 0), chunk_size=args.forward_chunk, progress=progress))
            patch = contextlib.nullcontext()
            if variant == "previous":
                patch = _patched(_chunking, "progress_hook", old_hook)
            elif variant == "callable-few":  # what the tap costs besides its host callbacks
                patch = _patched(_progress, "MAX_REPORTS", FEW)
            with patch:
                jax.block_until_ready(fn(w, xs[workload]))  # traces and compiles (with this variant's hook)
            fns[(workload, variant)] = fn
    return fns, w, xs


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=200)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--forward-chunk", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--workloads", default="grad,forward", help="comma-separated: grad, forward")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()

    load_before = uptime()
    print("load before:", load_before, flush=True)
    devnull = open(os.devnull, "w")  # noqa: SIM115
    with contextlib.redirect_stderr(devnull):
        fns, w, xs = build(args)
        jax.effects_barrier()
        times: dict = {key: [] for key in fns}
        keys = list(fns)
        for r in range(args.repeats):
            for key in keys if r % 2 == 0 else keys[::-1]:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[key](w, xs[key[0]]))
                jax.effects_barrier()
                times[key].append(time.perf_counter() - t0)
    load_after = uptime()

    rows = {}
    for (workload, variant), ts in times.items():
        base = times[(workload, "off")]
        rows[f"{workload}/{variant}"] = {
            "min_ms": 1e3 * min(ts),
            "median_ms": 1e3 * float(np.median(ts)),
            "ratio_min": min(ts) / min(base),
            "ratio_median": float(np.median(ts) / np.median(base)),
        }
    result = {
        "config": vars(args) | {"backend": jax.default_backend(), "jax": jax.__version__, "cpus": os.cpu_count()},
        "reports_per_loop": f"at most {_progress.MAX_REPORTS} + 2 (stride "
        f"{_progress.report_stride(args.chunks)} at {args.chunks} chunks)",
        "ms_per_chunk_off": {wl: rows[f"{wl}/off"]["min_ms"] / args.chunks for wl in args.workloads.split(",")},
        "load_before": load_before,
        "load_after": load_after,
        "results": rows,
        "times_ms": {f"{wl}/{v}": [round(1e3 * t, 3) for t in ts] for (wl, v), ts in times.items()},
    }
    print(f"{'':20s} {'min ms':>8s} {'median':>8s} {'x off (min)':>12s} {'x off (med)':>12s}")
    for name, row in rows.items():
        ms = f"{row['min_ms']:8.1f} {row['median_ms']:8.1f}"
        ratios = f"{row['ratio_min']:12.3f} {row['ratio_median']:12.3f}"
        print(f"{name:20s} {ms} {ratios}")
    print("ms per chunk (off, min):", {k: round(v, 3) for k, v in result["ms_per_chunk_off"].items()})
    print("load after:", load_after)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "progress.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out / "progress.json")


if __name__ == "__main__":
    main()
