"""chunkop on an accelerator, against the same programs on the host's CPU (never part of CI).

    python benchmarks/accelerator_check.py [--n-los 65536] [--n-pix 4096] [--n-bins 64]
        [--chunk 4096] [--out DIR]

Runs on ``jax.default_backend()`` (a TPU or GPU; on a CPU-only host it checks itself against
itself) with float32 products at ``"highest"`` precision, as CPUs compute them, and writes
``DIR/accelerator_<backend>.json`` and ``.md``:

- the LOS ``RowOperator`` (``bench_los.Workload``): ``A x``, ``A^T y`` with the scatter-add and
  with ``segment_key="pix"``, the gradient of ``sum(sin(A x))`` and a Hessian-vector product,
  each against the same call on the CPU device (largest difference relative to the largest
  element); whether each transpose repeats bitwise on the device;
- ``chunkop.vmap`` of a per-example MLP loss under ``jax.grad`` against ``jax.vmap`` on the
  device, and the compiled temp memory of both (XLA's ``memory_analysis`` of the device's
  program);
- the device's compiled temp memory of ``jax.grad`` through ``A x`` against the unchunked
  ``jax.vmap`` of ``row_fn``.

Exits 1 when a difference exceeds its tolerance (``1e-4`` relative: float32 sums of up to
``n_bins`` terms computed in another order on another device).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_los as B

import chunkop

RTOL = 1e-4


def rel(a: jax.Array, b: jax.Array) -> float:
    """The largest difference of ``a`` and ``b`` relative to the largest element of ``b``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), np.finfo(np.float32).tiny))


def temp_mib(fn, *args) -> float:
    """Compiled temp memory of ``jax.jit(fn)`` on the arguments' device, in MiB."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def run(a: argparse.Namespace) -> dict:
    device, cpu = jax.devices()[0], jax.devices("cpu")[0]
    wl = B.Workload(a.n_pix, a.n_bins, a.chunk)
    data = wl.data(a.n_los)
    put = lambda tree, d: jax.device_put(tree, d)

    def ops(rows: dict) -> dict:
        A = chunkop.RowOperator(wl.row_fn, rows, wl.x_struct, chunk_size=a.chunk)
        S = chunkop.RowOperator(wl.row_fn, rows, wl.x_struct, chunk_size=a.chunk, segment_key="pix")
        return {
            "A x": jax.jit(lambda x: A.mv(x)),
            "A^T y (scatter)": jax.jit(lambda y: A.T.mv(y)),
            "A^T y (segment_key)": jax.jit(lambda y: S.T.mv(y)),
            "grad sum(sin(A x))": jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(A.mv(x))))),
            "hvp": jax.jit(lambda x, v: jax.jvp(jax.grad(lambda z: jnp.sum(jnp.sin(A.mv(z)))), (x,), (v,))[1]),
        }

    args = {"A x": ("x",), "A^T y (scatter)": ("y",), "A^T y (segment_key)": ("y",)}
    args.update({"grad sum(sin(A x))": ("x",), "hvp": ("x", "v")})
    on_device, on_cpu = ops(put(data["rows"], device)), ops(put(data["rows"], cpu))
    checks = {}
    for name, fn in on_device.items():
        dev_args = [put(data[k], device) for k in args[name]]
        out = fn(*dev_args)
        again = fn(*dev_args)
        ref = on_cpu[name](*[put(data[k], cpu) for k in args[name]])
        checks[name] = {
            "relative difference vs CPU": rel(out, ref),
            "bitwise repeatable": bool(np.array_equal(np.asarray(out), np.asarray(again))),
        }

    # the transforms: a per-example MLP loss under grad
    k = jax.random.split(jax.random.key(0), 3)
    n, d = 16384, 32
    w = put(jax.random.normal(k[0], (d, d), jnp.float32) / d**0.5, device)
    xs = put(jax.random.normal(k[1], (n, d), jnp.float32), device)
    ys = put(jax.random.normal(k[2], (n, d), jnp.float32), device)
    loss = lambda w, x, y: jnp.sum((jnp.tanh(jnp.tanh(x @ w) @ w) - y) ** 2)
    chunked = jax.grad(lambda w, x, y: chunkop.vmap(loss, (None, 0, 0), chunk_size=1024)(w, x, y).sum())
    plain = jax.grad(lambda w, x, y: jax.vmap(loss, (None, 0, 0))(w, x, y).sum())
    checks["chunkop.vmap grad (MLP) vs jax.vmap"] = {
        "relative difference vs jax.vmap": rel(jax.jit(chunked)(w, xs, ys), jax.jit(plain)(w, xs, ys)),
        "temp MiB chunkop.vmap": temp_mib(chunked, w, xs, ys),
        "temp MiB jax.vmap": temp_mib(plain, w, xs, ys),
    }
    rows, x = put(data["rows"], device), put(data["x"], device)
    A = chunkop.RowOperator(wl.row_fn, rows, wl.x_struct, chunk_size=a.chunk)
    checks["grad through A x: temp memory"] = {
        "temp MiB RowOperator": temp_mib(jax.grad(lambda x: jnp.sum(jnp.sin(A.mv(x)))), x),
        "temp MiB jax.vmap(row_fn)": temp_mib(jax.grad(lambda x: jnp.sum(jnp.sin(wl.f_vmap(rows, x)))), x),
    }
    ok = all(v <= RTOL for c in checks.values() for key, v in c.items() if key.startswith("relative"))
    return {
        "backend": jax.default_backend(),
        "device": str(device),
        "jax": jax.__version__,
        "sizes": {"n_los": a.n_los, "n_pix": a.n_pix, "n_bins": a.n_bins, "chunk": a.chunk},
        "rtol": RTOL,
        "ok": ok,
        "checks": checks,
    }


def markdown(res: dict) -> str:
    s = res["sizes"]
    lines = [
        f"# chunkop on {res['device']} (jax {res['jax']}) against the CPU",
        "",
        f"LOS operator: {s['n_los']} lines, sky {s['n_pix']} x {s['n_bins']}, chunk {s['chunk']}; "
        f"float32 products at 'highest' precision; tolerance {res['rtol']:g} relative. All within: {res['ok']}.",
        "",
        "| check | figure | value |",
        "| --- | --- | --- |",
    ]
    for name, c in res["checks"].items():
        for key, v in c.items():
            lines.append(f"| {name} | {key} | {v:.3g} |" if isinstance(v, float) else f"| {name} | {key} | {v} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-los", type=int, default=65536)
    p.add_argument("--n-pix", type=int, default=4096)
    p.add_argument("--n-bins", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    with jax.default_matmul_precision("highest"):
        res = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"accelerator_{res['backend']}"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
