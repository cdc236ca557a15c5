"""Windows of completed queries, the stability rule, and 3-sigma outlier rejection.

Windows: every ``size`` completed queries (in completion order), that window's p50/p99 latency,
queries/s and output tokens/s over its own span. Stability: the last three windows' mean
latencies lie within 10% of their mean. Outliers: values beyond 3 standard deviations of the mean
are left out of the *trimmed* mean; percentiles are always computed on every query, never trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import statistics

from variantbench.metrics.latency import percentile
from variantbench.records import QueryRecord


@dataclass
class Window:
    index: int
    queries: int
    p50_latency_ms: float | None
    p99_latency_ms: float | None
    mean_latency_ms: float | None
    qps: float | None
    output_tokens_per_s: float | None
    start_ns: int = 0  # the window's span: (previous window's last completion, its last completion]
    end_ns: int = 0


def block_spans(records: Sequence[QueryRecord]) -> list[tuple[int, int]]:
    """Where the variant was measured: one (first scheduled, last completed) span per interleaved
    block (one span for a run that was not interleaved). Between blocks the other variants ran."""
    spans: dict[int, tuple[int, int]] = {}
    for r in records:
        lo, hi = spans.get(r.block, (r.scheduled_ns, r.completed_ns))
        spans[r.block] = (min(lo, r.scheduled_ns), max(hi, r.completed_ns))
    return sorted(spans.values())


def active_s(records: Sequence[QueryRecord]) -> float:
    """Seconds the variant was measured: its blocks' spans summed (the run's span if not interleaved)."""
    return sum(hi - lo for lo, hi in block_spans(records)) / 1e9


def _busy_ns(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)


def windows(records: Sequence[QueryRecord], size: int = 50) -> list[Window]:
    if size < 1:
        raise ValueError("window size must be at least 1")
    done = sorted(records, key=lambda r: r.completed_ns)
    spans = block_spans(done)
    out: list[Window] = []
    previous_end = min((r.issued_ns for r in done), default=0)
    for i in range(0, len(done) - size + 1, size):
        chunk = done[i : i + size]
        ok = [r for r in chunk if r.status == "ok"]
        lat = [r.latency_from_scheduled_ms for r in ok]
        # the window's own measured time: the gaps where other variants ran are not its time
        span_s = _busy_ns(spans, previous_end, chunk[-1].completed_ns) / 1e9
        chunk_start, previous_end = previous_end, chunk[-1].completed_ns
        out.append(
            Window(
                index=len(out),
                queries=len(chunk),
                p50_latency_ms=percentile(lat, 50),
                p99_latency_ms=percentile(lat, 99),
                mean_latency_ms=statistics.fmean(lat) if lat else None,
                qps=len(ok) / span_s if span_s > 0 else None,
                output_tokens_per_s=sum(r.output_tokens for r in ok) / span_s if span_s > 0 else None,
                start_ns=chunk_start,
                end_ns=chunk[-1].completed_ns,
            )
        )
    return out


def stable(ws: Sequence[Window], last: int = 3, tolerance: float = 0.10) -> bool | None:
    """Whether the last ``last`` windows' mean latencies are within ``tolerance`` of their mean."""
    means = [w.mean_latency_ms for w in ws[-last:] if w.mean_latency_ms is not None]
    if len(ws) < last or len(means) < last:
        return None  # not enough windows to say
    centre = statistics.fmean(means)
    return all(abs(m - centre) <= tolerance * centre for m in means)


@dataclass
class Trimmed:
    removed: int
    trimmed_mean: float | None
    raw_mean: float | None


def outliers(values: Sequence[float]) -> list[bool]:
    """Which values lie beyond 3 standard deviations of the mean (none with fewer than 3 values)."""
    if len(values) < 3:
        return [False] * len(values)
    centre, sd = statistics.fmean(values), statistics.pstdev(values)
    return [sd > 0 and abs(v - centre) > 3 * sd for v in values]


def three_sigma(values: Sequence[float]) -> Trimmed:
    if not values:
        return Trimmed(0, None, None)
    raw = statistics.fmean(values)
    kept = [v for v, out in zip(values, outliers(values), strict=True) if not out]
    return Trimmed(len(values) - len(kept), statistics.fmean(kept), raw)
