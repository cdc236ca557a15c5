"""Issue 41 against the real server on 127.0.0.1 (the tiny model): keys, hosts and origins, slow and
oversized clients, configured priority levels, a request's lifetime, and a worker killed by a fault."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import socket
import time

import httpx
import pytest

PROMPT = "Q: what is the capital of the town? A:"


@pytest.fixture(scope="module")
def fp32(tiny_model_dir: Path):  # noqa: ANN201
    from variantbench.backends.registry import make_backend
    from variantbench.variants.spec import VariantSpec

    backend = make_backend(VariantSpec.parse("fp32"), None, str(tiny_model_dir))
    backend.load()
    yield backend
    backend.close()


@contextmanager
def serving(backend, access=None, header_timeout_s: float = 10.0, max_request_s: float = 600.0,
            router=None, **options) -> Iterator:  # noqa: ANN001  # fmt: skip
    """``variantbench serve``'s app and uvicorn configuration (``server_config``) on a free port."""
    from variantbench.loadgen.noop_server import ThreadServer
    from variantbench.serving.app import make_app
    from variantbench.serving.host import ServeOptions, serve_model, server_config
    from variantbench.serving.requests import Limits

    opts = ServeOptions(**{"max_len": 256, **options})
    models = {"fp32": serve_model("fp32", backend, opts)}
    limits = Limits(max_len=opts.max_len, priority_levels=opts.priority_levels)
    app = make_app(models, router(models) if router else None, access=access, limits=limits,
                   max_request_s=max_request_s)  # fmt: skip

    def config(port: int):  # noqa: ANN202
        return server_config(app, "127.0.0.1", port, header_timeout_s=header_timeout_s, log_level="critical")

    with ThreadServer(config=config) as srv:
        srv.models = models
        yield srv


def _ask(srv, **kw) -> httpx.Response:  # noqa: ANN001
    body = {"model": "fp32", "prompt": PROMPT, "max_tokens": 2, **kw.pop("body", {})}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=30, **kw)


def test_keys_hosts_origins_and_content_types(fp32) -> None:  # noqa: ANN001
    from variantbench.serving.guard import Access

    access = Access.for_server("127.0.0.1", keys=("k-one", "k-two"))
    with serving(fp32, access=access) as srv:
        # no key, a wrong one, the wrong scheme: 401 with an OpenAI-style body; each of the keys: 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-one"}):
            r = _ask(srv, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        for key in ("k-one", "k-two"):
            assert _ask(srv, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # every endpoint but the public ones wants it
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        good = {"Authorization": "Bearer k-one"}
        # a browser's cross-site form post: refused for its origin, and for its content type
        form = {"Content-Type": "application/x-www-form-urlencoded", **good}
        r = httpx.post(srv.url + "/v1/completions", content=b"model=fp32&prompt=hi",
                       headers={**form, "Origin": "http://evil.example"})  # fmt: skip
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = httpx.post(srv.url + "/v1/completions", content=b"model=fp32&prompt=hi", headers=form)
        assert r.status_code == 415
        r = httpx.post(srv.url + "/v1/completions", content=b'{"model": "fp32", "prompt": "hi"}',
                       headers={"Content-Type": "text/plain", **good})  # fmt: skip
        assert r.status_code == 415
        # DNS rebinding: the page's own name in Host
        r = _ask(srv, headers={**good, "Host": "evil.example:8000"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert _ask(srv, headers={**good, "Host": f"localhost:{srv.port}"}).status_code == 200
        assert _ask(srv, headers={**good, "Origin": f"http://localhost:{srv.port}"}).status_code == 200


def test_keys_come_from_the_environment_and_the_client_sends_them(fp32, monkeypatch) -> None:  # noqa: ANN001
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.openai_http import OpenAIBackend
    from variantbench.plan import ServePlan
    from variantbench.serving.host import serve_access

    monkeypatch.setenv("VARIANTBENCH_API_KEY", "secret-a, secret-b")
    access = serve_access(ServePlan(), {"VARIANTBENCH_API_KEY": "secret-a, secret-b"})
    assert access.keys == ("secret-a", "secret-b")
    with serving(fp32, access=access) as srv:
        client = OpenAIBackend(srv.url + "/v1", model="fp32")
        client.load()  # GET /v1/models with the key
        out = client.generate([GenerationRequest("s", prompt=PROMPT, max_new_tokens=2)])[0]
        client.close()
        assert out.error is None and out.output_tokens == 2
    from variantbench.errors import UserError

    with pytest.raises(UserError, match="without an API key"):
        serve_access(ServePlan(host="0.0.0.0"), {})
    wide = serve_access(ServePlan(host="0.0.0.0", allow_unauthenticated=True), {})
    assert wide.keys == () and wide.host_ok("anything:8000")


def test_slow_and_oversized_clients_are_cut_off(fp32) -> None:  # noqa: ANN001
    from variantbench.serving.guard import Access

    access = Access(max_body_bytes=1 << 20, body_timeout_s=1.0)
    with serving(fp32, access=access, header_timeout_s=1.0) as srv:
        # headers a byte at a time: the connection is closed once the deadline passes
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            got = b""
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n":
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
                except OSError:
                    break
                if time.monotonic() - t0 > 4:
                    break
            sock.settimeout(3)
            try:
                while chunk := sock.recv(4096):
                    got += chunk
            except OSError:
                pass
        assert time.monotonic() - t0 < 4 and (got == b"" or got.startswith(b"HTTP/1.1 408")), got[:80]
        # a body that stops halfway: 408 once the body deadline passes
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\":")  # fmt: skip
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 4, head[:80]
        # a declared body over the limit: 413 before a byte of it is read
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 999999999\r\n\r\n")  # fmt: skip
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head[:80]
        # ... and one that says nothing of its length (chunked) is cut at the limit
        chunks = (b"x" * 65536 for _ in range(40))
        r = httpx.post(
            srv.url + "/v1/completions", content=chunks, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 413
        assert _ask(srv).status_code == 200  # still serving


def test_priority_levels_are_configured_and_the_queue_is_bounded_in_all(fp32) -> None:  # noqa: ANN001
    with serving(fp32, priority_levels=2, max_queue_total=2, max_batch_size=1) as srv:
        for bad in (2, -1, 1000, "1", 1.5):
            r = _ask(srv, body={"priority": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", bad
        assert _ask(srv, body={"priority": 1}).status_code == 200
        worker = srv.models["fp32"].worker
        worker.scheduler.max_total = 0  # a full queue in all levels: the next request is turned away
        r = _ask(srv, body={"priority": 1})
        assert r.status_code == 429 and "in all levels" in r.json()["error"]["message"]
        worker.scheduler.max_total = 2
        metrics = httpx.get(srv.url + "/metrics").text
        levels = {
            line.split('priority="')[1].split('"')[0] for line in metrics.splitlines() if 'priority="' in line
        }
        assert levels <= {"0", "1"}  # labels only of configured levels
    from variantbench.errors import UserError
    from variantbench.serving.host import ServeOptions, parse_queue_policy

    with pytest.raises(UserError, match="the levels are 0 to 2"):
        ServeOptions(policies=dict([parse_queue_policy("5:max_queue=4")]))


def test_limits_on_prompt_stop_n_and_lifetime(fp32) -> None:  # noqa: ANN001
    with serving(fp32, max_request_s=0.3) as srv:
        served = srv.models["fp32"]
        # a prompt far past the context is refused by its bytes, before the tokenizer sees it
        for prompt, said in (("word " * 4000, "at most 8192 characters"), ("\u00e9" * 5000, "10000 bytes")):
            r = _ask(srv, body={"prompt": prompt})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert said in r.json()["error"]["message"]
        for bad, param in (({"stop": ["a"] * 5}, "stop"), ({"stop": ["x" * 300]}, "stop"), ({"n": 2}, "n"),
                           ({"max_tokens": 10**9}, "max_tokens")):  # fmt: skip
            r = _ask(srv, body=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "fp32", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}] * 1025})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        # a request past its lifetime ends with 504 (whole) or an error event (streamed)
        batch = served.worker.batch
        step = batch.step

        def slow(*args):  # noqa: ANN002, ANN202 - a model that takes 50 ms a token
            time.sleep(0.05)
            return step(*args)

        batch.step = slow
        try:
            r = _ask(srv, body={"max_tokens": 40, "ignore_eos": True})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            with httpx.stream("POST", srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT,
                              "max_tokens": 40, "ignore_eos": True, "stream": True}) as s:  # fmt: skip
                lines = [line for line in s.iter_lines() if line.startswith("data:")]
            assert '"error"' in lines[-2] and "longest lifetime" in lines[-2] and lines[-1] == "data: [DONE]"
        finally:
            batch.step = step
        deadline = time.monotonic() + 5
        while batch.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert batch.active == 0  # the late requests left the batch


def test_a_worker_that_fails_restarts_and_one_that_keeps_failing_stops(fp32) -> None:  # noqa: ANN001
    from variantbench.serving import worker as worker_module

    with serving(fp32) as srv:
        worker = srv.models["fp32"].worker
        stopped: list[str] = []
        worker.on_fatal.append(stopped.append)
        real = worker.scheduler.useful_batch
        faults = {"left": 1}

        def faulty() -> int:  # an injected fault outside the step and admission code
            if faults["left"]:
                faults["left"] -= 1
                raise RuntimeError("injected worker fault")
            return real()

        worker.scheduler.useful_batch = faulty
        r = _ask(srv)
        assert r.status_code == 500 and "injected worker fault" in r.json()["error"]["message"]
        assert "restarts" in r.json()["error"]["message"]
        assert _ask(srv).status_code == 200 and httpx.get(srv.url + "/health").status_code == 200
        assert len(worker.failures) == 1 and worker.down is None and not stopped
        # a fault every time: it restarts MAX_RESTARTS times, then stops for good and says so
        faults["left"] = 10**6
        for _ in range(worker_module.MAX_RESTARTS + 1):
            r = _ask(srv)
            assert r.status_code in (500, 503), r.text
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stopped and "failed" in stopped[0]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "injected worker fault" in health.json()["down"]["fp32"]
        r = _ask(srv)
        assert r.status_code == 503 and "is down" in r.json()["error"]["message"]


def test_a_router_at_share_0_or_1_lists_its_models(fp32) -> None:  # noqa: ANN001
    from variantbench.serving.router import Calibration, TieredRouter

    for threshold, always in ((float("inf"), "fp32"), (float("-inf"), "fp32")):
        cal = Calibration(0.0 if threshold > 0 else 1.0, threshold, 1.0, 1.0, 1.0, 1.0, 4)

        def router(models, cal=cal):  # noqa: ANN001, ANN202
            return TieredRouter("fp32", "fp32", models["fp32"].backend.token_log_probs, cal, name="tiered")

        with serving(fp32, router=router) as srv:
            r = httpx.get(srv.url + "/v1/models")
            assert r.status_code == 200, r.text
            tiered = next(m for m in r.json()["data"] if m["id"] == "tiered")
            assert (
                tiered["router"]["calibration"]["threshold"] is None and tiered["router"]["always"] == always
            )


def test_serve_exits_with_an_error_when_a_worker_cannot_restart(fp32) -> None:  # noqa: ANN001
    """``run_server`` (what ``variantbench serve`` runs): a worker that fails on every turn stops the
    server, and the call raises the one-line error the command line prints (exit 1)."""
    import threading

    from variantbench.errors import UserError
    from variantbench.loadgen.noop_server import free_port
    from variantbench.serving.app import make_app
    from variantbench.serving.host import ServeOptions, run_server, serve_model

    models = {"fp32": serve_model("fp32", fp32, ServeOptions(max_len=256))}
    worker = models["fp32"].worker

    def broken() -> int:
        raise RuntimeError("injected, every time")

    worker.scheduler.useful_batch = broken
    port = free_port()
    outcome: list[BaseException | None] = []

    def serve() -> None:
        try:
            run_server(make_app(models), "127.0.0.1", port)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - what the command line would see
            outcome.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "fp32", "prompt": "hi",
                       "max_tokens": 2}, timeout=5)  # fmt: skip
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    thread.join(timeout=30)
    assert outcome and isinstance(outcome[0], UserError), outcome
    assert "failed" in str(outcome[0]) and "injected, every time" in str(outcome[0])
