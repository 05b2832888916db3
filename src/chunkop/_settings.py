"""chunkop's settings: the sizes of its caches and the defaults of ``chunk_size="auto"``.

One immutable :class:`Settings` value is in force; :func:`configure` replaces fields of it
(validated, by name) and returns the previous value, so a caller can restore it.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

__all__ = ["Settings", "settings", "configure"]


class Settings(NamedTuple):
    """What chunkop's caches hold and how ``chunk_size="auto"`` plans by default.

    Attributes:
        loop_cache_size: compiled chunk loops kept (least recently used dropped first).
        plan_cache_size: ``chunk_size="auto"`` plans kept.
        cpu_temp_cap: on CPU, the temp memory (bytes) ``"auto"`` aims at even when the budget
            is larger: chunks whose working set stays near the caches run faster there
            (``benchmarks/RESULTS.md``). None: no cap, the largest chunk within the budget.
            Accelerators are never capped.
        budget_fraction: the share of the device's free memory that ``memory_budget=None``
            means (in ``(0, 1]``).

    Example:
        >>> import chunkop
        >>> chunkop.settings().loop_cache_size
        128
    """

    loop_cache_size: int = 128
    plan_cache_size: int = 512
    cpu_temp_cap: int | None = 16 * 2**20
    budget_fraction: float = 0.5


_CURRENT = Settings()
_LOCK = threading.Lock()


def settings() -> Settings:
    """The settings in force (a :class:`Settings`).

    Returns:
        The current :class:`Settings`.

    Example:
        >>> import chunkop
        >>> chunkop.settings().budget_fraction
        0.5
    """
    return _CURRENT


def _check(name: str, value: Any) -> Any:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in ("loop_cache_size", "plan_cache_size"):
        if not is_int or value < 0:
            raise ValueError(f"chunkop.configure: `{name}` must be an int >= 0, got {value!r}.")
    elif name == "cpu_temp_cap":
        if value is not None and (not is_int or value < 1):
            raise ValueError(
                f"chunkop.configure: `cpu_temp_cap` must be a positive int (bytes) or None, got {value!r}."
            )
    elif name == "budget_fraction":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not 0 < value <= 1:
            raise ValueError(f"chunkop.configure: `budget_fraction` must be a number in (0, 1], got {value!r}.")
        value = float(value)
    else:
        raise TypeError(f"chunkop.configure: unknown setting {name!r}; the settings are {Settings._fields}.")
    return value


def configure(**changes: Any) -> Settings:
    """Change chunkop's settings (see :class:`Settings` for each); returns the previous ones.

    Smaller cache sizes take effect at the next insertion; plans already made keep their chunk
    (call :func:`chunkop.clear_caches` to plan again under a new cap or fraction).

    Args:
        **changes: ``loop_cache_size``, ``plan_cache_size``, ``cpu_temp_cap`` and/or
            ``budget_fraction``, by name.

    Returns:
        The settings before the change (pass them back as ``configure(**old._asdict())``).

    Raises:
        TypeError: for an unknown name. ValueError: for a value out of range.

    Example:
        >>> import chunkop
        >>> old = chunkop.configure(cpu_temp_cap=None)  # plan for the budget alone on CPU too
        >>> chunkop.settings().cpu_temp_cap is None
        True
        >>> _ = chunkop.configure(**old._asdict())
    """
    global _CURRENT
    checked = {name: _check(name, value) for name, value in changes.items()}
    with _LOCK:
        previous = _CURRENT
        _CURRENT = previous._replace(**checked)
    return previous
