"""vllm_result.VARIANT.json: one run in the field names of ``vllm bench serve --save-result``, so
the tooling a vLLM user already has (plots, dashboards, comparison scripts) reads our runs.

Same definitions as vLLM's: TTFT, TPOT (per request, tokens after the first), ITL (every gap
between tokens), E2EL (issue to last token), request/output/total-token throughput over the run's
duration, goodput as completed requests meeting every SLO per second; percentiles by LoadGen's rule.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
import statistics
from typing import Any

from variantbench.metrics.latency import percentile
from variantbench.records import QueryRecord
from variantbench.report.results import VariantResult, counted
from variantbench.report.schema import Report, RunReport
from variantbench.report.summary import gaps_ms, metric_values


def _p_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def result(report: Report, run: RunReport, records: list[QueryRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.status == "ok"]
    duration = run.duration_s or 0.0
    plan = report.plan
    load = plan.get("load") or {}
    tokens_in, tokens_out = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "date": dt.datetime.fromisoformat(report.created_utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if (plan.get("model") or {}).get("api") == "chat" else "openai",
        "model_id": run.backend.get("model") or run.variant,
        "tokenizer_id": (plan.get("model") or {}).get("tokenizer"),
        "num_prompts": len(records),
        "request_rate": load.get("rate_qps", "inf") if load.get("scenario") == "server" else "inf",
        "burstiness": load.get("burstiness", 1.0),
        "max_concurrency": load.get("max_concurrency"),
        "duration": duration,
        "completed": len(ok),
        "total_input_tokens": tokens_in,
        "total_output_tokens": tokens_out,
        "request_throughput": len(ok) / duration if duration else None,
        "request_goodput": run.goodput.requests_per_s if run.goodput else None,
        "output_throughput": tokens_out / duration if duration else None,
        "total_token_throughput": (tokens_in + tokens_out) / duration if duration else None,
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [(r.ttft_ms or 0.0) / 1e3 for r in records],
        "itls": [[gap / 1e3 for gap in gaps_ms(r)] for r in records],
        "generated_texts": [r.output for r in records],
        "errors": [r.error or "" for r in records],
    }
    values = metric_values(ok)
    points = [float(p) for p in (plan.get("output") or {}).get("metric_percentiles") or (50, 90, 99)]
    for metric in (plan.get("output") or {}).get("percentile_metrics") or ("ttft", "tpot", "itl", "e2el"):
        xs = values[metric]
        out[f"mean_{metric}_ms"] = statistics.fmean(xs) if xs else None
        out[f"median_{metric}_ms"] = statistics.median(xs) if xs else None
        out[f"std_{metric}_ms"] = statistics.pstdev(xs) if xs else None
        for p in points:
            out[f"p{_p_word(p)}_{metric}_ms"] = percentile(xs, p)
    return out


def write_vllm_results(
    report: Report, records: list[QueryRecord], raws: list[VariantResult], out: Path
) -> None:
    by_variant = counted(records, raws)
    for run in report.runs:
        if run.status == "ok":
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run.variant)
            path = out / f"vllm_result.{safe}.json"
            path.write_text(
                json.dumps(result(report, run, by_variant.get(run.variant, [])), indent=2), encoding="utf-8"
            )
