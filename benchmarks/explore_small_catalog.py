"""Where the TPU's seconds go at the families' default size (131072 lines, 64 x 48 pixels, 96 bins).

    python benchmarks/explore_small_catalog.py [--family NAME] [--out FILE]

Session 29 saw, on a TPU v5e, ``field3d.compress_lines`` take 11-19 s and ``field3d.data_on``
17-38 s per family where the 2-core CPU takes about 1 s each (benchmarks/RESULTS.md, "The families on
the chip"). This separates, for one family's catalog, each pass's compile from its run, and
``data_on`` under each ``layout=`` of its latent operators (``"auto"``, ``"plain"``, ``"windowed"``):
every pass is called twice in one process (each call builds its programs anew, as the reconstruction
does), and the jitted transposes of ``data_on``'s first block are lowered, compiled and run apart.
Prints and writes a JSON record (machine load before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "astro_los"))
import families
import field3d
from catalog import load_catalog

import chunkop


def timed(f, *a, **k):
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*a, **k))
    return out, time.perf_counter() - t0


def variants(cat, V: np.ndarray, rows: dict) -> dict:
    """Compile and run seconds of the compression pass's parts: the pass as it is at ``K`` = all, 32
    and 8 radial vectors; ``g`` alone (no truncation measurements); ``jax.vmap`` for ``chunkop.map``."""
    import los

    out = {}

    def g_only(Vj, mapper):
        def one(row):
            w = jax.lax.optimization_barrier(los.response_weights(row["d"], row["s"], cat.edges, "standard"))
            return w @ Vj

        def run(r):
            with jax.default_matmul_precision("float32"):
                return mapper(one, r).T

        return run

    cases = {
        f"pass_K{k}": jax.jit(field3d._compress_pass(cat.edges, V[:, :k], "standard", 8192))
        for k in (V.shape[1], 32, 8)
    }
    Vj = jnp.asarray(V, jnp.float32)
    cases["g_only_chunkop"] = jax.jit(g_only(Vj, lambda f, r: chunkop.map(f, r, chunk_size=8192)))
    cases["g_only_vmap"] = jax.jit(g_only(Vj, lambda f, r: jax.vmap(f)(r)))
    cases["g_only_vmap_no_barrier"] = jax.jit(
        lambda r: jax.vmap(lambda row: los.response_weights(row["d"], row["s"], cat.edges, "standard") @ Vj)(r)
    )
    for name, f in cases.items():
        t0 = time.perf_counter()
        comp = f.lower(rows).compile()
        out[name] = {"compile_s": time.perf_counter() - t0, "run_s": min(timed(comp, rows)[1] for _ in range(3))}
        print(name, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="compact_clouds", choices=families.FAMILIES)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--layouts", nargs="*", default=["auto", "plain", "windowed"], help="data_on's layouts, in this order"
    )
    p.add_argument("--variants", action="store_true", help="also compile the compression pass's variants apart")
    p.add_argument(
        "--grid", nargs=4, type=int, metavar=("NX", "NY", "BINS", "LINES"), help="another size than the default's"
    )
    a = p.parse_args(argv)
    res: dict = {"backend": jax.default_backend(), "jax": jax.__version__, "load_before": os.getloadavg()}
    size = "default"
    if a.grid:
        size = "x".join(map(str, a.grid))
        families.GRIDS[size] = tuple(a.grid)
    res["size"] = families.GRIDS[size]
    with tempfile.TemporaryDirectory() as tmp:
        cat = load_catalog(families.write_family(a.family, tmp, size)[0])
    V, _ = field3d.radial_basis(cat, "standard")
    V = V[:, : field3d.basis_kept(cat.n_los, cat.n_bins)]
    res["lines"], res["K"] = cat.n_los, V.shape[1]
    res["x_bytes"] = {"A": cat.n_pix * 24 * 4, "B": cat.n_pix * 24 * 24 * 4}  # data_on's two operators' x
    for i in (1, 2):
        sec: dict = {}
        (g, _, _), t = timed(field3d.compress_lines, cat, V, "standard", 8192, sec)
        res[f"compress_lines_call{i}_s"] = t
        res[f"compress_lines_call{i}_parts"] = sec
    run = jax.jit(field3d._compress_pass(cat.edges, V, "standard", 8192))
    rows = {k: jnp.asarray(getattr(cat, k), jnp.float32) for k in ("d", "s", "sigma")}
    t0 = time.perf_counter()
    comp = run.lower(rows).compile()
    res["compress_compile_s"] = time.perf_counter() - t0
    res["compress_run_s"] = min(timed(comp, rows)[1] for _ in range(3))
    g = np.ascontiguousarray(g[:, :24])
    grid = field3d.grid_for(cat.nx, cat.ny, field3d.MAX_LEARN)
    cpix = grid.of_pixel(cat.pix)
    iv = jnp.asarray(1.0 / cat.sigma.astype(np.float64) ** 2, jnp.float32)
    if a.variants:
        res["compress_variants"] = variants(cat, V, rows)
    for layout in a.layouts:
        t0 = time.perf_counter()
        jax.block_until_ready(field3d.latent_operator(g, cpix, grid.size, 8192, None, layout))
        res[f"build_{layout}_first_s"] = time.perf_counter() - t0
        for i in (1, 2):
            _, t = timed(field3d.data_on, cat, g, grid, 8192, layout)
            res[f"data_on_{layout}_call{i}_s"] = t
            print(f"data_on_{layout}_call{i}_s: {t:.3f}", flush=True)  # (in order among JAX_LOG_COMPILES's lines)
        A = field3d.latent_operator(g, cpix, grid.size, 8192, None, layout)
        res[f"data_on_{layout}_sorted"] = A.row_order is not None
        t0 = time.perf_counter()
        comp = jax.jit(field3d._transposed).lower(A, iv).compile()
        res[f"At_{layout}_compile_s"] = time.perf_counter() - t0
        res[f"At_{layout}_run_s"] = min(timed(comp, A, iv)[1] for _ in range(3))
    res["load_after"] = os.getloadavg()
    res["chunkop"] = chunkop.__version__
    for k, v in res.items():
        print(f"{k}: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
