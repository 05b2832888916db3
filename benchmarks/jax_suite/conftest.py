"""pytest plugin: run JAX's own vmap tests with ``jax.vmap`` swapped for ``chunkop.vmap(chunk_size=2)``.

Copy this file beside JAX's test files (``/tmp/jax_tests/conftest.py``, see README.md). With
``CHUNKOP_SWAP=1`` every test module's own names for ``vmap`` are swapped before its tests run:

* a module-level ``vmap`` (``from jax import vmap``),
* ``jax`` and ``api`` (``jax._src.api``): replaced in the test module's namespace by a proxy
  module whose ``vmap`` is the chunked one and whose every other attribute is the real module's.

Nothing in ``jax`` itself is patched, so JAX's internals (``jax.jacfwd``, ``jax.hessian``, the
test utilities) and chunkop's own internals (which call ``jax.vmap``) keep the real ``jax.vmap``:
no recursion, and only the tests' direct calls are measured. Without ``CHUNKOP_SWAP`` the plugin
only records which tests run (the baseline).

``CHUNKOP_CALLS=path.json`` writes, per test id, how many times the chunked vmap was built.
"""

import functools
import json
import os
import types

import jax
import jax._src.api as _jax_api

SWAP = os.environ.get("CHUNKOP_SWAP", "") not in ("", "0")
CHUNK = int(os.environ.get("CHUNKOP_CHUNK", "2"))
_calls: dict[str, int] = {}
_current = [""]


def _chunked_vmap(fun=None, *args, **kwargs):
    import chunkop

    _calls[_current[0]] = _calls.get(_current[0], 0) + 1
    kwargs.setdefault("chunk_size", CHUNK)
    if fun is None:  # not part of jax.vmap's API either; keeps the error JAX's own
        return jax.vmap(fun, *args, **kwargs)
    return chunkop.vmap(fun, *args, **kwargs)


functools.update_wrapper(_chunked_vmap, jax.vmap)
_chunked_vmap.__wrapped__ = jax.vmap


class _Proxy(types.ModuleType):
    """A stand-in for a module: ``vmap`` is chunked, every other attribute is the module's."""

    def __init__(self, mod):
        super().__init__(mod.__name__, mod.__doc__)
        object.__setattr__(self, "_mod", mod)
        object.__setattr__(self, "vmap", _chunked_vmap)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_mod"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_mod"), name, value)

    def __dir__(self):
        return dir(object.__getattribute__(self, "_mod"))


_patched: set[int] = set()


def _patch_module(mod):
    if mod is None or id(mod) in _patched:
        return
    _patched.add(id(mod))
    g = mod.__dict__
    if g.get("vmap") is jax.vmap:
        g["vmap"] = _chunked_vmap
    if g.get("jax") is jax:
        g["jax"] = _Proxy(jax)
    if g.get("api") is _jax_api:
        g["api"] = _Proxy(_jax_api)


def pytest_runtest_setup(item):
    _current[0] = item.nodeid
    if SWAP:
        _patch_module(getattr(item, "module", None))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CHUNKOP_CALLS")
    if path:
        with open(path, "w") as f:
            json.dump(_calls, f, indent=0, sort_keys=True)
