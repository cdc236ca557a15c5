"""The load generator: schedules, scenarios, run limits, validity, windows and outliers.

The system under test in the scenario tests is a fake that sleeps for a known service time: the
harness is what is tested here, and a known service time is what makes its behaviour checkable.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from variantbench.backends.base import GenerationRequest, GenerationResult, LoadInfo
from variantbench.loadgen.harness import LoadSettings, run_scenario
from variantbench.loadgen.schedule import arrival_offsets_ns
from variantbench.loadgen.validity import (
    binomial_cdf,
    early_stopping_estimate,
    early_stopping_passes,
    min_queries_for,
)
from variantbench.metrics.windows import stable, three_sigma, windows
from variantbench.records import QueryRecord
from variantbench.report.schema import Resources
from variantbench.report.summary import Criteria, summarize_run
from variantbench.workloads import SyntheticLibrary


class SleepSystem:
    """Completes each generate call after ``service_s`` (per call, whatever the batch size)."""

    name = "sleep"

    def __init__(self, service_s: float, hang_ids: set[str] | None = None) -> None:
        self.service_s = service_s
        self.hang_ids = hang_ids or set()
        self.batch_sizes: list[int] = []
        self.lock = threading.Lock()

    def load(self) -> LoadInfo:
        return LoadInfo(0.0, 0)

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self.lock:
            self.batch_sizes.append(len(requests))
        start = time.perf_counter_ns()
        if any(r.request_id in self.hang_ids for r in requests):
            time.sleep(5)
        time.sleep(self.service_s)
        first = time.perf_counter_ns()
        return [
            GenerationResult(r.request_id, text="ok", input_tokens=3, output_tokens=2, start_ns=start,
                             first_token_ns=first, token_ns=[first, time.perf_counter_ns()], end_ns=first)
            for r in requests
        ]  # fmt: skip


@pytest.fixture(scope="module")
def library() -> SyntheticLibrary:
    return SyntheticLibrary(n=20, seed=0, tokens=(16, 32))


def test_poisson_schedule_has_target_rate_and_exponential_gaps() -> None:
    n, rate = 20_000, 250.0
    offsets = np.array(arrival_offsets_ns(n, rate, seed=11)) / 1e9
    gaps = np.diff(offsets)
    assert offsets[0] == 0
    assert (n - 1) / offsets[-1] == pytest.approx(rate, rel=1e-6)  # rescaled to the exact mean rate
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential: CV = 1
    # Kolmogorov-Smirnov against Exp(rate): critical value at 1% is 1.63 / sqrt(n)
    x = np.sort(gaps)
    cdf = 1 - np.exp(-rate * x)
    emp_hi = np.arange(1, len(x) + 1) / len(x)
    ks = max(np.max(emp_hi - cdf), np.max(cdf - (emp_hi - 1 / len(x))))
    assert ks < 1.63 / np.sqrt(len(x))
    assert arrival_offsets_ns(50, rate, seed=11) == arrival_offsets_ns(50, rate, seed=11)
    assert arrival_offsets_ns(50, rate, seed=12) != arrival_offsets_ns(50, rate, seed=11)


@pytest.mark.parametrize(("burstiness", "cv"), [(0.25, 2.0), (4.0, 0.5)])
def test_burstiness_changes_spread_not_rate(burstiness: float, cv: float) -> None:
    offsets = np.array(arrival_offsets_ns(20_000, 100.0, seed=3, burstiness=burstiness)) / 1e9
    gaps = np.diff(offsets)
    assert 19_999 / offsets[-1] == pytest.approx(100.0, rel=1e-6)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_bad_rates_are_rejected() -> None:
    with pytest.raises(ValueError):
        arrival_offsets_ns(10, 0, seed=0)
    with pytest.raises(ValueError):
        LoadSettings(scenario="server", rate_qps=-1)
    with pytest.raises(ValueError):
        LoadSettings(scenario="nope")


def _server(library, rate: float, service_s: float, n: int, **kw) -> list[QueryRecord]:
    settings = LoadSettings(scenario="server", rate_qps=rate, min_queries=n, max_queries=n, warmup=0,
                            max_batch_size=1, **kw)  # fmt: skip
    return run_scenario(SleepSystem(service_s), library, settings).records


def test_latency_from_schedule_grows_when_the_system_is_slower_than_arrivals(library) -> None:
    fast = _server(library, rate=20, service_s=0.01, n=30)  # 50 ms gaps, 10 ms service: no queue
    slow = _server(library, rate=100, service_s=0.02, n=30)  # 10 ms gaps, 20 ms service: queue builds
    fast_lat = [r.latency_from_scheduled_ms for r in fast]
    slow_lat = [r.latency_from_scheduled_ms for r in slow]
    assert max(fast_lat) < 60  # 10 ms service, nothing queued
    assert np.mean(slow_lat[-10:]) > 3 * np.mean(slow_lat[:10])
    assert slow_lat[-1] > 200  # ~30 x 10 ms of backlog
    assert len(slow) == 30 and all(r.status == "ok" for r in slow)


def test_waiting_for_a_concurrency_slot_is_lag_and_counts_in_latency(library) -> None:
    records = _server(library, rate=100, service_s=0.02, n=20, max_concurrency=1)
    lags = [r.dispatch_lag_ms for r in records]
    assert lags[-1] > 100  # each query waited for the one before it
    for r in records:
        assert r.latency_from_scheduled_ms == pytest.approx(r.dispatch_lag_ms + r.latency_ms, abs=1e-6)
        assert r.latency_ms < 100  # once issued, served in ~20 ms


def test_offline_issues_everything_at_once_and_batches(library) -> None:
    system = SleepSystem(0.01)
    settings = LoadSettings(scenario="offline", min_queries=20, warmup=0, max_batch_size=8)
    result = run_scenario(system, library, settings)
    assert len(result.records) == 20
    assert len({r.issued_ns for r in result.records}) == 1
    # building 5000 query records takes tens of ms: that is harness set-up, not dispatch lag
    from variantbench.selftest import NullSystem

    many = run_scenario(NullSystem(), library, LoadSettings(scenario="offline", min_queries=5000, warmup=0))
    assert max(r.dispatch_lag_ms for r in many.records) < 5
    assert max(system.batch_sizes) == 8 and sum(system.batch_sizes) == 20


def test_multi_stream_query_latency_is_the_slowest_sample(library) -> None:
    settings = LoadSettings(scenario="multi-stream", samples_per_query=3, min_queries=4, max_queries=4,
                            warmup=0)  # fmt: skip
    result = run_scenario(SleepSystem(0.005), library, settings)
    assert len(result.records) == 12
    assert sorted({r.query for r in result.records}) == [0, 1, 2, 3]
    run = summarize_run("v", result.records, Resources(), scenario="multi-stream")
    per_query = []
    for q in range(4):
        group = [r for r in result.records if r.query == q]
        per_query.append(max(r.completed_ns for r in group) / 1e6 - min(r.issued_ns for r in group) / 1e6)
    assert run.latency_from_issue_ms.p99 == pytest.approx(max(per_query))


def test_single_stream_runs_until_both_minimums_are_met(library) -> None:
    settings = LoadSettings(min_queries=3, min_duration_s=0.3, warmup=0)
    result = run_scenario(SleepSystem(0.02), library, settings)
    assert len(result.records) >= 8  # 0.3 s of 20 ms queries, not just 3
    assert (result.ended_ns - result.started_ns) / 1e9 >= 0.3
    capped = run_scenario(
        SleepSystem(0.02), library, LoadSettings(min_queries=3, max_queries=5, min_duration_s=5)
    )
    assert len(capped.records) == 5


def test_every_query_completes_exactly_once_even_when_the_system_hangs(library) -> None:
    system = SleepSystem(0.001, hang_ids={"q2"})
    settings = LoadSettings(scenario="server", rate_qps=200, min_queries=6, max_queries=6, warmup=0,
                            max_batch_size=1, drain_timeout_s=0.5)  # fmt: skip
    t0 = time.perf_counter()
    result = run_scenario(system, library, settings)
    assert time.perf_counter() - t0 < 3  # no hang: the stuck call is abandoned
    assert sorted(r.index for r in result.records) == list(range(6))
    status = {r.index: (r.status, r.error) for r in result.records}
    assert status[2] == ("error", "timed out")


def test_early_stopping_matches_hand_computed_cases() -> None:
    # 0 over-target queries: 0.99^n <= 0.01 first holds at n = 459 (ln 0.01 / ln 0.99 = 458.2)
    assert binomial_cdf(0, 459, 0.01) == pytest.approx(0.99**459)
    assert early_stopping_passes(0, 459, 99) and not early_stopping_passes(0, 458, 99)
    assert min_queries_for(0, 99) == 459
    # 1 over-target: 0.99^n + n 0.01 0.99^(n-1) <= 0.01 first at n = 662
    assert min_queries_for(1, 99) == 662
    assert binomial_cdf(1, 662, 0.01) == pytest.approx(0.99**662 + 662 * 0.01 * 0.99**661)
    # MLPerf's own single-stream summaries: 2048 queries at p90 -> discard 172, report the 173rd largest
    estimate = early_stopping_estimate([float(i) for i in range(1, 2049)], 90)
    assert estimate == 2048 - 172
    for n, discarded in ((2116, 178), (2145, 181), (7469, 685)):  # more LoadGen summaries at p90
        assert early_stopping_estimate([float(i) for i in range(1, n + 1)], 90) == n - discarded
    assert early_stopping_estimate([1.0] * 10, 99) is None


def _rec(i: int, latency_ms: float, tokens: int = 10) -> QueryRecord:
    start = i * 1_000_000_000
    return QueryRecord(run_id="r", variant="v", scenario="server", index=i, sample_id=str(i), task="qa",
                       status="ok", error=None, scheduled_ns=start, issued_ns=start, first_token_ns=start,
                       completed_ns=start + int(latency_ms * 1e6), input_tokens=1, output_tokens=tokens)  # fmt: skip


def test_windows_and_outliers_on_a_known_series() -> None:
    records = [_rec(i, 100.0 + (i % 50)) for i in range(150)]  # three identical windows of 100..149 ms
    ws = windows(records, 50)
    assert len(ws) == 3
    assert [w.p50_latency_ms for w in ws] == [125.0, 125.0, 125.0]  # sorted[25] of 50, as LoadGen
    assert [w.p99_latency_ms for w in ws] == [149.0, 149.0, 149.0]
    assert all(w.mean_latency_ms == pytest.approx(124.5) for w in ws)
    assert stable(ws) is True
    drifting = [_rec(i, 100.0 * (1 + i // 50)) for i in range(150)]  # 100, 200, 300 ms windows
    assert stable(windows(drifting, 50)) is False
    assert stable(ws[:2]) is None
    values = [10.0] * 99 + [1000.0]
    trimmed = three_sigma(values)
    assert trimmed.removed == 1 and trimmed.trimmed_mean == 10.0 and trimmed.raw_mean == pytest.approx(19.9)


def test_summary_reports_validity_against_a_latency_target() -> None:
    records = [_rec(i, 50.0) for i in range(500)]
    ok = summarize_run("v", records, Resources(), scenario="server",
                       criteria=Criteria(latency_target_ms=60, min_queries=500))  # fmt: skip
    assert ok.validity.verdict == "VALID" and ok.validity.checks["latency"].result == "PASS"
    short = summarize_run("v", records[:100], Resources(), scenario="server",
                          criteria=Criteria(latency_target_ms=60, min_queries=100))  # fmt: skip
    assert short.validity.verdict == "INVALID"
    assert any("459" in r for r in short.validity.recommendations)  # run longer: at least 459 queries
    slow = summarize_run("v", [_rec(i, 80.0) for i in range(500)], Resources(), scenario="server",
                         criteria=Criteria(latency_target_ms=60, min_queries=500))  # fmt: skip
    assert slow.validity.verdict == "INVALID" and "reduce target QPS" in slow.validity.recommendations
    assert slow.achieved_qps == pytest.approx(1.0)


class EngineClockSystem(SleepSystem):
    """Reports its own account of each request (as llama.cpp's perf counters do): 8 ms of 'eval'."""

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = super().generate(requests)
        for r in results:
            r.engine_timings = {"eval_ms": 8.0, "eval_tokens": 2}
        return results


def test_the_engines_own_clock_reaches_the_report_beside_ours() -> None:
    library = SyntheticLibrary(n=4, seed=0)
    result = run_scenario(EngineClockSystem(0.01), library, LoadSettings(min_queries=5, warmup=0))
    assert all(r.engine_timings == {"eval_ms": 8.0, "eval_tokens": 2} for r in result.records)
    assert QueryRecord.from_json(result.records[0].to_json()).engine_timings == {
        "eval_ms": 8.0,
        "eval_tokens": 2,
    }
    run = summarize_run("clock", result.records, Resources())
    timings = run.engine_timings
    assert timings is not None and timings["eval_ms"] == 40.0 and timings["eval_tokens"] == 10
    assert timings["queries"] == 5 and timings["measured_ms"] >= 50.0  # each query slept 10 ms
    assert timings["engine_ms_share"] == pytest.approx(40.0 / timings["measured_ms"], rel=1e-3)
    assert 0.5 < timings["engine_ms_share"] < 0.81  # 8 of each query's 10+ ms
    assert summarize_run("plain", run_scenario(SleepSystem(0.001), library, LoadSettings(min_queries=2, warmup=0)).records,
                         Resources()).engine_timings is None  # fmt: skip


def test_a_late_issue_invalidates_a_schedule_not_a_single_stream_run() -> None:
    """One query in ten issued 3 ms after it was made: a missed schedule in the server scenario; in
    single-stream, where a query is issued when the last completes, only dispatch lag (issue 17)."""
    records = [_rec(i, 50.0) for i in range(10)]
    records[4].issued_ns += 3_000_000
    records[4].completed_ns += 3_000_000
    single = summarize_run(
        "v", records, Resources(), scenario="single-stream", criteria=Criteria(min_queries=10)
    )
    server = summarize_run(
        "v", records, Resources(), scenario="server", criteria=Criteria(min_queries=10, target_qps=1)
    )
    assert single.late_share == server.late_share == pytest.approx(0.1)
    assert single.validity.verdict == "VALID" and single.dispatch_lag_ms.max == pytest.approx(3.0)
    assert server.validity.verdict == "INVALID" and "issued more than 1 ms late" in server.validity.reasons[0]
