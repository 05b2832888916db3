"""Bad arguments fail early with a message that names the argument.

Every error is first checked to be an error for ``jax.vmap`` too (where ``jax.vmap`` has the
same argument), then for ``chunkop.vmap`` with and without chunking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkop

X = jnp.ones((8, 3))
W = jnp.ones((5, 3))
CHUNKS = [None, 2]


# ----------------------------------------------------------------------------------------------
# chunk_size, remat, axis_size: checked when the transform is built.

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


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("bad, exc, msg", BAD_CHUNK_SIZES, ids=[repr(b[0]) for b in BAD_CHUNK_SIZES])
def test_bad_chunk_size(builder, bad, exc, msg):
    with pytest.raises(exc, match=rf"chunkop\.{builder}: {msg}"):
        BUILDERS[builder](bad)


@pytest.mark.parametrize("builder", ["map", "jacrev", "jacfwd"])
def test_chunk_size_required_where_it_has_no_default_meaning(builder):
    with pytest.raises(TypeError, match=rf"chunkop\.{builder}: `chunk_size` is required"):
        BUILDERS[builder](None)


@pytest.mark.parametrize("builder", ["vmap", "sum", "mean"])
def test_bad_remat(builder):
    make = {"vmap": chunkop.vmap, "sum": chunkop.sum, "mean": chunkop.mean}[builder]
    for bad in ["yes", 1, None]:
        with pytest.raises(
            TypeError, match=rf"chunkop\.{builder}: `remat` must be True, False or a checkpoint policy.*got {bad!r}"
        ):
            make(jnp.sin, chunk_size=2, remat=bad)
    with pytest.raises(TypeError, match=r"chunkop\.map: `remat` must be"):
        chunkop.map(jnp.sin, X, chunk_size=2, remat="no")


@pytest.mark.parametrize(
    "bad, exc, msg",
    [
        (2.0, TypeError, r"`axis_size` must be a non-negative int or None, got 2\.0 of type float"),
        (False, TypeError, r"`axis_size` must be a non-negative int or None, got False of type bool"),
        (-1, ValueError, r"`axis_size` must be a non-negative int, got -1"),
    ],
)
def test_bad_axis_size(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        chunkop.vmap(jnp.sin, in_axes=None, axis_size=bad, chunk_size=2)
    with pytest.raises(exc, match=msg):
        chunkop.sum(jnp.sin, in_axes=None, axis_size=bad, chunk_size=2)


def test_fun_not_callable():
    with pytest.raises(TypeError, match=r"chunkop\.vmap: `fun` must be callable, got 3"):
        chunkop.vmap(3, chunk_size=2)


@pytest.mark.parametrize(
    "in_axes, msg",
    [
        ({"a": 0}, r"`in_axes` must be an int, None, or a tuple/list .* got \{'a': 0\} of type dict"),
        (1.0, r"`in_axes` must be an int, None, or a tuple/list .* got 1\.0 of type float"),
        (True, r"`in_axes` must be an int, None, or a tuple/list .* got True of type bool"),
        ((0, "x"), r"every leaf of `in_axes` must be an int or None, got 'x' of type str"),
        ((0, {"w": 1.5}), r"every leaf of `in_axes` must be an int or None, got 1\.5 of type float"),
    ],
)
def test_bad_in_axes_type(in_axes, msg):
    with pytest.raises(TypeError):
        jax.vmap(lambda x: x, in_axes=in_axes)(X)
    with pytest.raises(TypeError, match=r"chunkop\.vmap: " + msg):
        chunkop.vmap(lambda x: x, in_axes=in_axes, chunk_size=2)


def test_bad_out_axes_type():
    with pytest.raises(TypeError, match=r"every leaf of `out_axes` must be an int or None, got 'a' of type str"):
        chunkop.vmap(lambda x: x, out_axes={"y": "a"}, chunk_size=2)


# ----------------------------------------------------------------------------------------------
# Errors that depend on the arguments: checked at call time.


def _expect(fun, args, kwargs=None, *, exc, match, chunk_size, jit=True, **vmap_kw):
    kwargs = kwargs or {}
    with pytest.raises(exc):
        jax.vmap(fun, **vmap_kw)(*args, **kwargs)
    with pytest.raises(exc, match=match):
        chunkop.vmap(fun, chunk_size=chunk_size, **vmap_kw)(*args, **kwargs)
    if not jit:  # non-array arguments cannot be passed through an outer jit
        return
    with pytest.raises(exc, match=match):  # the same under jit
        jax.jit(lambda *a, **k: chunkop.vmap(fun, chunk_size=chunk_size, **vmap_kw)(*a, **k))(*args, **kwargs)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_mapped_sizes_differ_names_both_arguments(chunk_size):
    _expect(
        lambda a, b: a.sum() + b["b"].sum(),
        (X, {"b": jnp.ones((3, 5))}),
        in_axes=(0, {"b": 1}),
        exc=ValueError,
        match=r"different sizes along the mapped axis: args\[0\] has size 8 along axis 0, "
        r"but args\[1\]\['b'\] has size 5 along axis 1",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_mapped_sizes_differ_with_kwargs(chunk_size):
    _expect(
        lambda a, *, b: a.sum() + b.sum(),
        (X,),
        {"b": jnp.ones((7, 2))},
        exc=ValueError,
        match=r"args\[0\] has size 8 along axis 0, but kwargs\['b'\] has size 7 along axis 0",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_in_axes_tuple_length_mismatch(chunk_size):
    _expect(
        lambda a, b: a,
        (X, W),
        in_axes=(0,),
        exc=ValueError,
        match=r"`in_axes` is a tuple of 1 entries, but the function was called with 2 positional arguments",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_in_axes_structure_mismatch(chunk_size):
    _expect(
        lambda a, b: a,
        (X, {"b": W}),
        in_axes=(0, [0]),
        exc=ValueError,
        match=r"`in_axes` must be a tree prefix of the positional arguments, but in_axes=\(0, \[0\]\)",
        chunk_size=chunk_size,
    )
    _expect(
        lambda a, b: a,
        (X, {"b": W}),
        in_axes=(0, {"b": 0, "c": None}),
        exc=ValueError,
        match=r"`in_axes` must be a tree prefix of the positional arguments",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_out_axes_structure_mismatch(chunk_size):
    _expect(
        lambda a: (a, a),
        (X,),
        out_axes=(0, 0, 0),
        exc=ValueError,
        match=r"`out_axes` must be a tree prefix of the function's output, but out_axes=\(0, 0, 0\)",
        chunk_size=chunk_size,
    )
    _expect(
        lambda a: {"y": a},
        (X,),
        out_axes={"z": 0},
        exc=ValueError,
        match=r"`out_axes` must be a tree prefix of the function's output",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_out_axes_out_of_range(chunk_size):
    _expect(
        lambda a: a,
        (X,),
        out_axes=2,
        exc=ValueError,
        match=r"out_axes=2 is out of range for an output of per-example shape \(3,\); it must be in \[-2, 2\)",
        chunk_size=chunk_size,
    )
    _expect(
        lambda a: (a.sum(), a),
        (X,),
        out_axes=(0, -3),
        exc=ValueError,
        match=r"out_axes=-3 is out of range for an output of per-example shape \(3,\)",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_in_axis_out_of_range_for_rank(chunk_size):
    _expect(
        lambda a, b: a,
        (X, W),
        in_axes=(0, 2),
        exc=ValueError,
        match=r"in_axes asks to map argument args\[1\] along axis 2, but it has rank 2 \(shape \(5, 3\)\)",
        chunk_size=chunk_size,
    )
    _expect(
        lambda a, b: a,
        (X, {"w": W}),
        in_axes=(0, {"w": -3}),
        exc=ValueError,
        match=r"argument args\[1\]\['w'\] along axis -3, but it has rank 2",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_mapped_scalar_names_argument(chunk_size):
    _expect(
        lambda a, *, b: a * b,
        (X,),
        {"b": 1.0},
        exc=ValueError,
        match=r"argument kwargs\['b'\] along axis 0, but it has rank 0 .*Pass in_axes=None for unmapped scalars",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_mapped_non_array_leaf(chunk_size):
    _expect(
        lambda a, s: a,
        (X, "abc"),
        exc=TypeError,
        match=r"argument args\[1\] is mapped \(axis 0\) but is a str, not an array",
        chunk_size=chunk_size,
        jit=False,
    )
    _expect(
        lambda a, s: a,
        (X, {"f": jnp.sin}),
        in_axes=(0, {"f": 0}),
        exc=TypeError,
        match=r"argument args\[1\]\['f'\] is mapped \(axis 0\) but is a",
        chunk_size=chunk_size,
        jit=False,
    )


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_no_mapped_arguments_and_no_axis_size(chunk_size):
    _expect(
        lambda a: a,
        (X,),
        in_axes=None,
        exc=ValueError,
        match=r"no argument is mapped \(all in_axes are None\), so `axis_size` must be given",
        chunk_size=chunk_size,
    )
    with pytest.raises(ValueError, match="`axis_size` must be given"):
        chunkop.vmap(lambda: jnp.ones(3), chunk_size=chunk_size)()


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_axis_size_disagrees_with_mapped_size(chunk_size):
    _expect(
        lambda a: a,
        (X,),
        axis_size=3,
        exc=ValueError,
        match=r"`axis_size`=3 does not match the mapped size 8 of argument args\[0\] along axis 0",
        chunk_size=chunk_size,
    )


def test_error_in_fun_is_not_masked():
    """An error raised by `fun` itself propagates unchanged (not replaced by an out_axes check)."""

    def fun(x):
        raise ValueError("boom from fun")

    for cs in CHUNKS:
        with pytest.raises(ValueError, match="boom from fun"):
            chunkop.vmap(fun, chunk_size=cs, out_axes=0)(X)


def test_reduce_errors_name_the_transform():
    with pytest.raises(ValueError, match=r"chunkop\.sum: mapped arguments have different sizes"):
        chunkop.sum(lambda a, b: a * b, chunk_size=2)(X, W)
    with pytest.raises(ValueError, match=r"chunkop\.mean: no argument is mapped"):
        chunkop.mean(lambda a: a, in_axes=None, chunk_size=2)(X)
    with pytest.raises(TypeError, match=r"chunkop\.map: argument xs\['s'\] is mapped"):
        chunkop.map(lambda t: t["x"], {"x": X, "s": "str"}, chunk_size=2)


def test_non_array_output_error_names_the_users_function():
    """JAX's own message for a non-array output names the traced function: the user's, with its
    file and line, not chunkop's internal wrapper."""

    def returns_a_string(x):
        return "hello"

    with pytest.raises(TypeError, match=r"function \S*returns_a_string at .*test_vmap_errors\.py:\d+"):
        chunkop.vmap(returns_a_string, chunk_size=2)(jnp.arange(5.0))
