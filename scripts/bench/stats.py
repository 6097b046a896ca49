"""Small statistics shared by the benchmarks: nearest-rank percentiles and a one-line summary."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest sample with at least ``fraction`` of the samples at or below it.

    Raises:
        ValueError: no samples, or ``fraction`` outside [0, 1].
    """
    if not samples:
        raise ValueError("no samples")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} outside [0, 1]")
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def summary(samples: Sequence[float]) -> dict[str, float]:
    """p50 (the median), p95, min and max of ``samples``."""
    return {"p50": statistics.median(samples), "p95": percentile(samples, 0.95),
            "min": min(samples), "max": max(samples)}
