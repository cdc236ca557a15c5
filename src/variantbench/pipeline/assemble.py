"""The one report assembly: raw job results + the query log -> Report, used by ``run`` and ``report``.

Pure function of the saved data (``raw/*.json``, ``queries.jsonl``, the plan and the run's header),
so ``variantbench report DIR`` recomputes exactly what the run wrote, find-peak runs included (their
raw results name the run id of the trial they summarize).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from variantbench.pipeline.settings import criteria_for
from variantbench.plan import Plan
from variantbench.records import QueryRecord
from variantbench.report.results import Fidelity, VariantResult
from variantbench.report.schema import (
    AB,
    AcrossRepeats,
    BatchThroughput,
    Cost,
    Incomplete,
    PairComparison,
    PeakSearch,
    Recommendation,
    RepeatRow,
    Report,
    RunReport,
    Spread,
)
from variantbench.report.summary import compare_to_standard, summarize_run


def assemble(header: Report, plan: Plan, raws: Iterable[VariantResult], records: Iterable[QueryRecord],
             order: list[str] | None = None) -> Report:  # fmt: skip
    """The report: ``header`` (model, workload, environment, ceilings) with one run per variant.

    ``raws`` are the measure jobs' results, failed ones with their error, partial ones (a run that
    stopped) with what they lack; ``order`` is the variants' order, the standard first (default: as
    the results come).
    """
    raws = list(raws)
    by_run: dict[str, list[QueryRecord]] = {}
    for rec in records:
        by_run.setdefault(rec.run_id, []).append(rec)
    order = order or list(dict.fromkeys(raw.variant for raw in raws))
    report = header.model_copy(update={"runs": [], "recommendations": {}})
    standard: tuple[RunReport, list[QueryRecord]] | None = None
    standard_repeats: list[RunReport] = []
    measured: dict[str, list[QueryRecord]] = {}  # each variant's records over its repeats
    for variant in order:
        repeats: list[RunReport] = []
        for raw in sorted((r for r in raws if r.variant == variant), key=lambda r: r.repeat):
            if raw.status == "failed" or raw.run_id is None:
                repeats.append(
                    RunReport(variant=variant, status="failed", error=raw.error or "nothing measured")
                )
                continue
            recs = [r for r in by_run.get(raw.run_id, []) if r.variant in (variant, raw.name)]
            if not recs and raw.status != "ok":  # loaded, then stopped before its first query
                repeats.append(RunReport(variant=variant, status="failed",
                                         error=f"stopped before its first query ({stopped_why(raw)})"))  # fmt: skip
                continue
            run = summarize_payload(raw, recs, plan, standard, header.ceilings)
            if run.status == "ok":
                measured.setdefault(variant, []).extend(recs)
            if raw.repeat == 0 and variant == header.standard and run.status == "ok":
                standard = (run, recs)
            repeats.append(run)
        if not repeats:
            continue
        run = combine_repeats(repeats, standard_repeats)
        if variant == header.standard:
            standard_repeats = repeats
        wall = next((r.wall_s for r in raws if r.variant == variant and r.wall_s), None)
        if wall is not None:
            run.backend.setdefault("wall_s", wall)
        report.runs.append(run)
    report.comparisons = [PairComparison(**c.to_json()) for c in comparisons(report, plan, measured)]
    finalize(report, plan)
    report.uninformative_tasks = uninformative_tasks(report, measured)
    return report


def look_confidence_of(plan: Plan) -> float:
    """The confidence of every interval a run decides on: 1 - alpha / looks under until_decided."""
    from variantbench.metrics.sequential import look_confidence

    a = plan.analysis
    return look_confidence(a.alpha, a.looks if a.until_decided else 1)


def comparisons(report: Report, plan: Plan, measured: dict[str, list[QueryRecord]]) -> list[Any]:
    """Every pair of measured variants: paired throughput over the samples both answered (at the
    confidence the run's looks used), and batch throughput over the interleaved batch rounds."""
    from variantbench.metrics.sequential import all_pairs, compare_repeated

    a = plan.analysis
    confidence = look_confidence_of(plan)
    band = a.tie_band / 100
    ok = [r.variant for r in report.runs if r.status == "ok" and r.variant in measured]
    out = all_pairs({v: measured[v] for v in ok}, confidence=confidence, band=band)
    batch = {r.variant: r.batch_throughput.values for r in report.runs
             if r.status == "ok" and r.batch_throughput and len(r.batch_throughput.values) >= 2}  # fmt: skip
    names = [v for v in ok if v in batch]
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            out.append(compare_repeated(x, y, batch[x], batch[y], metric="batch throughput",
                                        confidence=1 - a.alpha, band=band))  # fmt: skip
    return out


def stopped_why(raw: VariantResult) -> str:
    """Why a result lacks phases: the run stopped there (killed), or nothing but its queries is left."""
    if raw.status == "log-only":
        return "no result file: rebuilt from its queries in the log"
    return "the run stopped while it was measured (killed)"


def summarize_payload(
    payload: VariantResult,
    records: list[QueryRecord],
    plan: Plan,
    standard: tuple[RunReport, list[QueryRecord]] | None = None,
    ceilings: dict[str, Any] | None = None,
) -> RunReport:
    """One variant's run from its raw results and its query records: summary, resources, cost, A/B."""
    from variantbench.analysis.cost import derive
    from variantbench.metrics.windows import windows as make_windows
    from variantbench.trackers.resources import sample_from_row, window_resources

    fidelity = payload.fidelity or Fidelity()
    criteria = criteria_for(plan, payload.seeds, target_qps=payload.target_qps)
    res = payload.resources.model_copy()
    if res.startup_warm_s is None:
        res.startup_warm_s = res.startup_s
    run = summarize_run(
        payload.name or payload.variant,
        records,
        res,
        backend=dict(payload.load.details) if payload.load else {},
        scenario=payload.scenario or plan.scenario,
        criteria=criteria,
        fidelity={
            "perplexity": fidelity.perplexity,
            "kl_mean": fidelity.kl_mean,
            "kl_p99": fidelity.kl_p99,
            "top1_agreement": fidelity.top1_agreement,
        },  # fmt: skip
    )
    if payload.likelihood:
        run.likelihood = payload.likelihood.model_copy(deep=True)
        _accuracy_by_likelihood(run)
    run.lm_eval = payload.lm_eval
    if payload.build:
        run.backend["build"] = payload.build.model_dump()
    if payload.phases_s:
        run.backend["phases_s"] = dict(payload.phases_s)
    if payload.node:  # where a job ran (Ray) and what was run again
        run.backend["node"] = payload.node
    if payload.retried:
        run.backend["retried"] = payload.retried
    if payload.status != "ok":
        run.incomplete = Incomplete(status=payload.status, why=stopped_why(payload), missing=payload.missing(),
                                    done=list(payload.done))  # fmt: skip
    where = {int(s["sender"]): s for s in payload.senders}  # Ray senders: node, clock offset
    for entry in run.senders:
        entry.update({k: v for k, v in where.get(int(entry["sender"]), {}).items() if k != "sender"})
    if payload.peak_search:
        passing = [t.rate_qps for t in payload.peak_search if t.passed]
        run.peak = PeakSearch(peak_qps=max(passing) if passing else None, trials=list(payload.peak_search))
    samples = [sample_from_row(row) for row in payload.resource_samples]
    if samples and run.windows:
        spans = [(w.start_ns, w.end_ns) for w in make_windows(records, criteria.window)]
        for w, extra in zip(run.windows, window_resources(samples, spans, res.cores or 1), strict=True):
            w.mean_rss_bytes, w.mean_cpu_util = extra["mean_rss_bytes"], extra["mean_cpu_util"]
    ok_tokens = sum(r.output_tokens for r in records if r.status == "ok")
    run.cost = Cost(**derive(cost_model(plan), duration_s=run.duration_s, output_tokens=ok_tokens,
                             energy_j=res.energy_j, tracked_wall_s=res.wall_s,
                             quality=run.quality.composite))  # fmt: skip
    _cost_intervals(run, records)
    batch = payload.batch_decode
    if batch and batch.tokens_per_s:
        from variantbench.metrics.significance import across_runs

        values = [float(v) for v in batch.tokens_per_s]
        spread = across_runs(values)
        run.batch_throughput = BatchThroughput(batch=batch.size, new_tokens=batch.new_tokens, values=values,
                                               tokens_per_s=spread["mean"], ci_low=spread["ci_low"],
                                               ci_high=spread["ci_high"])  # fmt: skip
    if payload.is_standard:
        run.quality_vs_standard = compare_to_standard(run, records, run, records)
    elif standard is not None:
        std_run, std_records = standard
        if std_run.variant == run.variant:
            run.quality_vs_standard = compare_to_standard(run, records, run, records)
        elif std_run.status == "ok":
            run.quality_vs_standard = compare_to_standard(
                run, records, std_run, std_records,
                threshold=plan.quality.threshold / 100, length_tolerance=plan.quality.length_tolerance / 100,
                likelihood=run.likelihood, standard_likelihood=std_run.likelihood,
                lm_eval=run.lm_eval, standard_lm_eval=std_run.lm_eval, confidence=look_confidence_of(plan),
            )  # fmt: skip
            run.ab_vs_standard = AB(**ab_compare(run.variant, records, std_run.variant, std_records))
    histograms = payload.server_metrics.latency_histograms if payload.server_metrics else None
    if histograms:
        run.server_latency = server_latency_view(run, histograms)
    if payload.diagnosis:
        run.diagnosis = payload.diagnosis.model_copy(update={
            "ceiling_gflops": (ceilings or {}).get("matmul_gflops"),
            "ceiling_gbps": (ceilings or {}).get("memory_gbps")})  # fmt: skip
    return run


def server_latency_view(run: RunReport, histograms: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """The server's own TTFT and ITL percentiles beside the client's: client p50 / server p50 near 1
    says both clocks saw the same run (on loopback the client adds the transport and its parsing)."""
    from variantbench.trackers.server_metrics import server_latency

    view = server_latency(histograms)
    client = {"ttft_ms": run.ttft_ms.p50, "itl_ms": run.itl_ms.p50}
    ratios = {}
    for key, entry in view.items():
        mine, theirs = client.get(key), entry.get("p50")
        if mine is not None and theirs:
            ratios[key.removesuffix("_ms")] = round(mine / theirs, 4)
    if not view:
        return None
    view["client_over_server_p50"] = ratios
    if run.queries.errors:  # e.g. client timeouts: the server went on and timed their tokens too
        view["note"] = (f"{run.queries.errors} queries failed on the client side; the server's "
                        "histograms also hold what it did for them, so the two cover different requests")  # fmt: skip
    return view


def _cost_intervals(run: RunReport, records: list[QueryRecord]) -> None:
    """The cost's and efficiency's 95% intervals from the throughput's: the cost per token scales as
    1/throughput (hardware time and energy per token both do), the efficiency as throughput^2."""
    from variantbench.metrics.significance import rate_interval

    ok = [r for r in records if r.status == "ok"]
    tput = rate_interval([r.output_tokens for r in ok], [r.latency_ms for r in ok])
    value, lo, hi = tput["value"], tput["ci_low"], tput["ci_high"]
    if run.cost is None or not value or lo is None or hi is None or lo <= 0:
        return
    if run.cost.per_million_output_tokens is not None:
        c = run.cost.per_million_output_tokens
        run.cost.per_million_output_tokens_ci = [c * value / hi, c * value / lo]
    if run.cost.efficiency is not None:
        e = run.cost.efficiency
        run.cost.efficiency_ci = [e * (lo / value) ** 2, e * (hi / value) ** 2]


def cost_model(plan: Plan) -> Any:
    from variantbench.analysis.cost import CostModel

    c = plan.cost
    defaults = type(c).model_fields
    placeholder = (
        c.per_hour == defaults["per_hour"].default
        and c.energy_price_kwh == defaults["energy_price_kwh"].default
    )
    return CostModel(cost_per_hour=c.per_hour, devices=c.devices, currency=c.currency,
                     energy_price_kwh=c.energy_price_kwh, watts_per_core=c.watts_per_core,
                     placeholder_prices=placeholder)  # fmt: skip


def ab_compare(variant: str, records: list[QueryRecord], standard: str, std_records: list[QueryRecord],
               seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Variant over standard: paired per sample when both answered the same samples (Wilcoxon
    signed-rank, BCa intervals), else per query unpaired (Mann-Whitney, percentile bootstrap)."""
    from variantbench.metrics import significance as sig

    ok_a = [r for r in records if r.status == "ok"]
    ok_b = [r for r in std_records if r.status == "ok"]
    matched = sig.pairs(ok_a, ok_b, key=lambda r: r.sample_id)
    if len(matched) >= 3:
        mine, theirs = [m for m, _ in matched], [t for _, t in matched]
        lat_a = [r.latency_from_scheduled_ms for r in mine]
        lat_b = [r.latency_from_scheduled_ms for r in theirs]
        latency = sig.paired_ratio(lat_a, lat_b, seed=seed)
        p50 = sig.paired_quantile_ratio(lat_a, lat_b, 50, seed=seed)
        p99 = sig.paired_quantile_ratio(lat_a, lat_b, 99, seed=seed + 1)
        tput = sig.paired_rate_ratio([r.output_tokens for r in mine], [r.latency_ms for r in mine],
                                     [r.output_tokens for r in theirs], [r.latency_ms for r in theirs],
                                     seed=seed + 2)  # fmt: skip
        with_ttft = [(m, t) for m, t in matched if m.ttft_ms is not None and t.ttft_ms is not None]
        ttft = sig.paired_ratio(
            [m.ttft_ms for m, _ in with_ttft], [t.ttft_ms for _, t in with_ttft], seed=seed + 3
        )
        p, test, n_pairs = sig.wilcoxon(lat_a, lat_b), "wilcoxon", len(matched)
    else:
        lat_a = [r.latency_from_scheduled_ms for r in ok_a]
        lat_b = [r.latency_from_scheduled_ms for r in ok_b]
        p50 = sig.bootstrap_ratio(lat_a, lat_b, 50, seed=seed)
        p99 = sig.bootstrap_ratio(lat_a, lat_b, 99, seed=seed + 1)
        tput = sig.bootstrap_rate_ratio([r.output_tokens for r in ok_a], [r.latency_ms for r in ok_a],
                                        [r.output_tokens for r in ok_b], [r.latency_ms for r in ok_b],
                                        seed=seed + 2)  # fmt: skip
        latency, ttft = p50, sig.no_ratio()
        p, test, n_pairs = sig.mann_whitney(lat_a, lat_b), "mann-whitney", 0
    word = sig.verdict(latency, p)
    return {
        "standard": standard,
        "paired": n_pairs > 0,
        "pairs": n_pairs,
        "test": test,
        "latency_ratio": latency,
        "latency_p50_ratio": p50,
        "latency_p99_ratio": p99,
        "ttft_ratio": ttft,
        "throughput_ratio": tput,
        "p_value": p,
        "verdict": word,
        "summary": sig.describe(variant, standard, latency, tput, p, word, test=test, pairs=n_pairs or None),
    }


def combine_repeats(repeats: list[RunReport], standard_repeats: list[RunReport]) -> RunReport:
    """The first run is the report's row; with repeats, each run's key numbers and, against the
    standard's run of the same index, the mean and 95% CI of the ratios across runs."""
    from variantbench.metrics.significance import across_runs

    main = repeats[0]
    if len(repeats) < 2:
        return main
    main.repeats = [
        RepeatRow(repeat=i, status=r.status, latency_p50_ms=r.latency_ms.p50, latency_p99_ms=r.latency_ms.p99,
                  output_tokens_per_s=r.throughput.output_tokens_per_s)
        for i, r in enumerate(repeats)
    ]  # fmt: skip
    if main.ab_vs_standard is not None and standard_repeats:
        p50, tput = [], []
        for mine, theirs in zip(repeats, standard_repeats, strict=False):
            if mine.status == theirs.status == "ok" and mine.latency_ms.p50 and theirs.latency_ms.p50:
                p50.append(mine.latency_ms.p50 / theirs.latency_ms.p50)
                if mine.throughput.output_tokens_per_s and theirs.throughput.output_tokens_per_s:
                    tput.append(mine.throughput.output_tokens_per_s / theirs.throughput.output_tokens_per_s)
        main.ab_vs_standard.across_repeats = AcrossRepeats(latency_p50_ratio=Spread(**across_runs(p50)),
                                                           throughput_ratio=Spread(**across_runs(tput)))  # fmt: skip
    return main


def _accuracy_by_likelihood(run: RunReport) -> None:
    """Classification scored as lm-evaluation-harness scores it: the label the model finds most
    likely after the prompt, not the first label word it happens to generate (the default model
    opens every answer with "The writer's opinion...": 0.000 for every variant in 4 tokens)."""
    lk = run.likelihood
    if lk is None or lk.choice_accuracy is None:
        return
    task = run.per_task.get("classification")
    for quality in [run.quality] + ([task.quality] if task is not None else []):
        quality.accuracy_generated = quality.accuracy
        quality.accuracy = lk.choice_accuracy
        quality.accuracy_by = "label likelihood"


def uninformative_tasks(report: Report, measured: dict[str, list[QueryRecord]]) -> dict[str, str]:
    """Tasks on which every measured variant scored every sample the same (all 0, or all 1): their
    scores cannot tell variants apart, and the report says so."""
    from variantbench.metrics.quality_compare import first_answers, sample_scores

    values: dict[str, set[float]] = {}
    for run in report.runs:
        if run.status != "ok" or run.variant not in measured:
            continue
        by_lk = {
            s.sample_id: s.acc
            for s in (run.likelihood.per_sample if run.likelihood else [])
            if s.acc is not None
        }
        for sid, record in first_answers(measured[run.variant]).items():
            lk = by_lk.get(sid) if record.task == "classification" else None
            score = lk if lk is not None else sample_scores(record)["task score"]
            values.setdefault(record.task, set()).add(round(float(score), 9))
    return {task: f"every variant scored {next(iter(v)):.3g} on every sample" for task, v in sorted(values.items())
            if len(v) == 1}  # fmt: skip


def finalize(report: Report, plan: Plan) -> None:
    """What needs every run: each diagnosis explained against the standard's, the recommendations."""
    from variantbench.analysis.diagnosis import explain
    from variantbench.analysis.recommend import recommend

    std = report.run(report.standard)
    for run in report.runs:
        if run.diagnosis is None or std is None or std.diagnosis is None or run.status != "ok":
            continue
        if run.diagnosis.summary.startswith("diagnosis failed"):
            continue
        if run.variant == std.variant:
            run.diagnosis.summary = f"{run.variant}: the standard (baseline of the comparison)"
            continue

        def ratio(mine: float | None, theirs: float | None) -> float | None:
            return mine / theirs if mine and theirs else None

        run.diagnosis.summary = explain(
            run.variant, run.diagnosis.model_dump(), std.variant, std.diagnosis.model_dump(),
            ratio(run.speed.decode_tokens_per_s, std.speed.decode_tokens_per_s),
            ratio(run.speed.prefill_tokens_per_s, std.speed.prefill_tokens_per_s),
        )  # fmt: skip
    report.recommendations = {
        name: Recommendation(**recommend(report.runs, report.standard, p, report.comparisons,
                                         band=plan.analysis.tie_band / 100, mix_backends=plan.decision.mix_backends))
        for name, p in plan.decision.profiles().items()
    }  # fmt: skip
