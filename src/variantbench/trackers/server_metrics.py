"""The server's own view: its Prometheus ``/metrics``, scraped while an endpoint is measured (and
beside each monitor probe).

Parsed with prometheus-client's parser (the exposition format has escapes, histograms and
exemplars: not a thing to split by hand). Kept: the serving engines' own series, by prefix
(vLLM's ``vllm:``, TGI's ``tgi_``, llama.cpp's ``llamacpp:``, SGLang's ``sglang:``, ours), gauges
and counters as they are, histograms as their ``_count`` and ``_sum``; a server without
``/metrics`` gives ``None`` and the probe goes on.
"""

from __future__ import annotations

import threading
import time
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


# the server's own series worth a chart, by what they mean: (kind, name prefixes); first found wins
KEY_SERIES: dict[str, tuple[str, ...]] = {
    "running requests": ("vllm:num_requests_running", "variantbench_running_requests", "sglang:num_running_reqs",
                         "llamacpp:requests_processing", "tgi_batch_current_size"),
    "waiting requests": ("vllm:num_requests_waiting", "variantbench_queue_depth", "sglang:num_queue_reqs",
                         "llamacpp:requests_deferred", "tgi_queue_size"),
    "KV-cache use (0-1)": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                           "llamacpp:kv_cache_usage_ratio"),
}  # fmt: skip


BATCH_HISTOGRAM = "variantbench_batch_size"  # rows per decode step: its mean per interval is the batch size


def _summed(series: dict[str, float], name: str) -> float | None:
    """A series summed over its label sets (None when the server does not expose it)."""
    values = [v for k, v in series.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def key_series(samples: list[list[Any]]) -> dict[str, list[tuple[int, float]]]:
    """From scraped samples ``[t_ns, {series: value}]``: each key gauge summed over its label sets,
    and the mean batch size per interval from the batch histogram's sum and count deltas."""
    out: dict[str, list[tuple[int, float]]] = {}
    for kind, names in KEY_SERIES.items():
        for name in names:
            points = [(t, v) for t, series in samples if (v := _summed(series, name)) is not None]
            if points:
                out[kind] = points
                break
    batch = []
    for (_, a), (t, b) in zip(samples, samples[1:], strict=False):
        steps = (_summed(b, BATCH_HISTOGRAM + "_count") or 0) - (_summed(a, BATCH_HISTOGRAM + "_count") or 0)
        if steps > 0:
            rows = (_summed(b, BATCH_HISTOGRAM + "_sum") or 0) - (_summed(a, BATCH_HISTOGRAM + "_sum") or 0)
            batch.append((t, rows / steps))
    if batch:
        out["mean batch size (rows per step)"] = batch
    return out


class ServerScraper:
    """The server's /metrics scraped every ``interval_s`` in a background thread while a block runs:
    ``samples`` is ``[[perf_counter_ns, {series: value}], ...]`` (the query log's clock), ``error``
    the reason when the server has no readable /metrics (scraping then stops at once)."""

    def __init__(self, base_url: str, interval_s: float = 1.0, headers: dict[str, str] | None = None) -> None:
        self.base_url, self.interval_s, self.headers = base_url, interval_s, headers
        self.samples: list[list[Any]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            got = scrape(self.base_url, self.headers, timeout_s=max(1.0, self.interval_s))
            if "error" in got:
                self.error = got["error"]
                return
            self.samples.append([time.perf_counter_ns(), got["series"]])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ServerScraper:
        self._thread = threading.Thread(target=self._run, name="server-metrics", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
