"""The server's own view: its Prometheus ``/metrics``, scraped beside each probe.

Parsed with prometheus-client's parser (the exposition format has escapes, histograms and
exemplars: not a thing to split by hand). Kept: the serving engines' own series, by prefix
(vLLM's ``vllm:``, TGI's ``tgi_``, llama.cpp's ``llamacpp:``, SGLang's ``sglang:``, ours), gauges
and counters as they are, histograms as their ``_count`` and ``_sum``; a server without
``/metrics`` gives ``None`` and the probe goes on.
"""

from __future__ import annotations

from typing import Any
from urllib.error import URLError
from urllib.request import Request, urlopen

PREFIXES = ("vllm:", "tgi_", "llamacpp:", "sglang:", "variantbench_")
KEPT_SUFFIXES = ("", "_total", "_count", "_sum")


def metrics_url(base_url: str) -> str:
    """``/metrics`` lives at the server's root, beside ``/v1``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/metrics"


def parse(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIXES):
            continue
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            if suffix not in KEPT_SUFFIXES or sample.name.endswith("_created"):
                continue  # histogram buckets: the count and the sum say enough between two probes
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def scrape(base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """``{"url", "series": {name: value}}``, or ``{"url", "error"}`` when there is no readable /metrics."""
    url = metrics_url(base_url)
    try:
        with urlopen(Request(url, headers=headers or {}), timeout=timeout_s) as resp:  # noqa: S310 - the user's server
            text = resp.read().decode("utf-8", "replace")
        return {"url": url, "series": parse(text)}
    except (URLError, OSError, ValueError) as exc:
        return {"url": url, "error": str(getattr(exc, "reason", exc))}
