"""The OpenAI-compatible HTTP backend against a real server on 127.0.0.1 (the no-op server)."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, HTTPServer
import json
import os
from pathlib import Path
import subprocess
import sys
import threading

import pytest

from variantbench.backends.base import GenerationRequest
from variantbench.backends.openai_http import OpenAIBackend
from variantbench.errors import UserError
from variantbench.loadgen.harness import LoadSettings, run_scenario
from variantbench.loadgen.noop_server import ThreadServer
from variantbench.report.schema import Resources
from variantbench.report.summary import summarize_run
from variantbench.workloads import SyntheticLibrary


@pytest.fixture(scope="module")
def server():
    with ThreadServer(tokens=6, token_delay_s=0.002, slow_s=3.0) as srv:
        yield srv


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streamed_answer_is_parsed(server, api: str) -> None:
    backend = OpenAIBackend(server.url, api=api)
    info = backend.load()
    assert info.details["model"] == "noop"
    result = backend.generate([GenerationRequest("a", prompt="hello", max_new_tokens=4)])[0]
    assert result.status == "ok", result.error
    assert result.text == "tok tok tok tok"
    assert result.output_tokens == 4 and result.input_tokens == 1  # from the server's usage
    assert len(result.token_ns) == 4
    assert result.start_ns < result.first_token_ns <= result.token_ns[-1] <= result.end_ns
    # the server sleeps 2 ms before each token: the 4th cannot arrive before 8 ms (timestamps are real)
    assert result.token_ns[-1] - result.start_ns >= 8_000_000
    assert all(b >= a for a, b in zip(result.token_ns, result.token_ns[1:], strict=False))


def test_http_500_is_an_error_result(server) -> None:
    result = OpenAIBackend(server.url, model="fail500").generate([GenerationRequest("a", prompt="x")])[0]
    assert result.status == "error" and result.error.startswith("HTTP 500")


def test_garbage_stream_is_an_error_result(server) -> None:
    result = OpenAIBackend(server.url, model="garbage").generate([GenerationRequest("a", prompt="x")])[0]
    assert result.status == "error" and "malformed SSE" in result.error


def test_timeout_is_an_error_result(server) -> None:
    backend = OpenAIBackend(server.url, model="slow", timeout_s=0.5)
    result = backend.generate([GenerationRequest("a", prompt="x")])[0]
    assert result.status == "error" and "timed out" in result.error


def test_server_scenario_over_http(server) -> None:
    library = SyntheticLibrary(n=10, seed=0, tokens=(16, 24))
    backend = OpenAIBackend(server.url)
    backend.load()
    settings = LoadSettings(scenario="server", rate_qps=100, min_queries=150, max_queries=150, warmup=2,
                            max_new_tokens=6)  # fmt: skip
    run = run_scenario(backend, library, settings)
    assert len(run.records) == 150 and all(r.status == "ok" for r in run.records)
    report = summarize_run("noop", run.records, Resources(), scenario="server")
    assert report.achieved_qps == pytest.approx(100, rel=0.05)
    assert report.ttft_ms.p50 < report.latency_ms.p50
    # inter-token time excludes the first token: ~2 ms per token, not TTFT-inflated
    assert 1.0 < report.tpot_ms.p50 < 15
    for r in run.records:
        assert r.output_tokens == 6 and len(r.token_ms) == 6


def test_unreachable_endpoint_fails_before_the_run() -> None:
    with pytest.raises(UserError, match="cannot reach endpoint"):
        OpenAIBackend("http://127.0.0.1:9").load()
    with pytest.raises(UserError, match="http"):
        OpenAIBackend("ftp://example")


class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html>not an API</html>")

    def log_message(self, *args: object) -> None:
        pass


def test_cli_endpoint_errors_are_one_line(tmp_path: Path) -> None:
    httpd = HTTPServer(("127.0.0.1", 0), _Garbage)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        for url, needle in ((f"http://127.0.0.1:{httpd.server_port}", "OpenAI-style JSON"),
                            ("http://127.0.0.1:9", "cannot reach endpoint")):  # fmt: skip
            proc = subprocess.run(
                [sys.executable, "-m", "variantbench", "run", "--endpoint", url, "--out", str(tmp_path)],
                capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
            )  # fmt: skip
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    finally:
        httpd.shutdown()


def test_cli_endpoint_run_writes_the_report(server, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "variantbench", "run", "--endpoint", server.url, "--scenario", "server",
         "--rate", "50", "--tasks", "5", "--min-queries", "60", "--max-new-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["variant"] == "noop" and run["backend"]["backend"] == "openai-http"
    assert run["queries"] == {"issued": 60, "completed": 60, "errors": 0}
    assert (out / "mlperf_log_summary.noop.txt").is_file()


def test_concurrency_cap_over_http_turns_waiting_into_lag(server) -> None:
    library = SyntheticLibrary(n=10, seed=0, tokens=(16, 24))
    backend = OpenAIBackend(server.url)
    backend.load()
    # each answer takes >= 12 ms (6 tokens x 2 ms); 200/s with one slot cannot keep up
    settings = LoadSettings(scenario="server", rate_qps=200, min_queries=40, max_queries=40, warmup=0,
                            max_concurrency=1, max_new_tokens=6)  # fmt: skip
    run = run_scenario(backend, library, settings)
    assert len(run.records) == 40 and all(r.status == "ok" for r in run.records)
    by_index = sorted(run.records, key=lambda r: r.index)
    assert by_index[-1].dispatch_lag_ms > 100  # the backlog is charged as lag...
    assert by_index[-1].latency_from_scheduled_ms > by_index[-1].latency_ms + 100  # ...and in latency
    spans = sorted((r.issued_ns, r.completed_ns) for r in run.records)
    assert all(b[0] >= a[1] - 1_000_000 for a, b in zip(spans, spans[1:], strict=False))  # one at a time


def _dropping_app(every: int = 20):  # noqa: ANN202
    """The real no-op server, cutting every ``every``-th connection mid-answer (5% at 20)."""
    from variantbench.loadgen.noop_server import make_app

    inner = make_app(tokens=6)
    count = {"n": 0}

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            count["n"] += 1
            if count["n"] % every == 0:
                await receive()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"data: {", "more_body": True})
                raise ConnectionResetError("dropped on purpose")  # uvicorn closes the connection
        return await inner(scope, receive, send)

    return app


def test_four_sender_processes_keep_exactly_once_books_over_dropped_connections() -> None:
    library = SyntheticLibrary(n=10, seed=0, tokens=(16, 24))
    with ThreadServer(app=_dropping_app()) as srv:
        backend = OpenAIBackend(srv.url)
        backend.load()
        settings = LoadSettings(scenario="server", rate_qps=100, min_queries=200, max_queries=200, warmup=0,
                                max_new_tokens=6, senders=4, drain_timeout_s=30)  # fmt: skip
        run = run_scenario(backend, library, settings)
    records = run.records
    assert len(records) == 200 and sorted(r.index for r in records) == list(range(200))  # each once
    assert {r.sender for r in records} == {0, 1, 2, 3}  # every sender took its slice
    assert all(r.sender == r.index % 4 for r in records)
    errors = [r for r in records if r.status == "error"]
    assert 5 <= len(errors) <= 15, [r.error for r in errors]  # the dropped ~5%, each an error record
    ok = [r for r in records if r.status == "ok"]
    assert all(r.issued_ns >= r.scheduled_ns and r.completed_ns >= r.issued_ns for r in ok)
    assert all(r.output_tokens == 6 for r in ok)


def _streaming_app(body: list[bytes]):  # noqa: ANN202
    """A server that answers every completion with these SSE chunks, as they are."""

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


TOKEN = b'data: {"choices": [{"text": "tok"}]}\n\n'


@pytest.mark.parametrize(
    ("body", "said"),
    [
        # the server gives up mid-answer, then closes the stream properly: not a shorter answer
        (
            [
                TOKEN,
                TOKEN,
                b'data: {"error": {"message": "out of KV cache", "type": "server_error"}}\n\n',
                b"data: [DONE]\n\n",
            ],
            "error event mid-stream after 2 tokens: out of KV cache",
        ),
        ([TOKEN, TOKEN], "stream ended without [DONE] after 2 tokens"),  # closed cleanly, cut short
        ([TOKEN, b"data: " + b"x" * (1 << 20) + b"y"], "an SSE line over 1 MiB without a newline"),
    ],
)
def test_a_failure_inside_the_stream_is_an_error_record_not_an_answer(body: list[bytes], said: str) -> None:
    with ThreadServer(app=_streaming_app(body)) as srv:
        result = OpenAIBackend(srv.url, model="m").generate([GenerationRequest("a", prompt="x")])[0]
    assert result.status == "error" and result.error == said, result.error
    with ThreadServer(app=_streaming_app([TOKEN, TOKEN, b"data: [DONE]\n\n"])) as srv:
        whole = OpenAIBackend(srv.url, model="m").generate([GenerationRequest("a", prompt="x")])[0]
    assert whole.status == "ok" and whole.text == "toktok" and len(whole.token_ns) == 2
