"""report.csv and queries.csv against report.json; the results history: rows, concurrency, a writer
killed mid-transaction, schema versions."""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
from pathlib import Path
import signal
import sqlite3
import subprocess
import sys

import pytest

from variantbench.errors import UserError
from variantbench.history import SCHEMA_VERSION, History
from variantbench.report.schema import Report, RunReport


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "variantbench", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("history")
    out, db = base / "out", base / "history.db"
    # in this process: a CLI run of its own cost 27 s, mostly importing torch and transformers again
    from variantbench.pipeline.run import execute
    from variantbench.plan import Plan

    execute(Plan.model_validate({
        "out": str(out), "model": {"source": str(tiny_model_dir)}, "variants": ["fp32", "bf16"],
        "workload": {"input_lengths": "uniform:64-200", "max_new_tokens": 8},
        "load": {"scenario": "single-stream", "tasks": 4}, "quality": {"fidelity": False},
        "analysis": {"diagnose": False, "cold_start": False, "until_decided": False},
        "execution": {"executor": "inline"}, "output": {"csv": True, "history": str(db)},
    }))  # fmt: skip
    return out, db


def _num(cell: str) -> float | None:
    return float(cell) if cell != "" else None


def test_report_csv_and_queries_csv_match_report_json(tiny_run: tuple[Path, Path]) -> None:
    out, _ = tiny_run
    report = json.loads((out / "report.json").read_text())
    with open(out / "report.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["variant"] for r in rows] == [r["variant"] for r in report["runs"]] == ["fp32", "bf16"]
    for row, run in zip(rows, report["runs"], strict=True):
        assert _num(row["latency_p50_ms"]) == pytest.approx(run["latency_ms"]["p50"])
        assert _num(row["latency_p99_ms"]) == pytest.approx(run["latency_ms"]["p99"])
        assert _num(row["output_tokens_per_s"]) == pytest.approx(run["throughput"]["output_tokens_per_s"])
        assert _num(row["quality_composite"]) == pytest.approx(run["quality"]["composite"])
        assert _num(row["peak_rss_bytes"]) == run["resources"]["peak_rss_bytes"]
        assert row["interleaved"] == "True" and row["status"] == "ok"
    assert rows[1]["ab_verdict"] == report["runs"][1]["ab_vs_standard"]["verdict"]
    log = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    with open(out / "queries.csv", newline="") as fh:
        queries = list(csv.DictReader(fh))
    assert len(queries) == len(log) == 8
    assert [(q["variant"], q["sample_id"]) for q in queries] == [(q["variant"], q["sample_id"]) for q in log]
    assert [_num(q["latency_ms"]) for q in queries] == pytest.approx([q["latency_ms"] for q in log])
    assert json.loads(queries[0]["token_ms"]) == pytest.approx(log[0]["token_ms"])


def test_the_run_is_in_the_history_with_its_identity_and_intervals(tiny_run: tuple[Path, Path]) -> None:
    out, db = tiny_run
    with History(db) as h:
        rows = h.rows()
    assert [r["variant"] for r in rows] == ["fp32", "bf16"]
    for r in rows:
        assert r["folder"] == str(out.resolve()) and r["status"] == "ok"
        assert (
            len(r["plan_hash"]) == 16 and len(r["model_hash"]) == 16 and len(r["machine_fingerprint"]) == 16
        )
        assert r["machine"]["cpu_logical_cores"] == os.cpu_count()
        tput = r["metrics"]["tokens_per_s_per_query"]
        assert tput["ci_low"] <= tput["value"] <= tput["ci_high"]
        p50 = r["metrics"]["latency_p50_ms"]
        assert p50["ci_low"] <= p50["value"] <= p50["ci_high"]
    listed = _cli("history", "--history", str(db), "--variant", "bf16")
    assert listed.returncode == 0 and "bf16" in listed.stdout and "fp32 " not in listed.stdout
    # the same run recorded again (a rebuilt report) replaces its rows: no duplicates
    report = Report.read(out / "report.json")
    with History(db) as h:
        h.record(report, out, [], model_hash=rows[0]["model_hash"])
        assert len(h.rows()) == 2


def test_history_plot_draws_a_trend_per_metric(tiny_run: tuple[Path, Path], tmp_path: Path, browser) -> None:  # noqa: ANN001
    _, db = tiny_run
    page = tmp_path / "trends.html"
    proc = _cli("history", "--history", str(db), "--plot", "--plot-out", str(page))
    assert proc.returncode == 0, proc.stderr
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.goto(page.as_uri())
    charts = tab.evaluate("""() => Array.from(document.querySelectorAll('section.chart')).map(s => [s.id,
        s.querySelector('.js-plotly-plot').data.map(t => t.y.length).reduce((a, b) => a + b, 0)])""")
    tab.close()
    assert errors == []
    by_id = dict(charts)
    # every metric with a value has its chart, one point per variant run (two variants, one run)
    for metric in (
        "latency_p50_ms",
        "latency_p99_ms",
        "output_tokens_per_s",
        "quality_composite",
        "peak_rss_bytes",
    ):
        assert by_id.get(f"trend-{metric}") == 2, charts


def test_compare_takes_history_ids_and_writes_its_page(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    out, db = tiny_run
    with History(db) as h:
        ids = {r["variant"]: r["id"] for r in h.rows()}
    page = tmp_path / "cmp.html"
    # one run's bf16 against its fp32, named by history ids: the ids choose the variants
    proc = _cli("compare", str(ids["fp32"]), str(ids["bf16"]), "--history", str(db), "--html", str(page),
                "--json", str(tmp_path / "cmp.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert {c["variant"] for c in data["changes"]} == {"bf16 vs fp32"}
    assert page.is_file() and "fig-compare" in page.read_text()
    missing = _cli("compare", "999", str(out), "--history", str(db))
    assert (
        missing.returncode != 0 and "999 is neither a run folder nor an id in the history" in missing.stderr
    )


def _report(tag: str) -> Report:
    return Report(tool_version="t", created_utc=tag, model={"name": "m"}, standard="a", plan={"out": tag},
                  workload={}, environment={"cpu_model": "x"},
                  runs=[RunReport(variant="a", status="failed", error="e"), RunReport(variant="b", status="failed")])  # fmt: skip


def _writer(db: str, worker: int, n: int) -> None:
    with History(db) as h:
        for i in range(n):
            h.record(_report(f"w{worker}-{i}"), Path(f"/runs/{worker}"), [], model_hash=None)


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    db = str(tmp_path / "h.db")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db, w, 10)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    with History(db) as h:
        rows = h.rows()
    assert len(rows) == 4 * 10 * 2 and len({r["run_key"] for r in rows}) == 80


def _killed_mid_write(db: str) -> None:
    h = History(db)
    h.db.execute("BEGIN IMMEDIATE")
    h.db.execute("INSERT INTO runs (run_key, created_utc, folder, plan_hash, variant, status, machine_fingerprint, "
                 "machine, code_version, metrics) VALUES ('half', 't', 'f', 'p', 'v', 'ok', 'm', '{}', 'c', '{}')")  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_mid_transaction_leaves_nothing_half_written(tmp_path: Path) -> None:
    db = str(tmp_path / "h.db")
    _writer(db, 0, 1)
    p = mp.get_context("spawn").Process(target=_killed_mid_write, args=(db,))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == -signal.SIGKILL
    with History(db) as h:
        assert [r["run_key"] for r in h.rows()] == [
            f"{Path('/runs/0').resolve()}|w0-0|a",
            f"{Path('/runs/0').resolve()}|w0-0|b",
        ]
        h.record(_report("after"), Path("/runs/9"), [], model_hash=None)  # and the file takes writes again
        assert len(h.rows()) == 4


def test_schema_versions_newer_refused_older_migrated(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    with History(newer):
        pass
    con = sqlite3.connect(newer)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(UserError, match="schema version 99, newer than this variantbench reads"):
        History(newer)
    listed = _cli("history", "--history", str(newer))
    assert (
        listed.returncode != 0 and "schema version 99" in listed.stderr and "Traceback" not in listed.stderr
    )
    older = tmp_path / "older.db"  # version 0: a file with no tables of ours yet
    sqlite3.connect(older).close()
    with History(older) as h:
        assert h.db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert h.rows() == []
