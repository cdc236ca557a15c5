"""The command line as a user meets it: bad input exits 2 with one line; a real run writes both files."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

from variantbench.report.schema import SCHEMA_VERSION


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "variantbench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def _cli_here(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in this process (typer's runner): for checks of the plan that fail before any
    work, where a process of their own cost 2.5 s each; exit code and stderr as a subprocess gives."""
    from typer.testing import CliRunner

    from variantbench.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    stderr = result.stderr + ("Traceback: " + repr(result.exception) if crashed else "")
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, stderr)


def _assert_user_error(proc: subprocess.CompletedProcess[str], needle: str, status_lines: int = 0) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()][status_lines:]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0], lines[0]


def test_missing_model_path(tmp_path: Path) -> None:
    _assert_user_error(
        _cli("run", "--model", str(tmp_path / "nope"), "--out", str(tmp_path)), "does not exist"
    )


def test_unknown_variant(tmp_path: Path) -> None:
    proc = _cli("run", "--variants", "fp32,int3", "--out", str(tmp_path))
    _assert_user_error(proc, "unknown variant 'int3'")
    assert "int8" in proc.stderr


@pytest.mark.parametrize("tasks", ["0", "-3"])
def test_non_positive_task_count(tmp_path: Path, tasks: str) -> None:
    _assert_user_error(_cli_here("run", "--tasks", tasks, "--out", str(tmp_path)), "--tasks")


def test_unwritable_output_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = _cli("run", "--model", str(tiny_model_dir), "--out", str(blocker / "sub"))
    _assert_user_error(proc, "not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; the file-in-the-way case covers it")
def test_read_only_output_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _assert_user_error(_cli("run", "--model", str(tiny_model_dir), "--out", str(ro)), "not writable")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = _cli("run", "--model", str(tiny_model_dir), "--device", "cuda", "--out", str(tmp_path))
    _assert_user_error(proc, "no CUDA device")


def test_not_a_model_folder(tmp_path: Path) -> None:
    _assert_user_error(_cli("run", "--model", str(tmp_path), "--out", str(tmp_path / "o")), "config.json")


def test_run_on_tiny_model_writes_report_and_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = _cli(
        "run", "--model", str(tiny_model_dir), "--variants", "int8,fp32",
        "--tasks", "4", "--warmup", "1", "--max-new-tokens", "6", "--input-lengths", "uniform:64-256",
        "--mix", "qa=1,classification=1", "--out", str(out), "--no-until-decided",  # one pass: 4 queries
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "variantbench" in proc.stdout and "int8" in proc.stdout and "1.00x" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == SCHEMA_VERSION == "1.5"
    # the standard runs first whatever the order given: the others are compared with it
    assert [r["variant"] for r in report["runs"]] == ["fp32", "int8"]
    assert report["workload"]["tasks"] == {"qa": 2, "classification": 2}
    assert 64 <= report["workload"]["input_tokens"]["min"] <= report["workload"]["input_tokens"]["max"] <= 256
    for run in report["runs"]:
        assert run["status"] == "ok"
        for key in ("latency_ms", "ttft_ms", "tpot_ms", "throughput", "quality", "resources", "queries"):
            assert key in run
        assert set(run["latency_ms"]) >= {"p50", "p90", "p99", "mean"}
        assert run["latency_ms"]["p50"] > 0 and run["ttft_ms"]["p50"] > 0
        assert run["throughput"]["qps"] > 0 and run["throughput"]["output_tokens_per_s"] > 0
        assert set(run["quality"]) >= {"bleu", "rouge1", "rouge2", "rougeL", "exact_match", "f1", "accuracy",
                                       "composite", "perplexity", "kl_mean", "kl_p99", "top1_agreement"}  # fmt: skip
        assert run["quality"]["perplexity"] > 1 and run["quality"]["scored"] == 4
        assert set(run["per_task"]) == {"qa", "classification"}
        assert run["per_task"]["qa"]["queries"] == 2 and run["per_task"]["qa"]["latency_ms"]["p50"] > 0
        gate = run["quality_vs_standard"]
        assert gate["standard"] == "fp32" and gate["gate"] in (
            ("n/a",) if run["variant"] == "fp32" else ("PASS", "FAIL", "UNDECIDED")
        )
        if run["variant"] != "fp32":  # the gate is the state of a paired interval, and says which
            assert gate["state"] in ("meets", "fails", "undecided", "tied") and gate["comparisons"]
            assert run["likelihood"]["samples"] == 4 and run["likelihood"]["kl_mean"] is not None
        assert run["resources"]["startup_s"] > 0 and run["resources"]["peak_rss_bytes"] > 0
        assert run["queries"] == {"issued": 4, "completed": 4, "errors": 0}
    runs = {r["variant"]: r for r in report["runs"]}
    assert runs["fp32"]["quality"]["top1_agreement"] == 1.0 and runs["fp32"]["quality"]["kl_mean"] < 1e-3
    assert runs["int8"]["quality"]["kl_mean"] > runs["fp32"]["quality"]["kl_mean"]
    assert "quality" in proc.stdout and "per task" in proc.stdout
    sizes = {r["variant"]: r["resources"]["param_bytes"] for r in report["runs"]}
    assert sizes["int8"] < sizes["fp32"]
    lines = (out / "queries.jsonl").read_text().splitlines()
    assert len(lines) == 8
    assert {json.loads(line)["variant"] for line in lines} == {"fp32", "int8"}
    # resources, cost, A/B, diagnosis and the decision
    for run in report["runs"]:
        res = run["resources"]
        assert res["energy_source"] == "estimate" and res["energy_j"] > 0 and res["watts_per_core"] == 10.0
        assert (
            0 < res["mean_cpu_util"] <= 1.05
            and res["startup_cold_s"] > 0
            and "page cache" in res["startup_cold_note"]
        )
        assert run["cost"]["per_million_output_tokens"] > 0 and run["cost"]["tokens_per_joule"] > 0
        diag = run["diagnosis"]
        assert set(diag["op_share"]) == {"matmul", "attention", "quantize/dequantize", "norm", "other"}
        assert set(diag["batch_tokens_per_s"]) == {"1", "8", "32"} and diag["ceiling_gbps"] > 0
        assert (
            "cache" not in diag["cache_misses"]
            or "unavailable" in diag["cache_misses"]
            or "%" in diag["cache_misses"]
        )
    assert runs["fp32"]["ab_vs_standard"] is None
    for name in ("int8",):
        ab = runs[name]["ab_vs_standard"]
        assert ab["verdict"] in ("faster", "slower", "no significant difference")
        assert (
            ab["latency_p50_ratio"]["ci_low"]
            <= ab["latency_p50_ratio"]["value"]
            <= ab["latency_p50_ratio"]["ci_high"]
        )
    recs = report["recommendations"]
    assert set(recs) == {"edge", "cloud", "latency", "batch"}
    for rec in recs.values():
        assert set(rec["reasons"]) == {"fp32", "int8"} and rec["summary"]
    assert "edge" in proc.stdout and "deploy" in proc.stdout  # the decision ends the console output
    md = (out / "report.md").read_text()
    for section in ("## Summary", "## Comparison", "## A/B against the standard", "## Diagnosis",
                    "## Recommendation per scenario", "## Cost model", "## Environment"):  # fmt: skip
        assert section in md
    # the report is a pure function of the query log and the raw data: regenerate it and compare
    (out / "report.md").unlink()
    again = _cli("report", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    rebuilt = json.loads((out / "report.json").read_text())
    assert rebuilt["recommendations"] == report["recommendations"]
    for a, b in zip(report["runs"], rebuilt["runs"], strict=True):
        for key in (
            "latency_ms",
            "throughput",
            "quality",
            "cost",
            "ab_vs_standard",
            "resources",
            "diagnosis",
        ):
            assert a[key] == b[key], key
    assert (out / "report.md").read_text() == md


def test_repeats_give_an_interval_across_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = _cli(
        "run", "--model", str(tiny_model_dir), "--variants", "fp32,bf16", "--repeats", "3", "--tasks", "3",
        "--max-new-tokens", "4", "--input-lengths", "fixed:64", "--no-fidelity", "--no-diagnose",
        "--no-cold-start", "--no-isolate", "--profile", "latency", "--out", str(out), "--no-until-decided",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "chosen profile -> " in proc.stdout
    report = json.loads((out / "report.json").read_text())
    bf16 = report["runs"][1]
    assert bf16["resources"]["param_bytes"] * 2 == report["runs"][0]["resources"]["param_bytes"]
    assert len(bf16["repeats"]) == 3 and all(r["status"] == "ok" for r in bf16["repeats"])
    across = bf16["ab_vs_standard"]["across_repeats"]["latency_p50_ratio"]
    assert across["n"] == 3 and across["ci_low"] <= across["mean"] <= across["ci_high"]
    assert len((out / "queries.jsonl").read_text().splitlines()) == 18
    assert len(list((out / "raw").glob("*.json"))) == 6


def test_report_command_needs_a_run_folder(tmp_path: Path) -> None:
    _assert_user_error(_cli("report", str(tmp_path)), "not a complete run folder")


def test_variants_command_lists_kinds(tmp_path: Path) -> None:
    proc = _cli("variants", env={"VARIANTBENCH_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-1000:]
    for kind in ("fp32", "bf16", "fp16", "int8", "prune-heads", "drop-layers", "distill", "onnx-int4",
                 "compile", "gguf-q8_0"):  # fmt: skip
        assert kind in proc.stdout
    assert "built: none yet" in proc.stdout


def test_clean_removes_interrupted_and_outdated_builds_only(tmp_path: Path) -> None:
    from variantbench.variants.build import _versions

    variants = tmp_path / "variants"
    partial, old, current = variants / "abc.partial-123", variants / "old", variants / "current"
    for folder in (partial, old, current, tmp_path / "fidelity" / "ref"):
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(b"x" * 1000)
    (old / "manifest.json").write_text(json.dumps({"versions": {"torch": "1.0"}}))
    (current / "manifest.json").write_text(json.dumps({"versions": _versions()}))
    env = {"VARIANTBENCH_CACHE": str(tmp_path)}
    dry = _cli("clean", "--dry-run", env=env)
    assert dry.returncode == 0 and "2 entries" in dry.stdout and partial.exists() and old.exists()
    assert _cli("clean", env=env).returncode == 0
    assert not partial.exists() and not old.exists() and current.exists()
    assert _cli("clean", "--all", env=env).returncode == 0
    assert not current.exists() and not (tmp_path / "fidelity" / "ref").exists()


def test_garbage_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = _cli(
        "run",
        "--model",
        str(bad),
        "--out",
        str(tmp_path / "o"),
        env={"VARIANTBENCH_CACHE": str(tmp_path / "c")},
    )
    assert proc.stderr.startswith("converting broken.gguf")  # what it was doing when it failed
    _assert_user_error(proc, "cannot load GGUF", status_lines=1)
    assert not any((tmp_path / "c" / "models").glob("broken-*"))  # no half-written cache entry


def test_model_file_that_is_not_gguf(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00")
    _assert_user_error(_cli("run", "--model", str(other), "--out", str(tmp_path / "o")), ".gguf")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scenario", "server"], "load.rate_qps: required by the server scenario (set it with --rate"),
        (["--rate", "2"], "--rate (load.rate_qps): not a setting of the single-stream scenario"),
        (["--scenario", "server", "--rate", "0"], "--rate"),
        (["--scenario", "server", "--rate", "-2"], "--rate"),
        (["--latency-percentile", "100"], "--latency-percentile"),
        (["--latency-percentile", "0"], "--latency-percentile"),
        (["--scenario", "bursty"], "unknown scenario"),
        (["--mix", "qa=1,poetry=2"], "unknown task 'poetry'"),
        (["--mix", "qa"], "task=weight"),
        (["--input-lengths", "lognormal:3"], "cannot read input lengths"),
        (["--input-lengths", "uniform:900-100"], "low <= high"),
        (["--quality-threshold", "120"], "--quality-threshold"),
        (["--accuracy-log", "0"], "--accuracy-log"),
        (["--executor", "spark"], "--executor (execution.executor)"),
        (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
    ],
)
def test_bad_load_settings(tmp_path: Path, args: list[str], needle: str) -> None:
    _assert_user_error(_cli_here("run", *args, "--out", str(tmp_path)), needle)


def test_a_bad_setting_is_one_line_from_a_process_of_its_own(tmp_path: Path) -> None:
    """The in-process checks above, once as a user meets them: a process, its exit code, its stderr."""
    _assert_user_error(
        _cli("run", "--rate", "2", "--out", str(tmp_path)), "not a setting of the single-stream"
    )


def test_server_scenario_report_fields(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = _cli(
        "run", "--model", str(tiny_model_dir), "--variants", "fp32", "--scenario", "server", "--rate", "20",
        "--tasks", "6", "--min-queries", "30", "--max-new-tokens", "4", "--latency-target-ms", "2000",
        "--window", "10", "--no-isolate", "--input-lengths", "fixed:64", "--no-fidelity", "--no-diagnose",
        "--no-cold-start", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " - server, standard = fp32" in proc.stdout  # the scenario measured, in the title
    assert "scenario server." in (out / "report.md").read_text()
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["scenario"] == "server" and run["target_qps"] == 20
    assert run["achieved_qps"] == pytest.approx(20, rel=0.1)
    assert set(run["seeds"]) >= {"schedule", "sample", "workload"}
    assert run["validity"]["verdict"] in ("VALID", "INVALID") and "reasons" in run["validity"]
    assert run["validity"]["checks"]["latency"]["target_ms"] == 2000
    assert set(run["dispatch_lag_ms"]) == {"p50", "p99", "max"} and run["late_share"] is not None
    assert len(run["windows"]) == 3 and run["windows"][0]["queries"] == 10
    assert set(run["outliers"]) >= {"removed", "trimmed_mean_latency_ms"}
    for key in ("latency_from_scheduled_ms", "latency_from_issue_ms"):
        assert run[key]["p99"] >= run[key]["p50"] > 0
    assert run["queries"]["issued"] == 30
    summary = (out / "mlperf_log_summary.fp32.txt").read_text()
    assert "Scenario : server" in summary and "Result is :" in summary


def test_accuracy_only_scores_every_sample_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = _cli(
        "run", "--model", str(tiny_model_dir), "--variants", "fp32", "--accuracy-only", "--tasks", "7",
        "--max-new-tokens", "3", "--input-lengths", "fixed:64", "--no-fidelity", "--no-isolate", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quality" in proc.stdout and "p50 ms" not in proc.stdout  # no speed table for an untimed pass
    lines = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    assert sorted(x["sample_id"] for x in lines) == sorted(f"synthetic-0-{i}" for i in range(7))
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["quality"]["scored"] == 7 and run["queries"]["issued"] == 7


def test_bad_workload_file_stops_before_measuring(tmp_path: Path) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    out = tmp_path / "out"
    proc = _cli("run", "--workload", str(bad), "--out", str(out))
    _assert_user_error(proc, "line 2: 'prompt' must be a non-empty string")
    assert not (out / "queries.jsonl").exists()
