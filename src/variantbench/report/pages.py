"""The page every HTML output shares (report.html, compare.html, history.html): one self-contained
file, plotly's JavaScript embedded once, so it opens with no network; a laptop-width layout."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
import html
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1b1b1b;
       background: #fafafa; }
main { max-width: 1200px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 1.5em; margin: 0.4em 0 0.1em; } h2 { font-size: 1.2em; margin: 1.6em 0 0.3em; }
.meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; width: 100%; font-size: 0.88em; background: white; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.caption { color: #444; margin: 0 0 6px; font-size: 0.92em; }
.missing, .notice { background: #fff4e5; border-left: 4px solid #f0a020; padding: 6px 10px; }
.notice.bad { background: #fdecea; border-color: #d62728; }
section.chart { background: white; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 12px;
                margin: 14px 0; }
.deploy { font-weight: 600; } pre { background: white; border: 1px solid #ddd; padding: 8px;
overflow-x: auto; font-size: 0.82em; } details { margin: 4px 0; }
"""


@cache
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def e(value: Any) -> str:
    return html.escape("-" if value is None else str(value))


def table(header: list[str], rows: Iterable[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{c}</td>' if i >= numeric_from else f"<td>{c}</td>"
                        for i, c in enumerate(row))  # fmt: skip
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure(fig: go.Figure, key: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{key}",
                       config={"responsive": True, "displaylogo": False})  # fmt: skip


def page(title: str, parts: Iterable[str]) -> str:
    head = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{e(title)}</title><style>{STYLE}</style>"
            f"<script type='text/javascript'>{plotly_js()}</script></head><body><main>")  # fmt: skip
    return "\n".join([head, *parts, "</main></body></html>"])


def write_page(text: str, path: Path) -> None:
    """Atomically: a crash mid-write never leaves half a page."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
