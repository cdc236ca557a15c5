"""From a query log (and what the backend said about its load) to a RunReport. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from variantbench.loadgen.records import QueryRecord
from variantbench.metrics.latency import distribution, percentile
from variantbench.metrics.quality import quality_summary
from variantbench.report.schema import (
    LatencyDist,
    Quality,
    Queries,
    Resources,
    RunReport,
    Speed,
    Tail,
    Throughput,
)


def _tail(values: Sequence[float]) -> Tail:
    return Tail(p50=percentile(values, 50), p99=percentile(values, 99))


def summarize_run(
    variant: str,
    records: Sequence[QueryRecord],
    resources: Resources,
    backend: dict | None = None,
    scenario: str = "single-stream",
) -> RunReport:
    ok = [r for r in records if r.status == "ok"]
    errors = len(records) - len(ok)
    latencies = [r.latency_ms for r in ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    duration_s = None
    throughput = Throughput()
    if records:
        duration_s = (max(r.completed_ns for r in records) - min(r.issued_ns for r in records)) / 1e9
        if duration_s > 0:
            throughput = Throughput(
                qps=len(ok) / duration_s,
                output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s,
            )
    prefill_s = sum(t for t in ttfts) / 1e3
    decode_tokens = sum(max(0, len(r.token_ms) - 1) for r in ok)
    decode_s = sum((r.token_ms[-1] - r.token_ms[0]) / 1e3 for r in ok if len(r.token_ms) > 1)
    speed = Speed(
        prefill_tokens_per_s=sum(r.input_tokens for r in ok if r.ttft_ms is not None) / prefill_s
        if prefill_s > 0
        else None,
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None,
    )
    # A failed query scores as an empty answer: errors must not flatter a variant's quality.
    quality = Quality(**quality_summary([r.output for r in records], [r.reference for r in records]))
    backend = dict(backend or {})
    return RunReport(
        variant=variant,
        scenario=scenario,
        weight_format=backend.get("weight_format"),
        backend=backend,
        duration_s=duration_s,
        latency_ms=LatencyDist(**distribution(latencies)),
        ttft_ms=_tail(ttfts),
        tpot_ms=_tail(tpots),
        throughput=throughput,
        speed=speed,
        quality=quality,
        resources=resources,
        queries=Queries(issued=len(records), completed=len(ok), errors=errors),
        input_tokens=_tail([r.input_tokens for r in ok]),
        output_tokens=_tail([r.output_tokens for r in ok]),
    )
