"""Bad arguments fail early with a message that names the argument and what was expected.

Two tables, each run by one parametrised test:

- ``BUILD_ERRORS``: arguments checked when the transform is built (``chunk_size``, ``remat``,
  ``axis_size``, ``fun``, the types of ``in_axes``/``out_axes``) and errors of the reductions
  and of the user's own function: ``(id, call, exception type, message regex)``, and, where
  ``jax.vmap`` has the same argument, the same call to ``jax.vmap``, which must fail too.
- ``CALL_ERRORS``: errors that depend on the arguments, checked at call time: each is first
  checked to be an error for ``jax.vmap`` too, then for ``chunkop.vmap`` with and without
  chunking, eagerly and under an outer ``jit`` (where the arguments are arrays).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkop

X = jnp.ones((8, 3))
W = jnp.ones((5, 3))


class BuildError(NamedTuple):
    id: str
    call: Callable[[], Any]
    exc: type[Exception]
    match: str
    jax_call: Callable[[], Any] | None = None  # jax.vmap on the same argument (must raise `exc`)


# -- built with a bad argument ----------------------------------------------------------------------

BAD_CHUNK_SIZES = [
    (2.5, TypeError, r"`chunk_size` must be a positive int.*got 2\.5 of type float"),
    ("4", TypeError, r"`chunk_size` must be a positive int.*got '4' of type str"),
    (True, TypeError, r"`chunk_size` must be a positive int.*got True of type bool"),
    (np.bool_(True), TypeError, r"`chunk_size` must be a positive int.*of type bool"),
    (0, ValueError, r"`chunk_size` must be a positive int, got 0"),
    (-3, ValueError, r"`chunk_size` must be a positive int, got -3"),
    (np.int32(-1), ValueError, r"`chunk_size` must be a positive int, got -1"),
]
BUILDERS = {
    "vmap": lambda cs: chunkop.vmap(jnp.sin, chunk_size=cs),
    "map": lambda cs: chunkop.map(jnp.sin, X, chunk_size=cs),
    "sum": lambda cs: chunkop.sum(jnp.sin, chunk_size=cs),
    "mean": lambda cs: chunkop.mean(jnp.sin, chunk_size=cs),
    "jacrev": lambda cs: chunkop.jacrev(jnp.sin, chunk_size=cs),
    "jacfwd": lambda cs: chunkop.jacfwd(jnp.sin, chunk_size=cs),
}
REMAT = {"vmap": chunkop.vmap, "sum": chunkop.sum, "mean": chunkop.mean}
BAD_AXIS_SIZES = [
    (2.0, TypeError, r"`axis_size` must be a non-negative int or None, got 2\.0 of type float"),
    (False, TypeError, r"`axis_size` must be a non-negative int or None, got False of type bool"),
    (-1, ValueError, r"`axis_size` must be a non-negative int, got -1"),
]
BAD_IN_AXES = [
    ({"a": 0}, r"`in_axes` must be an int, None, or a tuple/list .* got \{'a': 0\} of type dict"),
    (1.0, r"`in_axes` must be an int, None, or a tuple/list .* got 1\.0 of type float"),
    (True, r"`in_axes` must be an int, None, or a tuple/list .* got True of type bool"),
    ((0, "x"), r"every leaf of `in_axes` must be an int or None, got 'x' of type str"),
    ((0, {"w": 1.5}), r"every leaf of `in_axes` must be an int or None, got 1\.5 of type float"),
]


JACS = {"rev": chunkop.jacrev, "fwd": chunkop.jacfwd}
THREE = (jnp.ones((3, 2)), jnp.ones(4), jnp.float32(0.7))


def _three_args(a, b, c):
    return jnp.tanh(a * c)[:, 0] + b[:3]


def _raise_in_fun(x):
    raise ValueError("boom from fun")


def returns_a_string(x):
    return "hello"


BUILD_ERRORS = [
    *(
        BuildError(f"{name}-chunk_size={bad!r}", lambda make=make, bad=bad: make(bad), exc, rf"chunkop\.{name}: {msg}")
        for name, make in BUILDERS.items()
        for bad, exc, msg in BAD_CHUNK_SIZES
    ),
    *(
        BuildError(
            f"{name}-chunk_size_required",
            lambda name=name: BUILDERS[name](None),
            TypeError,
            rf"chunkop\.{name}: `chunk_size` is required",
        )
        for name in ["map", "jacrev", "jacfwd"]
    ),
    *(
        BuildError(
            f"{name}-remat={bad!r}",
            lambda make=make, bad=bad: make(jnp.sin, chunk_size=2, remat=bad),
            TypeError,
            rf"chunkop\.{name}: `remat` must be True, False or a checkpoint policy.*got {bad!r}",
        )
        for name, make in REMAT.items()
        for bad in ["yes", 1, None]
    ),
    BuildError(
        "map-remat='no'",
        lambda: chunkop.map(jnp.sin, X, chunk_size=2, remat="no"),
        TypeError,
        r"chunkop\.map: `remat` must be",
    ),
    *(
        BuildError(
            f"{name}-axis_size={bad!r}",
            lambda make=make, bad=bad: make(jnp.sin, in_axes=None, axis_size=bad, chunk_size=2),
            exc,
            msg,
        )
        for name, make in [("vmap", chunkop.vmap), ("sum", chunkop.sum)]
        for bad, exc, msg in BAD_AXIS_SIZES
    ),
    BuildError(
        "fun_not_callable",
        lambda: chunkop.vmap(3, chunk_size=2),
        TypeError,
        r"chunkop\.vmap: `fun` must be callable, got 3",
    ),
    *(
        BuildError(
            f"in_axes={in_axes!r}",
            lambda in_axes=in_axes: chunkop.vmap(lambda x: x, in_axes=in_axes, chunk_size=2),
            TypeError,
            r"chunkop\.vmap: " + msg,
            jax_call=lambda in_axes=in_axes: jax.vmap(lambda x: x, in_axes=in_axes)(X),
        )
        for in_axes, msg in BAD_IN_AXES
    ),
    BuildError(
        "out_axes_leaf_type",
        lambda: chunkop.vmap(lambda x: x, out_axes={"y": "a"}, chunk_size=2),
        TypeError,
        r"every leaf of `out_axes` must be an int or None, got 'a' of type str",
    ),
    *(
        BuildError(
            f"{name}-progress={bad!r}",
            lambda make=make, bad=bad: make(bad),
            TypeError,
            rf"chunkop\.{name}: `progress` must be",
        )
        for name, make, bad in [
            ("vmap", lambda p: chunkop.vmap(jnp.sin, chunk_size=2, progress=p), "yes"),
            ("sum", lambda p: chunkop.sum(jnp.sin, chunk_size=2, progress=p), 3),
            ("map", lambda p: chunkop.map(jnp.sin, jnp.ones(4), chunk_size=2, progress=p), 1.5),
        ]
    ),
    BuildError(
        "vmap-remat_not_a_policy",
        lambda: chunkop.vmap(jnp.sin, chunk_size=2, remat=lambda x: x),
        TypeError,
        r"chunkop\.vmap: `remat`=.* is not a usable checkpoint policy",
    ),
    BuildError(
        "sum-remat_not_a_policy",
        lambda: chunkop.sum(jnp.sin, chunk_size=2, remat=lambda *a, **k: "yes"),
        TypeError,
        r"chunkop\.sum: `remat`=.* is not a checkpoint policy",
    ),
    # chunkop.jacrev / jacfwd: argnums, and what can be differentiated (as jax.jacrev / jacfwd)
    *(
        BuildError(
            f"jac{mode}-argnums={argnums!r}",
            lambda jac=jac, argnums=argnums: jac(_three_args, argnums=argnums, chunk_size=2)(*THREE),
            ValueError,
            rf"chunkop\.jac{mode}: `argnums`={re.escape(repr(argnums))} must be int\(s\) indexing the 3 positional",
        )
        for mode, jac in JACS.items()
        for argnums in [3, -4, (0, 5), 1.5, "a", True]
    ),
    *(
        BuildError(
            f"jac{mode}-argnums=()",
            lambda jac=jac: jac(jnp.sin, argnums=(), chunk_size=2)(1.0),
            ValueError,
            r"`argnums`=\(\) selects no argument",
        )
        for mode, jac in JACS.items()
    ),
    *(
        BuildError(
            f"jac{mode}-integer_input",
            lambda jac=jac: jac(lambda x: x * 2, chunk_size=2)(np.arange(3)),
            TypeError,
            rf"chunkop\.jac{mode}: differentiation requires .*float arguments, got dtype int32",
            jax_call=lambda theirs=theirs: theirs(lambda x: x * 2)(np.arange(3)),
        )
        for (mode, jac), theirs in zip(JACS.items(), [jax.jacrev, jax.jacfwd])
    ),
    *(
        BuildError(
            f"jacrev-{dtype}_output",
            lambda fun=fun: chunkop.jacrev(fun, chunk_size=2)(np.ones(3, np.float32)),
            TypeError,
            rf"chunkop\.jacrev: differentiation requires real float outputs, got dtype {dtype}",
            jax_call=lambda fun=fun: jax.jacrev(fun)(np.ones(3, np.float32)),
        )
        for fun, dtype in [(lambda x: x * 1j, "complex64"), (lambda x: (x > 0).astype(jnp.int32), "int32")]
    ),
    BuildError(
        "jacfwd-complex_input",
        lambda: chunkop.jacfwd(jnp.abs, chunk_size=2)(np.ones(3, np.complex64)),
        TypeError,
        r"chunkop\.jacfwd: differentiation requires real float arguments, got dtype complex64",
        jax_call=lambda: jax.jacfwd(jnp.abs)(np.ones(3, np.complex64)),
    ),
    # the reductions name themselves
    BuildError(
        "sum-sizes_differ",
        lambda: chunkop.sum(lambda a, b: a * b, chunk_size=2)(X, W),
        ValueError,
        r"chunkop\.sum: mapped arguments have different sizes",
    ),
    BuildError(
        "mean-nothing_mapped",
        lambda: chunkop.mean(lambda a: a, in_axes=None, chunk_size=2)(X),
        ValueError,
        r"chunkop\.mean: no argument is mapped",
    ),
    BuildError(
        "map-non_array_leaf",
        lambda: chunkop.map(lambda t: t["x"], {"x": X, "s": "str"}, chunk_size=2),
        TypeError,
        r"chunkop\.map: argument xs\['s'\] is mapped",
    ),
    # an error raised by `fun` itself propagates unchanged (not replaced by an out_axes check)
    *(
        BuildError(
            f"error_in_fun_not_masked-chunk_size={cs}",
            lambda cs=cs: chunkop.vmap(_raise_in_fun, chunk_size=cs, out_axes=0)(X),
            ValueError,
            "boom from fun",
        )
        for cs in [None, 2]
    ),
    # JAX's own message for a non-array output names the traced function: the user's, with its
    # file and line, not chunkop's internal wrapper
    BuildError(
        "non_array_output_names_the_users_function",
        lambda: chunkop.vmap(returns_a_string, chunk_size=2)(jnp.arange(5.0)),
        TypeError,
        r"function \S*returns_a_string at .*test_vmap_errors\.py:\d+",
    ),
]


@pytest.mark.parametrize("case", BUILD_ERRORS, ids=[c.id for c in BUILD_ERRORS])
def test_build_error(case):
    if case.jax_call is not None:
        with pytest.raises(case.exc):
            case.jax_call()
    with pytest.raises(case.exc, match=case.match):
        case.call()


# -- called with arguments that do not fit ----------------------------------------------------------


class CallError(NamedTuple):
    id: str
    fun: Callable
    args: tuple
    exc: type[Exception]
    match: str
    kwargs: Mapping[str, Any] = MappingProxyType({})
    vmap_kw: Mapping[str, Any] = MappingProxyType({})  # in_axes, out_axes, axis_size
    jit: bool = True  # non-array arguments cannot be passed through an outer jit


CALL_ERRORS = [
    CallError(
        "mapped_sizes_differ",
        lambda a, b: a.sum() + b["b"].sum(),
        (X, {"b": jnp.ones((3, 5))}),
        ValueError,
        r"different sizes along the mapped axis: args\[0\] has size 8 along axis 0, "
        r"but args\[1\]\['b'\] has size 5 along axis 1",
        vmap_kw={"in_axes": (0, {"b": 1})},
    ),
    CallError(
        "mapped_sizes_differ_kwargs",
        lambda a, *, b: a.sum() + b.sum(),
        (X,),
        ValueError,
        r"args\[0\] has size 8 along axis 0, but kwargs\['b'\] has size 7 along axis 0",
        kwargs={"b": jnp.ones((7, 2))},
    ),
    CallError(
        "in_axes_tuple_length",
        lambda a, b: a,
        (X, W),
        ValueError,
        r"`in_axes` is a tuple of 1 entries, but the function was called with 2 positional arguments",
        vmap_kw={"in_axes": (0,)},
    ),
    CallError(
        "in_axes_not_a_prefix_list",
        lambda a, b: a,
        (X, {"b": W}),
        ValueError,
        r"`in_axes` must be a tree prefix of the positional arguments, but in_axes=\(0, \[0\]\)",
        vmap_kw={"in_axes": (0, [0])},
    ),
    CallError(
        "in_axes_not_a_prefix_keys",
        lambda a, b: a,
        (X, {"b": W}),
        ValueError,
        r"`in_axes` must be a tree prefix of the positional arguments",
        vmap_kw={"in_axes": (0, {"b": 0, "c": None})},
    ),
    CallError(
        "out_axes_not_a_prefix_tuple",
        lambda a: (a, a),
        (X,),
        ValueError,
        r"`out_axes` must be a tree prefix of the function's output, but out_axes=\(0, 0, 0\)",
        vmap_kw={"out_axes": (0, 0, 0)},
    ),
    CallError(
        "out_axes_not_a_prefix_keys",
        lambda a: {"y": a},
        (X,),
        ValueError,
        r"`out_axes` must be a tree prefix of the function's output",
        vmap_kw={"out_axes": {"z": 0}},
    ),
    CallError(
        "out_axes_out_of_range",
        lambda a: a,
        (X,),
        ValueError,
        r"out_axes=2 is out of range for an output of per-example shape \(3,\); it must be in \[-2, 2\)",
        vmap_kw={"out_axes": 2},
    ),
    CallError(
        "out_axes_out_of_range_negative",
        lambda a: (a.sum(), a),
        (X,),
        ValueError,
        r"out_axes=-3 is out of range for an output of per-example shape \(3,\)",
        vmap_kw={"out_axes": (0, -3)},
    ),
    CallError(
        "in_axis_out_of_range",
        lambda a, b: a,
        (X, W),
        ValueError,
        r"in_axes asks to map argument args\[1\] along axis 2, but it has rank 2 \(shape \(5, 3\)\)",
        vmap_kw={"in_axes": (0, 2)},
    ),
    CallError(
        "in_axis_out_of_range_nested",
        lambda a, b: a,
        (X, {"w": W}),
        ValueError,
        r"argument args\[1\]\['w'\] along axis -3, but it has rank 2",
        vmap_kw={"in_axes": (0, {"w": -3})},
    ),
    CallError(
        "mapped_scalar",
        lambda a, *, b: a * b,
        (X,),
        ValueError,
        r"argument kwargs\['b'\] along axis 0, but it has rank 0 .*Pass in_axes=None for unmapped scalars",
        kwargs={"b": 1.0},
    ),
    CallError(
        "mapped_str",
        lambda a, s: a,
        (X, "abc"),
        TypeError,
        r"argument args\[1\] is mapped \(axis 0\) but is a str, not an array",
        jit=False,
    ),
    CallError(
        "mapped_function",
        lambda a, s: a,
        (X, {"f": jnp.sin}),
        TypeError,
        r"argument args\[1\]\['f'\] is mapped \(axis 0\) but is a",
        vmap_kw={"in_axes": (0, {"f": 0})},
        jit=False,
    ),
    CallError(
        "nothing_mapped_no_axis_size",
        lambda a: a,
        (X,),
        ValueError,
        r"no argument is mapped \(all in_axes are None\), so `axis_size` must be given",
        vmap_kw={"in_axes": None},
    ),
    CallError("no_arguments_no_axis_size", lambda: jnp.ones(3), (), ValueError, r"`axis_size` must be given"),
    CallError(
        "axis_size_disagrees",
        lambda a: a,
        (X,),
        ValueError,
        r"`axis_size`=3 does not match the mapped size 8 of argument args\[0\] along axis 0",
        vmap_kw={"axis_size": 3},
    ),
]


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("case", CALL_ERRORS, ids=[c.id for c in CALL_ERRORS])
def test_call_error(case, chunk_size):
    with pytest.raises(case.exc):  # an error for jax.vmap too
        jax.vmap(case.fun, **case.vmap_kw)(*case.args, **case.kwargs)
    chunked = chunkop.vmap(case.fun, chunk_size=chunk_size, **case.vmap_kw)
    with pytest.raises(case.exc, match=case.match):
        chunked(*case.args, **case.kwargs)
    if case.jit:  # the same under jit
        with pytest.raises(case.exc, match=case.match):
            jax.jit(lambda *a, **k: chunked(*a, **k))(*case.args, **case.kwargs)
