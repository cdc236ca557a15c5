"""report.html's charts: plotly figures computed from the report, the query log and raw/*.json.

Every chart is a ``Chart``: an element id, a title, a one-line caption saying what to read from it,
and either a figure (units on every axis) or the reason it could not be drawn (a failed variant, a
run without a GPU). Nothing here measures: ``variantbench report DIR`` redraws them all from the
files a run left, like every other renderer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from variantbench.metrics.windows import block_spans, outliers, windows
from variantbench.records import QueryRecord
from variantbench.report.results import VariantResult, counted
from variantbench.report.schema import Report
from variantbench.report.summary import inter_token_ms
from variantbench.trackers.resources import sample_from_row

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip
# operator families get colours of their own, so a family is never mistaken for a variant
FAMILY_PALETTE = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3")
LAYOUT = {"template": "plotly_white", "margin": {"l": 70, "r": 20, "t": 50, "b": 55}, "height": 440,
          "legend": {"orientation": "h", "y": -0.18}, "font": {"size": 12}}  # fmt: skip


@dataclass
class Chart:
    key: str
    title: str
    caption: str
    figure: go.Figure | None = None
    missing: str | None = None  # why there is no figure
    applies: bool = True  # False: the run has nothing of this kind (a local run's server view): left out


@dataclass
class Inputs:
    """What the charts are drawn from: the report, its query records by variant, its raw payloads."""

    report: Report
    records: dict[str, list[QueryRecord]]
    raws: list[VariantResult]

    @classmethod
    def of(cls, report: Report, records: Iterable[QueryRecord], raws: list[VariantResult]) -> Inputs:
        """Only the records the report counted (``records.counted``), keyed by variant."""
        raws = list(raws)
        return cls(report, counted(records, raws), [raw for raw in raws if raw.measured])

    @property
    def variants(self) -> list[str]:
        return [r.variant for r in self.report.runs]

    def color(self, variant: str) -> str:
        names = self.variants
        return PALETTE[(names.index(variant) if variant in names else len(names)) % len(PALETTE)]

    def origin_ns(self) -> int:
        """The run's first moment on the monotonic clock every worker process shares (CLOCK_MONOTONIC)."""
        times = [r.scheduled_ns for recs in self.records.values() for r in recs]
        times += [row[0] for raw in self.raws for row in raw.resource_samples]
        return min(times, default=0)


def _style(fig: go.Figure, **extra: Any) -> go.Figure:
    fig.update_layout(**(LAYOUT | extra))
    return fig


def _ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


LATENCY_PANELS = (
    ("latency from scheduled time (ms)", lambda recs: [r.latency_from_scheduled_ms for r in recs]),
    ("time to first token (ms)", lambda recs: [r.ttft_ms for r in recs if r.ttft_ms is not None]),
    ("time per output token (ms)", lambda recs: [r.tpot_ms for r in recs if r.tpot_ms is not None]),
    ("inter-token latency (ms)", inter_token_ms),
)


def latency_cdfs(data: Inputs) -> Chart:
    chart = Chart("latency-cdf", "Latency distributions",
                  "Each curve is one variant's empirical CDF: further left is faster; read P50 at 0.5 and "
                  "P99 at 0.99, and compare the tails' spread.")  # fmt: skip
    ok = {v: [r for r in recs if r.status == "ok"] for v, recs in data.records.items()}
    if not any(ok.values()):
        chart.missing = "no query completed"
        return chart
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for t, _ in LATENCY_PANELS],
                        horizontal_spacing=0.09, vertical_spacing=0.17)  # fmt: skip
    for i, (title, values_of) in enumerate(LATENCY_PANELS):
        row, col = i // 2 + 1, i % 2 + 1
        for variant in data.variants:
            values = [v for v in values_of(ok.get(variant, [])) if v is not None and v > 0]
            if not values:
                continue
            xs, ys = _ecdf(values)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line_shape="hv", name=variant,
                                     legendgroup=variant, showlegend=i == 0,
                                     line={"color": data.color(variant)},
                                     hovertemplate=f"{variant}: %{{x:.1f}} ms at %{{y:.2f}}<extra></extra>"),
                          row=row, col=col)  # fmt: skip
        fig.update_xaxes(title_text=title.replace(" (ms)", ", ms (log)"), type="log", row=row, col=col)
        share = "fraction of token gaps" if title.startswith("inter-token") else "fraction of queries"
        fig.update_yaxes(title_text=share, range=[0, 1.02], row=row, col=col)
    chart.figure = _style(fig, height=640)
    return chart


def _throughput_points(records: Sequence[QueryRecord], origin: int) -> tuple[list[float], list[float]]:
    """Output tokens/s per interleaved block (the variant ran alone during it), or per window of
    completed queries when the run was not interleaved. x: the point's end, s from the run's start."""
    ok = [r for r in records if r.status == "ok"]
    if any(r.block >= 0 for r in ok):
        xs, ys = [], []
        for lo, hi in block_spans(ok):
            inside = [r for r in ok if lo <= r.scheduled_ns and r.completed_ns <= hi]
            if inside and hi > lo:
                xs.append((hi - origin) / 1e9)
                ys.append(sum(r.output_tokens for r in inside) / ((hi - lo) / 1e9))
        return xs, ys
    ws = windows(ok, max(3, len(ok) // 10)) if ok else []
    return ([(w.end_ns - origin) / 1e9 for w in ws if w.output_tokens_per_s is not None],
            [w.output_tokens_per_s for w in ws if w.output_tokens_per_s is not None])  # fmt: skip


def over_time(data: Inputs) -> Chart:
    chart = Chart("over-time", "Latency and throughput over the run",
                  "Each dot is one query at its completion time; red crosses lie beyond 3 sigma (kept in every "
                  "percentile). The lower panel is the stability rule made visible: a flat line is a steady "
                  "run, a trend is warm-up or drift.")  # fmt: skip
    origin = data.origin_ns()
    if not any(data.records.values()):
        chart.missing = "no query completed"
        return chart
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["latency per query", "output tokens/s per block or window"])  # fmt: skip
    flagged_x: list[float] = []
    flagged_y: list[float] = []
    flagged_text: list[str] = []
    for variant in data.variants:
        ok = sorted(
            (r for r in data.records.get(variant, []) if r.status == "ok"), key=lambda r: r.completed_ns
        )
        if not ok:
            continue
        xs = [(r.completed_ns - origin) / 1e9 for r in ok]
        ys = [r.latency_from_scheduled_ms for r in ok]
        color = data.color(variant)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=variant, legendgroup=variant,
                                 marker={"color": color, "size": 6},
                                 text=[r.sample_id for r in ok],
                                 hovertemplate=f"{variant} %{{text}}: %{{y:.0f}} ms at %{{x:.1f}} s<extra></extra>"),
                      row=1, col=1)  # fmt: skip
        for x, y, r, out in zip(xs, ys, ok, outliers(ys), strict=True):
            if out:
                flagged_x.append(x)
                flagged_y.append(y)
                flagged_text.append(f"{variant} {r.sample_id}")
        tx, ty = _throughput_points(ok, origin)
        fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines+markers", name=f"{variant} tokens/s",
                                 legendgroup=variant, showlegend=False, line={"color": color},
                                 hovertemplate=f"{variant}: %{{y:.1f}} tokens/s<extra></extra>"),
                      row=2, col=1)  # fmt: skip
    fig.add_trace(go.Scatter(x=flagged_x, y=flagged_y, mode="markers", name="outlier (> 3 sigma)",
                             marker={"symbol": "x", "color": "red", "size": 11}, text=flagged_text,
                             hovertemplate="%{text}: %{y:.0f} ms<extra>outlier</extra>"),
                  row=1, col=1)  # fmt: skip
    fig.update_yaxes(title_text="latency, ms", row=1, col=1)
    fig.update_yaxes(title_text="output tokens/s", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="time since the run started, s", row=2, col=1)
    chart.figure = _style(fig, height=600)
    return chart


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names no other point beats on both coordinates (higher is better on both), by x."""
    front = [name for name, (x, y) in points.items()
             if not any(ox >= x and oy >= y and (ox, oy) != (x, y) for ox, oy in points.values())]  # fmt: skip
    return sorted(front, key=lambda n: points[n][0])


# the score a task is judged by (its own metric), the composite otherwise
TASK_METRIC = {"classification": ("accuracy", "accuracy"), "qa": ("f1", "token F1")}


def _task_score(task: str, quality: Any) -> tuple[float | None, str]:
    field, label = TASK_METRIC.get(task, ("composite", "composite"))
    return getattr(quality, field), label


def quality_speed(data: Inputs) -> Chart:
    chart = Chart("quality-speed", "Quality against speed",
                  "Up and to the right is better: variants on the highlighted Pareto front are each the "
                  "fastest at their quality; a variant below the front is beaten on both. Per-task panels "
                  "show where a variant's quality is lost.")  # fmt: skip
    runs = [r for r in data.report.runs if r.status == "ok"]
    points = {r.variant: (r.throughput.output_tokens_per_s, r.quality.composite) for r in runs
              if r.throughput.output_tokens_per_s is not None and r.quality.composite is not None}  # fmt: skip
    if not points:
        chart.missing = "no variant has both a throughput and a quality score"
        return chart
    tasks = sorted({t for r in runs for t in r.per_task})
    cols = max(1, len(tasks))
    titles = ["all tasks: composite quality"] + [
        f"{t}: {TASK_METRIC.get(t, ('', 'composite'))[1]}" for t in tasks
    ]
    specs = [[{"colspan": cols}] + [None] * (cols - 1)] + ([[{}] * cols] if tasks else [])
    fig = make_subplots(rows=len(specs), cols=cols, specs=specs, subplot_titles=titles, horizontal_spacing=0.06,
                        vertical_spacing=0.2, row_heights=[0.6, 0.4] if tasks else None)  # fmt: skip
    front = pareto_front(points)
    for name, (x, y) in points.items():
        fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers+text", text=[name], textposition="top center",
                                 name=name, legendgroup=name,
                                 marker={"color": data.color(name), "size": 14 if name in front else 9,
                                         "line": {"width": 2 if name in front else 0, "color": "black"}},
                                 hovertemplate=f"{name}: %{{x:.1f}} tokens/s, quality %{{y:.3f}}<extra></extra>"),
                      row=1, col=1)  # fmt: skip
    fig.add_trace(go.Scatter(x=[points[n][0] for n in front], y=[points[n][1] for n in front],
                             mode="lines", name="Pareto front", line={"color": "black", "dash": "dot", "width": 2}),
                  row=1, col=1)  # fmt: skip
    for col, task in enumerate(tasks, start=1):
        scores = []
        for r in runs:
            tr = r.per_task.get(task)
            score = _task_score(task, tr.quality)[0] if tr else None
            if tr is None or score is None or tr.output_tokens_per_s is None:
                continue
            scores.append(score)
            fig.add_trace(go.Scatter(x=[tr.output_tokens_per_s], y=[score], mode="markers", name=r.variant,
                                     legendgroup=r.variant, showlegend=False,
                                     marker={"color": data.color(r.variant), "size": 10},
                                     hovertemplate=f"{r.variant} on {task}: %{{x:.1f}} tokens/s, %{{y:.3f}}<extra></extra>"),
                          row=2, col=col)  # fmt: skip
        fig.update_xaxes(title_text="output tokens/s", row=2, col=col)
        fig.update_yaxes(range=[0, max([*scores, 0.05]) * 1.15], row=2, col=col)
    fig.update_xaxes(title_text="output tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="quality score, 0-1", row=1, col=1)
    if tasks:
        fig.update_yaxes(title_text="task score, 0-1", row=2, col=1)
    chart.figure = _style(fig, height=640 if tasks else 420)
    return chart


FOREST_LATENCY = (("latency_ratio", "latency per sample"), ("ttft_ratio", "TTFT per sample"),
                  ("latency_p50_ratio", "P50 latency"), ("latency_p99_ratio", "P99 latency"))  # fmt: skip


def _forest_row(fig: go.Figure, col: int, label: str, ratio: Any, color: str) -> bool:
    value = ratio.get("value") if isinstance(ratio, dict) else getattr(ratio, "value", None)
    if value is None or value <= 0:
        return False
    low = ratio.get("ci_low") if isinstance(ratio, dict) else ratio.ci_low
    high = ratio.get("ci_high") if isinstance(ratio, dict) else ratio.ci_high
    err = {"type": "data", "symmetric": False, "array": [(high or value) - value],
           "arrayminus": [value - (low or value)], "color": color, "thickness": 2}  # fmt: skip
    fig.add_trace(go.Scatter(x=[value], y=[label], mode="markers", error_x=err, showlegend=False,
                             marker={"color": color, "size": 10, "symbol": "square"},
                             hovertemplate=f"{label}: x%{{x:.3f}} [{low or value:.3f}, {high or value:.3f}]<extra></extra>"),
                  row=1, col=col)  # fmt: skip
    return True


def _verdict_color(low: float | None, high: float | None, lower_is_better: bool) -> str:
    if low is None or high is None or low <= 1 <= high:
        return "#7f7f7f"  # the interval holds 1: no evidence either way
    better = high < 1 if lower_is_better else low > 1
    return "#2ca02c" if better else "#d62728"


def forest(data: Inputs) -> Chart:
    chart = Chart("forest", "A/B ratios with their intervals",
                  f"Left: each variant / {data.report.standard} with its 95% interval. Right: every pair's "
                  "throughput ratio at the confidence the stopping rule used. Green is significantly better for "
                  "the first name, red worse, grey an interval that holds 1 (no evidence).")  # fmt: skip
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.25,
                        subplot_titles=["latency ratios (< 1 is faster)", "throughput ratios (> 1 is faster)"])  # fmt: skip
    drawn = 0
    for run in data.report.runs:
        ab = run.ab_vs_standard
        if ab is None or run.status != "ok":
            continue
        for key, what in FOREST_LATENCY:
            ratio = getattr(ab, key)
            drawn += _forest_row(
                fig,
                1,
                f"{run.variant}: {what}",
                ratio,
                _verdict_color(ratio.ci_low, ratio.ci_high, lower_is_better=True),
            )
    pairs = [(f"{c.a} / {c.b}: {'batch-8' if c.metric == 'batch throughput' else 'single'}",
              {"value": c.ratio, "ci_low": c.ci_low, "ci_high": c.ci_high})
             for c in data.report.comparisons]  # fmt: skip
    if not pairs:  # one variant against the standard only: the A/B's own throughput ratio
        pairs = [(f"{r.variant} / {data.report.standard}", r.ab_vs_standard.throughput_ratio.model_dump())
                 for r in data.report.runs if r.ab_vs_standard is not None and r.status == "ok"]  # fmt: skip
    for label, ratio in pairs:
        drawn += _forest_row(
            fig, 2, label, ratio, _verdict_color(ratio["ci_low"], ratio["ci_high"], lower_is_better=False)
        )
    if not drawn:
        chart.missing = "no variant was compared with another (a single variant, or none measured)"
        return chart
    for col in (1, 2):
        fig.add_vline(x=1, line={"color": "black", "dash": "dash", "width": 1}, row=1, col=col)
        fig.update_xaxes(type="log", title_text="ratio (log scale)", row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    fig.update_yaxes(title_text="variant: measure", row=1, col=1)
    fig.update_yaxes(title_text="pair: load", row=1, col=2)
    rows = max(4, drawn // 2)
    chart.figure = _style(fig, height=min(900, 160 + 34 * rows), showlegend=False)
    return chart


def _segments(rows: Sequence[list[Any]]) -> list[list[list[Any]]]:
    """Samples split where the sampler paused (between a variant's interleaved blocks): a gap of
    more than 1 s is not drawn as a line across time the variant did not run."""
    out: list[list[list[Any]]] = []
    for row in rows:
        if not out or row[0] - out[-1][-1][0] > 1_000_000_000:
            out.append([])
        out[-1].append(row)
    return out


def _cpu_percent(rows: Sequence[list[Any]], span_ns: int = 500_000_000) -> list[float | None]:
    """CPU % of one core over the last ``span_ns`` (two samples 1 ms apart make a meaningless rate)."""
    out: list[float | None] = []
    j = 0
    for i, row in enumerate(rows):
        while j < i and row[0] - rows[j + 1][0] >= span_ns:
            j += 1
        dt = (row[0] - rows[j][0]) / 1e9
        out.append(100.0 * (row[2] - rows[j][2]) / dt if j < i and dt > 0 else None)
    return out


def _with_gaps(rows: Sequence[list[Any]], origin: int, value: Any) -> tuple[list[float | None], list[Any]]:
    """x (s from the run's start) and values over every segment, a None between segments."""
    xs: list[float | None] = []
    ys: list[Any] = []
    for seg in _segments(rows):
        if xs:
            xs.append(None)
            ys.append(None)
        xs += [(row[0] - origin) / 1e9 for row in seg]
        ys += value(seg)
    return xs, ys


def resources(data: Inputs) -> Chart:
    chart = Chart("resources", "Resources over time",
                  "Memory (RSS) and CPU of each variant's worker process while it was measured; in an "
                  "interleaved run the variants take turns, so each line is busy only in its own blocks. "
                  "100% CPU is one core.")  # fmt: skip
    raws = [r for r in data.raws if r.resource_samples]
    if not raws:
        chart.missing = "no resource samples (the variants failed before measuring, or the run predates them)"
        return chart
    has_gpu = any(len(row) > 3 for r in raws for row in r.resource_samples)
    titles = ["resident memory", "CPU"] + (["GPU utilization", "GPU memory"] if has_gpu else [])
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=titles)  # fmt: skip
    origin = data.origin_ns()
    order = {v: i for i, v in enumerate(data.variants)}
    for raw in sorted(raws, key=lambda r: (order.get(r.variant, 99), r.repeat)):
        variant = raw.variant
        name = variant if not raw.repeat else f"{variant} (repeat {raw.repeat})"
        rows = raw.resource_samples
        line = {"color": data.color(variant), "width": 1.5}
        panels: list[Any] = [lambda seg: [row[1] / 1e6 for row in seg], _cpu_percent]
        if has_gpu:
            panels += [lambda seg: [sample_from_row(row).gpu_util for row in seg],
                       lambda seg: [(sample_from_row(row).gpu_mem_bytes or 0) / 1e6 for row in seg]]  # fmt: skip
        for i, value in enumerate(panels, start=1):
            xs, ys = _with_gaps(rows, origin, value)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, legendgroup=name, showlegend=i == 1,
                                     line=line, connectgaps=False), row=i, col=1)  # fmt: skip
    fig.update_yaxes(title_text="RSS, MB", row=1, col=1)
    fig.update_yaxes(title_text="CPU, % of a core", rangemode="tozero", row=2, col=1)
    if has_gpu:
        fig.update_yaxes(title_text="GPU, %", range=[0, 100], row=3, col=1)
        fig.update_yaxes(title_text="GPU memory, MB", row=4, col=1)
    fig.update_xaxes(title_text="time since the run started, s", row=len(titles), col=1)
    chart.figure = _style(fig, height=260 * len(titles) + 80)
    return chart


def energy(data: Inputs) -> Chart:
    runs = [r for r in data.report.runs if r.status == "ok" and r.resources.energy_j is not None]
    sources = sorted({r.resources.energy_source or "?" for r in runs})
    chart = Chart("energy", "Energy per output token",
                  "Joules each variant spent per output token it produced (lower is better); source: "
                  f"{', '.join(sources) or '-'} (an estimate is CPU seconds x watts per core, not a meter).")  # fmt: skip
    points = []
    for r in runs:
        tokens = (r.throughput.output_tokens_per_s or 0) * (r.duration_s or 0)
        if tokens > 0:
            points.append((r.variant, r.resources.energy_j / tokens))
    if not points:
        chart.missing = "no variant has both an energy reading and output tokens"
        return chart
    chart.figure = _variant_bars(data, points, "energy, J per output token", "%{y:.2f} J per token")
    return chart


def _variant_bars(
    data: Inputs,
    points: list[tuple[str, float]],
    axis: str,
    hover: str,
    lows: list[float | None] | None = None,
    highs: list[float | None] | None = None,
) -> go.Figure:
    """One bar per variant in its colour, with its interval where given."""
    ys = [y for _, y in points]
    error = None
    if lows is not None and highs is not None:
        error = {"type": "data", "symmetric": False, "array": [(h or y) - y for h, y in zip(highs, ys, strict=True)],
                 "arrayminus": [y - (lo or y) for lo, y in zip(lows, ys, strict=True)]}  # fmt: skip
    fig = go.Figure(go.Bar(x=[v for v, _ in points], y=ys, marker_color=[data.color(v) for v, _ in points],
                           error_y=error, hovertemplate="%{x}: " + hover + "<extra></extra>"))  # fmt: skip
    fig.update_yaxes(title_text=axis)
    fig.update_xaxes(title_text="variant")
    return _style(fig, height=360, showlegend=False)


def batch_throughput(data: Inputs) -> Chart:
    chart = Chart("batch", "Decode throughput at batch 8",
                  "Tokens/s decoding 8 sequences at once, measured in interleaved rounds (mean and 95% "
                  "t-interval): the batch profile ranks by it; overlapping bars are not a difference.")  # fmt: skip
    runs = [r for r in data.report.runs if r.batch_throughput and r.batch_throughput.tokens_per_s]
    if not runs:
        chart.missing = (
            "batch rounds were not measured (an endpoint, find-peak or a backend without batching)"
        )
        return chart
    chart.figure = _variant_bars(
        data, [(r.variant, r.batch_throughput.tokens_per_s) for r in runs if r.batch_throughput],
        "decode tokens/s at batch 8", "%{y:.1f} tokens/s",
        lows=[r.batch_throughput.ci_low for r in runs if r.batch_throughput],
        highs=[r.batch_throughput.ci_high for r in runs if r.batch_throughput])  # fmt: skip
    return chart


def diagnosis(data: Inputs) -> Chart:
    chart = Chart("diagnosis", "Where the time goes",
                  "Profiled time per operator family, stacked per variant: the tallest segment is where a "
                  "variant spends its time, and a segment that grows against the standard is why it is slower.")  # fmt: skip
    runs = [r for r in data.report.runs if r.diagnosis and (r.diagnosis.op_ms or r.diagnosis.prefill_op_ms)]
    if not runs:
        chart.missing = "no variant was profiled (an endpoint, or diagnosis turned off)"
        return chart
    families = sorted({f for r in runs for f in (*r.diagnosis.op_ms, *r.diagnosis.prefill_op_ms)})
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=["one decode step", "one prefill"], horizontal_spacing=0.12
    )
    for i, family in enumerate(families):
        color = FAMILY_PALETTE[i % len(FAMILY_PALETTE)]
        for col, field in ((1, "op_ms"), (2, "prefill_op_ms")):
            fig.add_trace(go.Bar(x=[r.variant for r in runs], y=[getattr(r.diagnosis, field).get(family, 0.0) for r in runs],
                                 name=family, legendgroup=family, showlegend=col == 1, marker_color=color,
                                 hovertemplate=f"{family}: %{{y:.2f}} ms<extra>%{{x}}</extra>"),
                          row=1, col=col)  # fmt: skip
    fig.update_yaxes(title_text="ms per decode step", row=1, col=1)
    fig.update_yaxes(title_text="ms per prefill", row=1, col=2)
    fig.update_xaxes(title_text="variant")
    chart.figure = _style(fig, barmode="stack", height=420)
    return chart


def server_view(data: Inputs) -> Chart:
    chart = Chart("server", "The server's view beside the client's",
                  "Top: each query's latency as this client saw it; below: the server's own Prometheus series "
                  "scraped while it was measured (running and waiting requests, KV-cache use, batch size where "
                  "exposed). Latency that rises with the waiting queue is queueing, not compute.")  # fmt: skip
    from variantbench.trackers.server_metrics import key_series

    served = {raw.variant: raw.server_metrics for raw in data.raws if raw.server_metrics}
    if not served:
        chart.applies = False
        return chart
    series = {v: key_series(m.samples) for v, m in served.items()}
    kinds = list(dict.fromkeys(k for per in series.values() for k in per))
    if not kinds:
        errors = sorted({m.error for m in served.values() if m.error})
        chart.missing = ("no server-side series: " + "; ".join(errors)) if errors else (
            "the server exposes no /metrics series we know")  # fmt: skip
        return chart
    fig = make_subplots(rows=1 + len(kinds), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["client: latency per query", *(f"server: {k}" for k in kinds)])  # fmt: skip
    origin = data.origin_ns()
    for variant in served:
        color = data.color(variant)
        ok = sorted(
            (r for r in data.records.get(variant, []) if r.status == "ok"), key=lambda r: r.completed_ns
        )
        fig.add_trace(go.Scatter(x=[(r.completed_ns - origin) / 1e9 for r in ok], y=[r.latency_ms for r in ok],
                                 mode="markers", name=variant, legendgroup=variant, marker={"color": color, "size": 5}),
                      row=1, col=1)  # fmt: skip
        for i, kind in enumerate(kinds, start=2):
            points = series[variant].get(kind, [])
            fig.add_trace(go.Scatter(x=[(t - origin) / 1e9 for t, _ in points], y=[v for _, v in points],
                                     mode="lines", name=variant, legendgroup=variant, showlegend=False,
                                     line={"color": color, "shape": "hv"}), row=i, col=1)  # fmt: skip
            fig.update_yaxes(title_text=kind.split(" (")[0], rangemode="tozero", row=i, col=1)
    fig.update_yaxes(title_text="latency, ms", row=1, col=1)
    fig.update_xaxes(title_text="time since the run started, s", row=1 + len(kinds), col=1)
    chart.figure = _style(fig, height=220 * (1 + len(kinds)) + 80)
    return chart


BUILDERS = (
    latency_cdfs,
    over_time,
    quality_speed,
    forest,
    batch_throughput,
    resources,
    energy,
    diagnosis,
    server_view,
)


def all_charts(data: Inputs) -> list[Chart]:
    charts = []
    for build in BUILDERS:
        try:
            charts.append(build(data))
        except (ValueError, TypeError, KeyError, ZeroDivisionError) as exc:  # a chart never sinks the report
            name = build.__name__.replace("_", " ")
            charts.append(Chart(build.__name__, name, "", missing=f"could not be drawn: {exc}"))
    return charts
