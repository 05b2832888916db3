"""Every kernel lowers for accelerators on this host, and the CPU fusion barrier is CPU-only.

``jax.export.export(jax.jit(f), platforms=[...])`` lowers a program for platforms this host
does not have. Each kernel (the ``RowOperator``'s ``mv``, ``T.mv`` (scatter-add and per-target),
gradients w.r.t. ``x`` and the rows, its hvp; ``chunkop.vmap``/``sum``/``map`` and their gradients; ``chunkop.jacrev``
and ``jacfwd``; progress off) is lowered for cuda, rocm and tpu, for cpu, and for cpu and cuda
in one module, and its StableHLO is inspected.

The fusion barrier (``_chunking.fusion_barrier``) is chosen per platform when lowering
(``jax.lax.platform_dependent``). What that lowers to: for each ``platform_dependent`` a
``stablehlo.case`` whose branches only return constants (the index of the kept branch) and a
``stablehlo.case`` over the kept branches (one region for one platform; cpu's and the
default's for cpu and cuda). On cpu the kept branch holds the barrier: a ``stablehlo.case`` of
two regions, one returning zeros and one returning the chunk unchanged (a lone
``stablehlo.return``). :func:`barrier_conditionals` counts those.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose

import chunkop

NPIX, K, N, CHUNK = 5, 3, 11, 4  # two chunks of 4 and a remainder of 3
X_STRUCT = jax.ShapeDtypeStruct((NPIX, K), jnp.float32)
ACCELERATORS = ["cuda", "rocm", "tpu"]


def row_fn(r: dict, x: jax.Array) -> jax.Array:
    return jnp.dot(jnp.exp(-r["w"]), x[r["pix"]])


def make_rows() -> dict:
    rng = np.random.default_rng(0)
    return {
        "pix": jnp.asarray(rng.integers(0, NPIX, N), jnp.int32),
        "w": jnp.asarray(rng.uniform(0.5, 2.0, (N, K)), jnp.float32),
    }


def op(rows: dict, **options) -> chunkop.RowOperator:
    return chunkop.RowOperator(row_fn, rows, X_STRUCT, chunk_size=CHUNK, progress=False, **options)


def example(x: jax.Array) -> jax.Array:
    return jnp.tanh(x[:2] * x[1:]) * 2.0


@functools.cache
def kernels() -> dict:
    """name -> (function, example arguments) (built when first used, not at collection)."""
    rows = make_rows()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(NPIX, K)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(2).normal(size=N), jnp.float32)
    xs = jnp.asarray(np.random.default_rng(3).normal(size=(N, 3)), jnp.float32)
    loss = lambda r, x: jnp.sum((op(r).mv(x) - y) ** 2)
    settings = {"chunk_size": CHUNK, "progress": False}
    vmapped = chunkop.vmap(example, **settings)
    summed = chunkop.sum(example, **settings)
    mapped = lambda a: chunkop.map(example, a, **settings)
    jac_in = jnp.arange(1.0, 12.0)  # 11 basis vectors, chunks of 4
    jac_f = lambda v: jnp.sin(v) * jnp.sum(v)
    return {
        "mv": (lambda r, x: op(r).mv(x), (rows, x)),
        "T.mv": (lambda r, y: op(r).T.mv(y), (rows, y)),
        "T.mv segment": (lambda r, y: op(r, segment_key="pix").T.mv(y), (rows, y)),
        "grad x": (jax.grad(loss, argnums=1), (rows, x)),
        "hvp": (lambda r, x: jax.jvp(lambda u: jax.grad(loss, argnums=1)(r, u), (x,), (x,))[1], (rows, x)),
        "grad rows": (lambda w, x: jax.grad(lambda w: loss({**rows, "w": w}, x))(w), (rows["w"], x)),
        "vmap": (vmapped, (xs,)),
        "vmap grad": (jax.grad(lambda a: jnp.sum(vmapped(a) ** 2)), (xs,)),
        "sum": (summed, (xs,)),
        "sum grad": (jax.grad(lambda a: jnp.sum(summed(a) ** 2)), (xs,)),
        "map": (mapped, (xs,)),
        "map grad": (jax.grad(lambda a: jnp.sum(mapped(a) ** 2)), (xs,)),
        "jacrev": (chunkop.jacrev(jac_f, chunk_size=CHUNK), (jac_in,)),
        "jacfwd": (chunkop.jacfwd(jac_f, chunk_size=CHUNK), (jac_in,)),
        # the windowed layout: concrete targets, built outside the exported function (the row
        # weights its arguments, so that its kernels are what is exported)
        "mv windowed": (lambda w, x: windowed(rows).with_rows({**rows, "w": w}).mv(x), (rows["w"], x)),
        "grad x windowed": (lambda w, x: jax.grad(lambda u: windowed_loss(rows, w, u, y))(x), (rows["w"], x)),
    }


def windowed(rows: dict) -> chunkop.RowOperator:
    return op(rows, layout="windowed")


def windowed_loss(rows: dict, w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((windowed(rows).with_rows({**rows, "w": w}).mv(x) - y) ** 2)


NAMES = ["mv", "T.mv", "T.mv segment", "grad x", "hvp", "grad rows"]
NAMES += ["vmap", "vmap grad", "sum", "sum grad", "map", "map grad"]
NAMES += ["jacrev", "jacfwd"]
NAMES += ["mv windowed", "grad x windowed"]


def _regions(text: str, start: int) -> list[str]:
    """The top-level regions of the op whose region list ``(`` is at ``text[start - 1]``."""
    regions, depth, begin, i = [], 0, 0, start
    while True:
        c = text[i]
        if c == "{":
            depth += 1
            if depth == 1:
                begin = i + 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                regions.append(text[begin:i])
        elif c == ")" and depth == 0:
            return regions
        i += 1


def barrier_conditionals(module: str) -> int:
    """How many fusion barriers a StableHLO module holds: ``stablehlo.case`` ops of two regions,
    neither holding another case, one of them a lone ``stablehlo.return`` and the other computing
    (the zeros)."""
    text = "\n".join(line for line in module.splitlines() if not line.startswith("#loc"))
    count = 0
    for m in re.finditer(r'"stablehlo\.case"\(%[\w#]+\) \(', text):
        regions = _regions(text, m.end())
        lone = [all(line.strip().startswith("stablehlo.return") for line in r.strip().splitlines()) for r in regions]
        if len(regions) == 2 and sum(lone) == 1 and not any('"stablehlo.case"' in r for r in regions):
            count += 1
    return count


def export(name: str, platforms: list[str]) -> jax.export.Exported:
    fn, args = kernels()[name]
    structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return jax.export.export(jax.jit(fn), platforms=platforms)(*structs)


@pytest.fixture(scope="module")
def modules() -> dict:
    """name -> {platforms: StableHLO text}, each kernel lowered for every platform set once."""
    out = {}
    for name in NAMES:
        out[name] = {
            tuple(p): export(name, p).mlir_module() for p in (["cpu"], ["cpu", "cuda"], ["cuda"], ["rocm"], ["tpu"])
        }
    return out


@pytest.mark.parametrize("name", NAMES)
def test_kernel_lowers_for_accelerators_without_the_barrier(name, modules):
    """Each kernel lowers for cuda, rocm and tpu with no barrier; for cpu it carries one or more,
    and in a cpu-and-cuda module the same ones (in the cpu branch: cuda alone has none)."""
    on_cpu = barrier_conditionals(modules[name][("cpu",)])
    assert on_cpu >= 1, f"{name}: no barrier in the cpu program"
    for platform in ACCELERATORS:
        text = modules[name][(platform,)]
        assert "stablehlo.optimization_barrier" not in text, f"{name}: the barrier's predicate on {platform}"
        assert barrier_conditionals(text) == 0, f"{name}: a barrier conditional on {platform}"
    assert barrier_conditionals(modules[name][("cpu", "cuda")]) == on_cpu


def test_barrier_counter_sees_the_barrier():
    """The counter is not vacuous: one barrier per chunk program (scan body, remainder) in the
    forward kernels; none where a plan has one chunk (no slice read, no barrier)."""
    assert barrier_conditionals(export("vmap", ["cpu"]).mlir_module()) == 2
    assert barrier_conditionals(export("mv", ["cpu"]).mlir_module()) == 2
    one_chunk = chunkop.vmap(example, chunk_size=N, progress=False)
    text = jax.export.export(jax.jit(one_chunk), platforms=["cpu"])(jax.ShapeDtypeStruct((N, 3), jnp.float32))
    assert barrier_conditionals(text.mlir_module()) == 0


def test_accelerator_export_together():
    """One module for all three accelerators lowers, and carries no barrier."""
    for name in ("mv", "T.mv", "vmap grad"):
        assert barrier_conditionals(export(name, ACCELERATORS).mlir_module()) == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs the cpu branch of the export")
@pytest.mark.parametrize("name", ["mv", "T.mv", "grad x", "sum grad"])
def test_multi_platform_export_runs_on_cpu_with_the_barrier(name):
    """The cpu-and-cuda module runs here with the values of the kernel, and XLA:CPU keeps the
    barrier's conditionals when it compiles it."""
    fn, args = kernels()[name]
    exported = export(name, ["cpu", "cuda"])
    assert_tree_allclose(exported.call(*args), jax.jit(fn)(*args), rtol=1e-6, atol=1e-6)
    compiled = jax.jit(exported.call).lower(*args).compile().as_text()
    assert "conditional(" in compiled


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the cpu program's barrier")
def test_barrier_under_vmap_stays_a_conditional():
    """Under ``jax.vmap`` over sets of rows the predicate (from the chunk index) is not batched:
    the cpu program keeps the barrier conditional, the cuda one has none."""
    rows = make_rows()
    batch = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), rows)
    ys = jnp.ones((2, N), jnp.float32)
    f = jax.jit(jax.vmap(lambda r, y: op(r).T.mv(y)))
    structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (batch, ys))
    assert barrier_conditionals(jax.export.export(f, platforms=["cpu"])(*structs).mlir_module()) >= 1
    assert barrier_conditionals(jax.export.export(f, platforms=["cuda"])(*structs).mlir_module()) == 0
    assert "conditional(" in f.lower(batch, ys).compile().as_text()


@pytest.mark.parametrize("name", ["mv windowed", "grad x windowed"])
def test_windowed_reads_are_chosen_per_platform(name, modules):
    """The windowed layout reads its windows (5 rows here) by a one-hot matrix product on a TPU
    and by a gather elsewhere (``row_layout.read_window``, ``jax.lax.platform_dependent``): the
    TPU program has a ``dot_general`` of the window that the CUDA one lacks."""
    tpu, cuda = modules[name][("tpu",)], modules[name][("cuda",)]
    assert tpu.count("stablehlo.dot_general") > cuda.count("stablehlo.dot_general")
    assert "stablehlo.gather" in cuda
