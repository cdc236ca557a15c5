"""report.html: one self-contained page to send a colleague.

The decision first (a recommendation per deployment profile, with its reasons), then the headline
numbers, then the charts of ``report/charts.py``, then how the run was made (environment, plan).
plotly's JavaScript is embedded once in the page, so it opens with no network; the page is about
5 MB, of which 4.8 MB is plotly.js. Drawn from report.json, queries.jsonl and raw/ like every other
renderer, so ``variantbench report DIR`` rewrites it, and a partial run's page says what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
import json
from pathlib import Path

import yaml

from variantbench.records import QueryRecord
from variantbench.report.charts import Chart, Inputs, all_charts
from variantbench.report.pages import e as _e
from variantbench.report.pages import figure, page, write_page
from variantbench.report.pages import table as _table
from variantbench.report.results import VariantResult
from variantbench.report.schema import BatchThroughput, Report, RunReport


def _num(value: float | None, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _interval(value: float | None, low: float | None, high: float | None, fmt: str = ",.1f") -> str:
    if value is None:
        return "-"
    if low is None or high is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def notices(report: Report, raws: list[VariantResult]) -> list[tuple[str, bool]]:
    """What a reader must know before trusting the page: failures, variants never measured, INVALID runs."""
    out: list[tuple[str, bool]] = []
    for line in report.stopped():  # killed halfway, failed, never started: what it lacks and why
        out.append((line, True))
    for run in report.runs:
        if run.status == "ok" and run.validity.verdict != "VALID":
            out.append((f"{run.variant} is INVALID: {'; '.join(run.validity.reasons) or 'see the validity checks'}",
                        False))  # fmt: skip
    if report.runs and not raws:
        out.append(("raw/ is empty: resource, batch and diagnosis charts cannot be drawn", False))
    return out


def _recommendations(report: Report) -> str:
    if not report.recommendations:
        return '<p class="missing">No recommendation: no variant finished measuring.</p>'
    rows = []
    for profile, rec in report.recommendations.items():
        reasons = rec.reasons
        others = "".join(
            f"<li><b>{_e(v)}</b>: {_e(why)}</li>" for v, why in reasons.items() if v != rec.variant
        )
        why = _e(reasons.get(rec.variant or "", rec.summary))
        detail = f"<details><summary>the others</summary><ul>{others}</ul></details>" if others else ""
        tied = ", ".join(rec.tied) or "-"
        rows.append([f"<b>{_e(profile)}</b><br><span class='meta'>{_e(rec.description)}</span>",
                     f"<span class='deploy'>{_e(rec.variant or 'none')}</span>", why + detail, _e(tied)])  # fmt: skip
    return _table(["profile", "deploy", "why", "tied with"], rows, numeric_from=99)


def _headline_row(run: RunReport) -> list[str]:
    batch = run.batch_throughput or BatchThroughput(batch=0, new_tokens=0)
    vs = run.quality_vs_standard
    cost = run.cost
    cost_ci = (cost.per_million_output_tokens_ci if cost else None) or [None, None]
    return [
        f"<b>{_e(run.variant)}</b>" + ("" if run.status == "ok" else " (failed)"),
        _num(run.latency_ms.p50, ",.0f"),
        _num(run.latency_ms.p99, ",.0f"),
        _num(run.ttft_ms.p50, ",.0f"),
        _num(run.tpot_ms.p50, ",.1f"),
        _num(run.throughput.output_tokens_per_s),
        _interval(batch.tokens_per_s, batch.ci_low, batch.ci_high),
        _num(run.quality.composite, ".3f"),
        _num(vs.ratio * 100 if vs and vs.ratio is not None else None, ".1f") + (f" {vs.gate}" if vs else ""),
        _num(run.quality.kl_mean, ".3g"),
        _num(run.resources.peak_rss_bytes / 1e6 if run.resources.peak_rss_bytes else None, ",.0f"),
        _interval(cost.per_million_output_tokens if cost else None, cost_ci[0], cost_ci[1], ",.2f"),
    ]


HEADLINE = ["variant", "P50 latency, ms", "P99 latency, ms", "P50 TTFT, ms", "P50 TPOT, ms", "output tokens/s",
            "batch-8 tokens/s [95% CI]", "quality", "% of standard, gate", "KL, nats", "peak RSS, MB",
            "cost per 1M tokens [95% CI]"]  # fmt: skip


def _chart(chart: Chart) -> str:
    head = f'<section class="chart" id="{chart.key}"><h2>{_e(chart.title)}</h2><p class="caption">{_e(chart.caption)}</p>'
    if chart.figure is None:
        return head + f'<p class="missing">Not drawn: {_e(chart.missing)}</p></section>'
    return head + figure(chart.figure, chart.key) + "</section>"


def _environment(report: Report) -> str:
    env = dict(report.environment)
    flags = env.pop("cpu_flags", None)
    rows = [[_e(k), _e(v if not isinstance(v, dict | list) else json.dumps(v))] for k, v in env.items()]
    if flags:
        rows.append(["cpu_flags", _e(" ".join(flags) if isinstance(flags, list) else flags)])
    return _table(["", "value"], rows, numeric_from=99)


def render(report: Report, records: Iterable[QueryRecord], raws: list[VariantResult]) -> str:
    charts = all_charts(Inputs.of(report, records, raws))
    model = report.model.get("name") or report.model.get("source") or "model"
    parts = [
        f"<h1>Which variant of {_e(model)} to deploy</h1>",
        f"<p class='meta'>variantbench {_e(report.tool_version)} · {_e(report.created_utc)} · standard "
        f"<b>{_e(report.standard)}</b> · variants {_e(', '.join(r.variant for r in report.runs) or 'none')} · "
        f"{_e(report.environment.get('cpu_model'))}, {_e(report.environment.get('cpu_logical_cores'))} cores</p>",
    ]
    parts += [
        f"<p class='notice{' bad' if bad else ''}'>{_e(text)}</p>" for text, bad in notices(report, raws)
    ]
    parts += ["<h2>Recommendation</h2>", _recommendations(report)]
    parts += ["<h2>Headline numbers</h2>",
              "<p class='caption'>From the measured queries; intervals are 95%. Quality is the composite "
              "(0.5 BLEU + 0.5 ROUGE-L) against the references.</p>",
              _table(HEADLINE, [_headline_row(r) for r in report.runs])]  # fmt: skip
    parts += [_chart(c) for c in charts if c.applies]
    execution = report.execution
    parts += ["<h2>How it was run</h2>",
              f"<p class='caption'>{'Interleaved' if execution.interleaved else 'One variant after another'}"
              f"{': ' + _e(execution.why_not) if execution.why_not else ''}.</p>",
              "<h3>Environment</h3>", _environment(report),
              "<h3>Plan</h3>", f"<pre>{_e(yaml.safe_dump(report.plan, sort_keys=False))}</pre>"]  # fmt: skip
    return page(f"variantbench: {model}", parts)


def write_html(report: Report, records: Iterable[QueryRecord], raws: list[VariantResult], path: Path) -> None:
    write_page(render(report, records, raws), path)
