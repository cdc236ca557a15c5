"""Secrets never written: what a plan may hold that must not reach ``plan.yaml``, ``report.json`` or a log.

Issue 41 found header values given literally, URL user-info (``http://user:pass@host``) and query
strings (``?api-key=...``) written into ``plan.yaml`` and ``report.json``. A plan is written through
``redact_plan`` (``plan_file.dump_plan`` and the report's copy): a header value that is not a
``$NAME`` reference, a ``serve.api_key`` that is not one, and the user-info and query of every URL
become ``***``. The HTTP client splits a URL once (``split_url``): user-info becomes a Basic
``Authorization`` header and the query is sent with every request, while the address it shows in
messages, records and reports has neither. ``tests/test_secrets.py`` plants secrets in a run and
greps every file it wrote.

A plan written with a secret redacted cannot resume with it: ``redacted_keys`` names such keys so
``run --resume`` can say to give them as ``$NAME``.
"""

from __future__ import annotations

import base64
import re
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

REDACTED = "***"
_URL = re.compile(r"\b(?:https?|wss?|ray)://[^\s\"'<>]+")


def split_url(url: str) -> tuple[str, dict[str, str], str]:
    """``http://u:p@host/v1?k=v`` -> (``http://host/v1``, Basic auth header for ``u:p``, ``k=v``)."""
    parts = urlsplit(url)
    headers: dict[str, str] = {}
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        token = base64.b64encode(unquote(userinfo).encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")), headers, parts.query


def redact_url(url: str) -> str:
    """A URL with its user-info and its query's values replaced by ``***`` (unchanged without them;
    the fragment kept: ``NAME=URL#MODEL`` names the served model there)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    if "@" not in parts.netloc and not parts.query:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(
        f"{item.partition('=')[0]}={REDACTED}" if "=" in item else REDACTED
        for item in parts.query.split("&")
        if item
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URL in ``text`` redacted (an error message that quotes the address it failed on)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def redact_plan(data: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON dump, safe to write: literal header values and keys, URL user-info and queries."""
    return _walk(data, ())


def _walk(value: Any, path: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v, (*path, str(k))) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, path) for v in value]
    if isinstance(value, str):
        if _is_secret(path) and value and not value.startswith("$"):
            return REDACTED
        if _URL.search(value):
            return redact_text(value)
    return value


def _is_secret(path: tuple[str, ...]) -> bool:
    """Header values (``endpoints.NAME.headers.H``, ``headers.H`` anywhere) and API keys."""
    return (len(path) >= 2 and path[-2] == "headers") or (path[-1:] == ("api_key",))


def redacted_keys(data: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Key paths of a written plan that hold a redacted value (``endpoints.vllm.headers.X-Key``)."""
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in redacted_keys(v, (*path, str(key)))]
    if isinstance(data, list):
        return [k for v in data for k in redacted_keys(v, path)]
    if isinstance(data, str) and REDACTED in data:
        return [".".join(path)]
    return []
