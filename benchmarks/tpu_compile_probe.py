"""Why the astro example's passes over the lines compiled slowly on a TPU v5e (issue #41).

Compile and run seconds of the standard weights (an ``erfc`` per bin) times the radial basis ``V``
(516 x 32) for 2M lines, one group of cases per call::

    python benchmarks/tpu_compile_probe.py compress  # compress_lines' pass: chunkop.map vs jax.vmap, a
                                                     # whole block of 2M lines and two remainders
    python benchmarks/tpu_compile_probe.py weights   # which part compiles slowly
    python benchmarks/tpu_compile_probe.py barrier   # the weights behind an optimization_barrier

Logs of the runs on the lent TPU v5e (load 0.00): ``results/tpu/compress_compile_probe.log``
(``compress``) and ``results/tpu/weights_matmul_compile_probe.log`` (``weights``, then ``barrier``).
The same cases ran then as three scripts; this file holds them together.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "astro_los"))
import los

import chunkop

EDGES = los.bin_edges(516)


def weights(d: jax.Array, s: jax.Array) -> jax.Array:
    return los.response_weights(d, s, EDGES, "standard")


def compress_case(V: jax.Array, chunked: bool, barrier: bool = False):
    def one(row):
        w = weights(row["d"], row["s"])
        w = jax.lax.optimization_barrier(w) if barrier else w
        return w @ V, jnp.sum(w * w), jnp.sum(w)

    def run(d, s, V):
        r = {"d": d, "s": s}
        g, w2, w1 = chunkop.map(one, r, chunk_size=min(8192, len(d))) if chunked else jax.vmap(one)(r)
        return g.T, w2, w1

    return run


def cases(group: str, V: jax.Array) -> dict:
    if group == "compress":
        return {"chunkop.map 8192": compress_case(V, True), "vmap": compress_case(V, False)}
    if group == "weights":
        log_hi = jnp.log(jnp.asarray(EDGES[1:], jnp.float32))
        return {
            "x+1": lambda d, s, V: d + 1.0,
            "erfc (n,)": lambda d, s, V: jax.scipy.special.erfc(d / s),
            "weights row sums": lambda d, s, V: weights(d, s).sum(1),
            "weights @ V": lambda d, s, V: weights(d, s) @ V,
            "log-width only": lambda d, s, V: ((log_hi - jnp.log(d)[:, None]) * (d / s)[:, None]).sum(1),
        }
    if group == "barrier":
        return {
            "barrier, weights @ V": lambda d, s, V: jax.lax.optimization_barrier(weights(d, s)) @ V,
            "HIGHEST weights @ V": lambda d, s, V: jnp.matmul(weights(d, s), V, precision="highest"),
            "chunkop.map barrier": compress_case(V, True, barrier=True),
        }
    raise SystemExit(f"group must be compress, weights or barrier, got {group!r}")


def main(group: str) -> None:
    rng = np.random.default_rng(0)
    V = jnp.asarray(np.linalg.qr(rng.standard_normal((516, 32)))[0].astype(np.float32))
    sizes = (2097152, 657088, 655360) if group == "compress" else (2097152,)
    for n in sizes:
        d = jnp.asarray(rng.uniform(40, 1700, n).astype(np.float32))
        s = 0.1 * d
        for name, f in cases(group, V).items():
            t = time.perf_counter()
            c = jax.jit(f).lower(d, s, V).compile()
            tc = time.perf_counter() - t
            jax.block_until_ready(c(d, s, V))
            t = time.perf_counter()
            jax.block_until_ready(c(d, s, V))
            print(f"{n} {name}: compile {tc:.2f}s run {time.perf_counter() - t:.4f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "barrier")
