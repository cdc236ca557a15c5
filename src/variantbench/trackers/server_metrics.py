"""The server's own view: its Prometheus ``/metrics``, scraped while an endpoint is measured (and
beside each monitor probe).

Parsed with prometheus-client's parser (the exposition format has escapes, histograms and
exemplars: not a thing to split by hand). Kept: the serving engines' own series, by prefix
(vLLM's ``vllm:``, TGI's ``tgi_``, llama.cpp's ``llamacpp:``, SGLang's ``sglang:``, ours), gauges
and counters as they are, histograms as their ``_count`` and ``_sum``, and the buckets of the
latency histograms (time to first token, inter-token latency) so that the server's own percentiles
can be set beside the client's; a server without ``/metrics`` gives ``None`` and the probe goes on.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.error import URLError
from urllib.request import Request, urlopen

from variantbench.credentials import auth_headers
from variantbench.redact import redact_text, split_url

PREFIXES = ("vllm:", "tgi_", "llamacpp:", "sglang:", "variantbench_")
KEPT_SUFFIXES = ("", "_total", "_count", "_sum")
# the engines' own latency histograms, by what they time: first found wins (their buckets are kept)
LATENCY_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("variantbench_ttft_seconds", "vllm:time_to_first_token_seconds",
             "sglang:time_to_first_token_seconds"),
    "itl": ("variantbench_inter_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
}  # fmt: skip
_BUCKETED = {name for names in LATENCY_HISTOGRAMS.values() for name in names}


def metrics_url(base_url: str) -> str:
    """``/metrics`` lives at the server's root, beside ``/v1``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/metrics"


def parse(text: str, buckets: bool = False) -> dict[str, float]:
    """The kept series by name (with labels); ``buckets`` also keeps the latency histograms' buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIXES):
            continue
        bucketed = buckets and family.name in _BUCKETED
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            if sample.name.endswith("_created") or not (
                suffix in KEPT_SUFFIXES or (bucketed and suffix == "_bucket")
            ):
                continue  # other histograms' buckets: their count and sum say enough between probes
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def scrape(
    base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0, buckets: bool = False
) -> dict[str, Any]:
    """``{"url", "series": {name: value}}``, or ``{"url", "error"}`` when there is no readable /metrics."""
    clean, basic, query = split_url(base_url)  # the URL recorded has no user-info and no query
    url = metrics_url(clean)
    try:
        sent = {**basic, **(headers if headers is not None else auth_headers())}
        with urlopen(Request(url + (f"?{query}" if query else ""), headers=sent), timeout=timeout_s) as resp:  # noqa: S310 - the user's server
            text = resp.read().decode("utf-8", "replace")
        return {"url": url, "series": parse(text, buckets)}
    except (URLError, OSError, ValueError) as exc:
        return {"url": url, "error": redact_text(str(getattr(exc, "reason", exc)))}


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


def _buckets(series: dict[str, float], family: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over its other labels."""
    out: dict[float, float] = {}
    head = family + "_bucket{"
    for key, value in series.items():
        if key.startswith(head):
            le = next(
                (part[4:-1] for part in key[len(head) : -1].split(",") if part.startswith('le="')), None
            )
            if le is not None:
                bound = float("inf") if le in ("+Inf", "Inf") else float(le)
                out[bound] = out.get(bound, 0.0) + value
    return out


def histogram_deltas(first: dict[str, float], last: dict[str, float]) -> dict[str, dict[str, float]]:
    """The latency histograms' bucket counts added between two scrapes: ``{family: {le: count}}``
    (a bound as text, "+Inf" for the last), for the first family of each kind the server exposes."""
    out: dict[str, dict[str, float]] = {}
    for names in LATENCY_HISTOGRAMS.values():
        for name in names:
            after = _buckets(last, name)
            if after:
                before = _buckets(first, name)
                out[name] = {("+Inf" if le == float("inf") else repr(le)): max(0.0, n - before.get(le, 0.0))
                             for le, n in sorted(after.items())}  # fmt: skip
                break
    return out


def add_deltas(total: dict[str, dict[str, float]], more: dict[str, dict[str, float]]) -> None:
    for name, buckets in more.items():
        into = total.setdefault(name, {})
        for le, n in buckets.items():
            into[le] = into.get(le, 0.0) + n


def histogram_quantile(buckets: dict[str, float], q: float) -> float | None:
    """Prometheus's ``histogram_quantile``: the rank's bucket, linearly interpolated inside it (the
    lowest bucket from 0; a rank in the +Inf bucket gives the highest finite bound)."""
    bounds = sorted((float(le), n) for le, n in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if upper == float("inf"):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = upper, count
    return lower


def server_latency(
    histograms: dict[str, dict[str, float]], quantiles: tuple[float, ...] = (50, 90, 99)
) -> dict[str, Any]:
    """The server's own TTFT and ITL percentiles (ms) from the bucket counts a run added."""
    out: dict[str, Any] = {}
    for kind, names in LATENCY_HISTOGRAMS.items():
        name = next((n for n in names if n in histograms), None)
        if name is None:
            continue
        buckets = histograms[name]
        count = max(buckets.values(), default=0.0)
        if count <= 0:
            continue
        entry: dict[str, Any] = {"source": name, "count": int(count)}
        for q in quantiles:
            value = histogram_quantile(buckets, q / 100)
            entry[f"p{q:g}"] = None if value is None else round(value * 1e3, 3)
        out[f"{kind}_ms"] = entry
    return out


class ServerScraper:
    """The server's /metrics scraped every ``interval_s`` in a background thread while a block runs:
    ``samples`` is ``[[perf_counter_ns, {series: value}], ...]`` (the query log's clock), ``error``
    the reason when the server has no readable /metrics (scraping then stops at once).

    The first scrape is taken before the block starts (again by ``mark()`` when its warm-up is
    over) and one more after it ends, so the latency histograms' counts added in between
    (``histograms``) are the measured queries' own."""

    def __init__(self, base_url: str, interval_s: float = 1.0, headers: dict[str, str] | None = None) -> None:
        self.base_url, self.interval_s, self.headers = base_url, interval_s, headers
        self.samples: list[list[Any]] = []
        self.histograms: dict[str, dict[str, float]] = {}
        self.error: str | None = None
        self._base = 0  # the sample the histograms count from
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> bool:
        got = scrape(self.base_url, self.headers, timeout_s=max(1.0, self.interval_s), buckets=True)
        if "error" in got:
            self.error = got["error"]
            return False
        with self._lock:
            self.samples.append([time.perf_counter_ns(), got["series"]])
        return True

    def mark(self) -> None:
        """The measured part starts now: the histograms count from a scrape taken here."""
        if self.error is None and self._take():
            with self._lock:
                self._base = len(self.samples) - 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._take():
                return

    def __enter__(self) -> ServerScraper:
        if self._take():
            self._thread = threading.Thread(target=self._run, name="server-metrics", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self.error is None and self._take():
                self.histograms = histogram_deltas(self.samples[self._base][1], self.samples[-1][1])
        for _, series in self.samples:  # the buckets served their purpose; the kept series stay small
            for key in [k for k in series if "_bucket{" in k]:
                del series[key]
