"""report.html from a real tiny-model run, opened in a real headless chromium: no JavaScript errors,
every chart drawn with data, a screenshot; a partial run's page says what is missing."""

from __future__ import annotations

import json
from pathlib import Path
import shutil
import subprocess
import sys

import pytest

CHARTS = ("latency-cdf", "over-time", "quality-speed", "forest", "batch", "resources", "energy", "diagnosis")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from variantbench.pipeline.run import execute
    from variantbench.plan import Plan

    out = tmp_path_factory.mktemp("html") / "run"
    execute(Plan.model_validate({
        "out": str(out), "model": {"source": str(tiny_model_dir)}, "variants": ["fp32", "bf16", "int8"],
        "workload": {"input_lengths": "uniform:64-256", "max_new_tokens": 12},
        "load": {"scenario": "single-stream", "tasks": 6},
        "analysis": {"diagnose": True, "cold_start": False, "batch_rounds": 2, "until_decided": False},
        "execution": {"executor": "inline"}, "output": {"record_history": False},
    }))  # fmt: skip
    return out


def _external_scripts(text: str) -> list[str]:
    from html.parser import HTMLParser

    found: list[str] = []

    class Scripts(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list) -> None:
            if tag in ("script", "link") and any(k in ("src", "href") for k, _ in attrs):
                found.append(str(attrs))

    Scripts().feed(text)
    return found


def _open(browser, path: Path, screenshot: Path | None = None) -> tuple[list[str], dict]:  # noqa: ANN001
    page = browser.new_page(viewport={"width": 1366, "height": 800})
    errors: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
    page.goto(path.as_uri())
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
    found = page.evaluate(r"""() => Object.fromEntries(Array.from(document.querySelectorAll('section.chart')).map(s => {
        const plot = s.querySelector('.js-plotly-plot');
        return [s.id, {
          traces: plot ? plot.querySelectorAll('g.trace, g.barlayer .point').length : 0,
          points: plot ? plot.querySelectorAll('path.point, g.point, path.js-line').length : 0,
          height: plot ? plot.getBoundingClientRect().height : 0,
          data: plot ? plot.data.filter(t => (t.x || []).length > 0).length : 0,
          xtitle: plot ? Object.keys(plot.layout).filter(k => /^xaxis\d*$/.test(k))
                           .map(k => (plot.layout[k].title || {}).text || '').join('') : '',
          ytitle: plot ? Object.keys(plot.layout).filter(k => /^yaxis\d*$/.test(k))
                           .map(k => (plot.layout[k].title || {}).text || '').join('') : '',
          missing: (s.querySelector('.missing') || {}).textContent || null,
        }];
      }))""")  # fmt: skip
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return errors + [f"network: {u}" for u in requests], found


def test_the_report_opens_in_a_browser_with_every_chart_drawn(run_dir: Path, browser, tmp_path: Path) -> None:  # noqa: ANN001
    page = run_dir / "report.html"
    text = page.read_text(encoding="utf-8")
    assert _external_scripts(text) == []  # self-contained: plotly.js embedded (and no request, below)
    shot = tmp_path / "report.png"
    errors, charts = _open(browser, page, shot)
    assert errors == []
    assert set(CHARTS) <= set(charts), charts
    for key in CHARTS:
        chart = charts[key]
        assert chart["missing"] is None, (key, chart)
        assert chart["data"] > 0 and chart["points"] + chart["traces"] > 0 and chart["height"] > 200, (
            key,
            chart,
        )
        assert chart["xtitle"] and chart["ytitle"], (key, chart)  # axes titled with their units
    assert shot.stat().st_size > 100_000  # a full page of charts, not a blank one
    # the decision comes first, with its reasons, and the environment and the plan are there
    assert text.index("Recommendation") < text.index('id="latency-cdf"')
    report = json.loads((run_dir / "report.json").read_text())
    for profile, rec in report["recommendations"].items():
        assert f"<b>{profile}</b>" in text
        if rec.get("variant"):
            assert f"<span class='deploy'>{rec['variant']}</span>" in text
    assert "Environment" in text and "input_lengths" in text


def test_a_partial_run_still_renders_and_says_what_is_missing(run_dir: Path, browser, tmp_path: Path) -> None:  # noqa: ANN001
    """A crashed variant and one whose result file is gone (only its queries in the log)."""
    partial = tmp_path / "partial"
    shutil.copytree(run_dir, partial)
    (partial / "raw" / "int8.0.json").unlink()  # the run was killed before int8's results landed
    (partial / "raw" / "bf16.0.json").write_text(json.dumps(
        {"variant": "bf16", "repeat": 0, "status": "failed", "error": "worker died: killed by signal 9"}))  # fmt: skip
    (partial / "report.html").unlink()
    proc = subprocess.run([sys.executable, "-m", "variantbench", "report", str(partial)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = (partial / "report.html").read_text(encoding="utf-8")
    assert "bf16: failed: worker died: killed by signal 9" in text
    # int8's queries are in the log: rebuilt from them, its missing phases named
    assert "int8: 6 queries measured; no result file: rebuilt from its queries in the log; missing: " in text
    errors, charts = _open(browser, partial / "report.html")
    assert errors == []
    assert charts["latency-cdf"]["data"] > 0  # fp32's measurements are still drawn
    assert charts["forest"]["data"] > 0  # int8, rebuilt from its queries, is still compared with fp32
