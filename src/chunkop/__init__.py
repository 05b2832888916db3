"""chunkop: chunked, memory-bounded vmap and implicit chunked linear operators for JAX."""

from ._jacobian import jacfwd, jacrev
from ._reduce import mean, sum
from ._vmap import map, vmap

__version__ = "0.1.0"

__all__ = ["vmap", "map", "sum", "mean", "jacrev", "jacfwd", "__version__"]
