"""history.html: one trend chart per headline metric, from the history's rows.

A line per model and variant over time, each point with its 95% interval; the marker's shape is
the machine it ran on, so a step that coincides with a new machine is read as the machine, not
the code (the hover gives the code version and the run folder).
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from variantbench.report.charts import PALETTE
from variantbench.report.pages import e, figure, page

# metric (as the history stores it) -> axis title with its unit
AXES = {
    "latency_p50_ms": "P50 latency, ms",
    "latency_p99_ms": "P99 latency, ms",
    "ttft_p50_ms": "P50 time to first token, ms",
    "tokens_per_s_per_query": "output tokens/s per query",
    "output_tokens_per_s": "output tokens/s",
    "batch8_decode_tokens_per_s": "batch-8 decode tokens/s",
    "quality_composite": "composite quality, 0-1",
    "quality_vs_standard": "quality / the standard's",
    "kl_mean_nats": "KL against the standard, nats",
    "peak_rss_bytes": "peak RSS, bytes",
    "startup_cold_s": "cold start, s",
    "energy_j": "energy, J",
    "cost_per_million_output_tokens": "cost per 1M output tokens",
    "p99_ms": "probe P99 latency, ms",
    "ttft_p99_ms": "probe P99 time to first token, ms",
    "quality": "probe quality against the references, 0-1",
}
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon")


def trend(rows: list[dict[str, Any]], metric: str) -> go.Figure | None:
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        m = (r.get("metrics") or {}).get(metric) or {}
        if m.get("value") is not None:
            series.setdefault(f"{r.get('model_name') or '?'} · {r['variant']}", []).append({**r, "m": m})
    if not series:
        return None
    machines = list(dict.fromkeys(r["machine_fingerprint"] for points in series.values() for r in points))
    fig = go.Figure()
    for i, (name, points) in enumerate(series.items()):
        ys = [p["m"]["value"] for p in points]
        hi = [
            (p["m"].get("ci_high") if p["m"].get("ci_high") is not None else y) - y
            for p, y in zip(points, ys, strict=True)
        ]
        lo = [
            y - (p["m"].get("ci_low") if p["m"].get("ci_low") is not None else y)
            for p, y in zip(points, ys, strict=True)
        ]
        fig.add_trace(go.Scatter(
            x=[p["created_utc"] for p in points], y=ys, mode="lines+markers", name=name,
            line={"color": PALETTE[i % len(PALETTE)]},
            marker={"size": 9, "symbol": [SYMBOLS[machines.index(p["machine_fingerprint"]) % len(SYMBOLS)] for p in points]},
            error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
            text=[f"id {p['id']} · machine {p['machine_fingerprint']} · code {p['code_version']}<br>{p['folder']}"
                  for p in points],
            hovertemplate="%{y:.4g} at %{x}<br>%{text}<extra>" + name + "</extra>"))  # fmt: skip
    fig.update_xaxes(title_text="time of the run (UTC)")
    fig.update_yaxes(title_text=AXES.get(metric, metric))
    fig.update_layout(template="plotly_white", height=380, margin={"l": 70, "r": 20, "t": 30, "b": 50},
                      legend={"orientation": "h", "y": -0.25})  # fmt: skip
    return fig


def render(rows: list[dict[str, Any]], where: str, metrics: list[str] | None = None) -> str:
    names = metrics or list(dict.fromkeys(k for r in rows for k in (r.get("metrics") or {})))
    machines = list(dict.fromkeys(r["machine_fingerprint"] for r in rows))
    parts = [f"<h1>Results history: {e(where)}</h1>",
             f"<p class='meta'>{len(rows)} variant runs · {len(machines)} machine(s): "
             + e(", ".join(f"{m} ({SYMBOLS[i % len(SYMBOLS)]})" for i, m in enumerate(machines))) + "</p>"]  # fmt: skip
    for metric in names:
        fig = trend(rows, metric)
        if fig is None:
            continue
        parts += [f"<section class='chart' id='trend-{e(metric)}'><h2>{e(AXES.get(metric, metric))}</h2>",
                  "<p class='caption'>One line per model and variant, each run with its 95% interval where it has "
                  "one; a step outside the neighbouring intervals is a change, and the marker's shape says "
                  "whether the machine changed with it.</p>", figure(fig, f"trend-{metric}"), "</section>"]  # fmt: skip
    return page(f"variantbench history: {where}", parts)
