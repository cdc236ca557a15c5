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
    from variantbench.report.markdown import backend_lines

    base = report.run(report.standard)
    base_ok = base if base is not None and base.status == "ok" else None
    table = Table(
        title=f"variantbench: {report.model.get('name')} - {report.scenario}, standard = {report.standard}",
        caption=" ".join(["ratios against the standard; green is better.", *backend_lines(report)]),
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
        return [run.variant, run.weight_format or "-", f"[red]failed: {run.error}[/red]"] + [""] * 11

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
        _num(run.resources.startup_s),
        cmp(lambda r: (r.resources.peak_rss_bytes or 0) / mb or None, False, "{:.0f}"),
        cmp(lambda r: (r.resources.param_bytes or 0) / mb or None, False, "{:.0f}"),
        str(run.queries.errors),
        "[green]VALID[/green]" if run.validity.verdict == "VALID" else "[red]INVALID[/red]",
    ]


def _gate(run: RunReport) -> str:
    q = run.quality_vs_standard
    if q is None or q.gate == "n/a":
        return "standard" if q is not None and q.standard == run.variant else "-"
    colour = {"PASS": "green", "UNDECIDED": "yellow"}.get(q.gate, "red")
    return f"[{colour}]{q.gate}[/{colour}]"


def quality_table(report: Report) -> Table:
    """Quality against the references, against the standard (the gates), and logit fidelity."""
    threshold = next(
        (r.quality_vs_standard.quality_threshold for r in report.runs if r.quality_vs_standard), 0.99
    )
    table = Table(
        title=f"quality - standard = {report.standard}",
        caption=(
            f"composite = 0.5 BLEU/100 + 0.5 ROUGE-L. Gate: quality >= {threshold:.1%} of the standard's and "
            "mean output length within the tolerance, on the same samples. Agreement: ROUGE-L against the "
            "standard's answers. Fidelity on a held-out text: perplexity, KL(standard||variant) in nats, "
            "top-1 agreement."
        ),
    )
    for name in ("variant", "scored", "BLEU", "ROUGE-L", "QA EM", "QA F1", "class.\nacc.", "composite",
                 "vs std", "length\nvs std", "agree\nROUGE-L", "gate", "ppl", "KL mean", "KL p99", "top-1"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("variant", "gate") else "right")
    for run in report.runs:
        if run.status != "ok":
            table.add_row(run.variant, f"[red]failed: {run.error}[/red]", *[""] * 14)
            continue
        q, v = run.quality, run.quality_vs_standard
        table.add_row(
            run.variant,
            str(q.scored),
            _num(q.bleu),
            _num(q.rougeL, "{:.3f}"),
            _num(q.exact_match, "{:.2f}"),
            _num(q.f1, "{:.2f}"),
            _num(q.accuracy, "{:.2f}"),
            _num(q.composite, "{:.3f}"),
            _num(v.ratio if v else None, "{:.1%}"),
            _num(v.length_ratio if v else None, "{:.1%}"),
            _num(v.agreement_rougeL if v else None, "{:.3f}"),
            _gate(run),
            _num(q.perplexity, "{:.2f}"),
            _num(q.kl_mean, "{:.4f}"),
            _num(q.kl_p99, "{:.4f}"),
            _num(q.top1_agreement, "{:.1%}"),
        )
    return table


TASK_SCORE = {"qa": ("F1", "f1"), "classification": ("accuracy", "accuracy")}


def task_table(report: Report, timed: bool = True) -> Table:
    """Per task type: latency, decode rate and the task's own quality score, per variant.

    An untimed pass (``--accuracy-only``) shows the quality columns only.
    """
    table = Table(
        title="per task",
        caption="score: QA token F1, classification accuracy (by label likelihood where measured), else ROUGE-L; tok/s = output tokens / "
        "the time of that task's queries.",
    )
    timing = ("p50 ms", "p99 ms", "TTFT p50\nms", "out tok/s") if timed else ()
    for name in ("variant", "task", "queries", "input tok\np50", *timing, "score", "composite"):
        table.add_column(name, justify="left" if name in ("variant", "task") else "right")
    for run in report.runs:
        if run.status != "ok":
            continue
        for task, t in run.per_task.items():
            label, key = TASK_SCORE.get(task, ("ROUGE-L", "rougeL"))
            score = getattr(t.quality, key)
            speed = (
                [_num(t.latency_ms.p50, "{:.0f}"), _num(t.latency_ms.p99, "{:.0f}"),
                 _num(t.ttft_ms.p50, "{:.0f}"), _num(t.output_tokens_per_s)]
                if timed else []
            )  # fmt: skip
            table.add_row(
                run.variant,
                task,
                str(t.queries),
                _num(t.input_tokens.p50, "{:.0f}"),
                *speed,
                "-" if score is None else f"{score:.3f} {label}",
                _num(t.quality.composite, "{:.3f}"),
            )
    return table
