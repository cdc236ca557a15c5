"""search.html: every trial of a variant search, the Pareto front highlighted, one panel per pair
of objectives; then the front's variants ready to paste, and every trial in a table."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots
import yaml

from variantbench.report.pages import e, figure, page, table, write_page

if TYPE_CHECKING:
    from variantbench.search.loop import Outcome, Trial

STYLES = {  # state -> (legend name, marker)
    "measured": ("measured", {"color": "#9aa5b1", "size": 9, "symbol": "circle"}),
    "front": ("Pareto front", {"color": "#d62728", "size": 13, "symbol": "diamond",
                               "line": {"color": "black", "width": 1}}),
    "pruned": ("stopped early (interim values)", {"color": "#f0a020", "size": 9, "symbol": "x"}),
    "reference": ("the standard", {"color": "#1f77b4", "size": 15, "symbol": "star"}),
}  # fmt: skip


def _kind(t: Trial) -> str:
    """The standard keeps its star on the front too (its hover and the table say whether it is on it)."""
    if t.state == "reference":
        return "reference"
    return "front" if t.front else t.state if t.state in STYLES else "measured"


def pareto_figure(outcome: Outcome) -> go.Figure | None:
    objectives = outcome.objectives
    pairs = list(combinations(range(len(objectives)), 2))[:6]
    points = [t for t in outcome.trials if t.state in ("measured", "pruned")]
    if outcome.reference is not None:
        points.append(outcome.reference)
    if not points or not pairs:
        return None
    cols = min(3, len(pairs))
    rows = (len(pairs) + cols - 1) // cols
    titles = [f"{objectives[j].name} vs {objectives[i].name}" for i, j in pairs]
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.1, vertical_spacing=0.18
    )
    shown: set[str] = set()
    for n, (i, j) in enumerate(pairs):
        row, col = n // cols + 1, n % cols + 1
        ox, oy = objectives[i], objectives[j]
        for kind, (legend, marker) in STYLES.items():
            group = [t for t in points if _kind(t) == kind and ox.name in t.values and oy.name in t.values]
            if not group:
                continue
            fig.add_trace(go.Scatter(
                x=[t.values[ox.name] / ox.scale for t in group], y=[t.values[oy.name] / oy.scale for t in group],
                mode="markers", name=legend, legendgroup=kind, showlegend=kind not in shown, marker=marker,
                text=[(f"#{t.number} " if t.number >= 0 else "") + t.variant + (" (on the front)" if t.front else "")
                      for t in group],
                hovertemplate="%{text}<br>" + f"{ox.label}: %{{x:.4g}}<br>{oy.label}: %{{y:.4g}}<extra></extra>",
            ), row=row, col=col)  # fmt: skip
            shown.add(kind)
        arrow = {"maximize": " (higher is better)", "minimize": " (lower is better)"}
        fig.update_xaxes(title_text=ox.label + arrow[ox.direction], row=row, col=col)
        fig.update_yaxes(title_text=oy.label + arrow[oy.direction], row=row, col=col)
    fig.update_layout(template="plotly_white", height=430 * rows, margin={"l": 70, "r": 20, "t": 60, "b": 60},
                      legend={"orientation": "h", "y": -0.12})  # fmt: skip
    return fig


def render(outcome: Outcome, front_plan: str) -> str:
    o = outcome.objectives
    measured = [t for t in outcome.trials if t.state == "measured"]
    counts = {
        s: sum(t.state == s for t in outcome.trials) for s in ("measured", "pruned", "failed", "repeat")
    }
    parts = [
        "<h1>Variant search</h1>",
        f"<p class='meta'>{len(outcome.trials)} trials: {counts['measured']} measured, {counts['pruned']} stopped "
        f"early, {counts['failed']} failed, {counts['repeat']} drawn again (values reused). Objectives: "
        + ", ".join(f"{e(x.name)} ({x.direction})" for x in o) + f". Folder: {e(outcome.out)}</p>",
    ]  # fmt: skip
    parts += [f"<p class='notice'>{e(n)}</p>" for n in outcome.notes]
    fig = pareto_figure(outcome)
    if fig is None:
        parts.append("<p class='missing'>No trial was measured yet: nothing to draw.</p>")
    else:
        parts.append("<section class='chart'><h2>Every trial, the front highlighted</h2>"
                     "<p class='caption'>Each panel is one pair of objectives; a red diamond is on the Pareto "
                     "front (no other trial is at least as good in every objective and better in one); an "
                     "orange cross stopped early, at its interim values.</p>" + figure(fig, "pareto") + "</section>")  # fmt: skip
    front = outcome.front
    parts.append("<h2>The front</h2>")
    if front:
        rows = [[e(t.variant), *(x.shown(t.values.get(x.name)) for x in o)] for t in front]
        parts.append(table(["variant", *(x.label for x in o)], rows))
        std = "fp32" if outcome.reference is None else outcome.reference.variant
        names = [std, *(t.variant for t in front if t.state != "reference")]
        line = yaml.safe_dump({"variants": names}, default_flow_style=True, width=10_000).strip()[1:-1]
        parts.append(f"<p>To paste into a plan: <code>{e(line)}</code></p>")
        parts.append("<details><summary>front.yaml: the search's plan with the standard and the front as its "
                     "variants, to compare them properly with <code>variantbench run front.yaml</code></summary>"
                     f"<pre>{e(front_plan)}</pre></details>")  # fmt: skip
    else:
        parts.append(
            f"<p class='missing'>No trial finished with every objective ({len(measured)} measured).</p>"
        )
    parts.append("<h2>Every trial</h2>")
    trials = sorted(outcome.trials, key=lambda t: t.number)
    if outcome.reference is not None:
        trials = [outcome.reference, *trials]
    rows = [[str(t.number) if t.number >= 0 else "ref", e(t.variant), e(t.state + (" (front)" if t.front else "")),
             *(x.shown(t.values.get(x.name)) for x in o), f"{t.seconds:.0f}", e(t.note)] for t in trials]  # fmt: skip
    parts.append(table(["#", "variant", "state", *(x.label for x in o), "s", "note"], rows, numeric_from=3))
    return page("variantbench search", parts)


def write_search_page(outcome: Outcome, path: Path, front_plan: str) -> None:
    write_page(render(outcome, front_plan), path)
