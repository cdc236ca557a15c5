"""The server's latency histograms read back as Prometheus would: buckets parsed from a real
prometheus-client exposition, deltas between two scrapes, quantiles interpolated in the bucket."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
import pytest

from variantbench.serving.app import Metrics
from variantbench.trackers.server_metrics import (
    histogram_deltas,
    histogram_quantile,
    parse,
    server_latency,
)


def _exposed(registry: CollectorRegistry, buckets: bool = True) -> dict[str, float]:
    return parse(generate_latest(registry).decode(), buckets=buckets)


def test_quantiles_from_our_servers_buckets_match_the_exact_ones() -> None:
    """Our server's TTFT/ITL buckets are 10% apart: the p50 read off them is within a few % of the
    exact p50, also for a tight distribution (what a steady decode's gaps look like)."""
    rng = np.random.default_rng(0)
    for name, values in (
        ("tight ITL", rng.normal(0.0031, 0.0001, 2000)),
        ("spread TTFT", rng.lognormal(np.log(0.25), 0.6, 2000)),
    ):
        m = Metrics()
        before = _exposed(m.registry)
        for v in values:
            m.itl.labels("a").observe(float(v))
            m.ttft.labels("a").observe(float(v))
        got = server_latency(histogram_deltas(before, _exposed(m.registry)))
        for key in ("ttft_ms", "itl_ms"):
            assert got[key]["count"] == len(values)
            for q in (50, 90):
                exact = float(np.percentile(values, q)) * 1e3
                assert got[key][f"p{q}"] == pytest.approx(exact, rel=0.05), (name, key, q)


def test_only_what_was_added_between_the_scrapes_counts_and_buckets_are_opt_in() -> None:
    r = CollectorRegistry()
    h = Histogram(
        "vllm:time_to_first_token_seconds", "ttft", ["model_name"], buckets=(0.1, 0.2, 0.4), registry=r
    )
    for v in (0.05, 0.05, 0.3):  # before the run: not the run's
        h.labels("m").observe(v)
    first = _exposed(r)
    for v in (0.15, 0.15, 0.15, 0.35):
        h.labels("m").observe(v)
    deltas = histogram_deltas(first, _exposed(r))
    assert deltas == {"vllm:time_to_first_token_seconds": {"0.1": 0.0, "0.2": 3.0, "0.4": 4.0, "+Inf": 4.0}}
    # rank 2 of 4 falls in (0.1, 0.2], which holds 3: 0.1 + 0.1 * 2/3
    assert histogram_quantile(deltas["vllm:time_to_first_token_seconds"], 0.5) == pytest.approx(
        0.1 + 0.1 * 2 / 3
    )
    assert server_latency(deltas)["ttft_ms"]["count"] == 4 and "itl_ms" not in server_latency(deltas)
    assert not any("_bucket" in k for k in _exposed(r, buckets=False))
    # a rank in the +Inf bucket gives the highest finite bound, as Prometheus does
    assert histogram_quantile({"0.1": 1.0, "+Inf": 4.0}, 0.9) == pytest.approx(0.1)
    assert histogram_quantile({"0.1": 0.0, "+Inf": 0.0}, 0.5) is None
