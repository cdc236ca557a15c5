"""A run killed with SIGKILL (its whole process group, as Ctrl-\\ or the OOM killer would) keeps what it
measured: ``report`` rebuilds every variant with a query and names what is missing, and ``run
--resume`` finishes it with the report an uninterrupted run writes (timings aside).

The kill comes from a named fault point (``variantbench/faults.py``): halfway to the first look (only
the queries are on disk), inside the logit fidelity and inside the diagnosis (both in the variant's
own process). Seven whole runs of a tiny model: slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest

from variantbench.report.results import migrate, read_result

pytestmark = pytest.mark.slow

ARGS = ["--variants", "fp32,int8", "--tasks", "4", "--warmup", "1", "--max-new-tokens", "6",
        "--input-lengths", "uniform:64-128", "--no-until-decided", "--no-cold-start", "--no-record-history"]  # fmt: skip


def _cli(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("VARIANTBENCH_KILL_AT", None)
    if kill_at:
        env["VARIANTBENCH_KILL_AT"] = kill_at
    # a session of its own: the fault point kills this process group, not pytest's
    return subprocess.run([sys.executable, "-m", "variantbench", *args], capture_output=True, text=True,
                          timeout=600, env=env, start_new_session=True)  # fmt: skip


def _queries(folder: Path) -> list[tuple[Any, ...]]:
    """What was asked and answered, in the order each variant asked it (timings and run id aside)."""
    rows = [json.loads(line) for line in (folder / "queries.jsonl").read_text().splitlines() if line.strip()]
    return sorted(
        (r["variant"], r["block"], r["index"], r["sample_id"], r["status"], r["output"]) for r in rows
    )


def _verdicts(report: dict[str, Any]) -> dict[str, Any]:
    """A report's content that does not depend on timings."""
    runs = {}
    for r in report["runs"]:
        lk = r["likelihood"] or {}
        runs[r["variant"]] = {
            "status": r["status"], "incomplete": r["incomplete"], "queries": r["queries"],
            "quality": {k: r["quality"][k] for k in ("scored", "composite", "rougeL", "accuracy", "perplexity",
                                                      "kl_mean", "top1_agreement")},
            "likelihood": [(s["sample_id"], round(s["ref_logprob"], 4)) for s in lk.get("per_sample", [])
                           if s.get("ref_logprob") is not None],
            "gate": (r["quality_vs_standard"] or {}).get("gate"),
            "batch_values": len((r["batch_throughput"] or {}).get("values", [])),
            "diagnosed": bool(r["diagnosis"] and r["diagnosis"]["op_share"]),
        }  # fmt: skip
    execution = {k: report["execution"].get(k) for k in ("interleaved", "executor")}
    rounds = [(x["rounds"], len(x["looks"]), x["stopped"]) for x in report["execution"].get("repeats", [])]
    return {"runs": runs, "execution": execution, "rounds": rounds}


@pytest.fixture(scope="module")
def whole_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "out"
    proc = _cli("run", "--model", str(tiny_model_dir), *ARGS, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(
    ("kill_at", "measured", "missing"),
    [
        ("first-look", 2, "scenario, batch, fidelity, likelihood, diagnosis"),
        ("fidelity", 4, "fidelity, likelihood, diagnosis"),
        ("diagnosis", 4, "diagnosis"),
    ],
)
def test_a_killed_run_is_rebuilt_then_resumed_to_the_whole_runs_report(
    kill_at: str, measured: int, missing: str, whole_run: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    killed = _cli("run", "--model", str(tiny_model_dir), *ARGS, "--out", str(out), kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "report.html").exists()

    rebuilt = _cli("report", str(out))
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert set(runs) == {"fp32", "int8"}  # both measured, both in the report
    # the first variant to reach the fault point kills the run: it lacks that phase and what follows;
    # the other either the same or (killed while waiting its turn) also the phases before
    first = runs["fp32"]
    assert first["queries"]["issued"] == measured and first["latency_ms"]["p50"] > 0
    assert first["incomplete"]["why"] == "the run stopped while it was measured (killed)"
    assert ", ".join(first["incomplete"]["missing"]) == missing
    assert runs["int8"]["incomplete"] and runs["int8"]["queries"]["issued"] >= 2
    said = rebuilt.stderr
    assert "the run did not finish" in said and f"fp32: {measured} queries measured" in said
    assert f"missing: {missing}" in said
    assert "The run did not finish" in (out / "report.md").read_text()
    assert "fp32: " in (out / "report.html").read_text()

    resumed = _cli("run", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    assert _queries(out) == _queries(whole_run)  # the same samples, in the same blocks, answered alike
    got, want = (json.loads((f / "report.json").read_text()) for f in (out, whole_run))
    assert _verdicts(got) == _verdicts(want)
    assert all(read_result(f).status == "ok" for f in (out / "raw").glob("*.json"))


def test_resume_refuses_a_folder_it_cannot_continue(tmp_path: Path) -> None:
    proc = _cli("run", "--resume", str(tmp_path))
    assert proc.returncode == 2 and "not a run folder to resume: plan.yaml is missing" in proc.stderr
    proc = _cli("run", "--resume", str(tmp_path), "--tasks", "3")
    assert proc.returncode == 2 and "--resume continues the run as its plan.yaml says" in proc.stderr


def test_a_run_folder_from_the_previous_version_rebuilds(whole_run: Path, tmp_path: Path) -> None:
    """raw/*.json as bd8b7ab wrote them (untyped dicts) read through ``migrate``: the same report."""
    old = tmp_path / "old"
    shutil.copytree(whole_run, old)
    for path in (old / "raw").glob("*.json"):
        new = json.loads(path.read_text())
        path.write_text(json.dumps(to_version_1(new)))
    proc = _cli("report", str(old))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, want = (json.loads((f / "report.json").read_text()) for f in (old, whole_run))
    assert _verdicts(got) == _verdicts(want)
    assert migrate(to_version_1(json.loads((whole_run / "raw" / "int8.0.json").read_text()))).status == "ok"


def to_version_1(new: dict[str, Any]) -> dict[str, Any]:
    """A version-2 result written back in version 1's shape (the job's dict of bd8b7ab)."""
    old = {k: v for k, v in new.items() if k not in ("version", "status", "done", "expected", "interim",
                                                     "target_qps", "likelihood", "retried", "node", "error")}  # fmt: skip
    old["load_settings"] = {"rate_qps": new["target_qps"]}
    lk = new.get("likelihood")
    if lk:
        per = lk.pop("per_sample")
        unavailable = lk.pop("unavailable")
        old["likelihood"] = {"samples": per, "summary": lk, "unavailable": unavailable}
    old["resources"] = {**new["resources"], "startup_warm_s": new["resources"]["startup_s"]}
    return old
