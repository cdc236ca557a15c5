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

from variantbench.ray_cluster import NODE_RESOURCE  # noqa: E402

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
        assert a["backend"]["threads"] == b["backend"]["threads"]  # not Ray's OMP_NUM_THREADS=1
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


def test_two_sender_actors_on_two_nodes_keep_exactly_once_accounting(
    cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    """An endpoint run on --executor ray: the schedule split between sender actors on two nodes, each
    one's clock offset measured and reported, every query issued once and completed once."""
    from conftest import served

    out = tmp_path / "senders"
    with served(tiny_model_dir) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "variantbench", "run", "--variants", f"a={url}#fp32", "--executor", "ray",
             "--ray-address", cluster.address, "--scenario", "server", "--rate", "8", "--tasks", "4",
             "--min-queries", "24", "--max-new-tokens", "3", "--input-lengths", "fixed:32", "--no-history",
             "--out", str(out)],
            capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "report.json").read_text())["runs"][0]
    senders = run["senders"]
    assert len(senders) == 2 and {s["sender"] for s in senders} == {0, 1}
    assert len({s["node_id"] for s in senders}) == 2, senders  # one a node
    for s in senders:
        assert s["queries"] == 12 and s["clock_rtt_ms"] > 0 and abs(s["clock_offset_ms"]) < 1_000
        assert s["lag_p99_ms"] is not None and s["lag_p99_ms"] < 100
    rows = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    ids = [r["index"] for r in rows]
    assert len(ids) == len(set(ids)) == 24 == run["queries"]["issued"] == run["queries"]["completed"]
    assert all(
        r["status"] == "ok" and r["completed_ns"] >= r["first_token_ns"] >= r["issued_ns"] for r in rows
    )
    assert "clock offset" in (out / "report.md").read_text()


def test_a_search_on_two_nodes_runs_its_trials_at_once(cluster, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    space = tmp_path / "space.yaml"
    space.write_text(
        "steps:\n  drop-layers:\n    count: 1\n    optional: false\nfinish: [fp32, bf16, int8]\n"
    )
    out = tmp_path / "search"
    proc = subprocess.run(
        [sys.executable, "-m", "variantbench", "search", "--space", str(space), "--budget", "2",
         "--objectives", "tokens_per_s,weights", "--set", f"model.source={tiny_model_dir}", "--tasks", "3",
         "--max-new-tokens", "3", "--input-lengths", "fixed:32", "--no-fidelity", "--executor", "ray",
         "--ray-address", cluster.address, "--set", f"execution.shared_cache={tmp_path / 'cache'}",
         "--set", "execution.memory_gb=0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "early stop off: the executor runs each trial as one job" in proc.stderr.replace("\n", " ")
    data = json.loads((out / "search.json").read_text())
    assert sum(t["state"] != "repeat" for t in data["trials"]) == 2 and data["front"]
    measured = [t["variant"] for t in data["trials"] if t["state"] == "measured"]
    assert len(measured) == 2 and all(v.startswith("drop-layers:1") for v in measured)
    nodes = {json.loads((out / "raw" / f"{v.replace(':', '_').replace('+', '_')}.0.json").read_text())["node"]["node_id"]
             for v in measured}  # fmt: skip
    first_batch = [t for t in data["trials"] if t["number"] < 2]  # asked together: at once, a node each
    if all(t["state"] == "measured" for t in first_batch):
        assert len(nodes) == 2
    built = [
        json.loads(m.read_text())["chain"] for m in (tmp_path / "cache").glob("variants/*/manifest.json")
    ]
    assert built == [["drop-layers:count=1"]]  # every trial's build, once, in the cache every node reads
