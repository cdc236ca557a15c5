"""The typed result (report/results.py): versioned, written atomically, earlier versions migrated,
and the plan reference page that is generated from the plan's fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from variantbench.plan_reference import leaf_paths, render
from variantbench.records import QueryRecord
from variantbench.report.results import RESULT_VERSION, VariantResult, counted, migrate, read_result

VERSION_1 = {  # a raw/*.json as bd8b7ab wrote it (the job's dict), trimmed
    "variant": "int8", "is_standard": False, "repeat": 0, "run_id": "R", "scenario": "single-stream",
    "diagnosis": {"summary": "int8 is memory-bound", "op_share": {"matmul": 0.7}, "ceiling_gbps": None,
                  "not_a_field": 1},
    "resource_samples": [[1, 2, 0.1]], "server_metrics": None, "name": "torch-int8",
    "phases_s": {"load": 1.0, "scenario": 2.0}, "peak_search": [], "batch_decode":
    {"size": 8, "new_tokens": 16, "tokens_per_s": [10.0, 11.0]}, "load_settings": {"rate_qps": None},
    "seeds": {"schedule": 0}, "senders": [], "fidelity": {"perplexity": 9.5, "kl_mean": 0.01, "kl_p99": 0.1,
                                                          "top1_agreement": 0.9, "text": "t", "tokens_scored": 5},
    "load": {"startup_s": 1.0, "param_bytes": 100, "details": {"device": "cpu"}},
    "build": {"built_now": True, "build_wall_s": 3.0},
    "resources": {"startup_s": 1.0, "param_bytes": 100, "peak_rss_bytes": 5, "startup_warm_s": 1.0,
                  "startup_cold_s": 2.5, "gpu": None},
    "likelihood": {"samples": [{"sample_id": "s0", "ref_logprob": -3.0, "ref_tokens": 3}],
                   "summary": {"samples": 1, "ref_logprob_per_token": -1.0, "ref_perplexity": 2.7,
                               "choice_accuracy": None, "choice_accuracy_norm": None, "choice_samples": 0,
                               "kl_mean": 0.02, "top1_agreement": 1.0}, "unavailable": None},
    "lm_eval": None, "wall_s": 12.0,
}  # fmt: skip


def test_a_version_1_result_reads_as_this_versions_model() -> None:
    r = migrate(json.loads(json.dumps(VERSION_1)))
    assert r.version == RESULT_VERSION and r.status == "ok" and r.run_id == "R" and r.name == "torch-int8"
    assert (
        r.likelihood is not None
        and r.likelihood.kl_mean == 0.02
        and r.likelihood.per_sample[0].sample_id == "s0"
    )
    assert r.diagnosis is not None and r.diagnosis.op_share == {"matmul": 0.7}
    assert r.fidelity is not None and r.fidelity.perplexity == 9.5
    assert r.batch_decode is not None and r.batch_decode.tokens_per_s == [10.0, 11.0]
    assert r.resources.startup_cold_s == 2.5 and r.target_qps is None
    assert r.done == ["load", "scenario", "batch", "fidelity", "likelihood", "diagnosis", "cold_start"]
    assert r.missing() == []
    failed = migrate({"variant": "bf16", "repeat": 1, "status": "failed", "error": "worker died"})
    assert (failed.status, failed.repeat, failed.error, failed.measured) == (
        "failed",
        1,
        "worker died",
        False,
    )


def test_a_result_round_trips_atomically_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    r = migrate(VERSION_1).model_copy(update={"status": "partial", "expected": ["load", "scenario", "diagnosis"],
                                              "done": ["load", "scenario"]})  # fmt: skip
    r.records = [{"never": "written"}]
    path = tmp_path / "int8.0.json"
    r.write(path)
    assert not list(tmp_path.glob("*.tmp")) and "never" not in path.read_text()
    back = read_result(path)
    assert back == r.model_copy(update={"records": None}) and back.missing() == ["diagnosis"]
    path.write_text('{"variant": 3')
    with pytest.raises(ValueError, match="int8.0.json: not a variant result"):
        read_result(path)


def test_counted_takes_each_results_run_id_only() -> None:
    def rec(run_id: str, variant: str) -> QueryRecord:
        return QueryRecord(run_id, variant, "single-stream", 0, "s", "qa", "ok", None, 0, 0, None, 1, 1, 1)

    results = [VariantResult(variant="fp32", run_id="R"), VariantResult(variant="srv", name="m", run_id="R"),
               VariantResult(variant="bf16", status="failed", error="x")]  # fmt: skip
    got = counted([rec("R", "fp32"), rec("old", "fp32"), rec("R", "m"), rec("R", "bf16")], results)
    assert {k: len(v) for k, v in got.items()} == {"fp32": 1, "srv": 1}


def test_the_plan_reference_lists_every_setting_with_its_default_and_flag() -> None:
    page = render()
    paths = leaf_paths()
    assert len(paths) > 80 and {"load.rate_qps", "analysis.looks", "model.device", "variants"} <= paths
    assert [p for p in paths if f"| `{p}` |" not in page] == []
    assert "| `load.rate_qps` | float | required | `--rate` | server: target queries/s |" in page
    assert "| `analysis.batch_rounds` | int | `3` |" in page


def test_a_run_folder_in_use_is_refused_or_moved_aside_with_its_history(tmp_path: Path) -> None:
    """Nothing measured is destroyed: a folder that holds a run is refused in one line; with
    --overwrite it moves aside to OUT.1 (then OUT.2), and its history rows follow it."""
    from variantbench.errors import UserError
    from variantbench.history import History
    from variantbench.pipeline.run import claim_folder
    from variantbench.plan import Plan

    out, db = tmp_path / "out", tmp_path / "history.db"
    claim_folder(Plan(out=out), say=print)  # absent: nothing to do
    out.mkdir()
    claim_folder(Plan(out=out), say=print)  # empty: nothing to do
    (out / "report.json").write_text("{}")
    with pytest.raises(UserError, match=f"{out} already holds a run: --overwrite moves it aside to {out}.1"):
        claim_folder(Plan(out=out), say=print)
    with History(db) as h:
        h.db.execute("INSERT INTO runs (run_key, created_utc, folder, plan_hash, model_name, variant, variant_spec, "
                     "scenario, status, machine_fingerprint, machine, code_version, metrics) VALUES "
                     "('k', 't', ?, 'p', 'm', 'fp32', 'fp32', 's', 'ok', 'f', '{}', 'v', '{}')", (str(out.resolve()),))  # fmt: skip
        h.db.commit()
    said: list[str] = []
    plan = Plan.model_validate({"out": str(out), "output": {"overwrite": True, "history": str(db)}})
    claim_folder(plan, say=said.append)
    assert not out.exists() and (tmp_path / "out.1" / "report.json").read_text() == "{}"
    assert said == [f"moved the run that was in {out} aside to {out}.1 (1 history rows follow it)"]
    with History(db) as h:
        assert [r["folder"] for r in h.rows()] == [str((tmp_path / "out.1").resolve())]
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already holds files: --overwrite moves it aside to .*out.2"):
        claim_folder(Plan(out=out), say=print)
