"""Process-wide counters behind ``tilec.stats()``."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

_STATS: dict[str, Any] = {}


def reset_stats() -> None:
    """Clear every counter."""
    _STATS.clear()
    _STATS.update(graphs=0, kernels=0, extern_calls=0, fallbacks=Counter())


def stats() -> dict[str, Any]:
    """A copy of the counters: graphs compiled, Triton kernels generated,
    library calls (``extern_calls``) in compiled programs, and ATen fallbacks
    by op name."""
    out = copy.deepcopy(_STATS)
    out["fallbacks"] = dict(out["fallbacks"])
    return out


def record_graph(kernels: int, extern_calls: int, fallbacks: dict[str, int]) -> None:
    _STATS["graphs"] += 1
    _STATS["kernels"] += kernels
    _STATS["extern_calls"] += extern_calls
    _STATS["fallbacks"].update(fallbacks)


reset_stats()
