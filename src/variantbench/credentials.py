"""The API key our clients send to a server that asks for one (issue 41).

``variantbench serve`` checks the keys of ``VARIANTBENCH_API_KEY`` (comma-separated) by default; the
benchmark client (``backends/openai_http.py``), the monitor's scrapes of ``/metrics`` and the serving
benchmarks' readiness probes send its first, unless they are given a key of their own. The key is
read from the environment at the moment it is sent and never written to a file (``report/redact.py``).
"""

from __future__ import annotations

import os

API_KEY_ENV = "VARIANTBENCH_API_KEY"


def default_api_key() -> str | None:
    """The first key of ``VARIANTBENCH_API_KEY``, if set."""
    keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return keys[0] if keys else None


def auth_headers() -> dict[str, str]:
    key = default_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}
