"""chunkop: chunked, memory-bounded vmap and implicit chunked linear operators for JAX."""

from ._vmap import map, vmap

__version__ = "0.1.0"

__all__ = ["vmap", "map", "__version__"]
