"""Latency statistics. One percentile definition everywhere: MLPerf LoadGen's summary's.

LoadGen (``results.cc``, ``PerformanceSummary::ProcessLatencies``) sorts the latencies and takes
``sorted[size_t(n * p)]``: the element at the truncated index ``n * p`` (0-based), not the
nearest rank ``ceil(n * p) - 1``. The two differ whenever ``n * p`` is a whole number: on 400
queries LoadGen's P99 is the 397th value, nearest rank's the 396th. ``tests/test_loadgen_parity.py``
runs LoadGen itself (``mlcommons-loadgen``) and checks our percentiles against its summary.
"""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float | None:
    """LoadGen's percentile: ``sorted(values)[int(n * p / 100)]`` (the last value for p = 100)."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    index = int(len(ordered) * (p / 100))  # the same double product LoadGen truncates
    return float(ordered[min(index, len(ordered) - 1)])


def mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def distribution(values: Sequence[float], points: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{p:g}": percentile(values, p) for p in points}
    out["mean"] = mean(values)
    return out
