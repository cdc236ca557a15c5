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

from variantbench.errors import UserError


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
        "UNDECIDED",
    )
    assert small["ab_vs_standard"]["paired"] is True and small["ab_vs_standard"]["pairs"] == 6
    # likelihood scores from each server (echo + logprobs), paired by sample: no fidelity from a server
    for run in (full, small):
        lk = run["likelihood"]
        assert lk["unavailable"] is None and lk["samples"] == 6 and lk["kl_mean"] is None
        assert all(s["ref_tokens"] >= 1 and s["ref_logprob"] < 0 for s in lk["per_sample"])
    assert "reference likelihood" in {c["metric"] for c in small["quality_vs_standard"]["comparisons"]}
    assert report["recommendations"]["latency"]["variant"] in ("full", "small")
    edge = report["recommendations"]["edge"]["reasons"]
    assert all("not measured (a served model's memory is the server's)" in why for why in edge.values())
    # the server's own view, scraped while each was measured, beside the client's latencies
    raw = json.loads((out / "raw" / "small.0.json").read_text())
    scraped = raw["server_metrics"]
    assert scraped["error"] is None and len(scraped["samples"]) >= 1
    assert any(k.startswith("variantbench_running_requests") for k in scraped["samples"][-1][1])
    assert 'id="server"' in (out / "report.html").read_text()
    # the server's own TTFT and ITL histograms over the blocks, beside the client's: the same run seen
    # from both ends, the warm-up left out of both (on loopback the client adds little)
    for run in (full, small):
        view = run["server_latency"]
        assert view["ttft_ms"]["source"] == "variantbench_ttft_seconds" and view["ttft_ms"]["count"] == 6
        assert view["itl_ms"]["count"] == 6 * 11  # one gap per token after the first, 12 tokens each
        # the tiny model's random tokens are often bytes with no text of their own, streamed with the
        # next token's: the client's first token can be the server's second, so TTFT is compared
        # loosely here, as a gap of at most one token and the client's HTTP path (5 ms on a busy
        # 2-core host; a ratio bound failed at 2.02 on a 5.4 ms server TTFT): the default model is
        # held to 10% by benchmarks/server_agreement.py. The tiny model's token gaps are ~1.5 ms, and
        # their quantiles are interpolated in histogram buckets; on a busy 2-core host the server's loop
        # can fall behind its worker (the GIL) and take two tokens in one wake-up (a CI run: server p50
        # 0.49 ms, p90 2.41; client p50 2.22), so a ratio or gap on the p50s (failed at 1.32 and 4.6x)
        # says little: each side's p50 must lie within the other's p90 and 2 ms (a unit or bucket
        # error is off by 1000x)
        ratio = view["client_over_server_p50"]
        gap = run["ttft_ms"]["p50"] - view["ttft_ms"]["p50"]
        assert ratio["ttft"] > 0.8 and gap < 2 * view["itl_ms"]["p50"] + 5.0, view
        client, server = run["itl_ms"], view["itl_ms"]
        assert client["p50"] < server["p90"] + 2.0 and server["p50"] < client["p90"] + 2.0, (view, client)
    assert "## The server's own latency histograms" in (out / "report.md").read_text()
    assert not any("_bucket{" in k for _, series in scraped["samples"] for k in series)
    # the plan written back replays the same comparison: the variants and their endpoints
    plan = (out / "plan.yaml").read_text()
    assert "endpoints:" in plan and f"url: {a}" in plan and "model: int8" in plan


def _recording_app(seen: list[tuple[dict[str, str], bytes]], tokens: int = 4):  # noqa: ANN202
    """The real no-op server's app, wrapped to keep every request's headers and body."""
    from variantbench.loadgen.noop_server import make_app

    inner = make_app(tokens=tokens)

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
        seen.append((headers | {"path": scope["path"], "query": scope["query_string"].decode()}, body))
        return await inner(scope, replay, send)

    return recording


def test_api_key_headers_and_extra_body_reach_the_server_and_no_secret_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41, item 9: a key from the environment, a literal header value, URL user-info and a query
    string reach the server, and none of them is in any file the run wrote (the history included)."""
    from variantbench.loadgen.noop_server import ThreadServer
    from variantbench.pipeline.run import execute, resume_run
    from variantbench.plan import Plan

    seen: list[tuple[dict[str, str], bytes]] = []
    recording = _recording_app(seen)
    monkeypatch.setenv("TEAM_KEY", "sk-test-123")
    monkeypatch.setenv("TENANT", "acme")
    secrets = ("sk-test-123", "planted-header", "planted-pass", "planted-query")
    out = tmp_path / "out"
    with ThreadServer(app=recording) as srv:
        url = srv.url.replace("http://", "http://user:planted-pass@") + "/v1?token=planted-query"
        execute(Plan.model_validate({
            "out": str(out), "variants": ["gw"], "output": {"history": str(tmp_path / "history.db")},
            "endpoints": {"gw": {"url": url, "api_key_env": "TEAM_KEY",
                                 "headers": {"X-Tenant": "$TENANT", "X-Plain": "planted-header"},
                                 "extra_body": {"top_k": 1}}},
            "load": {"scenario": "single-stream", "tasks": 3}, "workload": {"max_new_tokens": 4},
        }))  # fmt: skip
    assert [h["path"] for h, _ in seen][0] == "/v1/models"
    # (a request whose client went away before its body arrived has none: nothing to check in it)
    generations = [(h, json.loads(b)) for h, b in seen if h["path"].endswith("completions") and b]
    assert len(generations) >= 3
    for headers, _ in seen:  # every request, /v1/models included
        assert headers["authorization"] == "Bearer sk-test-123"
        assert headers["x-tenant"] == "acme" and headers["x-plain"] == "planted-header"
        assert headers["query"] == "token=planted-query"
    assert all(body["top_k"] == 1 and body["model"] == "noop" for _, body in generations)
    # no secret in any file the run wrote, nor in the history; the references ($NAME) are kept
    files = [f for f in [*out.rglob("*"), tmp_path / "history.db"] if f.is_file()]
    assert len(files) >= 5
    for f in files:
        data = f.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, (f, secret)
    plan = (out / "plan.yaml").read_text()
    assert "TEAM_KEY" in plan and "$TENANT" in plan and "X-Plain: '***'" in plan and "user:" not in plan
    # a plan whose literal secret was not written cannot resume with it: one line says what to do
    with pytest.raises(UserError, match=r"endpoints.gw.(url|headers.X-Plain) was given literally"):
        resume_run(out)


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


VLLM = ("--base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model Qwen/x --request-rate 4 "
        "--num-prompts 100 --dataset-name sharegpt --dataset-path data.json --percentile-metrics ttft,itl "
        "--metric-percentiles 50,99.9 --goodput ttft:500 tpot:50 --ignore-eos --save-result --max-concurrency 8 "
        "--burstiness 0.5 --seed 3")  # fmt: skip
NATIVE = ("--endpoint http://127.0.0.1:8000 --api chat --endpoint-model Qwen/x --scenario server --rate 4 --tasks 100 "
          "--workload data.json --set output.percentile_metrics=ttft,itl --set output.metric_percentiles=50,99.9 "
          "--set targets.goodput_ms=ttft:500,tpot:50 --set workload.ignore_eos=true --set output.vllm_result=true "
          "--max-concurrency 8 --burstiness 0.5 --seed 3")  # fmt: skip


def test_vllm_bench_flags_make_the_same_plan_as_ours() -> None:
    from variantbench.cli_args import parse_run_args
    from variantbench.errors import UserError
    from variantbench.plan_file import load_plan

    vllm, native = (load_plan(None, parse_run_args(x.split()).overrides) for x in (VLLM, NATIVE))
    assert vllm == native
    assert vllm.load.scenario == "server" and vllm.load.rate_qps == 4 and vllm.model.api == "chat"
    assert vllm.targets.goodput_ms == {"ttft": 500, "tpot": 50} and vllm.output.metric_percentiles == (
        50,
        99.9,
    )
    offline = load_plan(None, parse_run_args("--base-url http://h:1 --request-rate inf".split()).overrides)
    assert offline.load.scenario == "offline"
    with pytest.raises(UserError, match="--dataset-name sharegpt needs --dataset-path"):
        parse_run_args("--base-url http://h:1 --dataset-name sharegpt".split())


def test_a_sharegpt_file_through_vllm_style_flags_with_goodput_itl_and_a_vllm_result(tmp_path: Path) -> None:
    from variantbench.loadgen.noop_server import ThreadServer

    data = [{"id": f"c{i}", "conversations": [{"from": "system", "value": "be brief"},
                                             {"from": "human", "value": f"Question number {i}?"},
                                             {"from": "gpt", "value": f"Answer {i}."},
                                             {"from": "human", "value": "and then?"}]} for i in range(5)]  # fmt: skip
    (tmp_path / "sharegpt.json").write_text(json.dumps(data))
    seen: list[tuple[dict[str, str], bytes]] = []
    out = tmp_path / "out"
    with ThreadServer(app=_recording_app(seen, tokens=6)) as srv:
        proc = subprocess.run([sys.executable, "-m", "variantbench", "run", "--base-url", srv.url, "--endpoint",
                               "/v1/completions", "--model", "noop", "--request-rate", "inf", "--num-prompts", "5",
                               "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"),
                               "--goodput", "ttft:5000", "e2el:10000", "--ignore-eos", "--save-result", "--no-history",
                               "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    bodies = [json.loads(b) for h, b in seen if h["path"] == "/v1/completions"]
    assert {b["prompt"] for b in bodies} <= {f"Question number {i}?" for i in range(5)}
    assert all(b["ignore_eos"] is True for b in bodies)
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["scenario"] == "offline" and run["queries"]["completed"] == 5
    refs = {json.loads(x)["reference"] for x in (out / "queries.jsonl").read_text().splitlines()}
    assert refs == {f"Answer {i}." for i in range(5)}  # the first model turn is the reference
    # a server that cannot score text (no /tokenize): not available, said once, and the run goes on
    assert (
        run["likelihood"]["per_sample"] == []
        and "/tokenize answered HTTP 404" in run["likelihood"]["unavailable"]
    )
    assert (
        "noop: likelihood scores not available (/tokenize answered HTTP 404"
        in (out / "report.md").read_text()
    )
    assert run["itl_ms"]["p50"] is not None and set(run["percentiles"]) == {"ttft", "tpot", "itl", "e2el"}
    assert run["goodput"]["slo_ms"] == {"ttft": 5000, "e2el": 10000} and run["goodput"]["met"] == 5
    vllm = json.loads((out / "vllm_result.noop.json").read_text())
    assert vllm["completed"] == 5 and vllm["request_rate"] == "inf" and vllm["model_id"] == "noop"
    assert vllm["p99_itl_ms"] == pytest.approx(run["percentiles"]["itl"]["99"])
    assert vllm["request_goodput"] == pytest.approx(run["goodput"]["requests_per_s"])
    assert len(vllm["itls"]) == 5 and all(len(x) == 5 for x in vllm["itls"])


def test_senders_default_to_the_cores_or_half_beside_a_local_server() -> None:
    from variantbench.pipeline.settings import default_senders, load_settings
    from variantbench.plan import Plan

    cores = len(os.sched_getaffinity(0))
    local = Plan.model_validate(
        {"variants": "a=http://127.0.0.1:8000/v1", "load": {"scenario": "server", "rate_qps": 5}}
    )
    remote = Plan.model_validate(
        {"variants": "a=http://10.1.2.3:8000/v1", "load": {"scenario": "server", "rate_qps": 5}}
    )
    assert default_senders(local) == max(1, cores // 2) and default_senders(remote) == cores
    assert load_settings(remote, "r").senders == cores
    pinned = Plan.model_validate({"variants": "a=http://10.1.2.3:8000/v1",
                                  "load": {"scenario": "server", "rate_qps": 5, "senders": 3}})  # fmt: skip
    assert load_settings(pinned, "r").senders == 3
    assert (
        load_settings(Plan.model_validate({"load": {"scenario": "server", "rate_qps": 5}}), "r").senders == 1
    )


@pytest.mark.slow  # 16 s: a whole run; lm-eval over a server is proved by tests/test_scoring.py
def test_a_served_variant_gets_lm_eval_on_its_server_in_a_run(two_servers: tuple[str, str], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """quality.lm_eval on a served variant: lm-eval's API model against the variant's server, in the
    report beside the likelihood scores the same server gave."""
    from test_quality_decision import LETTERS, _task_folder

    from variantbench.pipeline.run import execute
    from variantbench.plan import Plan

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, _ = two_servers
    folder = _task_folder(tmp_path / "tasks")
    execute(Plan.model_validate({
        "out": str(tmp_path / "out"), "variants": ["full"], "output": {"record_history": False},
        "endpoints": {"full": {"url": a, "model": "fp32"}},
        "load": {"scenario": "single-stream", "tasks": 3}, "workload": {"max_new_tokens": 4},
        "quality": {"lm_eval": {"tasks": ["vb_sentiment"], "include_path": str(folder)}},
    }))  # fmt: skip
    run = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]
    assert run["lm_eval"]["unavailable"] is None and len(run["lm_eval"]["docs"]["vb_sentiment"]) == len(
        LETTERS
    )
    assert 0 <= run["lm_eval"]["tasks"]["vb_sentiment"]["acc"] <= 1
    # samples longer than the test server's 512-token context are left out, the others scored
    assert run["likelihood"]["unavailable"] is None and 1 <= run["likelihood"]["samples"] < 3
    assert "lm-evaluation-harness" in (tmp_path / "out" / "report.md").read_text()
