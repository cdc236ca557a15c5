"""Latency statistics. Percentiles by nearest rank over every counted query, as MLPerf does."""

from __future__ import annotations

from collections.abc import Sequence
import math


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of values at or below it."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return float(ordered[rank - 1])


def mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def distribution(values: Sequence[float], points: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{p:g}": percentile(values, p) for p in points}
    out["mean"] = mean(values)
    return out
