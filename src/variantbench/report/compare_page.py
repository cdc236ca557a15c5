"""compare.html: run B against run A as a forest plot and a table, from ``Comparison.to_json()``.

Plain data in (the comparison's JSON), so this page needs nothing from ``compare.py`` and could be
drawn again from a saved ``--json`` file.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from variantbench.report.pages import e, figure, page, table

VERDICT_COLORS = {"better": "#2ca02c", "worse": "#d62728"}
# metric -> (panel title, higher is better)
PANELS = {
    "latency": ("latency per sample (< 1 is faster)", False),
    "p99": ("P99 latency (< 1 is faster)", False),
    "tokens_per_s": ("tokens/s per query (> 1 is faster)", True),
    "quality": ("composite quality (> 1 is better)", True),
}


def _fmt(c: dict[str, Any]) -> str:
    if c.get("ratio") is None:
        return "-"
    if c.get("ci_low") is None:
        return f"{c['ratio']:.3f}"
    return f"{c['ratio']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]"


def forest(changes: list[dict[str, Any]]) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for t, _ in PANELS.values()],
                        horizontal_spacing=0.22, vertical_spacing=0.2)  # fmt: skip
    for i, metric in enumerate(PANELS):
        row, col = i // 2 + 1, i % 2 + 1
        for c in (c for c in changes if c["metric"] == metric and c.get("ratio")):
            value, low, high = c["ratio"], c.get("ci_low"), c.get("ci_high")
            err = None
            if low is not None and high is not None:
                err = {
                    "type": "data",
                    "symmetric": False,
                    "array": [high - value],
                    "arrayminus": [value - low],
                }
            color = VERDICT_COLORS.get(c["verdict"], "#7f7f7f")
            fig.add_trace(go.Scatter(x=[value], y=[c["variant"]], mode="markers", error_x=err, showlegend=False,
                                     marker={"color": color, "size": 11, "symbol": "square"},
                                     hovertemplate=f"{c['variant']} {metric}: B/A {_fmt(c)}, {c['verdict']}"
                                                   f" ({c['pairs']} pairs)<extra></extra>"),
                          row=row, col=col)  # fmt: skip
        fig.add_vline(x=1, line={"color": "black", "dash": "dash", "width": 1}, row=row, col=col)
        fig.update_xaxes(type="log", title_text="ratio B/A (log scale)", row=row, col=col)
        fig.update_yaxes(title_text="variant", autorange="reversed", row=row, col=col)
    variants = len({c["variant"] for c in changes})
    fig.update_layout(template="plotly_white", height=max(460, 220 + 70 * variants),
                      margin={"l": 80, "r": 20, "t": 50, "b": 50})  # fmt: skip
    return fig


def render(data: dict[str, Any]) -> str:
    changes = data["changes"]
    parts = [f"<h1>{e(data['b'])} against {e(data['a'])}</h1>",
             "<p class='meta'>Ratios B/A with 95% intervals, paired by sample where both runs answered the same "
             "samples; a verdict only where the whole interval lies on one side of 1.</p>"]  # fmt: skip
    if data.get("machine_differs"):
        keys = sorted(k for k in data["machine_a"] if data["machine_a"].get(k) != data["machine_b"].get(k))
        parts.append(f"<p class='notice bad'>WARNING: the runs were made on different machines ({e(', '.join(keys))} "
                     "differ): their ratios mix the machines with the change.</p>")  # fmt: skip
    parts += ["<section class='chart' id='compare-forest'><h2>Every metric, B against A</h2>",
              "<p class='caption'>Green: B significantly better; red: significantly worse; grey: no evidence "
              "either way (the interval holds 1), or no interval (quality is deterministic, a P99 of few pairs "
              "has none).</p>", figure(forest(changes), "compare"), "</section>"]  # fmt: skip
    rows = [[e(c["variant"]), e(c["metric"]), e(_fmt(c)), e(c["pairs"]), e(c["verdict"])] for c in changes]
    parts += [
        "<h2>Table</h2>",
        table(["variant", "metric", "B/A [95% CI]", "pairs", "verdict"], rows, numeric_from=2),
    ]
    return page(f"variantbench compare: {data['b']} vs {data['a']}", parts)
