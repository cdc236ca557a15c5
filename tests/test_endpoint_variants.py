"""Served models as variants: two of our own servers (tiny model, fp32 and int8) compared end to end
with quality, A/B and a recommendation; API key, headers and extra body reach the server."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

from conftest import served
import pytest


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir: Path):  # noqa: ANN201
    with served(tiny_model_dir, "fp32") as a, served(tiny_model_dir, "int8") as b:
        yield a, b


def test_two_served_variants_compared_end_to_end(two_servers: tuple[str, str], tmp_path: Path) -> None:
    a, b = two_servers
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "variantbench", "run", "--variants", f"full={a}#fp32,small={b}#int8",
                           "--tasks", "6", "--max-new-tokens", "12", "--input-lengths", "uniform:32-128",
                           "--no-history", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [r["variant"] for r in report["runs"]] == ["full", "small"] and report["standard"] == "full"
    assert report["model"]["kind"] == "endpoint" and report["model"]["name"] == "fp32 / int8"
    assert report["execution"]["why_not"] == "served variants are measured one after another"
    full, small = report["runs"]
    for run in (full, small):
        assert run["status"] == "ok" and run["queries"]["completed"] == 6
        assert run["backend"]["backend"] == "openai-http"
        # what needs the weights, or the server's own process, is not claimed for a served model
        assert run["diagnosis"] is None and run["quality"]["kl_mean"] is None
        assert run["resources"]["peak_rss_bytes"] is None and "served" in run["resources"]["energy_source"]
    assert {run["backend"]["endpoint"] for run in (full, small)} == {
        a.removesuffix("/v1"),
        b.removesuffix("/v1"),
    }
    # the same samples answered by both: quality against the standard, a paired A/B
    assert small["quality_vs_standard"]["standard"] == "full" and small["quality_vs_standard"]["gate"] in (
        "PASS",
        "FAIL",
    )
    assert small["ab_vs_standard"]["paired"] is True and small["ab_vs_standard"]["pairs"] == 6
    assert report["recommendations"]["latency"]["variant"] in ("full", "small")
    edge = report["recommendations"]["edge"]["reasons"]
    assert all("not measured (a served model's memory is the server's)" in why for why in edge.values())
    assert (out / "report.html").is_file()
    # the plan written back replays the same comparison: the variants and their endpoints
    plan = (out / "plan.yaml").read_text()
    assert "endpoints:" in plan and f"url: {a}" in plan and "model: int8" in plan


def test_api_key_headers_and_extra_body_reach_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from variantbench.loadgen.noop_server import ThreadServer, make_app
    from variantbench.pipeline.run import execute
    from variantbench.plan import Plan

    seen: list[tuple[dict[str, str], bytes]] = []
    inner = make_app(tokens=4)

    async def recording(scope, receive, send):  # noqa: ANN001, ANN202 - an ASGI wrapper around the real no-op app
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = b""

        async def replay():  # noqa: ANN202
            return {"type": "http.request", "body": body, "more_body": False}

        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append((headers | {"path": scope["path"]}, body))
        return await inner(scope, replay, send)

    monkeypatch.setenv("TEAM_KEY", "sk-test-123")
    monkeypatch.setenv("TENANT", "acme")
    with ThreadServer(app=recording) as srv:
        execute(Plan.model_validate({
            "out": str(tmp_path / "out"), "variants": ["gw"], "output": {"record_history": False},
            "endpoints": {"gw": {"url": srv.url + "/v1", "api_key_env": "TEAM_KEY",
                                 "headers": {"X-Tenant": "$TENANT", "X-Plain": "yes"}, "extra_body": {"top_k": 1}}},
            "load": {"scenario": "single-stream", "tasks": 3}, "workload": {"max_new_tokens": 4},
        }))  # fmt: skip
    assert [h["path"] for h, _ in seen][0] == "/v1/models"
    generations = [(h, json.loads(b)) for h, b in seen if h["path"] != "/v1/models"]
    assert len(generations) >= 3
    for headers, _ in seen:  # every request, /v1/models included
        assert headers["authorization"] == "Bearer sk-test-123"
        assert headers["x-tenant"] == "acme" and headers["x-plain"] == "yes"
    assert all(body["top_k"] == 1 and body["model"] == "noop" for _, body in generations)
    # the key itself never lands in the run's files
    written = "".join(
        f.read_text() for f in (tmp_path / "out").glob("*.*") if f.suffix in (".yaml", ".json", ".md")
    )
    assert "sk-test-123" not in written and "TEAM_KEY" in written


def test_served_and_local_variants_do_not_mix_and_a_missing_key_is_one_line(tmp_path: Path) -> None:
    mixed = subprocess.run([sys.executable, "-m", "variantbench", "run", "--variants", "a=http://127.0.0.1:9/v1,fp32",
                            "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert mixed.returncode == 2 and "a is served (NAME=URL) and fp32 local" in mixed.stderr
    plan = tmp_path / "p.yaml"
    plan.write_text(
        "variants: [gw]\nendpoints:\n  gw: {url: 'http://127.0.0.1:9/v1', api_key_env: NO_SUCH_KEY_VAR}\n"
    )
    missing = subprocess.run([sys.executable, "-m", "variantbench", "run", str(plan), "--out", str(tmp_path / "o")],
                             capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "NO_SUCH_KEY_VAR"})  # fmt: skip
    assert missing.returncode == 2 and "the environment variable NO_SUCH_KEY_VAR is not set" in missing.stderr
    assert "Traceback" not in missing.stderr + mixed.stderr
