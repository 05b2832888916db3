"""Issue #40, second finding: the 516-bin sky on a TPU, stored row-major by the user.

XLA:TPU gives an ``f32[786432, 516]`` argument the layout ``{0,1}`` (pixels minor: 516 is not a
multiple of 128, 786432 is), and a program that reads whole rows of it first copies all of ``x``
(1920 MiB of temp; ``RESULTS.md``, "Windowed rows"). A user can commit the sky row-major
instead (``jax.experimental.layout.Format(Layout(major_to_minor=(0, 1)))`` for ``device_put``
and the jit's ``in_shardings`` / ``out_shardings``: padded to 640 columns in memory). This
script measures the plain and the windowed operator on both layouts, against 512 bins.

    python benchmarks/explore_sky_layout.py [--lines 132400] [--rounds 5] [--out DIR]

Writes ``DIR/sky_layout_<backend>.json`` and ``.md`` (median of interleaved rounds, compiled temp
memory, the entry layouts XLA chose, the load before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_layout import lines, one_los
from explore_window import timed
from jax.experimental.layout import Format, Layout

import chunkop


def entry_layout(compiled) -> str:
    found = re.search(r"entry_computation_layout=\{([^}]*\})", compiled.as_text())
    return found.group(1)[:160] if found else "?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=132400)
    p.add_argument("--n-pix", type=int, default=786432)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    load0 = os.getloadavg()
    dev = jax.devices()[0]
    rows = lines(a.lines, a.n_pix)
    y = jnp.asarray(np.random.default_rng(1).normal(size=a.lines), jnp.float32)
    loss = lambda A, x: 0.5 * jnp.sum((A.mv(x) - y) ** 2)
    fns, temps, layouts = {}, {}, {}
    for n_bins in (516, 512):
        edges = np.geomspace(40.0, 1700.0, n_bins + 1)
        x = jnp.asarray(np.random.default_rng(2).random((a.n_pix, n_bins)), jnp.float32)
        row_major = Format(
            Layout(major_to_minor=(0, 1)),
            (
                jax.sharding.make_single_device_sharding
                if hasattr(jax.sharding, "make_single_device_sharding")  # (jax 0.12 deprecates the class's use)
                else jax.sharding.SingleDeviceSharding
            )(dev),
        )
        for layout in ("plain", "windowed"):
            A = chunkop.RowOperator(
                one_los(edges), rows, jax.ShapeDtypeStruct(x.shape, x.dtype), chunk_size=a.chunk, layout=layout
            )
            for store in ("default", "row-major") if n_bins == 516 else ("default",):
                xs = jax.device_put(x, row_major) if store == "row-major" else x
                kw = {} if store == "default" else {"in_shardings": row_major}
                kw_out = {} if store == "default" else {"out_shardings": row_major}
                ops = {
                    "mv": (jax.jit(lambda x, A=A: A.mv(x), **kw), xs),
                    "T": (jax.jit(lambda y, A=A: A.T.mv(y), **kw_out), y),
                    "grad": (jax.jit(lambda x, A=A: jax.grad(lambda x: loss(A, x))(x), **kw, **kw_out), xs),
                }
                for op, (f, arg) in ops.items():
                    name = f"{n_bins} {layout} {store} {op}"
                    compiled = f.lower(arg).compile()
                    temps[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
                    layouts[name] = entry_layout(compiled)
                    fns[name] = lambda f=f, arg=arg: f(arg)
    # agreement: every variant of an operation against the plain default one (below)
    agree = {}
    for name, f in fns.items():
        bins, layout, store, op = name.split()
        ref = f"{bins} plain default {op}"
        if name != ref:
            got, want = np.asarray(f()), np.asarray(fns[ref]())
            agree[name] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    res = timed(fns, a.rounds)
    load1 = os.getloadavg()
    rows_out = []
    for name, r in res.items():
        rows_out.append(
            {
                "name": name,
                "ms": r["median_ms"],
                "temp_mib": temps[name],
                "rel_diff_vs_plain_default": agree.get(name, 0.0),
                "entry_layout": layouts[name],
            }
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"sky_layout_{jax.default_backend()}_{a.lines}"
    meta = {"device": str(dev), "jax": jax.__version__, "load": [load0, load1], "lines": a.lines, "chunk": a.chunk}
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
    md = [f"# explore_sky_layout on {dev} (jax {jax.__version__}), {a.lines} lines, chunk {a.chunk}", ""]
    md += [f"load {load0} -> {load1}", "", "| bins layout store op | ms | temp MiB | rel. diff | entry layout |"]
    md += ["|---|---|---|---|---|"]
    md += [
        f"| {r['name']} | {r['ms']:.2f} | {r['temp_mib']:.1f} | {r['rel_diff_vs_plain_default']:.1e} | "
        f"`{r['entry_layout']}` |"
        for r in rows_out
    ]
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
