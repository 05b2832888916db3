"""The registry of ``chunkop.vmap`` test cases, shared by the transform tests (as
``operator_registry.py`` is by the operator tests).

``CASES[name] = (fun, args, kwargs, vmap_options)``: a function, its arguments (mapped along
``N = 8`` elements as ``vmap_options["in_axes"]`` says), keyword arguments (mapped along axis 0,
or None) and the ``jax.vmap`` options (``in_axes``, ``out_axes``, ``axis_size``). Together they
cover int/tuple/list/dict/nested ``in_axes``, negative and inner axes, keyword arguments,
``out_axes`` trees, negative and ``None``, ``axis_size``, output dtypes, integer, boolean and
complex inputs, and ``None`` outputs. ``test_vmap_semantics.py`` checks the values of each at every
chunk plan; ``test_vmap_transforms.py`` the gradient of each that has one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

N = 8


def _rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


X = _rand(N, 5, seed=1)
W = _rand(5, 3, seed=2)
XT = _rand(5, N, seed=3)  # mapped along axis 1 / -1
X3 = _rand(2, 3, N, seed=4)  # mapped along axis 2 / -1

CASES = {
    "int_axes": (lambda x, y: jnp.tanh(x) * y.sum(), (X, XT.T), None, dict(in_axes=0)),
    "axis_1": (lambda x: jnp.cumsum(x) ** 2, (XT,), None, dict(in_axes=1)),
    "tuple_with_none": (lambda x, w: jnp.sin(x @ w), (X, W), None, dict(in_axes=(0, None))),
    "list_axes": (lambda x, w: jnp.sin(x @ w), (X, W), None, dict(in_axes=[0, None])),
    "negative_axes": (lambda a, b: a.sum() * b, (XT, X3), None, dict(in_axes=(-1, -1))),
    "rank3_axis2": (lambda a: a @ a.T, (X3,), None, dict(in_axes=2)),
    "dict_prefix_with_none": (
        lambda d, v: d["a"] @ d["w"] + v.sum(),
        ({"a": X, "w": W}, XT),
        None,
        dict(in_axes=({"a": 0, "w": None}, 1)),
    ),
    "nested_prefix": (
        lambda t: t[0] * t[1]["s"] + t[1]["v"].sum(),
        ((X, {"s": np.float32(2.0), "v": XT}),),
        None,
        dict(in_axes=((0, {"s": None, "v": -1}),)),
    ),
    "kwargs_mapped_axis0": (
        lambda x, *, scale, shift: x * scale + shift,
        (X,),
        {"scale": _rand(N, seed=5)[:, None], "shift": _rand(N, 5, seed=6)},
        dict(),
    ),
    "kwargs_with_tuple_in_axes": (
        lambda w, x, bias: x @ w + bias,
        (W, X),
        {"bias": _rand(N, 3, seed=7)},
        dict(in_axes=(None, 0)),
    ),
    "out_axes_tree": (
        lambda x: {"a": jnp.outer(x, x), "b": (x.sum(), x[:2] * 2)},
        (X,),
        None,
        dict(out_axes={"a": 1, "b": (0, -1)}),
    ),
    "out_axes_negative": (lambda x: jnp.outer(x, x[:3]), (X,), None, dict(out_axes=-1)),
    "out_axes_minus_rank": (lambda x: jnp.outer(x, x[:3]), (X,), None, dict(out_axes=-3)),
    "out_axes_none_unmapped": (
        lambda x, w: (x @ w, w.sum(0), jnp.float32(3.0)),
        (X, W),
        None,
        dict(in_axes=(0, None), out_axes=(0, None, None)),
    ),
    "out_axes_none_dict_leaf": (
        lambda x, w: {"y": x @ w, "c": {"w2": w * 2, "k": 4}},
        (X, W),
        None,
        dict(in_axes=(0, None), out_axes={"y": 1, "c": None}),
    ),
    "out_python_scalar_unmapped": (
        lambda x: (x * 2, 1.0),
        (X,),
        None,
        dict(out_axes=(0, None)),
    ),
    "axis_size_no_mapped_args": (
        lambda w: jnp.tanh(w) * 2,
        (W,),
        None,
        dict(in_axes=None, axis_size=N),
    ),
    "axis_size_matching": (lambda x: x * 2, (X,), None, dict(axis_size=N)),
    "output_dtypes": (
        lambda x: (
            (x * 10).astype(jnp.int32),
            x > 0,
            x.astype(jnp.complex64) * (1 + 2j),
            (x * 10).astype(jnp.uint8),
            jnp.float16(1) * x,
        ),
        (X,),
        None,
        dict(),
    ),
    "int_and_bool_inputs": (
        lambda i, b: jnp.where(b, i * 2, -i),
        (np.arange(N * 3, dtype=np.int32).reshape(N, 3), (np.arange(N * 3) % 3 == 0).reshape(N, 3)),
        None,
        dict(),
    ),
    "complex_inputs": (
        lambda z: jnp.abs(z) + z.conj() * 1j,
        (X.astype(np.complex64) + 1j * XT.T.astype(np.complex64),),
        None,
        dict(),
    ),
    "none_in_output": (lambda x: (x * 2, None, {"a": x.sum()}), (X,), None, dict()),
    "empty_output": (lambda x: (), (X,), None, dict()),
    "numpy_inputs": (lambda x, w: x @ w, (np.asarray(X, np.float64), W), None, dict(in_axes=(0, None))),
    "python_scalar_unmapped": (lambda x, s: x * s, (X, 3.0), None, dict(in_axes=(0, None))),
    "none_argument": (lambda x, nothing: x * 2, (X, None), None, dict(in_axes=(0, None))),
}
