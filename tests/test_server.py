"""The OpenAI-compatible server, started for real on 127.0.0.1 with the tiny model, driven by the openai client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import re
import time

import httpx
import openai
import pytest

PROMPT = "Q: what is the capital of the town? A:"
MESSAGES = [{"role": "user", "content": "Summarize: the town has a river and a mill."}]


@pytest.fixture(scope="module")
def backends(tiny_model_dir: Path):  # noqa: ANN201
    from variantbench.backends.registry import make_backend
    from variantbench.variants.spec import VariantSpec

    loaded = {}
    for name in ("fp32", "int8"):
        b = make_backend(VariantSpec.parse(name), None, str(tiny_model_dir))
        b.load()
        loaded[name] = b
    yield loaded
    for b in loaded.values():
        b.close()


@contextmanager
def running(backends, router=None, **options) -> Iterator:  # noqa: ANN001
    """A fresh app (own workers, metrics) over the loaded backends, on uvicorn on 127.0.0.1."""
    from variantbench.loadgen.noop_server import ThreadServer
    from variantbench.serving.app import make_app
    from variantbench.serving.host import ServeOptions, serve_model

    opts = ServeOptions(**{"max_len": 256, **options})
    models = {name: serve_model(name, b, opts) for name, b in backends.items()}
    app = make_app(models, router(models) if router else None)
    with ThreadServer(app=app) as srv:
        srv.models = models
        yield srv


def _client(srv, **kw) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, **kw)


def _async_client(srv) -> openai.AsyncOpenAI:  # noqa: ANN001
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_gets_the_engines_greedy_text_streamed_or_not(backends) -> None:  # noqa: ANN001
    from variantbench.backends.base import GenerationRequest

    want_chat = backends["fp32"].generate(
        [GenerationRequest("c", messages=tuple(MESSAGES), max_new_tokens=12)]
    )[0]
    with running(backends) as srv:
        client = _client(srv)
        assert {m.id for m in client.models.list().data} == {"fp32", "int8"}
        chat = client.chat.completions.create(model="fp32", messages=MESSAGES, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content.strip() == want_chat.text
        assert chat.usage.completion_tokens == want_chat.output_tokens
        parts, finish, usage = [], None, None
        stream = client.chat.completions.create(model="fp32", messages=MESSAGES, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(parts) == chat.choices[0].message.content and finish == chat.choices[0].finish_reason
        assert usage.completion_tokens == chat.usage.completion_tokens
        whole = client.completions.create(model="int8", prompt=PROMPT, max_tokens=10)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="int8", prompt=PROMPT, max_tokens=10, stream=True) if c.choices)  # fmt: skip
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens <= 10
        # the raw stream ends with data: [DONE]
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT,
                          "max_tokens": 3, "stream": True}) as r:  # fmt: skip
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and r.headers["content-type"].startswith("text/event-stream")
        # a stop string ends the text before it
        full = whole.choices[0].text
        if len(full) > 4:
            cut = full[2:4]
            stopped = client.completions.create(model="int8", prompt=PROMPT, max_tokens=10, stop=[cut])
            assert stopped.choices[0].text == full[: full.index(cut)]
            assert stopped.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_style_4xx_and_the_server_keeps_serving(backends) -> None:  # noqa: ANN001
    with running(backends) as srv:
        client = _client(srv)
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="fp32", prompt="word " * 400, max_tokens=2)
        assert err.value.body["code"] == "context_length_exceeded"
        for bad in ({"max_tokens": 0}, {"temperature": 5}, {"n": 2}, {"max_tokens": "many"}, {"stop": [1]},
                    {"priority": "high"}, {"ignore_eos": "yes"}, {"logprobs": 3}, {"prompt": ""}, {"prompt": {"x": 1}}):  # fmt: skip
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": "hi", **bad})
            assert r.status_code == 400, bad
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json",
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "fp32", "messages": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert httpx.get(srv.url + "/v1/nothing").status_code == 404
        assert httpx.get(srv.url + "/v1/completions").status_code == 405
        assert client.completions.create(model="fp32", prompt="hi", max_tokens=2).choices  # still serving
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_hostile_bodies_get_a_4xx_never_a_5xx(backends) -> None:  # noqa: ANN001
    """Issue 41's cases that gave a 500: deep nesting, lone surrogates, non-finite numbers, a deadline
    that overflowed the worker, an oversized body; each now a 4xx with an OpenAI-style error body."""
    raw = [
        (b'{"model": "fp32", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested"),
        (b'{"model": "\\ud800", "prompt": "hi"}', 400, "not valid Unicode"),
        (b'{"model": "fp32", "prompt": "\\ud800 hi"}', 400, "not valid Unicode"),
        (b'{"model": "fp32", "prompt": "hi", "temperature": NaN}', 400, "NaN is not JSON"),
        (b'{"model": "fp32", "prompt": "hi", "top_p": Infinity}', 400, "Infinity is not JSON"),
        (b'{"model": "fp32", "prompt": "hi", "deadline_ms": 1e400}', 400, "finite number"),
        (
            b'{"model": "fp32", "prompt": "hi", "deadline_ms": 1e308}',
            400,
            "'deadline_ms': input should be less than or equal to 86400000",
        ),
        (b'{"model": "fp32", "prompt": "' + b"x" * (5 << 20) + b'"}', 413, "over 4 MiB"),
    ]
    with running(backends) as srv:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            for body, status, said in raw:
                r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
                if path != "/v1/completions" and b"deadline_ms" in body:
                    continue  # a field only a completion reads (the others refuse the body's shape first)
                assert r.status_code == status and said in r.json()["error"]["message"], (
                    path,
                    body[:60],
                    r.text[:200],
                )
        # a bug (planted: a tokenizer that raises) is a logged 500 with a request id, not a hang
        served = srv.models["fp32"]
        tokenizer = served.tokenizer

        class Broken:
            def __getattr__(self, name: str) -> object:
                raise RuntimeError("planted")

        served.tokenizer = Broken()
        try:
            r = httpx.post(srv.url + "/tokenize", json={"model": "fp32", "prompt": "hi"})
        finally:
            served.tokenizer = tokenizer
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "internal_error" and "request id" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": "hi", "deadline_ms": 60000,
                                                          "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"]  # still serving
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_concurrent_requests_form_batches_and_an_idle_server_does_not(backends) -> None:  # noqa: ANN001
    with running(backends, max_batch_size=8) as srv:
        client = _client(srv)
        worker = srv.models["fp32"].worker
        for _ in range(3):  # one at a time: every step runs alone, nothing is held open
            client.completions.create(model="fp32", prompt=PROMPT, max_tokens=8)
        assert set(worker.batch_sizes) == {1} and not worker.holds
        worker.batch_sizes.clear()

        async def burst() -> list[str]:
            c = _async_client(srv)
            outs = await asyncio.gather(*(c.completions.create(model="fp32", prompt=PROMPT + f" {i}", max_tokens=24)
                                          for i in range(8)))  # fmt: skip
            await c.close()
            return [o.choices[0].text for o in outs]

        asyncio.run(burst())
        assert max(worker.batch_sizes) >= 4
        metrics = httpx.get(srv.url + "/metrics").text
        for name in ("variantbench_batch_size_bucket", "variantbench_queue_wait_seconds_bucket",
                     "variantbench_ttft_seconds_bucket", "variantbench_inter_token_seconds_bucket",
                     "variantbench_compute_seconds_bucket", "variantbench_step_seconds_bucket",
                     'variantbench_queue_depth{model="fp32"}'):  # fmt: skip
            assert name in metrics, name
        assert 'variantbench_requests_total{endpoint="completions",model="fp32",status="200"} 11.0' in metrics


def test_a_served_model_starts_warm_with_its_step_cost_fitted_and_nothing_counted(backends) -> None:  # noqa: ANN001
    from variantbench.serving.host import ServeOptions, serve_model

    for kv in ("paged", "contiguous"):
        worker = serve_model("fp32", backends["fp32"], ServeOptions(max_len=256, kv_cache=kv)).worker
        cost = worker.scheduler.cost
        # fitted on a prompt alone, one row and two (the terms' sizes are the host's noise on the
        # tiny model, whose steps all take ~1 ms: what the warm-up fed the model is the test)
        seen = {(rows, tokens) for rows, tokens, _ in cost.samples}
        assert seen == {(0, 64), (1, 0), (1, 16), (2, 0)}, seen  # alone, one row, one beside a prompt, two
        assert cost.known and cost.step_s(1) > 0
        assert worker.batch.active == 0 and worker.batch.prompt_tokens == {"computed": 0, "cached": 0}
        assert not worker.batch_sizes  # /metrics and the step log see requests' steps only


def test_a_shared_prompt_prefix_is_served_from_the_prefix_cache(backends) -> None:  # noqa: ANN001
    head = "Read the report and answer the question with a short phrase taken from it. " * 6
    prompts = [head + "Q: who owns the mill? A:", head + "Q: where is the river? A:"]

    def serve(prefix_cache_mb: float, kv_cache: str = "paged") -> tuple[list[str], str, int]:
        with running(backends, prefix_cache_mb=prefix_cache_mb, kv_cache=kv_cache) as srv:
            client = _client(srv)
            texts = [client.completions.create(model="fp32", prompt=p, max_tokens=10).choices[0].text
                     for p in prompts]  # fmt: skip
            return texts, httpx.get(srv.url + "/metrics").text, srv.models["fp32"].worker.batch.prefix.block

    want, _, _ = serve(0)
    copied, _, _ = serve(64, "contiguous")
    got, metrics, block = serve(64)
    assert got == want == copied  # shared (paged) or copied (contiguous) keys/values decode as computed ones

    def count(source: str) -> float:
        m = re.search(rf'variantbench_prompt_tokens_total{{model="fp32",source="{source}"}} (\S+)', metrics)
        return float(m.group(1)) if m else 0.0

    head_blocks = len(backends["fp32"].tokenize(head)) // block * block
    assert count("cached") >= head_blocks - block > 0  # the second request's shared full blocks
    assert count("computed") > 0


def test_priority_order_holds_under_a_backlog_and_overload_gets_429(backends) -> None:  # noqa: ANN001
    with running(backends, max_batch_size=1, max_queue=2) as srv:
        batch = srv.models["fp32"].worker.batch
        batch.stop_ids = frozenset()  # every request runs to max_tokens: the first surely holds the model
        real = batch.step

        def slow_step(*args):  # noqa: ANN002, ANN202 - 3 ms more per step, so the backlog forms on any machine
            time.sleep(0.003)
            return real(*args)

        batch.step = slow_step

        async def scenario() -> tuple[list[str], list[httpx.Response]]:
            c = _async_client(srv)
            done: list[str] = []

            async def ask(tag: str, priority: int, n: int) -> None:
                await c.completions.create(
                    model="fp32", prompt=PROMPT, max_tokens=n, extra_body={"priority": priority}
                )
                done.append(tag)

            first = asyncio.ensure_future(ask("first", 0, 200))
            await asyncio.sleep(0.2)  # it runs; the rest queue behind it (batch size 1)
            low = asyncio.ensure_future(ask("low", 2, 4))
            await asyncio.sleep(0.05)
            high = asyncio.ensure_future(ask("high", 0, 4))
            await asyncio.sleep(0.05)
            async with httpx.AsyncClient() as h:  # priority 0's queue holds 2 (high + one): the rest get 429
                extra = await asyncio.gather(*(h.post(srv.url + "/v1/completions", json={
                    "model": "fp32", "prompt": PROMPT, "max_tokens": 2, "priority": 0}, timeout=60)
                    for _ in range(3)))  # fmt: skip
            await asyncio.gather(first, low, high)
            await c.close()
            return done, list(extra)

        done, extra = asyncio.run(scenario())
        assert done.index("high") < done.index("low")
        refused = [r for r in extra if r.status_code == 429]
        assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        assert any(r.status_code == 200 for r in extra)


def test_hopeless_deadline_is_shed_with_503(backends) -> None:  # noqa: ANN001
    with running(backends) as srv:
        client = _client(srv)
        client.completions.create(model="fp32", prompt=PROMPT, max_tokens=12)  # the cost model learns
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 200,
                                                          "deadline_ms": 1})  # fmt: skip
        assert (
            r.status_code == 503
            and int(r.headers["retry-after"]) >= 1
            and "deadline" in r.json()["error"]["message"]
        )
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 4,
                                                           "deadline_ms": 60000})  # fmt: skip
        assert ok.status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_its_slot(backends) -> None:  # noqa: ANN001
    with running(backends, max_batch_size=2) as srv:
        worker = srv.models["fp32"].worker
        worker.batch.stop_ids = frozenset()  # only the hang-up can end it early
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT,
                          "max_tokens": 230, "stream": True}) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # first token seen: hang up
        deadline = time.monotonic() + 10
        while worker.batch.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.batch.active == 0
        assert len(worker.batch_sizes) < 200  # it stopped decoding long before 230 tokens
        assert 'status="499"' in httpx.get(srv.url + "/metrics").text


def test_a_failing_step_fails_only_its_batch(backends) -> None:  # noqa: ANN001
    with running(backends) as srv:
        batch = srv.models["fp32"].worker.batch
        real = batch.step
        calls = {"n": 0}

        def flaky(*args):  # noqa: ANN002, ANN202 - the model raises once (an injected fault; the server is under test)
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected step failure")
            return real(*args)

        batch.step = flaky
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 6})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        other = httpx.post(
            srv.url + "/v1/completions", json={"model": "int8", "prompt": PROMPT, "max_tokens": 6}
        )
        again = httpx.post(
            srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 6}
        )
        assert other.status_code == 200 and again.status_code == 200 and batch.active == 0


def test_ignore_eos_runs_to_max_tokens_past_the_stop_tokens(backends) -> None:  # noqa: ANN001
    """vLLM's ``ignore_eos``: a benchmark's answers run to ``max_tokens`` whatever the prompt."""
    with running(backends) as srv:
        batch = srv.models["fp32"].worker.batch
        batch.stop_ids = frozenset(range(backends["fp32"].tokenizer.vocab_size + 8))  # any token ends it
        body = {"model": "fp32", "prompt": PROMPT, "max_tokens": 7}
        stopped = httpx.post(srv.url + "/v1/completions", json=body).json()
        through = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}).json()
    assert (stopped["usage"]["completion_tokens"], stopped["choices"][0]["finish_reason"]) == (1, "stop")
    assert (through["usage"]["completion_tokens"], through["choices"][0]["finish_reason"]) == (7, "length")


def test_shutdown_drains_in_flight_requests(backends) -> None:  # noqa: ANN001
    import threading

    results: dict[str, object] = {}
    with running(backends) as srv:
        srv.models["fp32"].worker.batch.stop_ids = frozenset()  # it runs to all 80 tokens

        def ask() -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 80},
                           timeout=60)  # fmt: skip
            results["status"] = r.status_code
            results["body"] = r.json()

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 10
        while not srv.models["fp32"].worker.batch.active and time.monotonic() < deadline:
            time.sleep(0.005)
        srv.server.should_exit = True  # what SIGINT/SIGTERM do
        t.join(timeout=60)
    assert results["status"] == 200
    assert results["body"]["usage"]["completion_tokens"] == 80
    assert results["body"]["choices"][0]["finish_reason"] == "length"


def test_router_realizes_its_calibrated_share_on_held_out_prompts(backends, tiny_model_dir: Path) -> None:  # noqa: ANN001
    from variantbench.backends.base import GenerationRequest, encode_request
    from variantbench.serving.host import build_router
    from variantbench.serving.router import split
    from variantbench.workloads import build_synthetic, parse_lengths
    from variantbench.workloads.counting import tokenizer_counter

    samples = build_synthetic(80, 3, lengths=parse_lengths("uniform:40-200"),
                              counter=tokenizer_counter(str(tiny_model_dir))).samples  # fmt: skip
    cal, held = split(len(samples), seed=3)
    made = {}

    def make(models):  # noqa: ANN001, ANN202
        made["router"] = build_router(models, "int8", "fp32", 0.25, [samples[i] for i in cal])
        return made["router"]

    with running(backends, router=make) as srv:
        router = made["router"]
        tok = srv.models["int8"].tokenizer
        picks = [
            router.route(encode_request(tok, GenerationRequest("x", prompt=samples[i].prompt)))[0]
            for i in held
        ]
        share = picks.count("fp32") / len(picks)
        assert abs(share - 0.25) <= 0.15, share
        client = _client(srv)
        assert "tiered" in {m.id for m in client.models.list().data}
        raw = client.completions.with_raw_response.create(
            model="tiered", prompt=samples[held[0]].prompt, max_tokens=3
        )
        assert raw.headers["x-variantbench-routed-to"] == picks[0]
        assert raw.parse().model == "tiered"
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'variantbench_router_decisions_total{{router="tiered",target="{picks[0]}"}} 1.0' in metrics


def test_hold_open_only_when_an_arrival_is_due_within_a_step() -> None:
    from variantbench.serving.worker import BatchWorker

    class Batch:  # only the size limits matter for the decision
        max_batch, max_len, stop_ids, active, slots = 8, 64, frozenset(), 0, []

    w = BatchWorker(Batch(), max_wait_ms=10)
    for n, s in [(1, 0.011), (2, 0.012), (4, 0.014), (8, 0.018)]:
        w.scheduler.cost.observe(n, s)  # a step costs 1 ms per row + 10 ms
    w._last_arrival, w._gap_s = time.perf_counter(), 0.004
    assert w.hold_s(0) == 0  # idle: never delayed
    assert w.hold_s(1) == pytest.approx(0.004)  # 1 x 4 ms waiting < a 12 ms step: hold
    assert w.hold_s(4) == 0  # 4 rows x 4 ms = 16 ms > a 15 ms step: go
    assert w.hold_s(8) == 0  # full
    w._gap_s = 0.05
    assert w.hold_s(1) == 0  # next arrival due later than max_wait_ms
    w._gap_s, w._last_arrival = 0.004, time.perf_counter() - 1.0
    assert w.hold_s(1) == 0  # arrivals have stopped


def test_serve_command_rejects_bad_options_in_one_line(tiny_model_dir: Path) -> None:
    from typer.testing import CliRunner

    from variantbench.cli import app

    runner = CliRunner()
    for args, words in [
        (["--variants", ""], "empty"),
        (["--variants", "fp32,fp32"], "twice"),
        (["--variants", "nonsense"], "unknown"),
        (["--port", "70000"], "port"),
        (["--router", "int8"], "LIGHT,STANDARD"),
        (["--max-batch-size", "0"], "max-batch-size"),
        (["--queue-policy", "x:max_queue=3"], "priority level"),
        (["--queue-policy", "0:max_queue=0"], "bad value"),
        (["--queue-policy", "0:on_timeout=later"], "bad value"),
        (["--queue-policy", "0:size=3"], "unknown key"),
        (["--prefill-chunk", "0"], "prefill-chunk"),
        (["--host", "0.0.0.0"], "without an API key"),
        (["--priority-levels", "0"], "--priority-levels (serve.priority_levels)"),
        (["--queue-policy", "3:max_queue=2"], "the levels are 0 to 2"),
        (["--prefix-cache-mb", "-1"], "prefix-cache-mb"),
        (["--weight-layout", "split"], "weight-layout"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb (serve.kv_cache_gb): Input should be greater than 0"),
        (
            ["--kv-cache-gb", "0.00001"],
            "less than one request of --max-len",
        ),  # found once the model is loaded
        (["--kv-cache-gb", "0.00001", "--kv-cache", "contiguous"], "contiguous KV cache needs"),
    ]:
        result = runner.invoke(app, ["serve", "--model", str(tiny_model_dir), *args])
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["serve", "--model", str(tiny_model_dir), "--router", "int8,bf16"])
    assert result.exit_code == 2 and "not among the served variants" in result.output


def test_route_command_compares_router_light_and_standard_on_held_out_samples(tiny_model_dir: Path) -> None:
    from typer.testing import CliRunner

    from variantbench.cli import app

    result = CliRunner().invoke(app, ["route", "--model", str(tiny_model_dir), "--router", "int8,fp32", "--tasks", "12",
                                      "--input-lengths", "uniform:40-120", "--standard-share", "0.5"],
                                env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    for words in ("router", "always-light", "always-standard", "random-at-share", "routing overhead"):
        assert words in result.output


def test_metrics_report_first_token_objectives_per_priority_level(backends) -> None:  # noqa: ANN001
    from variantbench.serving.scheduler import QueuePolicy

    # level 0 gets the default 500 ms objective; level 1 one it cannot meet (and sheds what would miss it)
    policies = {1: QueuePolicy(ttft_slo_ms=0.001, shed_late=True)}
    with running(backends, policies=policies) as srv:
        for priority in (0, 0, 2):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 3,
                                                              "priority": priority})  # fmt: skip
            assert r.status_code == 200
        shed = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "max_tokens": 3,
                                                             "priority": 1})  # fmt: skip
        assert shed.status_code == 503 and int(shed.headers["retry-after"]) >= 1
        assert "first-token objective" in shed.json()["error"]["message"]
        text = httpx.get(srv.url + "/metrics").text
        pool = srv.models["fp32"].worker.batch.pool

    def value(line: str) -> float:
        found = [x for x in text.splitlines() if x.startswith(line + " ")]
        assert found, line
        return float(found[0].split()[-1])

    # the KV memory held now: the paged pool's written blocks (the prefix cache keeps the prompts')
    assert value('variantbench_kv_resident_bytes{model="fp32"}') == pool.committed_bytes > 0
    assert value("process_resident_memory_bytes") > pool.committed_bytes
    assert value('variantbench_ttft_slo_requests_total{model="fp32",outcome="met",priority="0"}') == 2
    assert value('variantbench_ttft_slo_attainment{model="fp32",priority="0"}') == 1.0
    assert value('variantbench_ttft_slo_requests_total{model="fp32",outcome="rejected",priority="1"}') == 1
    assert value('variantbench_ttft_by_priority_seconds_count{model="fp32",priority="2"}') == 1
    assert 'priority="2"' not in "".join(
        x for x in text.splitlines() if x.startswith("variantbench_ttft_slo")
    )
    assert value('variantbench_busy_seconds_total{model="fp32"}') > 0
