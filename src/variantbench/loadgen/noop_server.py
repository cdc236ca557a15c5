"""A no-op OpenAI-compatible server: answers instantly (or after set delays) with fixed tokens.

It measures the harness, not a model: ``variantbench selftest`` and the peer benchmark drive it at
increasing rates, and the tests use it for SSE parsing, timeouts and HTTP errors. A bare ASGI app
on uvicorn (httptools parser), so the server costs as little as possible per request. Behaviour by
the request's ``model`` field: ``fail500`` answers HTTP 500, ``garbage`` streams non-JSON data,
``slow`` waits ``slow_s`` before the first token; anything else streams ``tokens`` tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import uvicorn

MODEL = "noop"


def make_app(tokens: int = 8, token_delay_s: float = 0.0, slow_s: float = 5.0):  # noqa: ANN201
    models_body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def read_body(receive: Any) -> bytes:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                return body

    async def send_json(send: Any, status: int, payload: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET" and path == "/health":
            await send_json(send, 200, b'{"status": "ok"}')
            return
        if scope["method"] == "GET" and path == "/v1/models":
            await send_json(send, 200, models_body)
            return
        if scope["method"] != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await send_json(send, 404, b'{"error": {"message": "not found"}}')
            return
        try:
            request = json.loads(await read_body(receive))
        except ValueError:
            await send_json(send, 400, b'{"error": {"message": "malformed JSON"}}')
            return
        model = request.get("model")
        if model == "fail500":
            await send_json(send, 500, b'{"error": {"message": "injected failure"}}')
            return
        n = min(int(request.get("max_tokens") or tokens), tokens)
        chat = path.endswith("chat/completions")
        if not request.get("stream"):
            text = " tok" * n
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            await send_json(send, 200, json.dumps({"choices": [choice], "usage": usage}).encode())
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        if model == "slow":
            await asyncio.sleep(slow_s)
        if model == "garbage":
            await send(
                {"type": "http.response.body", "body": b"data: this is not json\n\n", "more_body": True}
            )
        for _ in range(n):
            if token_delay_s:
                await asyncio.sleep(token_delay_s)
            choice = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            chunk = b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        tail = b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(port: int, app: Any = None, host: str = "127.0.0.1", **app_kw: Any) -> uvicorn.Config:
    return uvicorn.Config(app or make_app(**app_kw), host=host, port=port, log_level="error", access_log=False,
                          http="httptools", lifespan="on", backlog=4096,
                          timeout_graceful_shutdown=30)  # fmt: skip


class ThreadServer:
    """An ASGI app (by default the no-op server) on uvicorn in a thread of this process (tests)."""

    def __init__(
        self, app: Any = None, config: Callable[[int], uvicorn.Config] | None = None, **app_kw: Any
    ) -> None:
        """``config``: the uvicorn configuration for a port (default: ours, with the no-op app's ``app_kw``)."""
        self.port = free_port()
        self.server = uvicorn.Server(config(self.port) if config else _config(self.port, app, **app_kw))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            if not self.thread.is_alive():
                raise RuntimeError("server stopped while starting")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class ProcessServer:
    """The no-op server in its own process, so it does not share the harness's interpreter."""

    def __init__(self, tokens: int = 8, token_delay_s: float = 0.0) -> None:
        self.port = free_port()
        self.args = [sys.executable, "-m", "variantbench.loadgen.noop_server", "--port", str(self.port),
                     "--tokens", str(tokens), "--token-delay", str(token_delay_s)]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ProcessServer:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__()
                    raise RuntimeError("no-op server did not start") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Terminate, wait up to ``timeout_s`` for it to finish (a server drains), then kill."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="no-op OpenAI-compatible server (measures harnesses)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    uvicorn.Server(_config(args.port, tokens=args.tokens, token_delay_s=args.token_delay)).run()


if __name__ == "__main__":
    main()
