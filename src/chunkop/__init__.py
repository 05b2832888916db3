"""chunkop: chunked, memory-bounded vmap and implicit chunked linear operators for JAX."""

from ._budget import BudgetPlan, plan
from ._cache import clear_caches
from ._jacobian import jacfwd, jacrev
from ._operator.checks import check_linear
from ._operator.gram import gram_diagonal
from ._operator.row_operator import AbstractRowOperator, RowOperator, TransposedRowOperator
from ._operator.scipy_view import to_scipy
from ._reduce import mean, sum
from ._settings import Settings, configure, settings
from ._vmap import map, vmap

__version__ = "0.1.0"

__all__ = [
    "vmap",
    "map",
    "sum",
    "mean",
    "jacrev",
    "jacfwd",
    "AbstractRowOperator",
    "RowOperator",
    "TransposedRowOperator",
    "check_linear",
    "gram_diagonal",
    "to_scipy",
    "clear_caches",
    "settings",
    "configure",
    "Settings",
    "plan",
    "BudgetPlan",
    "__version__",
]
