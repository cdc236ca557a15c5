"""The OpenAI-compatible HTTP server: starlette routes over one ``BatchWorker`` per variant.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as SSE ending in
``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``/health`` and Prometheus ``/metrics``;
prompt scoring (``echo`` + ``logprobs`` on ``/v1/completions``) and vLLM's ``/tokenize``,
``/detokenize`` and ``/tokenizer_info`` (``serving/scoring.py``).
The ``model`` field picks a variant, or the tiered router by its name. Beyond OpenAI's fields a
request may carry ``priority`` (integer, lower first, vLLM's field), ``deadline_ms`` (from
arrival; a request that cannot meet it is refused at once with 503 rather than served late) and
``ignore_eos`` (vLLM's: the answer runs to ``max_tokens`` past the end-of-text token, so a benchmark
offers the same work whatever the prompt; the default model ended 6 of 16 summaries between 67
and 111 of 128 tokens, which moved a soak's window means by more than its 10% rule).

Every refusal is an OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``)
with a 4xx status, or 429/503 with ``Retry-After`` under overload; only a failing model step gives
500, and then only for the requests in that step. Decoding is greedy whatever ``temperature`` says
(the benchmark's outputs must be reproducible); the ``x-variantbench-decoding: greedy`` header says so.

No global state: ``make_app`` builds everything (the Prometheus registry included) per app, so tests
and benchmarks can run several servers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
import itertools
import json
import logging
import time
from typing import Any
import uuid

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from variantbench.backends.base import GenerationRequest, encode_request
from variantbench.serving.batching import KvMemory
from variantbench.serving.guard import Access, Guard
from variantbench.serving.requests import (
    ApiError,
    Limits,
    RequestModels,
    ScoreRequest,
    openapi,
    parse_body,
    validate,
)
from variantbench.serving.scheduler import Rejected
from variantbench.serving.scoring import outside_vocab
from variantbench.serving.worker import BatchWorker

LOG = logging.getLogger("variantbench.serving")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # OpenAI's chat default is "until the context ends"; we cap it
# fields we do not implement, and the values that ask for nothing (clients often send those)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"}),
}  # fmt: skip


@dataclass
class ServedModel:
    """One variant behind the server: its loaded backend, tokenizer and executor."""

    name: str
    backend: Any
    tokenizer: Any
    worker: BatchWorker
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        return self.worker.max_len


def _geometric(low: float, high: float, ratio: float) -> list[float]:
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * ratio)
    return out


class Metrics:
    """Prometheus metrics of one app, in its own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        # TTFT and ITL in buckets 10% apart: a percentile read off the histogram (interpolated in its
        # bucket) then stays within a few % of the exact one, so a client's p50 can be checked against
        # it (tests/test_server_metrics.py: within 5%); with the old ITL buckets (1, 2.5, 5 ms, ...) a
        # steady 3.1 ms decode read 1.21x its true p50 and 1.47x its p90
        fine = tuple(round(x, 7) for x in _geometric(0.0005, 120.0, 1.1))
        self.requests = Counter("variantbench_requests", "Requests by model, endpoint and HTTP status",
                                ["model", "endpoint", "status"], registry=r)  # fmt: skip
        self.queue_depth = Gauge("variantbench_queue_depth", "Requests waiting", ["model"], registry=r)
        self.running = Gauge("variantbench_running_requests", "Requests in the batch", ["model"], registry=r)
        self.kv_bytes = Gauge("variantbench_kv_resident_bytes", "Keys/values the batch holds resident now (a "
                              "paged pool: its written blocks; a contiguous cache: all of it)", ["model"],
                              registry=r)  # fmt: skip
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (Linux)
        self.prompt_tokens = Counter("variantbench_prompt_tokens", "Prompt tokens taken in, by where their "
                                     "keys/values came from (computed, or copied from the prefix cache)",
                                     ["model", "source"], registry=r)  # fmt: skip
        self.batch_size = Histogram("variantbench_batch_size", "Rows in each decode step", ["model"],
                                    buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), registry=r)  # fmt: skip
        self.step = Histogram("variantbench_step_seconds", "Compute time of each decode step", ["model"],
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)  # fmt: skip
        self.queue_wait = Histogram("variantbench_queue_wait_seconds", "Arrival to admission into the batch",
                                    ["model"], buckets=latency, registry=r)  # fmt: skip
        self.compute = Histogram("variantbench_compute_seconds", "Admission to the last token", ["model"],
                                 buckets=latency, registry=r)  # fmt: skip
        self.ttft = Histogram("variantbench_ttft_seconds", "Request received to the first token", ["model"],
                              buckets=fine, registry=r)  # fmt: skip
        self.itl = Histogram("variantbench_inter_token_seconds", "Gap between consecutive tokens", ["model"],
                             buckets=fine, registry=r)  # fmt: skip
        self.ttft_level = Histogram("variantbench_ttft_by_priority_seconds", "Request received to the first "
                                    "token, by priority level", ["model", "priority"], buckets=fine, registry=r)  # fmt: skip
        self.slo = Counter("variantbench_ttft_slo_requests", "Requests of a level with a first-token objective, by "
                           "outcome: met, missed, or rejected (429/503 before a first token)",
                           ["model", "priority", "outcome"], registry=r)  # fmt: skip
        self.attainment = Gauge("variantbench_ttft_slo_attainment", "Share of a level's answered requests whose "
                                "first token met its objective", ["model", "priority"], registry=r)  # fmt: skip
        self._slo_counts: dict[tuple[str, str], list[int]] = {}
        self.busy = Counter("variantbench_busy_seconds", "Time the model spent computing steps (decode, "
                            "prefill or both): its share of wall time is how busy the variant is",
                            ["model"], registry=r)  # fmt: skip
        self.routed = Counter("variantbench_router_decisions", "Tiered router decisions", ["router", "target"],
                              registry=r)  # fmt: skip

    def first_token(self, model: ServedModel, priority: int, seconds: float) -> None:
        """A request's first token, ``seconds`` after it was received: its level's TTFT and objective."""
        level = str(priority)
        self.ttft_level.labels(model.name, level).observe(seconds)
        objective = model.worker.scheduler.policy(priority).ttft_slo_ms
        if objective is None:
            return
        met = seconds * 1e3 <= objective
        self.slo.labels(model.name, level, "met" if met else "missed").inc()
        counts = self._slo_counts.setdefault((model.name, level), [0, 0])
        counts[0 if met else 1] += 1
        self.attainment.labels(model.name, level).set(counts[0] / (counts[0] + counts[1]))

    def turned_away(self, model: ServedModel, priority: int) -> None:
        """Rejected before a first token (429 or 503): counted against its level's objective, if any."""
        if model.worker.scheduler.policy(priority).ttft_slo_ms is not None:
            self.slo.labels(model.name, str(priority), "rejected").inc()

    def watch(self, model: ServedModel) -> None:
        w = model.worker
        self.queue_depth.labels(model.name).set_function(w.queue_depth)
        self.running.labels(model.name).set_function(lambda: w.batch.active)
        if isinstance(w.batch, KvMemory):
            self.kv_bytes.labels(model.name).set_function(lambda: w.batch.kv_resident_bytes)
        sizes, steps = self.batch_size.labels(model.name), self.step.labels(model.name)
        busy = self.busy.labels(model.name)

        counts = getattr(w.batch, "prompt_tokens", None)  # the batch's own running totals
        seen = {"computed": 0, "cached": 0}

        def on_step(size: int, seconds: float, prompt_tokens: int) -> None:
            busy.inc(seconds)
            if size:
                sizes.observe(size)
                steps.observe(seconds)
            for source, total in (counts or {}).items():
                if total > seen[source]:
                    self.prompt_tokens.labels(model.name, source).inc(total - seen[source])
                    seen[source] = total

        w.step_listeners.append(on_step)


# ---- request parsing -----------------------------------------------------------------------------


@dataclass
class Parsed:
    model: str
    ids: list[int]
    max_new: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    priority: int
    deadline_s: float | None
    ignore_eos: bool = False


def _prompt_bytes(n: int, limits: Limits) -> None:
    """The prompt's size before it is tokenized: a prompt far past the context is refused unread."""
    if n > limits.prompt_bytes:
        raise ApiError(400, f"the prompt is {n} bytes, over this server's {limits.prompt_bytes} "
                       f"(serve.max_prompt_bytes; its context is {limits.max_len} tokens)", "prompt",
                       "context_length_exceeded")  # fmt: skip


def _chat_ids(messages: list[Any], tokenizer: Any, limits: Limits) -> list[int]:
    clean = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        clean.append({"role": m.role, "content": content})
    _prompt_bytes(sum(len(c["content"].encode()) + len(c["role"]) for c in clean), limits)
    try:
        return encode_request(tokenizer, GenerationRequest("chat", messages=tuple(clean)))
    except Exception as exc:  # noqa: BLE001 - a template that refuses these messages
        raise ApiError(400, f"cannot apply the chat template: {exc}".splitlines()[0], "messages") from None


def _text_ids(prompt: str | list[Any], tokenizer: Any, limits: Limits, special: bool = True) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _prompt_bytes(len(prompt.encode()), limits)
        return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
    if why := outside_vocab(prompt, len(tokenizer)):
        raise ApiError(400, f"'prompt' {why}", "prompt")
    return list(prompt)


# ---- streaming text -------------------------------------------------------------------------------


class TextStream:
    """Token ids in, text deltas out: holds back an incomplete UTF-8 character and any tail that may
    be the start of a stop string; stops at the first stop string (which is not returned)."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop_ids, self.stop = tokenizer, stop_ids, stop
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def _hold(self, text: str) -> int:
        """Characters at the end of ``text`` that might begin a stop string."""
        most = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    most = max(most, k)
                    break
        return most

    def push(self, token: int, final: bool = False) -> str:
        if token not in self.stop_ids:
            self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        ready = len(self.text)
        if not (final or self.stopped):
            if self.text.endswith("\ufffd"):
                return ""
            ready -= self._hold(self.text)
        if ready <= self.sent:
            return ""
        delta = self.text[self.sent : ready]
        self.sent = ready
        return delta

    def flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta


# ---- the app ----------------------------------------------------------------------------------------


class Server:
    def __init__(self, models: dict[str, ServedModel], router: Any = None, drain_timeout_s: float = 30.0,
                 limits: Limits | None = None, max_request_s: float = 600.0) -> None:  # fmt: skip
        self.models = models
        self.router = router
        self.metrics = Metrics()
        self.drain_timeout_s = drain_timeout_s
        self.max_request_s = max_request_s
        # the context bound is the smallest served one: the schema cannot say it per model
        first = min((m.max_len for m in models.values()), default=2048)
        self.limits = limits or Limits(max_len=first)
        names = (*models, *([router.name] if router is not None else []))
        self.requests = RequestModels.for_limits(self.limits, names)
        self.created = int(time.time())
        self._ids = itertools.count()
        for m in models.values():
            self.metrics.watch(m)

    # ---- helpers ------------------------------------------------------------------------------

    def _model(self, name: Any) -> ServedModel | None:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' is required", "model")
        if self.router is not None and name == self.router.name:
            return None
        if name not in self.models:
            known = [*self.models, *([self.router.name] if self.router else [])]
            raise ApiError(404, f"The model '{name[:80]}' does not exist; served: {', '.join(known)}", "model",
                           "model_not_found")  # fmt: skip
        return self.models[name]

    async def _body(self, request: Request) -> dict[str, Any]:
        return parse_body(await request.body())

    def _ids_of(self, req: Any, tokenizer: Any, chat: bool) -> list[int]:
        if chat:
            return _chat_ids(req.messages, tokenizer, self.limits)
        return _text_ids(req.prompt, tokenizer, self.limits)

    async def _parse(self, request: Request, chat: bool) -> tuple[Parsed, ServedModel, str | None]:
        body = await self._body(request)
        req = validate(self.requests.chat if chat else self.requests.completion, body)
        target = self._model(req.model)
        for name, allowed in UNSUPPORTED.items():
            if body.get(name) not in allowed:
                raise ApiError(400, f"'{name}' is not supported by this server", name)
        asked = (
            req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        )
        name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        routed: str | None = None
        if target is None:  # the tiered router: score with the light model, then pick
            tokenizer = self.models[self.router.light].tokenizer
            ids = await asyncio.to_thread(self._ids_of, req, tokenizer, chat)
            routed, _ = await asyncio.to_thread(self.router.route, ids)
            self.metrics.routed.labels(self.router.name, routed).inc()
            target = self.models[routed]
            if target.tokenizer is not tokenizer:
                ids = await asyncio.to_thread(self._ids_of, req, target.tokenizer, chat)
        else:  # templating and tokenizing off the event loop: it keeps streaming the others meanwhile
            ids = await asyncio.to_thread(self._ids_of, req, target.tokenizer, chat)
        default = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
        max_new = asked if asked is not None else max(1, min(default, target.max_len - len(ids)))
        if len(ids) + max_new > target.max_len:
            raise ApiError(400, f"This model's maximum context length is {target.max_len} tokens. However, you "
                           f"requested {len(ids) + max_new} tokens ({len(ids)} in the prompt, {max_new} for "
                           f"the completion).", name if len(ids) < target.max_len else "prompt",
                           "context_length_exceeded")  # fmt: skip
        stop = () if req.stop is None else ((req.stop,) if isinstance(req.stop, str) else tuple(req.stop))
        parsed = Parsed(
            model=req.model, ids=ids, max_new=max_new, stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage), stop=stop,
            priority=req.priority, deadline_s=req.deadline_ms / 1e3 if req.deadline_ms is not None else None,
            ignore_eos=req.ignore_eos,
        )  # fmt: skip
        return parsed, target, routed

    async def _next(self, events: asyncio.Queue, request: Request, until_ns: int | None = None) -> tuple:
        """The next worker event: ``("gone",)`` once the client has gone away meanwhile, ``("late",)``
        once the request has lived past ``until_ns`` (its lifetime, ``serve.max_request_s``)."""
        while True:
            wait = 0.5
            if until_ns is not None:
                left = (until_ns - time.perf_counter_ns()) / 1e9
                if left <= 0:
                    return ("late",)
                wait = min(wait, left)
            try:
                return await asyncio.wait_for(events.get(), timeout=wait)
            except TimeoutError:
                if await request.is_disconnected():
                    return ("gone",)

    def late(self) -> ApiError:
        return ApiError(504, f"the request ran past this server's longest lifetime, {self.max_request_s:g} s "
                        "(serve.max_request_s)", None, "timeout", "server_error")  # fmt: skip

    # ---- endpoints ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        down = {name: m.worker.down for name, m in self.models.items() if m.worker.down is not None}
        down.update({name: "its thread is not running" for name, m in self.models.items()
                     if name not in down and m.worker.started and not m.worker.alive})  # fmt: skip
        if down:
            return JSONResponse(
                {"status": "unavailable", "models": list(self.models), "down": down}, status_code=503
            )
        return JSONResponse({"status": "ok", "models": list(self.models)})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi(self.requests))

    async def list_models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "variantbench",
                 "max_model_len": m.max_len, "max_batch_size": m.worker.batch.max_batch} for name, m in self.models.items()]  # fmt: skip
        if self.router is not None:
            data.append({"id": self.router.name, "object": "model", "created": self.created,
                         "owned_by": "variantbench", "router": self.router.describe()})  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        raw = await request.body()  # starlette keeps it: _parse reads it again
        if b'"echo"' in raw:
            with contextlib.suppress(ApiError):  # a bad body gets its 4xx from the generation path
                body = parse_body(raw)
                if body.get("echo") is True:
                    return await self._score(body)
        return await self._generate(request, chat=False)

    async def _score(self, body: dict[str, Any]) -> Response:
        """Prompt scoring: each prompt token's log-probability, computed on the variant's worker."""
        from variantbench.backends.base import LogProbs
        from variantbench.serving.scoring import ScoringError, logprobs_object, prompts_of, score

        label = "-"
        try:
            req = validate(ScoreRequest, body)
            target = self._model(req.model)
            if target is None:
                raise ApiError(400, "scoring needs a variant, not the router", "model")
            label = target.name
            top, new = req.logprobs or 0, req.max_tokens or 0
            if not isinstance(target.backend, LogProbs):
                raise ApiError(400, f"the variant {target.name} cannot score prompts (its backend gives no "
                               "log-probabilities)", "echo")  # fmt: skip
            try:
                prompts, texts = await asyncio.to_thread(prompts_of, body, target.tokenizer)
            except ScoringError as exc:
                raise ApiError(400, str(exc), exc.param) from None
            longest = max(len(p) for p in prompts)
            if longest + new > target.max_len:
                raise ApiError(400, f"This model's maximum context length is {target.max_len} tokens; a prompt "
                               f"of {longest} tokens was given", "prompt", "context_length_exceeded")  # fmt: skip

            def run() -> list[dict[str, Any]]:
                return [score(target.backend, ids, top, bool(new)) for ids in prompts]

            try:
                scored = await asyncio.wrap_future(target.worker.call_between_steps(run))
            except RuntimeError as exc:
                raise ApiError(503, str(exc), None, "server_overloaded", "server_error", 1.0) from None
        except ApiError as exc:
            self.metrics.requests.labels(label, "completions", str(exc.status)).inc()
            return exc.response()
        choices = []
        for i, (one, text) in enumerate(zip(scored, texts, strict=True)):
            full, logprobs = logprobs_object(target.tokenizer, one, text)
            choices.append({"index": i, "text": full, "logprobs": logprobs, "finish_reason": "length"})
        prompt_tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": new * len(prompts),
                 "total_tokens": prompt_tokens + new * len(prompts)}  # fmt: skip
        self.metrics.requests.labels(label, "completions", "200").inc()
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                             "created": int(time.time()), "model": target.name, "choices": choices, "usage": usage},
                            headers={"x-variantbench-model": target.name})  # fmt: skip

    def _tokenizer_of(self, name: Any) -> ServedModel:
        """The variant a tokenizer request names (the router: its light variant), else the first."""
        if name is None:
            return next(iter(self.models.values()))
        target = self._model(name)
        return target if target is not None else self.models[self.router.light]  # None: name is the router's

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"prompt": text, "add_special_tokens": true}`` or ``{"messages": [...]}``."""
        try:
            req = validate(self.requests.tokenize, await self._body(request))
            target = self._tokenizer_of(req.model)
            if req.messages is not None:
                ids = await asyncio.to_thread(_chat_ids, req.messages, target.tokenizer, self.limits)
            elif req.prompt is not None:
                ids = await asyncio.to_thread(_text_ids, req.prompt, target.tokenizer, self.limits,
                                              req.add_special_tokens)  # fmt: skip
            else:
                raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt")
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"count": len(ids), "max_model_len": target.max_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``."""
        try:
            req = validate(self.requests.detokenize, await self._body(request))
            target = self._tokenizer_of(req.model)
            if why := outside_vocab(req.tokens, len(target.tokenizer)):
                raise ApiError(400, f"'tokens' {why}", "tokens")
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": target.tokenizer.decode(req.tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        from variantbench.serving.scoring import tokenizer_info

        try:
            target = self._tokenizer_of(request.query_params.get("model"))
        except ApiError as exc:
            return exc.response()
        return JSONResponse(tokenizer_info(target.tokenizer, target.max_len))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        label = "-"
        # TTFT counts from here, the request received, as vLLM's does: reading and tokenizing the
        # prompt are the server's time (from after them, our p50 read 1.4x below the client's on the
        # tiny model; test_endpoint_variants)
        received = time.perf_counter_ns()
        try:
            parsed, target, routed = await self._parse(request, chat)
            label = target.name
            key = next(self._ids)
            arrival = time.perf_counter_ns()
            try:
                events = target.worker.submit(
                    key, parsed.ids, parsed.max_new, parsed.priority, parsed.deadline_s, parsed.ignore_eos
                )
            except Rejected as exc:
                self.metrics.turned_away(target, parsed.priority)
                kind = "rate_limit_exceeded" if exc.status == 429 else "server_overloaded"
                raise ApiError(exc.status, str(exc), None, kind, kind, exc.retry_after_s) from None
            except ValueError as exc:
                raise ApiError(400, str(exc), "prompt", "context_length_exceeded") from None
            until = received + int(self.max_request_s * 1e9)
            first = await self._next(
                events, request, until
            )  # errors before the first token keep their status
            if first[0] == "late":
                target.worker.cancel(key)
                raise self.late()
            if first[0] == "gone":
                target.worker.cancel(key)
                self.metrics.requests.labels(label, endpoint, "499").inc()
                return Response(status_code=499)
            if first[0] == "error":
                status = first[1]
                if status in (429, 503):
                    self.metrics.turned_away(target, parsed.priority)
                raise ApiError(status, first[2], None, "server_overloaded" if status == 503 else "internal_error",
                               "server_error", 1.0 if status == 503 else None)  # fmt: skip
        except ApiError as exc:
            self.metrics.requests.labels(label, endpoint, str(exc.status)).inc()
            return exc.response()
        run = _Run(self, target, parsed, key, arrival, chat, received)
        headers = {"x-variantbench-decoding": "greedy", "x-variantbench-model": target.name}
        if routed:
            headers["x-variantbench-routed-to"] = routed
        if parsed.stream:
            return StreamingResponse(run.sse(first, events, request), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})  # fmt: skip
        return await run.whole(first, events, request, headers)


class _Run:
    """One admitted request: turns worker events into OpenAI chunks, and records its metrics."""

    def __init__(self, server: Server, target: ServedModel, parsed: Parsed, key: int, arrival_ns: int,
                 chat: bool, received_ns: int | None = None) -> None:  # fmt: skip
        self.server, self.target, self.p, self.key = server, target, parsed, key
        self.arrival_ns, self.chat = arrival_ns, chat  # arrival: queued at the worker
        self.received_ns = received_ns if received_ns is not None else arrival_ns
        self.until_ns = self.received_ns + int(server.max_request_s * 1e9)  # its longest lifetime
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.text = TextStream(target.tokenizer, target.worker.batch.stop_ids, parsed.stop)
        self.completion_tokens = 0
        self.finish: str | None = None
        self.last_ns: int | None = None  # the last token's time on this loop
        self.computed_ns: int | None = None  # ... and on the worker's clock
        self.admitted_ns: int | None = None
        self.endpoint = "chat" if chat else "completions"

    def _observe(self, event: tuple) -> str:
        """Record one token event; return the text it adds.

        TTFT and ITL are timed when the token reaches this loop to be written out, not when the worker
        computed it (``t_ns``): a token that waits for the loop (the GIL, a busy loop) waits for the
        client too, and the server's histograms should say so."""
        m, name = self.server.metrics, self.target.name
        _, token, t_ns, queue_wait_s = event
        seen = time.perf_counter_ns()
        if self.last_ns is None:
            m.ttft.labels(name).observe((seen - self.received_ns) / 1e9)
            m.first_token(self.target, self.p.priority, (seen - self.received_ns) / 1e9)
            if queue_wait_s is not None:
                m.queue_wait.labels(name).observe(queue_wait_s)
                self.admitted_ns = self.arrival_ns + int(queue_wait_s * 1e9)
        else:
            m.itl.labels(name).observe((seen - self.last_ns) / 1e9)
        self.last_ns = seen
        self.computed_ns = t_ns
        self.completion_tokens += 1
        return self.text.push(token)

    def _close(self, status: str) -> None:
        m, name = self.server.metrics, self.target.name
        if self.admitted_ns is not None and self.computed_ns is not None:
            m.compute.labels(name).observe((self.computed_ns - self.admitted_ns) / 1e9)
        m.requests.labels(name, self.endpoint, status).inc()

    def _usage(self) -> dict[str, int]:
        n_in = len(self.p.ids)
        return {"prompt_tokens": n_in, "completion_tokens": self.completion_tokens,
                "total_tokens": n_in + self.completion_tokens}  # fmt: skip

    def _chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.p.model,
            "choices": [choice],
        }

    async def _events(self, first: tuple, events: asyncio.Queue, request: Request):  # noqa: ANN202
        """Text deltas until the end; sets ``finish``; raises ApiError on a worker error."""
        event = first
        while True:
            if event[0] == "token":
                delta = self._observe(event)
                if self.text.stopped:  # a stop string: the request ends here
                    self.target.worker.cancel(self.key)
                    self.finish = "stop"
                    yield delta
                    return
                if delta:
                    yield delta
            elif event[0] == "done":
                self.finish = event[1]
                tail = self.text.flush()
                if tail:
                    yield tail
                return
            elif event[0] == "error":
                raise ApiError(event[1], event[2], None, "internal_error", "server_error")
            elif event[0] == "gone":
                raise ConnectionError("client went away")
            elif event[0] == "late":
                self.target.worker.cancel(self.key)
                raise self.server.late()
            event = await self.server._next(events, request, self.until_ns)

    async def whole(self, first: tuple, events: asyncio.Queue, request: Request, headers: dict) -> Response:
        parts: list[str] = []
        try:
            async for delta in self._events(first, events, request):
                parts.append(delta)
        except ApiError as exc:
            self._close(str(exc.status))
            return exc.response()
        except ConnectionError:
            self.target.worker.cancel(self.key)
            self._close("499")
            return Response(status_code=499)
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": self.finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.p.model, "choices": [choice], "usage": self._usage()}  # fmt: skip
        self._close("200")
        return JSONResponse(body, headers=headers)

    async def sse(self, first: tuple, events: asyncio.Queue, request: Request):  # noqa: ANN201
        status = "200"

        def data(obj: Any) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        try:
            if self.chat:
                yield data(self._chunk(None, None, role=True))
            async for delta in self._events(first, events, request):
                if delta:
                    yield data(self._chunk(delta, None))
            yield data(self._chunk(None, self.finish))
            if self.p.include_usage:
                yield data({"id": self.id, "object": self._chunk(None, None)["object"], "created": self.created,
                            "model": self.p.model, "choices": [], "usage": self._usage()})  # fmt: skip
            yield b"data: [DONE]\n\n"
        except ApiError as exc:  # the stream has begun: the error goes in the stream
            status = str(exc.status)
            yield data({"error": {"message": exc.message, "type": exc.kind, "param": None, "code": exc.code}})
            yield b"data: [DONE]\n\n"
        finally:  # normal end, error, or the client went away (cancelled or GeneratorExit)
            if self.finish is None:
                self.target.worker.cancel(self.key)  # free its queue entry or batch slot
                if status == "200":
                    status = "499"
            self._close(status)


def make_app(models: dict[str, ServedModel], router: Any = None, drain_timeout_s: float = 30.0,
             access: Access | None = None, limits: Limits | None = None, max_request_s: float = 600.0) -> Starlette:  # fmt: skip
    """The ASGI app. Starting it starts the workers; shutting it down drains them. ``access``: who may
    call it and how large and slow a body may be (default: no key, loopback names only)."""
    from starlette.middleware import Middleware

    server = Server(models, router, drain_timeout_s, limits, max_request_s)
    access = access or Access(max_body_bytes=server.limits.max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # noqa: ANN202
        for m in models.values():
            if not m.worker.started:
                m.worker.start()
        try:
            yield
        finally:  # uvicorn has already waited for open connections (its graceful shutdown)
            await asyncio.gather(*(asyncio.to_thread(m.worker.drain_and_stop, drain_timeout_s)
                                   for m in models.values()))  # fmt: skip

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def internal(request: Request, exc: Exception) -> Response:
        """A bug we see, not a hang: logged with a request id the client is given too."""
        rid = uuid.uuid4().hex[:12]
        LOG.error("request %s %s %s failed: %s", rid, request.method, request.url.path, exc, exc_info=exc)
        return ApiError(500, f"internal error (request id {rid}): {type(exc).__name__}", kind="server_error",
                        code="internal_error").response()  # fmt: skip

    app = Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.list_models, methods=["GET"]),
            Route("/metrics", server.prometheus, methods=["GET"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/tokenize", server.tokenize, methods=["POST"]),
            Route("/detokenize", server.detokenize, methods=["POST"]),
            Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
            Route("/openapi.json", server.openapi, methods=["GET"]),
        ],
        middleware=[Middleware(Guard, access=access)],
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_allowed, Exception: internal},
    )
    app.state.server = server
    return app
