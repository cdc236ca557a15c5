"""The pipeline end to end on the tiny model: a run replays from its plan.yaml, builds come before startup."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import yaml

PLANS = Path(__file__).resolve().parents[1] / "plans"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "variantbench", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})  # fmt: skip


def _queries(folder: Path) -> list[dict]:
    return sorted(
        (json.loads(x) for x in (folder / "queries.jsonl").read_text().splitlines()), key=lambda q: q["index"]
    )


@pytest.mark.slow  # 18 s, two whole runs: run by .ci/run's slow pass (room for the engine kernels' tests)
def test_a_run_replays_from_its_plan_yaml_with_the_same_samples_and_schedule(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "run"
    first = _cli(
        "run", str(PLANS / "default.yaml"), "--set", "load.tasks=4", "--set", f"model.source={tiny_model_dir}",
        "--variants", "fp32", "--scenario", "server", "--rate", "25", "--min-queries", "12",
        "--max-new-tokens", "3", "--input-lengths", "uniform:64-200", "--seed", "5", "--schedule-seed", "9",
        "--no-fidelity", "--no-diagnose", "--no-cold-start", "--no-isolate", "--out", str(out),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["load"] == {"scenario": "server", "tasks": 4, "rate_qps": 25.0, "burstiness": 1.0,
                            "max_concurrency": None, "max_batch_size": 8, "find_peak": False, "senders": None}  # fmt: skip
    assert plan["seeds"] == {"workload": 5, "schedule": 9} and plan["model"]["source"] == str(tiny_model_dir)

    again = _cli("run", str(out / "plan.yaml"))
    assert again.returncode == 0, again.stderr[-2000:]
    replay = tmp_path / "run-replay-1"  # the original folder is left as it was
    assert f"replaying {out / 'plan.yaml'} into {replay}" in again.stderr.replace("\n", "")
    replayed = yaml.safe_load((replay / "plan.yaml").read_text())
    assert {**replayed, "out": None} == {**plan, "out": None}
    a, b = _queries(out), _queries(replay)
    assert len(a) == len(b) == 12
    assert [q["sample_id"] for q in a] == [q["sample_id"] for q in b]
    assert [q["reference"] for q in a] == [q["reference"] for q in b]

    def offsets(qs: list[dict]) -> list[int]:
        return [q["scheduled_ns"] - qs[0]["scheduled_ns"] for q in qs]

    assert offsets(a) == offsets(b)  # the same arrival schedule, to the nanosecond
    ra, rb = (json.loads((f / "report.json").read_text()) for f in (out, replay))
    assert ra["workload"] == rb["workload"] and ra["runs"][0]["seeds"] == rb["runs"][0]["seeds"]


@pytest.mark.slow  # 27 s (a build in the run): run by .ci/run's slow pass (the default suite's 10 minutes)
def test_a_variant_built_in_the_run_reports_build_s_apart_from_startup(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = {"VARIANTBENCH_CACHE": str(tmp_path / "cache")}
    common = ("--model", str(tiny_model_dir), "--variants", "fp32,drop-layers:1+int8", "--tasks", "2",
              "--max-new-tokens", "2", "--input-lengths", "fixed:64", "--no-fidelity", "--no-diagnose",
              "--no-cold-start", "--no-isolate")  # fmt: skip
    runs = []
    for name in ("fresh", "cached"):
        proc = _cli("run", *common, "--out", str(tmp_path / name), env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads((tmp_path / name / "report.json").read_text())
        runs.append({r["variant"]: r for r in report["runs"]})
    fresh, cached = runs[0]["drop-layers:1+int8"], runs[1]["drop-layers:1+int8"]
    assert fresh["backend"]["build"]["built_now"] is True and cached["backend"]["build"]["built_now"] is False
    assert (
        fresh["resources"]["build_s"] > 0 and cached["resources"]["build_s"] == fresh["resources"]["build_s"]
    )
    assert runs[0]["fp32"]["resources"]["build_s"] == 0
    # the build ran before the measured process loaded it: startup is the load of a built folder
    # (int8 applied at load), not the build; on this model both are a fraction of a second
    assert fresh["resources"]["startup_s"] < 3 * cached["resources"]["startup_s"] + 0.5
    assert fresh["backend"]["built"]["key"] == cached["backend"]["built"]["key"]


def test_jobs_pickle_whole_for_another_process_or_machine(tiny_model_dir: Path) -> None:
    """Jobs cross process boundaries (spawn today, Ray workers later): plain data, the variant parsed."""
    import pickle

    from variantbench.pipeline.jobs import BuildJob, ColdStartJob, MeasureJob
    from variantbench.pipeline.settings import criteria_for, load_settings
    from variantbench.plan_file import load_plan
    from variantbench.variants.spec import VariantSpec, plain_artifact
    from variantbench.workloads import build_synthetic

    plan = load_plan(PLANS / "server-sweep.yaml")
    spec = VariantSpec.parse("prune-heads:0.5+int8")
    library = build_synthetic(3, 0)
    jobs = [
        BuildJob(str(tiny_model_dir), spec, seed=3),
        MeasureJob(
            variant=spec.name,
            workload=library,
            log_path="q.jsonl",
            load=load_settings(plan, "r", 3),
            spec=spec,
            artifact=plain_artifact(str(tiny_model_dir)),
            base_dir=str(tiny_model_dir),
            criteria=criteria_for(plan),
            find_peak=True,
        ),  # fmt: skip
        ColdStartJob(spec, plain_artifact(str(tiny_model_dir)), str(tiny_model_dir)),
    ]
    for job in jobs:
        back = pickle.loads(pickle.dumps(job))
        assert back == job and back.id == job.id
    assert [j.id for j in jobs] == ["build:prune-heads:0.5+int8", "measure:prune-heads:0.5+int8#0",
                                    "cold-start:prune-heads:0.5+int8"]  # fmt: skip
    assert [r.kind for r in pickle.loads(pickle.dumps(spec)).recipes] == ["prune-heads", "int8"]


@pytest.mark.slow  # 14 s, a find-peak search: run by .ci/run's slow pass (room for the engine kernels' tests)
def test_a_find_peak_run_is_rebuilt_from_its_raw_data_and_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "peak"
    proc = _cli(
        "run", "--model", str(tiny_model_dir), "--variants", "fp32", "--scenario", "server", "--rate", "64",
        "--find-peak", "--latency-target-ms", "60", "--latency-percentile", "50", "--tasks", "6", "--min-queries", "12",
        "--max-new-tokens", "2", "--input-lengths", "fixed:64", "--no-fidelity", "--no-diagnose",
        "--no-cold-start", "--no-isolate", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    run = report["runs"][0]
    trials = run["peak"]["trials"]
    assert len(trials) >= 2 and all(t["run_id"].endswith(f"@{t['rate_qps']:.4g}qps") for t in trials)
    # the summary is of one trial's queries (the best passing one, else the last), not of all of them
    assert run["queries"]["issued"] == 12
    (out / "report.json").unlink()
    (out / "report.md").unlink()
    (out / "report.json").write_text(json.dumps(report))  # the header the rebuild starts from
    again = _cli("report", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    rebuilt = json.loads((out / "report.json").read_text())["runs"][0]
    for key in ("peak", "latency_ms", "queries", "throughput", "achieved_qps", "validity", "quality"):
        assert rebuilt[key] == run[key], key
