"""Measure any OpenAI-compatible server (vLLM, TGI, llama.cpp's server, ours) over HTTP with SSE.

Each request streams (``stream: true``), so time to first token and every later token are seen as
they arrive; token counts come from the server's ``usage`` when it sends one (``stream_options``),
else one token per content chunk. HTTP errors, timeouts and garbage are per-query error results,
never exceptions into the harness. The client is aiohttp with a connection pool sized for the load
and a 1 MiB read buffer: aiohttp's 64 KB default collapses throughput on long streamed answers
(vLLM's finding). httpx was measured first and dropped: its connection pool assigns waiting
requests in quadratic time, and at 400 queries/s against a no-op server here it stalled.

``load()`` is a synchronous probe of ``/v1/models``: an unreachable endpoint or one that answers
garbage fails there, before the run, with one clear line.

Likelihood scores of a served variant (``continuation_logprobs``, ``metrics/likelihood.py``) are
vLLM's way, which our server answers too: the prompt as the server sees the request from vLLM's
``/tokenize`` (the messages through the server's chat template, or the plain prompt), each
continuation tokenized alone, and one ``/v1/completions`` request with ``echo: true, logprobs: 1,
max_tokens: 1`` over the token ids, whose ``token_logprobs`` after the prompt are the
continuation's. Token ids and not text: text would be split again at the join, and a chat prompt
has no text form outside the server. A server without ``/tokenize`` or one that refuses ``echo``
(TGI, llama.cpp's server, hosted APIs) is reported as not available, never guessed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any
import urllib.error
import urllib.request

import aiohttp

from variantbench.backends.base import GenerationRequest, GenerationResult, LoadInfo
from variantbench.credentials import default_api_key
from variantbench.errors import SampleNotScored, ScoringUnavailable, UserError
from variantbench.redact import redact_url, split_url

APIS = ("completions", "chat")
JSON_HEADERS = {"Content-Type": "application/json"}
READ_BUFFER_BYTES = 1 << 20


class OpenAIBackend:
    """Picklable until ``astart()``: only the address and options."""

    concurrent = True  # the harness drives agenerate() from an event loop, many requests in flight

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api: str = "completions",
        timeout_s: float = 120.0,
        max_connections: int = 0,
        name: str | None = None,
        api_key: str | None = None,
        headers: dict[str, str] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if api not in APIS:
            raise UserError(f"unknown API {api!r}; known: {', '.join(APIS)}")
        if not base_url.startswith(("http://", "https://")):
            raise UserError(f"endpoint must be an http(s) URL, got {redact_url(base_url)!r}")
        # user-info and query are sent (Basic auth; the query on every request), never shown or stored
        url, basic, self.query = split_url(base_url)
        url = url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.model = model
        self.api = api
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.name = name or model or "endpoint"
        # sent with every request, /v1/models included: a gateway or a hosted API checks them all;
        # with no key given, VARIANTBENCH_API_KEY's first (the key `variantbench serve` checks)
        api_key = api_key or (None if basic else default_api_key())
        self.headers = {
            **basic,
            **(headers or {}),
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        }
        self.extra_body = dict(extra_body or {})  # merged over ours: the user's word wins
        self._client: aiohttp.ClientSession | None = None
        self._info: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    # ---- lifecycle ------------------------------------------------------------------------------

    def load(self) -> LoadInfo:
        t0 = time.perf_counter_ns()
        request = urllib.request.Request(
            f"{self.base_url}{self._q('/v1/models')}", headers={"Accept": "application/json", **self.headers}
        )
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 10.0)) as resp:  # noqa: S310 - user URL
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise UserError(f"endpoint {self.base_url}/v1/models answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UserError(f"cannot reach endpoint {self.base_url}: {reason}") from None
        try:
            models = [m["id"] for m in json.loads(raw)["data"]]
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"endpoint {self.base_url} did not answer /v1/models with OpenAI-style JSON"
            ) from None
        if self.model is None:
            if not models:
                raise UserError(f"endpoint {self.base_url} lists no models; pass one with --endpoint-model")
            self.model = models[0]
            if self.name == "endpoint":
                self.name = self.model
        self._info = {"backend": "openai-http", "endpoint": self.base_url, "model": self.model, "api": self.api,
                      "models": models}  # fmt: skip
        return LoadInfo(
            startup_s=(time.perf_counter_ns() - t0) / 1e9, param_bytes=0, details=dict(self._info)
        )

    def _q(self, path: str) -> str:
        """``path`` with the endpoint URL's query (an API version, a gateway's key), if it had one."""
        return f"{path}?{self.query}" if self.query else path

    def address(self) -> tuple[str, str | None, dict[str, str]]:
        return self.base_url, self.model, dict(self.headers)

    def info(self) -> dict[str, Any]:
        return dict(self._info) or {"backend": "openai-http", "endpoint": self.base_url}

    def _new_session(self) -> aiohttp.ClientSession:
        # 0: no cap here. The harness enforces --max-concurrency itself; a pool cap (aiohttp's default
        # is 100) would queue requests silently and cap the concurrency the user asked for
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10.0)
        return aiohttp.ClientSession(
            base_url=self.base_url,
            connector=connector,
            timeout=timeout,
            read_bufsize=READ_BUFFER_BYTES,
            headers={**JSON_HEADERS, **self.headers},
        )

    async def astart(self) -> None:
        self._client = self._new_session()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def close(self) -> None:
        pass  # the async client is closed by aclose() on its own loop

    # ---- requests -------------------------------------------------------------------------------

    def _body(self, req: GenerationRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api == "chat" or req.messages:
            messages = list(req.messages) if req.messages else [{"role": "user", "content": req.prompt or ""}]
            body["messages"] = messages
            return "/v1/chat/completions", {**body, **self.extra_body}
        body["prompt"] = req.prompt or ""
        return "/v1/completions", {**body, **self.extra_body}

    async def agenerate(
        self, req: GenerationRequest, client: aiohttp.ClientSession | None = None
    ) -> GenerationResult:
        if client is None:
            if self._client is None:
                await self.astart()
            client = self._client
        assert client is not None
        path, body = self._body(req)
        start = time.perf_counter_ns()
        token_ns: list[int] = []
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        try:
            # the body encoded here, once: aiohttp's JSON payload would encode it on the loop's turn
            async with client.post(self._q(path), data=json.dumps(body).encode()) as resp:
                if resp.status != 200:
                    detail = (await resp.content.read(200)).decode("utf-8", "replace").strip()
                    return _error(req, start, f"HTTP {resp.status}: {detail}")
                # whatever arrived, at once, stamped once: the lines of one read arrived together
                # (iterating line by line cost more: 489 against 415 us of CPU a request for 8
                # streamed tokens from the no-op server, aiohttp's own share being about 300)
                rest = b""
                done = False
                async for data in resp.content.iter_any():
                    now = time.perf_counter_ns()
                    *lines, rest = (rest + data).split(b"\n")
                    if len(rest) > MAX_LINE_BYTES:  # a server that sends no newlines: not buffered forever
                        return _error(
                            req, start, f"an SSE line over {MAX_LINE_BYTES >> 20} MiB without a newline"
                        )
                    for raw in lines:
                        event = _sse_event(raw)
                        if event is _DONE:
                            done = True
                            break
                        if isinstance(event, str):
                            return _error(req, start, event)
                        if event is not None and "error" in event:  # the server gave up mid-answer
                            return _error(req, start, f"error event mid-stream after {len(token_ns)} tokens: "
                                                      f"{_error_message(event['error'])}")  # fmt: skip
                        if event is not None:
                            usage = event.get("usage") or usage
                            text = _chunk_text(event)
                            if text:
                                token_ns.append(now)
                                parts.append(text)
                    if done:
                        break
        except TimeoutError:
            return _error(req, start, f"timed out after {self.timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return _error(req, start, f"{type(exc).__name__}: {exc}")
        end = time.perf_counter_ns()
        if not done:  # a connection closed cleanly mid-answer is not a shorter answer
            return _error(req, start, f"stream ended without [DONE] after {len(token_ns)} tokens")
        if not token_ns and usage is None:
            return _error(req, start, "stream ended without any token")
        output_tokens = int(usage.get("completion_tokens", len(token_ns))) if usage else len(token_ns)
        input_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
        return GenerationResult(
            req.request_id,
            text="".join(parts).strip(),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            start_ns=start,
            first_token_ns=token_ns[0] if token_ns else None,
            token_ns=token_ns,
            end_ns=end,
        )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Synchronous form (warm-up, simple callers): all requests concurrently, on a private loop."""

        async def run() -> list[GenerationResult]:
            async with self._new_session() as client:  # its own session: the harness's stays untouched
                return list(await asyncio.gather(*(self.agenerate(r, client) for r in requests)))

        return asyncio.run(run())

    # ---- likelihood scoring (ScoresServed) --------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One synchronous JSON request; ``ScoringUnavailable`` with the server's reason otherwise."""
        request = urllib.request.Request(f"{self.base_url}{self._q(path)}", data=json.dumps(body).encode(),
                                         headers={**JSON_HEADERS, **self.headers}, method="POST")  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:  # noqa: S310 - user URL
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode("utf-8", "replace")
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                detail = json.loads(detail)["error"]["message"]
            if exc.code == 400 and "maximum context length" in str(detail):  # OpenAI's and vLLM's words
                raise SampleNotScored(" ".join(str(detail).split())[:200]) from None
            raise ScoringUnavailable(
                f"{path} answered HTTP {exc.code}: {' '.join(str(detail).split())[:200]}"
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ScoringUnavailable(f"{path}: {getattr(exc, 'reason', exc)}") from None
        if not isinstance(answer, dict):
            raise ScoringUnavailable(f"{path} did not answer a JSON object")
        return answer

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        tokens = self._post("/tokenize", {"model": self.model, **body}).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ScoringUnavailable("/tokenize did not answer a list of token ids")
        return tokens

    def continuation_logprobs(self, request: GenerationRequest, continuations: list[str],
                              max_tokens: int) -> list[list[float]]:  # fmt: skip
        """Each continuation's token log-probabilities after the request's prompt (module docstring)."""
        if self.api == "chat" or request.messages:
            messages = (
                list(request.messages)
                if request.messages
                else [{"role": "user", "content": request.prompt or ""}]
            )
            prompt = self._tokens({"messages": messages, "add_generation_prompt": True})
        else:
            prompt = self._tokens({"prompt": request.prompt or "", "add_special_tokens": True})
        conts = [self._tokens({"prompt": c, "add_special_tokens": False})[:max_tokens] for c in continuations]
        body = {"model": self.model, "prompt": [prompt + c for c in conts], "echo": True, "logprobs": 1,
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        choices = sorted(
            self._post("/v1/completions", body).get("choices") or [], key=lambda c: c.get("index", 0)
        )
        if len(choices) != len(conts):
            raise ScoringUnavailable(
                f"/v1/completions answered {len(choices)} choices for {len(conts)} prompts"
            )
        out = []
        for cont, choice in zip(conts, choices, strict=True):
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            scored = logprobs[len(prompt) : len(prompt) + len(cont)] if isinstance(logprobs, list) else []
            if len(scored) != len(cont) or not all(isinstance(v, (int, float)) for v in scored):
                raise ScoringUnavailable(
                    "/v1/completions with echo did not return the prompt's token log-probabilities"
                )
            out.append([float(v) for v in scored])
        return out


_DONE = object()
MAX_LINE_BYTES = 1 << 20  # one SSE line: a streamed chunk is a few hundred bytes


def _error_message(error: Any) -> str:
    """An OpenAI-style ``{"error": {"message": ...}}`` event's message (or whatever it holds)."""
    message = error.get("message") if isinstance(error, dict) else error
    text = str(message if message is not None else error).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _sse_event(raw: bytes) -> dict[str, Any] | str | object | None:
    """One SSE line: its JSON object, ``_DONE`` at ``[DONE]``, None for what carries no data
    (blank separators, comments, ``event:`` lines), or a one-line error for malformed data."""
    if not raw.startswith(b"data:"):
        return None
    payload = raw[5:].strip()
    if payload == b"[DONE]":
        return _DONE
    try:
        chunk = json.loads(payload)
    except ValueError:
        return f"malformed SSE data: {payload[:80]!r}"
    return chunk if isinstance(chunk, dict) else f"malformed SSE data: {payload[:80]!r}"


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:  # /v1/completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}  # /v1/chat/completions
    return delta.get("content") or ""


def _error(req: GenerationRequest, start: int, message: str) -> GenerationResult:
    return GenerationResult(
        req.request_id, status="error", error=message, start_ns=start, end_ns=time.perf_counter_ns()
    )
