"""Who may talk to the server, and how much and how slowly: an ASGI layer in front of the routes.

Issue 41: the server took any request from anyone. Any web page the user visited could POST to
``127.0.0.1:8000`` (a cross-site form post is a "simple" request: no preflight, any Content-Type),
and a DNS-rebinding page, whose own name resolves to 127.0.0.1, could read the answers (no Host check).
A body was read whole, however large, and however slowly it came. In order, each request must:

1. name an allowed host (``Host``: the bound address, localhost, ``serve.allowed_hosts``): else 400;
2. come from no other origin (a browser's ``Origin`` header, when present, must name an allowed host): else 403;
3. carry a key (``Authorization: Bearer KEY``, compared in constant time against every configured key,
   as vLLM's ``--api-key`` does) unless its path is public (``/health``, ``/metrics`` by default): else 401;
4. on POST, say ``Content-Type: application/json``: else 415 (what a form can send is refused);
5. send a body no larger than ``max_body_bytes`` (413, read no further: a ``Content-Length`` above it
   is refused before a byte of the body is read) within ``body_timeout_s`` (408, and the connection
   is closed).

The header phase is bounded beneath this layer, in the HTTP protocol (``serving/protocol.py``): the
app sees a request only once its headers are in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
import hmac
from typing import Any
from urllib.parse import urlsplit

from variantbench.serving.requests import ApiError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Access:
    """The keys and names a server accepts (the plan's ``serve`` section, resolved)."""

    keys: tuple[str, ...] = ()
    public_paths: tuple[str, ...] = ("/health", "/metrics")
    hosts: tuple[str, ...] = LOOPBACK  # lower-case names without a port; "*": any
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0

    @staticmethod
    def for_server(
        bound: str, keys: Sequence[str] = (), allowed_hosts: Sequence[str] = (), **kw: Any
    ) -> Access:
        """The names a server bound to ``bound`` is reached by: that address and loopback's, and
        ``allowed_hosts``; bound to every interface (0.0.0.0), any name unless ``allowed_hosts`` lists them."""
        extra = tuple(h.lower().strip("[]") for h in allowed_hosts)
        if bound in WILDCARDS and not extra:
            hosts: tuple[str, ...] = ("*",)
        else:
            hosts = (*LOOPBACK, *([bound.lower().strip("[]")] if bound not in WILDCARDS else []), *extra)
        return Access(keys=tuple(keys), hosts=hosts, **kw)

    def host_ok(self, value: str) -> bool:
        if "*" in self.hosts:
            return True
        return _hostname(value) in self.hosts

    def key_ok(self, header: str | None) -> bool:
        if not self.keys:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        # every key compared, each in constant time: how long the check takes says nothing of a key
        return sum(hmac.compare_digest(given, key.encode()) for key in self.keys) > 0


def _hostname(value: str) -> str:
    """``host:port``, ``[::1]:8000`` or a bare name -> the lower-case name."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, _, port = value.rpartition(":")
    return name if name and port.isdigit() else value


def parse_keys(value: str | None, environ: dict[str, str]) -> tuple[str, ...]:
    """``serve.api_key``: keys, comma-separated, or ``$NAME`` for the variable holding them."""
    if not value:
        return ()
    if value.startswith("$"):
        value = environ.get(value[1:], "")
    return tuple(k.strip() for k in value.split(",") if k.strip())


class Guard:
    """The ASGI middleware: checks 1-5 above, then hands the request, body read, to ``app``."""

    def __init__(self, app: Any, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            receive = await self._admit(scope, receive)
        except ApiError as exc:
            await _respond(send, exc)
            return
        await self.app(scope, receive, send)

    async def _admit(self, scope: dict, receive: Any) -> Any:
        a = self.access
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if not a.host_ok(host):
            raise ApiError(400, f"the Host {host[:60]!r} is not one this server answers to (serve.allowed_hosts)",
                           code="host_not_allowed")  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and not a.host_ok(urlsplit(origin).netloc if origin != "null" else "null"):
            raise ApiError(403, "cross-origin requests are refused (the Origin is not an allowed host)",
                           code="origin_not_allowed", kind="permission_error")  # fmt: skip
        path = scope.get("path", "")
        if path not in a.public_paths and not a.key_ok(headers.get("authorization")):
            raise ApiError(401, "a valid API key is required: 'Authorization: Bearer KEY'", code="invalid_api_key",
                           kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if scope.get("method") != "POST":
            return receive
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {ctype[:60]!r}",
                           code="unsupported_media_type")  # fmt: skip
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > a.max_body_bytes:
            raise _too_large(a.max_body_bytes)
        body = await self._body(receive)
        return _replay(body, receive)

    async def _body(self, receive: Any) -> bytes:
        """The whole body within the byte limit and the time limit."""
        a = self.access
        loop = asyncio.get_running_loop()
        deadline = loop.time() + a.body_timeout_s
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {a.body_timeout_s:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None  # fmt: skip
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client went away before its body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > a.max_body_bytes:
                raise _too_large(a.max_body_bytes)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit / (1 << 20):g} MiB", code="body_too_large",
                    headers={"Connection": "close"})  # fmt: skip


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives the body read already, then waits on the connection (a disconnect)."""
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _respond(send: Any, exc: ApiError) -> None:
    import json

    payload = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.header_list().items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
