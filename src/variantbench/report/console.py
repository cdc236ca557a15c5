"""The comparison table printed at the end of a run: the standard variant is the 1.00x baseline."""

from __future__ import annotations

from rich.table import Table

from variantbench.report.schema import Report, RunReport


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(value: float | None, base: float | None, higher_is_better: bool) -> str:
    if value is None or not base:
        return ""
    ratio = value / base
    good = ratio >= 1 if higher_is_better else ratio <= 1
    colour = "green" if good else "red"
    if abs(ratio - 1) < 0.005:
        colour = "white"
    return f"\n[{colour}]{ratio:.2f}x[/{colour}]"


def comparison_table(report: Report) -> Table:
    base = report.run(report.standard)
    base_ok = base if base is not None and base.status == "ok" else None
    table = Table(
        title=f"variantbench: {report.model.get('name')} - {report.plan.get('scenario', 'single-stream')}, "
        f"standard = {report.standard}",
        caption="ratios against the standard; green is better. BLEU 0-100, ROUGE-L F 0-1.",
    )
    columns = [
        ("variant", "left"),
        ("weights", "left"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("TTFT p50\nms", "right"),
        ("TPOT p50\nms", "right"),
        ("out\ntok/s", "right"),
        ("prefill\ntok/s", "right"),
        ("decode\ntok/s", "right"),
        ("BLEU", "right"),
        ("ROUGE-L", "right"),
        ("startup\ns", "right"),
        ("peak RSS\nMB", "right"),
        ("params\nMB", "right"),
        ("errors", "right"),
        ("valid", "left"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for run in report.runs:
        table.add_row(*_row(run, base_ok))
    return table


def _row(run: RunReport, base: RunReport | None) -> list[str]:
    if run.status != "ok":
        return [run.variant, run.weight_format or "-", f"[red]failed: {run.error}[/red]"] + [""] * 13

    def cmp(get, higher_is_better: bool, fmt: str = "{:.1f}") -> str:  # noqa: ANN001
        value = get(run)
        return _num(value, fmt) + (_ratio(value, get(base), higher_is_better) if base is not None else "")

    mb = 1024 * 1024
    return [
        run.variant,
        run.weight_format or "-",
        cmp(lambda r: r.latency_ms.p50, False, "{:.0f}"),
        cmp(lambda r: r.latency_ms.p99, False, "{:.0f}"),
        cmp(lambda r: r.ttft_ms.p50, False),
        cmp(lambda r: r.tpot_ms.p50, False),
        cmp(lambda r: r.throughput.output_tokens_per_s, True),
        cmp(lambda r: r.speed.prefill_tokens_per_s, True, "{:.0f}"),
        cmp(lambda r: r.speed.decode_tokens_per_s, True),
        _num(run.quality.bleu),
        _num(run.quality.rougeL, "{:.3f}"),
        _num(run.resources.startup_s),
        cmp(lambda r: (r.resources.peak_rss_bytes or 0) / mb or None, False, "{:.0f}"),
        cmp(lambda r: (r.resources.param_bytes or 0) / mb or None, False, "{:.0f}"),
        str(run.queries.errors),
        "[green]VALID[/green]" if run.validity.verdict == "VALID" else "[red]INVALID[/red]",
    ]
