"""``--executor ray`` on a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``):
the variants measured at once, each on a node of its own; the report a local run's; a worker killed
mid-job run again. Marked ``ray``: the default test command leaves them out, ``.ci/run`` runs them."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from variantbench.pipeline.ray_executor import NODE_RESOURCE  # noqa: E402

COMMON = ("--variants", "fp32,bf16", "--tasks", "3", "--max-new-tokens", "4", "--input-lengths", "fixed:48",
          "--no-fidelity", "--no-diagnose", "--no-until-decided", "--no-history")  # fmt: skip


@pytest.fixture(scope="module")
def cluster():  # noqa: ANN201
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {NODE_RESOURCE: 1}})
    c.add_node(num_cpus=1, resources={NODE_RESOURCE: 1})
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _run(
    model: Path, out: Path, *extra: str, wait: bool = True
) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "variantbench",
        "run",
        "--model",
        str(model),
        *COMMON,
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, "COLUMNS": "200"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _outputs(out: Path) -> dict[tuple[str, str], str]:
    rows = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    return {(r["variant"], r["sample_id"]): r["output"] for r in rows}


def test_two_variants_at_once_on_two_nodes_give_a_local_runs_report(
    cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    on_ray = _run(tiny_model_dir, tmp_path / "ray", "--executor", "ray", "--ray-address", cluster.address)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    inline = _run(tiny_model_dir, tmp_path / "inline", "--no-isolate", "--no-interleave")
    assert inline.returncode == 0, inline.stderr[-3000:]
    ray_report, inline_report = (
        json.loads((tmp_path / d / "report.json").read_text()) for d in ("ray", "inline")
    )
    ex = ray_report["execution"]
    assert ex["executor"] == "ray" and ex["nodes"] == 2 and ex["interleaved"] is False
    assert ex["why_not"] == "each variant measured at once on a node of its own"
    # the same schema and, where nothing is timed, the same numbers as the inline run
    assert ray_report.keys() == inline_report.keys()
    for a, b in zip(ray_report["runs"], inline_report["runs"], strict=True):
        assert a["variant"] == b["variant"] and a["status"] == b["status"] == "ok"
        assert a.keys() == b.keys()
        assert a["queries"] == b["queries"] and a["resources"]["param_bytes"] == b["resources"]["param_bytes"]
        assert a["quality"]["composite"] == b["quality"]["composite"]
        assert a["resources"]["startup_cold_s"] > 0  # the cold start ran as a job on a node too
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "inline")  # greedy answers, token for token
    # each measurement on a node of its own, named in its payload and in the report
    nodes = {
        v: json.loads((tmp_path / "ray" / "raw" / f"{v}.0.json").read_text())["node"]
        for v in ("fp32", "bf16")
    }
    assert nodes["fp32"]["node_id"] != nodes["bf16"]["node_id"]
    assert all(n["cpu_model"] and n["host"] for n in nodes.values())
    assert {r["backend"]["node"]["node_id"] for r in ray_report["runs"]} == {
        n["node_id"] for n in nodes.values()
    }


def test_a_worker_killed_mid_measurement_is_run_again_and_the_other_variant_kept(
    cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    import psutil

    out = tmp_path / "killed"
    proc = _run(
        tiny_model_dir,
        out,
        "--executor",
        "ray",
        "--ray-address",
        cluster.address,
        "--tasks",
        "12",
        wait=False,
    )
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        for p in psutil.process_iter(["cmdline"]):
            if any("ray::measure:bf16" in part for part in p.info["cmdline"] or []):
                time.sleep(1.0)  # mid-job: loaded and measuring
                p.kill()
                killed = p.pid
                break
        time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=600)
    assert killed is not None, "never saw the bf16 measurement's worker: " + stderr[-2000:]
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert runs["bf16"]["status"] == "ok" and runs["bf16"]["backend"]["retried"]
    assert (
        "Worker" in runs["bf16"]["backend"]["retried"][0] or "died" in runs["bf16"]["backend"]["retried"][0]
    )
    assert runs["fp32"]["status"] == "ok" and "retried" not in runs["fp32"]["backend"]
    assert "- bf16: run again after " in (out / "report.md").read_text()
    # every query of both variants in the log exactly once, the killed attempt's none
    rows = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    for variant in ("fp32", "bf16"):
        ids = [r["index"] for r in rows if r["variant"] == variant]
        assert len(ids) == len(set(ids)) == runs[variant]["queries"]["issued"]


def test_a_cuda_plan_on_a_cluster_without_gpus_is_one_line(
    cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    proc = _run(tiny_model_dir, tmp_path / "gpu", "--executor", "ray", "--ray-address", cluster.address,
                "--device", "cuda")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no node of the Ray cluster offers a GPU" in proc.stderr and "Traceback" not in proc.stderr
