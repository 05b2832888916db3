"""The bounded caches of compiled chunk loops and ``"auto"`` plans, and :func:`chunkop.clear_caches`.

The loop cache is a bounded LRU (``chunkop.settings().loop_cache_size`` loops, 128 by default).
It holds jaxprs without their top-level constants (those are hoisted and passed as arguments),
so it keeps alive only what the custom rules and callbacks of at most that many loops hold.
Beside it, the ``"auto"`` plans (:func:`cached_plan`) are kept per call signature, under keys
built on the same fingerprints.
:func:`clear_caches` empties both, and every cache registered with :func:`register_cache`.

The keys are built by :mod:`chunkop._fingerprint` (what was traced, never the user's function).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

from ._settings import settings

__all__ = ["cached", "cached_plan", "clear_caches", "register_cache"]


# -- the cache ------------------------------------------------------------------------------------

_LOOPS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def cached(key: Hashable, make: Callable[[], Callable]) -> Callable:
    """The compiled loop for ``key``, made by ``make()`` on a miss (least-recently-used eviction)."""
    with _LOCK:
        if key in _LOOPS:
            _LOOPS.move_to_end(key)
            return _LOOPS[key]
    loop = make()
    with _LOCK:
        _LOOPS[key] = loop
        while len(_LOOPS) > settings().loop_cache_size:
            _LOOPS.popitem(last=False)
    return loop


# -- the plan cache -------------------------------------------------------------------------------

_PLANS: dict = {}


def cached_plan(key: Hashable, compute: Callable[[], Any]) -> Any:
    """The ``"auto"`` plan cached under ``key``, computed by ``compute()`` on first use.

    At most ``chunkop.settings().plan_cache_size`` plans are kept (the oldest dropped first).

    Args:
        key: the call signature the plan is for; an unhashable key is not cached.
        compute: makes the plan (a :class:`chunkop.BudgetPlan`).

    Returns:
        The cached plan, or the one ``compute()`` makes.
    """
    try:
        hash(key)
    except TypeError:
        return compute()
    with _LOCK:  # (one lock for both caches: threads may plan and evict at once)
        plan = _PLANS.get(key)
    if plan is None:
        plan = compute()  # (outside the lock: a plan compiles probes)
        with _LOCK:
            while _PLANS and len(_PLANS) >= settings().plan_cache_size:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
    return plan


_CLEARERS: list[Callable[[], None]] = []


def register_cache(clear: Callable[[], None]) -> None:
    """Register another cache's ``clear`` with :func:`clear_caches` (plans, chunk plans ...)."""
    _CLEARERS.append(clear)


def clear_caches() -> None:
    """Drop everything chunkop caches: compiled chunk loops, ``"auto"`` plans, chunk plans.

    chunkop keys its caches by what was traced, never by a user function, so this is never
    needed for correctness; it frees memory (the caches are bounded in any case, see
    :func:`chunkop.settings`), and makes ``"auto"`` plan again (after :func:`chunkop.configure`).

    Example:
        >>> import chunkop
        >>> chunkop.clear_caches()
    """
    with _LOCK:
        _LOOPS.clear()
        _PLANS.clear()
    for clear in _CLEARERS:
        clear()
