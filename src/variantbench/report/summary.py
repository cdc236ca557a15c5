"""From a query log (and what the backend said about its load) to a RunReport. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import groupby
from typing import Any

from variantbench.loadgen.scenarios import SCENARIOS
from variantbench.loadgen.validity import Target, judge
from variantbench.metrics.latency import distribution, percentile
from variantbench.metrics.quality import Scored, agreement, summarize_quality
from variantbench.metrics.windows import active_s, stable, three_sigma, windows
from variantbench.plan import default_of
from variantbench.records import QueryRecord
from variantbench.report.schema import (
    Goodput,
    LagDist,
    LatencyDist,
    Outliers,
    Quality,
    QualityComparisonReport,
    QualityVsStandard,
    Queries,
    Resources,
    RunReport,
    Speed,
    Tail,
    TaskReport,
    Throughput,
    Validity,
    WindowReport,
)

LATE_NS = 1_000_000  # a query issued more than 1 ms after its scheduled time is late


@dataclass(frozen=True)
class Criteria:
    """What a run is judged against (the validity rules of the scenario)."""

    # built from the plan by ``pipeline/settings.criteria_for``; a default here is the plan's
    percentile: float = default_of("targets.percentile")
    latency_target_ms: float | None = default_of("targets.latency_ms")
    ttft_target_ms: float | None = default_of("targets.ttft_ms")
    tpot_target_ms: float | None = default_of("targets.tpot_ms")
    min_queries: int = 1  # the plan derives its own from load.tasks (Plan.min_queries)
    min_duration_s: float = default_of("limits.min_duration_s")
    window: int = default_of("targets.window")
    confidence: float = 0.99  # MLPerf's early-stopping confidence: a rule, not a setting
    seeds: dict[str, int] = field(default_factory=dict)
    target_qps: float | None = None
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)  # ttft / tpot / e2el -> ms
    percentile_metrics: tuple[str, ...] = default_of("output.percentile_metrics")
    metric_percentiles: tuple[float, ...] = default_of("output.metric_percentiles")

    def slos(self) -> dict[str, float]:
        """Goodput's SLOs: the stated ones, else the run's targets (latency as end-to-end)."""
        if self.goodput_slo_ms:
            return dict(self.goodput_slo_ms)
        given = {"ttft": self.ttft_target_ms, "tpot": self.tpot_target_ms, "e2el": self.latency_target_ms}
        return {k: v for k, v in given.items() if v is not None}


def gaps_ms(record: QueryRecord) -> list[float]:
    """One query's gaps between consecutive tokens."""
    return [b - a for a, b in zip(record.token_ms, record.token_ms[1:], strict=False)]


def inter_token_ms(records: Sequence[QueryRecord]) -> list[float]:
    """Every gap between consecutive tokens of every query (vLLM's ITL: per gap, not per query)."""
    return [gap for r in records for gap in gaps_ms(r)]


def metric_values(records: Sequence[QueryRecord]) -> dict[str, list[float]]:
    """The per-request (ITL: per gap) values of vLLM's percentile metrics; e2el from issue, as vLLM's."""
    return {
        "ttft": [r.ttft_ms for r in records if r.ttft_ms is not None],
        "tpot": [r.tpot_ms for r in records if r.tpot_ms is not None],
        "itl": inter_token_ms(records),
        "e2el": [r.latency_ms for r in records],
    }


def sender_lags(records: Sequence[QueryRecord]) -> list[dict[str, float | int | None]]:
    """Each sender process's share of the queries and its dispatch lag (ms); [] with no senders."""
    by: dict[int, list[float]] = {}
    for r in records:
        if r.sender >= 0 and r.issued_ns:
            by.setdefault(r.sender, []).append((r.issued_ns - r.scheduled_ns) / 1e6)
    return [{"sender": k, "queries": len(v), "lag_p50_ms": percentile(v, 50), "lag_p99_ms": percentile(v, 99),
             "lag_max_ms": max(v)} for k, v in sorted(by.items())]  # fmt: skip


def goodput(
    ok: Sequence[QueryRecord], issued: int, duration_s: float | None, slos: dict[str, float]
) -> Goodput | None:
    """vLLM's goodput: completed requests meeting every SLO, per second of the run."""
    if not slos or not duration_s:
        return None

    def good(r: QueryRecord) -> bool:
        values = {"ttft": r.ttft_ms, "tpot": r.tpot_ms, "e2el": r.latency_ms}
        # a one-token answer has no TPOT: that SLO cannot be missed
        return all(values[k] is None and k == "tpot" or (values[k] is not None and values[k] <= v)
                   for k, v in slos.items())  # fmt: skip

    met = sum(1 for r in ok if good(r))
    return Goodput(
        slo_ms=slos, requests_per_s=met / duration_s, met=met, share=met / issued if issued else None
    )


def _tail(values: Sequence[float]) -> Tail:
    return Tail(p50=percentile(values, 50), p99=percentile(values, 99))


def _by_block(records: Sequence[QueryRecord]) -> list[list[QueryRecord]]:
    blocks: dict[int, list[QueryRecord]] = {}
    for r in records:
        blocks.setdefault(r.block, []).append(r)
    return list(blocks.values())


def _queries(records: Sequence[QueryRecord]) -> list[list[QueryRecord]]:
    """Samples grouped by the query they belong to (multi-stream); one sample per query otherwise."""
    ordered = sorted(records, key=lambda r: (r.query if r.query >= 0 else r.index, r.index))
    return [list(g) for _, g in groupby(ordered, key=lambda r: r.query if r.query >= 0 else r.index)]


def summarize_run(
    variant: str,
    records: Sequence[QueryRecord],
    resources: Resources,
    backend: dict | None = None,
    scenario: str = "single-stream",
    criteria: Criteria | None = None,
    fidelity: dict | None = None,
) -> RunReport:
    crit = criteria or Criteria()
    scheduled = SCENARIOS[scenario].scheduled if scenario in SCENARIOS else False
    ok = [r for r in records if r.status == "ok"]
    errors = len(records) - len(ok)
    # per query: the slowest of its samples (multi-stream), counted only if every sample succeeded
    groups = [g for g in _queries(records) if all(r.status == "ok" for r in g)]
    from_sched = [max(r.completed_ns for r in g) / 1e6 - min(r.scheduled_ns for r in g) / 1e6 for g in groups]
    from_issue = [max(r.completed_ns for r in g) / 1e6 - min(r.issued_ns for r in g) / 1e6 for g in groups]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    lags_ns = [r.issued_ns - r.scheduled_ns for r in records]
    duration_s = None
    throughput = Throughput()
    achieved_qps = None
    if records:
        duration_s = active_s(records)  # interleaved: the variant's own blocks, not the others'
        if duration_s > 0:
            throughput = Throughput(
                qps=len(groups) / duration_s,
                output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s,
            )
        gaps, issue_span_s = 0, 0.0
        for block in _by_block(records):  # n arrivals span n-1 gaps, block by block
            gaps += len(_queries(block)) - 1
            issue_span_s += (max(r.issued_ns for r in block) - min(r.scheduled_ns for r in block)) / 1e9
        if scheduled and issue_span_s > 0 and gaps > 0:
            achieved_qps = gaps / issue_span_s
    prefill_s = sum(ttfts) / 1e3
    decode_tokens = sum(max(0, len(r.token_ms) - 1) for r in ok)
    decode_s = sum((r.token_ms[-1] - r.token_ms[0]) / 1e3 for r in ok if len(r.token_ms) > 1)
    speed = Speed(
        prefill_tokens_per_s=sum(r.input_tokens for r in ok if r.ttft_ms is not None) / prefill_s
        if prefill_s > 0
        else None,
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None,
    )
    quality = Quality(**summarize_quality(_scored(records)), **(fidelity or {}))
    values = metric_values(ok)
    per_task = {task: _task_report(rs) for task, rs in sorted(_by_task(records).items())}
    ws = windows(records, crit.window) if records else []
    lat_trim = three_sigma(from_sched)
    win_trim = three_sigma([w.output_tokens_per_s for w in ws if w.output_tokens_per_s is not None])
    late_share = sum(1 for lag in lags_ns if lag > LATE_NS) / len(lags_ns) if lags_ns else None
    targets = [
        Target(name, limit)
        for name, limit in (
            ("latency", crit.latency_target_ms),
            ("ttft", crit.ttft_target_ms),
            ("tpot", crit.tpot_target_ms),
        )
        if limit is not None
    ]
    verdict = judge(
        {"latency": from_sched, "ttft": ttfts, "tpot": tpots},
        targets,
        crit.percentile,
        issued=len(_queries(records)),
        min_queries=crit.min_queries,
        duration_s=duration_s or 0.0,
        min_duration_s=crit.min_duration_s,
        # a late issue means a missed schedule: single-stream issues when the last query completes,
        # so a GC pause before the issue is no one's lateness (it is in the dispatch lag, not the verdict)
        late_share=(late_share or 0.0) if scheduled else 0.0,
        errors=errors,
        confidence=crit.confidence,
    )
    backend = dict(backend or {})
    return RunReport(
        variant=variant,
        scenario=scenario,
        seeds=dict(crit.seeds),
        weight_format=backend.get("weight_format"),
        backend=backend,
        duration_s=duration_s,
        latency_ms=LatencyDist(**distribution(from_sched)),
        latency_from_scheduled_ms=LatencyDist(**distribution(from_sched)),
        latency_from_issue_ms=LatencyDist(**distribution(from_issue)),
        dispatch_lag_ms=LagDist(
            p50=percentile([x / 1e6 for x in lags_ns], 50),
            p99=percentile([x / 1e6 for x in lags_ns], 99),
            max=max(lags_ns) / 1e6 if lags_ns else None,
        ),
        late_share=late_share,
        senders=sender_lags(records),
        target_qps=crit.target_qps if scheduled else None,
        achieved_qps=achieved_qps,
        validity=Validity(**asdict(verdict)),
        windows=[
            WindowReport(**{k: v for k, v in asdict(w).items() if k not in ("start_ns", "end_ns")})
            for w in ws
        ],
        stable=stable(ws),
        outliers=Outliers(
            removed=lat_trim.removed,
            trimmed_mean_latency_ms=lat_trim.trimmed_mean,
            raw_mean_latency_ms=lat_trim.raw_mean,
            windows_removed=win_trim.removed,
            trimmed_output_tokens_per_s=win_trim.trimmed_mean,
        ),
        ttft_ms=_tail(ttfts),
        tpot_ms=_tail(tpots),
        itl_ms=LatencyDist(**distribution(inter_token_ms(ok))),
        percentiles={
            m: {f"{p:g}": percentile(values[m], p) for p in crit.metric_percentiles}
            for m in crit.percentile_metrics
        },  # fmt: skip
        goodput=goodput(ok, len(records), duration_s, crit.slos()),
        throughput=throughput,
        speed=speed,
        quality=quality,
        per_task=per_task,
        resources=resources,
        queries=Queries(issued=len(records), completed=len(ok), errors=errors),
        input_tokens=_tail([r.input_tokens for r in ok]),
        output_tokens=_tail([r.output_tokens for r in ok]),
        engine_timings=engine_timings(ok),
        cpu_work=cpu_work(ok),
    )


def engine_timings(ok: Sequence[QueryRecord]) -> dict[str, float] | None:
    """The engine's own clock summed over the queries that report one, beside ours for the same queries.

    ``engine_ms_share`` = the engine's milliseconds (every ``*_ms`` key) over our latency from issue:
    near 1 means our clock measures the engine; well below 1, time goes outside it (tokenizing,
    Python, the harness).
    """
    timed = [r for r in ok if r.engine_timings]
    if not timed:
        return None
    totals: dict[str, float] = {}
    for r in timed:
        for key, value in (r.engine_timings or {}).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    ours_ms = sum(r.latency_ms for r in timed)
    engine_ms = sum(v for k, v in totals.items() if k.endswith("_ms"))
    return {**{k: round(v, 3) for k, v in totals.items()}, "queries": len(timed), "measured_ms": round(ours_ms, 3),
            "engine_ms_share": round(engine_ms / ours_ms, 4) if ours_ms > 0 else None}  # fmt: skip


def cpu_work(ok: Sequence[QueryRecord]) -> dict[str, float] | None:
    """The CPU work around the model per query, and its share of the latency from issue: ``share``
    all of it, ``critical_share`` the part the model's thread waited for (all when encoded inline;
    little when encoded ahead while the model computed)."""
    timed = [r for r in ok if r.cpu_work]
    if not timed:
        return None
    total = {
        k: sum((r.cpu_work or {}).get(k, 0.0) for r in timed)
        for k in ("encode_ms", "encode_waited_ms", "detokenize_ms")
    }
    latency = sum(r.latency_ms for r in timed)
    n = len(timed)
    return {
        "queries": n,
        "encode_ms_mean": round(total["encode_ms"] / n, 4),
        "detokenize_ms_mean": round(total["detokenize_ms"] / n, 4),
        "share": round((total["encode_ms"] + total["detokenize_ms"]) / latency, 6) if latency > 0 else 0.0,
        "critical_share": round((total["encode_waited_ms"] + total["detokenize_ms"]) / latency, 6)
        if latency > 0
        else 0.0,
    }


def _scored(records: Sequence[QueryRecord]) -> list[Scored]:
    """The accuracy log's answers; a failed query scores as an empty answer (errors never flatter)."""
    return [
        Scored(r.task, r.output if r.status == "ok" else "", r.reference, tuple(r.alternatives))
        for r in records
        if r.scored
    ]


def _by_task(records: Sequence[QueryRecord]) -> dict[str, list[QueryRecord]]:
    out: dict[str, list[QueryRecord]] = {}
    for r in records:
        out.setdefault(r.task, []).append(r)
    return out


def _task_report(records: Sequence[QueryRecord]) -> TaskReport:
    ok = [r for r in records if r.status == "ok"]
    busy_s = sum(r.latency_ms for r in ok) / 1e3
    return TaskReport(
        queries=len(records),
        latency_ms=_tail([r.latency_from_scheduled_ms for r in ok]),
        ttft_ms=_tail([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        input_tokens=_tail([r.input_tokens for r in ok]),
        output_tokens_per_s=sum(r.output_tokens for r in ok) / busy_s if busy_s > 0 else None,
        quality=Quality(**summarize_quality(_scored(records))),
    )


def compare_to_standard(
    run: RunReport,
    records: Sequence[QueryRecord],
    standard: RunReport,
    standard_records: Sequence[QueryRecord],
    threshold: float = 0.99,
    length_tolerance: float = 0.10,
    likelihood: Any = None,
    standard_likelihood: Any = None,
    lm_eval: Any = None,
    standard_lm_eval: Any = None,
    confidence: float = 0.95,
) -> QualityVsStandard:
    """MLPerf-style gates: quality >= threshold x the standard's, mean output length within tolerance.

    Both are taken on the samples both variants answered (first answer per sample; greedy decoding
    answers a repeated sample the same way), so a variant cannot win by answering fewer or shorter.
    Quality is decided on paired intervals (``metrics/quality_compare.py``): the gate PASSes when
    the deciding interval meets the threshold (or fidelity ties), FAILs when it lies below, and is
    UNDECIDED between; with fewer than 3 paired samples and no likelihood scores it falls back to the
    point ratio and says so. ``likelihood``: the two runs' ``Likelihood`` reports, where measured;
    ``confidence``: the intervals' (the run's looks split alpha over them, as for speed).
    """
    from variantbench.metrics.quality_compare import compare, gate_state

    result = QualityVsStandard(
        standard=standard.variant, quality_threshold=threshold, length_tolerance=length_tolerance
    )
    if run.variant == standard.variant:
        return result

    def first_ok(rs: Sequence[QueryRecord]) -> dict[str, QueryRecord]:
        out: dict[str, QueryRecord] = {}
        for r in rs:
            if r.status == "ok" and r.scored:
                out.setdefault(r.sample_id, r)
        return out

    mine, theirs = first_ok(records), first_ok(standard_records)
    common = sorted(set(mine) & set(theirs))
    if not common:
        result.reasons.append("no sample answered by both this variant and the standard")
        return result
    result.agreement_rougeL, result.identical = agreement(
        [mine[k].output for k in common], [theirs[k].output for k in common]
    ).values()
    std_tokens = sum(theirs[k].output_tokens for k in common)
    if std_tokens:
        result.length_ratio = sum(mine[k].output_tokens for k in common) / std_tokens
    base, q = standard.quality.composite, run.quality.composite
    if base and q is not None:
        result.ratio = q / base
    comparisons = compare(run.variant, records, likelihood, standard.variant, standard_records,
                          standard_likelihood, floor=threshold, lm_eval=lm_eval,
                          standard_lm_eval=standard_lm_eval, confidence=confidence)  # fmt: skip
    result.comparisons = [QualityComparisonReport(**{k: v for k, v in c.to_json().items()
                                                     if k in QualityComparisonReport.model_fields})
                          for c in comparisons]  # fmt: skip
    result.state, result.decided_by = gate_state(comparisons)
    failures = []
    if result.state == "fails":
        failures.append(f"quality below {threshold:.1%} of the standard's: {result.decided_by}")
    elif result.state is None and result.ratio is not None and result.ratio < threshold:
        failures.append(f"quality {result.ratio:.1%} of the standard's, below {threshold:.1%} "
                        f"(a point estimate on {len(common)} samples: too few for an interval)")  # fmt: skip
    if result.length_ratio is not None and abs(result.length_ratio - 1) > length_tolerance:
        failures.append(
            f"mean output length {result.length_ratio:.1%} of the standard's, outside ±{length_tolerance:.0%}"
        )
    if run.queries.errors:
        failures.append(f"{run.queries.errors} queries failed")
    if result.ratio is None and result.length_ratio is None:
        result.reasons.append("no reference quality and no output length to compare")
        return result
    result.gate = "FAIL" if failures else "UNDECIDED" if result.state == "undecided" else "PASS"
    result.reasons = failures or (
        [f"quality undecided: {result.decided_by}"] if result.state == "undecided" else []
    )
    return result
