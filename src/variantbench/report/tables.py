"""Flat tables for spreadsheets and pandas: ``report.csv`` (one row per variant run) and, on request,
``queries.csv`` (one row per query). Rendered from the report and the query log like every other
output, so ``variantbench report DIR`` writes them again. Units are in the column names.
"""

from __future__ import annotations

from collections.abc import Iterable
import csv
import json
from pathlib import Path
from typing import Any

from variantbench.records import QueryRecord
from variantbench.report.schema import BatchThroughput, Report, RunReport


def _ratio(prefix: str, r: Any) -> dict[str, Any]:
    return {prefix: r.value if r else None, f"{prefix}_ci_low": r.ci_low if r else None,
            f"{prefix}_ci_high": r.ci_high if r else None}  # fmt: skip


def run_row(report: Report, run: RunReport) -> dict[str, Any]:
    """One variant run, flat: the headline numbers of the report with their intervals."""
    cost, res, ab, vs = run.cost, run.resources, run.ab_vs_standard, run.quality_vs_standard
    cost_ci = (cost.per_million_output_tokens_ci if cost else None) or [None, None]
    batch = run.batch_throughput or BatchThroughput(batch=0, new_tokens=0)
    row: dict[str, Any] = {
        "variant": run.variant,
        "status": run.status,
        "error": run.error,
        "standard": report.standard,
        "scenario": run.scenario,
        "interleaved": report.execution.interleaved,
        "queries_issued": run.queries.issued,
        "queries_errors": run.queries.errors,
        "duration_s": run.duration_s,
        "latency_p50_ms": run.latency_ms.p50,
        "latency_p90_ms": run.latency_ms.p90,
        "latency_p99_ms": run.latency_ms.p99,
        "latency_mean_ms": run.latency_ms.mean,
        "ttft_p50_ms": run.ttft_ms.p50,
        "ttft_p99_ms": run.ttft_ms.p99,
        "tpot_p50_ms": run.tpot_ms.p50,
        "tpot_p99_ms": run.tpot_ms.p99,
        "throughput_qps": run.throughput.qps,
        "output_tokens_per_s": run.throughput.output_tokens_per_s,
        "prefill_tokens_per_s": run.speed.prefill_tokens_per_s,
        "decode_tokens_per_s": run.speed.decode_tokens_per_s,
        "batch8_decode_tokens_per_s": batch.tokens_per_s,
        "batch8_decode_tokens_per_s_ci_low": batch.ci_low,
        "batch8_decode_tokens_per_s_ci_high": batch.ci_high,
        "quality_composite": run.quality.composite,
        "quality_vs_standard_ratio": vs.ratio if vs else None,
        "perplexity": run.quality.perplexity,
        "kl_mean_nats": run.quality.kl_mean,
        "top1_agreement": run.quality.top1_agreement,
        "peak_rss_bytes": res.peak_rss_bytes,
        "param_bytes": res.param_bytes,
        "startup_warm_s": res.startup_warm_s,
        "startup_cold_s": res.startup_cold_s,
        "build_s": res.build_s,
        "cpu_s": res.cpu_s,
        "energy_j": res.energy_j,
        "energy_source": res.energy_source,
        "cost_per_million_output_tokens": cost.per_million_output_tokens if cost else None,
        "cost_per_million_output_tokens_ci_low": cost_ci[0],
        "cost_per_million_output_tokens_ci_high": cost_ci[1],
        "cost_currency": (cost.inputs.get("currency") if cost else None),
        "cost_prices": (cost.inputs.get("prices") if cost else None),
        **_ratio("ab_latency_ratio", ab.latency_ratio if ab else None),
        **_ratio("ab_throughput_ratio", ab.throughput_ratio if ab else None),
        "ab_p_value": ab.p_value if ab else None,
        "ab_verdict": ab.verdict if ab else None,
        "validity": run.validity.verdict if run.status == "ok" else None,
    }
    return row


def write_report_csv(report: Report, path: Path) -> None:
    rows = [run_row(report, run) for run in report.runs]
    _write(path, rows)


QUERY_COLUMNS = ("run_id", "variant", "scenario", "block", "query", "index", "sample_id", "task", "status", "error",
                 "scheduled_ns", "issued_ns", "first_token_ns", "completed_ns", "latency_ms",
                 "latency_from_scheduled_ms", "ttft_ms", "tpot_ms", "input_tokens", "output_tokens", "scored",
                 "output", "reference")  # fmt: skip


def write_queries_csv(records: Iterable[QueryRecord], path: Path) -> None:
    rows = []
    for r in records:
        data = r.to_json()
        rows.append(
            {k: data.get(k) for k in QUERY_COLUMNS} | {"token_ms": json.dumps(data.get("token_ms") or [])}
        )
    _write(path, rows, columns=[*QUERY_COLUMNS, "token_ms"])


def _write(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """Atomically: a reader never sees half a file. Empty cells for missing values."""
    columns = columns or (list(rows[0]) if rows else ["variant"])
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    tmp.replace(path)
