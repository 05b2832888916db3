"""Issue #42: a chunk layout that keeps an Auto mesh's sharding under ``jax.jit`` without ``set_mesh``.

Under ``jax.jit`` on an Auto mesh, a traced argument's type carries no sharding, so
``chunkop.vmap`` cannot tell that its mapped axis is sharded: it chunks the axis as on one device
(contiguous chunks), and XLA's partitioner gathers the whole input to every device (an
all-gather) and returns the output replicated, where ``jax.vmap`` keeps the input's sharding.

A layout that needs no knowledge of the sharding: view the mapped axis of ``n = c * k`` as
``(c, k)`` and scan over ``k`` (chunk ``j`` holds elements ``j, k + j, 2k + j, ...``). With the
axis sharded in blocks over ``D`` devices (``D`` dividing ``c``), every chunk then spreads over
all devices, ``c / D`` elements each, and the partitioner keeps everything local. This script
compiles, on ``D`` host devices, the three for one function, forward and reverse mode, and
reports each program's collectives (and whether any runs inside a loop), the output's sharding
and the compiled temp memory per device. CPU host devices: no timing (they share the cores).

    python benchmarks/explore_interleaved.py [--devices 4] [--n 4096] [--chunk 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _multidevice_checks import collectives, collectives_in_loops

    import chunkop

    mesh = jax.make_mesh((a.devices,), ("d",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    F = a.features
    w = jnp.asarray(rng.normal(size=(F, F)) / np.sqrt(F), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(a.n, F)), jnp.float32)
    x = jax.device_put(xs, NamedSharding(mesh, P("d")))

    def f(w, v):  # one example: a small MLP layer and its square norm
        h = jnp.tanh(v @ w)
        return h * jnp.sum(h**2)

    def interleaved(w, x, c=a.chunk):
        n = x.shape[0]
        k = n // c
        chunks = jnp.moveaxis(x.reshape(c, k, *x.shape[1:]), 1, 0)  # (k, c, ...): chunk j = x[j::k]

        @jax.checkpoint
        def body(_, chunk):
            return None, jax.vmap(f, (None, 0))(w, chunk)

        _, ys = jax.lax.scan(body, None, chunks)  # (k, c, ...)
        return jnp.moveaxis(ys, 0, 1).reshape(n, *ys.shape[2:])

    variants = {
        "jax.vmap": lambda w, x: jax.vmap(f, (None, 0))(w, x),
        "chunkop.vmap (contiguous chunks)": lambda w, x: chunkop.vmap(f, (None, 0), chunk_size=a.chunk)(w, x),
        "interleaved chunks (by hand)": interleaved,
    }
    want = np.asarray(jax.vmap(f, (None, 0))(w, xs))
    rows = []
    for name, fn in variants.items():
        loss = lambda w, x, fn=fn: jnp.sum(fn(w, x) ** 2)
        grad = jax.grad(loss)
        y = jax.jit(fn)(w, x)  # no jax.set_mesh: the mesh only in the input's sharding
        err = float(np.max(np.abs(np.asarray(y) - want)) / np.max(np.abs(want)))
        temp = {
            "forward": jax.jit(fn).lower(w, x).compile().memory_analysis().temp_size_in_bytes,
            "grad": jax.jit(grad).lower(w, x).compile().memory_analysis().temp_size_in_bytes,
        }
        rows.append(
            {
                "variant": name,
                "max_rel_err": err,
                "out_spec": str(y.sharding.spec) if isinstance(y.sharding, NamedSharding) else str(y.sharding),
                "forward_collectives": collectives(fn, w, x),
                "grad_collectives": collectives(grad, w, x),
                "grad_collectives_in_loops": len(collectives_in_loops(grad, w, x)),
                "temp_bytes": temp,
            }
        )
    meta = {"jax": jax.__version__, "devices": a.devices, "n": a.n, "chunk": a.chunk, "features": F}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interleaved_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# explore_interleaved: {a.devices} host devices, Auto mesh, jit without set_mesh ({meta})", ""]
    lines += [
        "| variant | output sharding | forward collectives | grad collectives (in loops) | temp fwd / grad (KiB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | `{r['out_spec']}` | {', '.join(r['forward_collectives']) or 'none'} | "
            f"{', '.join(r['grad_collectives']) or 'none'} ({r['grad_collectives_in_loops']}) | "
            f"{r['temp_bytes']['forward'] / 1024:.0f} / {r['temp_bytes']['grad'] / 1024:.0f} |"
        )
    (out / "interleaved_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
