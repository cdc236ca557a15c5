"""A plain-text summary per run in the spirit of MLPerf LoadGen's ``mlperf_log_summary.txt``."""

from __future__ import annotations

from variantbench.report.schema import Report, RunReport


def _f(value: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def run_summary(report: Report, run: RunReport) -> str:
    lines = [
        "================================================",
        "variantbench results summary",
        "================================================",
        f"Model : {report.model.get('name')}",
        f"Variant : {run.variant}",
        f"Scenario : {run.scenario}",
        f"Result is : {run.validity.verdict}",
    ]
    for reason in run.validity.reasons:
        lines.append(f"  reason : {reason}")
    for rec in run.validity.recommendations:
        lines.append(f"  recommendation : {rec}")
    for name, check in run.validity.checks.items():
        lines.append(
            f"  {name} p{check.percentile:g} target {check.target_ms:g} ms : {check.result} "
            f"(observed {_f(check.observed_ms, '{:.1f}')} ms, early-stopping estimate "
            f"{_f(check.early_stopping_estimate_ms, '{:.1f}')} ms, {check.over_target}/{check.queries} over)"
        )
    lines += [
        "",
        "================================================",
        "Additional stats",
        "================================================",
    ]
    if run.target_qps is not None:
        lines.append(f"Target QPS : {_f(run.target_qps, '{:.2f}')}")
        lines.append(f"Achieved issue QPS : {_f(run.achieved_qps, '{:.2f}')}")
    lines += [
        f"Completed samples per second : {_f(run.throughput.qps)}",
        f"Output tokens per second : {_f(run.throughput.output_tokens_per_s, '{:.2f}')}",
        f"Queries issued / ok / errors : {run.queries.issued} / {run.queries.completed} / {run.queries.errors}",
        f"Duration (s) : {_f(run.duration_s, '{:.2f}')}",
        "",
    ]
    for label, dist in (
        ("from scheduled", run.latency_from_scheduled_ms),
        ("from issue", run.latency_from_issue_ms),
    ):
        lines.append(f"Latency {label} (ms): p50 {_f(dist.p50, '{:.1f}')}  p90 {_f(dist.p90, '{:.1f}')}  "
                     f"p99 {_f(dist.p99, '{:.1f}')}  mean {_f(dist.mean, '{:.1f}')}")  # fmt: skip
    lines += [
        f"TTFT (ms): p50 {_f(run.ttft_ms.p50, '{:.1f}')}  p99 {_f(run.ttft_ms.p99, '{:.1f}')}",
        f"TPOT (ms): p50 {_f(run.tpot_ms.p50, '{:.2f}')}  p99 {_f(run.tpot_ms.p99, '{:.2f}')}",
        f"Dispatch lag (ms): p50 {_f(run.dispatch_lag_ms.p50)}  p99 {_f(run.dispatch_lag_ms.p99)}  "
        f"max {_f(run.dispatch_lag_ms.max)}  late share {_f(run.late_share, '{:.2%}')}",
        f"Outliers (3 sigma): {run.outliers.removed} removed, trimmed mean latency "
        f"{_f(run.outliers.trimmed_mean_latency_ms, '{:.1f}')} ms (raw {_f(run.outliers.raw_mean_latency_ms, '{:.1f}')})",
        f"Windows: {len(run.windows)}, stable: {run.stable if run.stable is not None else 'n/a (fewer than 3)'}",
        "",
        f"Seeds : {run.seeds}",
    ]
    return "\n".join(lines) + "\n"
