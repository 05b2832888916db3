"""The jaxpr types chunkop reads, from ``jax.extend.core`` where this JAX version exports them.

``jax.extend.core`` exports ``DropVar`` and ``jaxprs_in_params`` only in recent versions;
older ones (jax 0.9-0.10.0, the floor in ``pyproject.toml`` is 0.10.0) keep them in
``jax._src.core``. The floor is installed and smoke-tested by ``.ci/run``.
"""

from __future__ import annotations

from jax.extend import core as _ext

__all__ = ["ClosedJaxpr", "DropVar", "Jaxpr", "Literal", "jaxprs_in_params"]

ClosedJaxpr = _ext.ClosedJaxpr
Jaxpr = _ext.Jaxpr
Literal = _ext.Literal
try:
    DropVar = _ext.DropVar
    jaxprs_in_params = _ext.jaxprs_in_params
except AttributeError:  # jax < 0.10
    from jax._src import core as _core

    DropVar = _core.DropVar
    jaxprs_in_params = _core.jaxprs_in_params
