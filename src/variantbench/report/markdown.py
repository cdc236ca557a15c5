"""report.md: the decision in words and tables, a pure function of report.json's schema."""

from __future__ import annotations

from typing import Any

from variantbench.analysis.kernel_gaps import bound_phrase
from variantbench.report.schema import Report


def _f(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.0f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _ratio(r: Any) -> str:
    if r is None or r.value is None:
        return "-"
    if r.ci_low is None:
        return f"{r.value:.2f}"
    return f"{r.value:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]"


def summary_lines(report: Report) -> list[str]:
    """The summary section: a recommendation per scenario, then why any variant is slower."""
    lines = ["## Summary", ""]
    for name, rec in report.recommendations.items():
        lines.append(f"- **{name}** ({rec.description}): {rec.summary}")
    diag = [r.diagnosis.summary for r in report.runs if r.diagnosis and " slower than " in r.diagnosis.summary
            and "not slower" not in r.diagnosis.summary]  # fmt: skip
    if diag:
        lines += ["", "Where a variant is slower than the standard:", ""]
        lines += [f"- {d}" for d in diag]
    undecided = [c for c in report.comparisons if c.state == "undecided"
                 and c.ratio is not None and c.ci_low is not None and c.ci_high is not None]  # fmt: skip
    if undecided:
        lines += ["", "Comparisons the measurements could not decide (treated as ties above):", ""]
        lines += [f"- {c.a} vs {c.b} on {c.metric}: {c.ratio:.2f} [{c.ci_low:.2f}, {c.ci_high:.2f}]"
                  + (f"; about {c.more_samples} samples in all ({c.pairs} so far) would likely decide it"
                     if c.more_samples else "")
                  for c in undecided]  # fmt: skip
    stopped = report.stopped()
    if stopped:
        lines += ["", "**The run did not finish** (`variantbench run --resume DIR` goes on); the decision above "
                  "reads only what was measured:", ""] + [f"- {line}" for line in stopped]  # fmt: skip
    return lines


def _comparison(report: Report) -> list[str]:
    rows = []
    for r in report.runs:
        if r.status != "ok":
            rows.append([r.variant, "failed: " + (r.error or "")] + ["-"] * 12)
            continue
        vs = r.quality_vs_standard
        res = r.resources
        rows.append([
            r.variant,
            r.weight_format or "-",
            _f(r.latency_ms.p50, ",.0f"),
            _f(r.latency_ms.p99, ",.0f"),
            _f(r.ttft_ms.p50, ",.0f"),
            _f(r.speed.prefill_tokens_per_s),
            _f(r.speed.decode_tokens_per_s),
            _f(r.quality.composite, ".3f"),
            f"{_f(vs.ratio * 100 if vs and vs.ratio is not None else None, '.1f', '%')} {vs.gate if vs else ''}",
            _mb(res.peak_rss_bytes),
            f"{_f(res.startup_warm_s or res.startup_s)} / {_f(res.startup_cold_s)}",
            f"{_f(res.energy_j, ',.0f')} ({res.energy_source or '-'})",
            _f(r.cost.per_million_output_tokens if r.cost else None, ".4g"),
            _f(r.cost.efficiency if r.cost else None, ".4g"),
        ])  # fmt: skip
    return _table(
        ["variant", "weights", "p50 ms", "p99 ms", "TTFT p50 ms", "prefill tok/s", "decode tok/s", "quality",
         "vs standard", "peak RSS MB", "startup warm/cold s", "energy J (source)", "cost / 1M tok",
         "efficiency"],
        rows,
    )  # fmt: skip


def _quality_gates(report: Report) -> list[str]:
    """Every paired quality comparison with the standard: value, interval, samples, margin, state."""
    rows = []
    for r in report.runs:
        vs = r.quality_vs_standard
        if vs is None or not vs.comparisons:
            continue
        for c in vs.comparisons:
            ci = (f"{c.value:.3g} [{c.ci_low:.3g}, {c.ci_high:.3g}]" if c.value is not None
                  and c.ci_low is not None and c.ci_high is not None else _f(c.value, ".3g"))  # fmt: skip
            floor = (
                "-"
                if c.floor is None
                else (
                    f"tie < {c.floor:g}, fail > {c.damage:g} nats"
                    if c.metric == "fidelity" and c.damage
                    else f"KL < {c.floor:g}"
                    if c.metric == "fidelity"
                    else f"{c.floor:.1%}"
                )  # fmt: skip
            )
            state = c.state or "(evidence)"
            if c.more_samples:
                state += f": about {c.more_samples} samples would decide it"
            rows.append([r.variant, c.metric, ci, str(c.pairs), floor, state])
    flags = [
        f"- {task}: {why}: its scores carry no information"
        for task, why in report.uninformative_tasks.items()
    ] + [f"- {r.variant}: likelihood scores not available ({r.likelihood.unavailable})"
         for r in report.runs if r.likelihood and r.likelihood.unavailable]  # fmt: skip
    if not rows and not flags:
        return []
    lines = ["## Quality against the standard (paired by sample)", "", *flags, *([""] if flags else []),
             "Each score on the samples both answered; BCa intervals (95%, or 1 - alpha/looks where the run "
             "looked more than once). A ratio's gate: *meets* when the "
             "interval clears the floor, *fails* below it, *undecided* across it; fidelity (KL on the samples' "
             "own positions) decides first: a tie below its tie level, a fail above its damage level.", ""]  # fmt: skip
    return lines + _table(["variant", "score", "value [95% CI]", "samples", "floor", "state"], rows) + [""]


def _lm_eval(report: Report) -> list[str]:
    """lm-evaluation-harness's task scores with their standard errors, per variant."""
    rows = []
    for r in report.runs:
        for task, metrics in sorted((r.lm_eval.tasks if r.lm_eval else {}).items()):
            shown = [f"{m} {v:.3f} ± {metrics.get(m + '_stderr') or 0:.3f}" for m, v in metrics.items()
                     if not m.endswith("_stderr") and v is not None]  # fmt: skip
            rows.append([r.variant, task, "; ".join(shown)])
        if r.lm_eval and r.lm_eval.unavailable:
            rows.append([r.variant, "-", f"not available: {r.lm_eval.unavailable}"])
    if not rows:
        return []
    version = next((r.lm_eval.version for r in report.runs if r.lm_eval), None)
    return [f"## lm-evaluation-harness ({version})", "", "Each metric ± its standard error, as lm-eval reports "
            "it; paired with the standard's by document in the quality table above.", "",
            *_table(["variant", "task", "scores"], rows), ""]  # fmt: skip


def _ab(report: Report) -> list[str]:
    rows = []
    for r in report.runs:
        ab = r.ab_vs_standard
        if ab is None:
            continue
        across = ""
        if ab.across_repeats:
            lat = ab.across_repeats.latency_p50_ratio
            if lat.mean is not None:
                across = f"{lat.mean:.2f}" + (
                    f" [{lat.ci_low:.2f}, {lat.ci_high:.2f}] over {lat.n} runs"
                    if lat.ci_low is not None and lat.ci_high is not None
                    else ""
                )
        basis = f"paired, {ab.pairs} samples" if ab.paired else "unpaired"
        rows.append([r.variant, basis, _ratio(ab.latency_ratio), _ratio(ab.latency_p50_ratio),
                     _ratio(ab.latency_p99_ratio), _ratio(ab.ttft_ratio), _ratio(ab.throughput_ratio),
                     _f(ab.p_value, ".3g"), ab.verdict, across or "-"])  # fmt: skip
    if not rows:
        return []
    return [
        f"## A/B against the standard ({report.standard})",
        "",
        "Ratios are variant / standard with 95% bootstrap intervals; latency below 1 and throughput above 1 "
        "are faster. Paired (both answered the same samples): latency and TTFT are the geometric means of the "
        "per-sample ratios, intervals BCa (scipy.stats.bootstrap, pairs resampled together), p from the "
        "Wilcoxon signed-rank test; unpaired: ratio of medians, percentile bootstrap, Mann-Whitney U.",
        "",
        *_table(
            [
                "variant",
                "basis",
                "latency",
                "median latency",
                "P99 latency",
                "TTFT",
                "throughput",
                "p",
                "verdict",
                "across repeats",
            ],
            rows,
        ),  # fmt: skip
        "",
    ]


def _execution(report: Report) -> list[str]:
    """How the variants shared the machine, and why the run stopped when it did."""
    e = report.execution
    if e.executor is None:  # a report from before the execution was recorded
        return []
    if e.interleaved:
        lines = ["Interleaved: every variant loaded at once, each in its own process, measured in turns "
                 "(single-stream: one query each per round, the order rotated; other scenarios: short "
                 "blocks in a seeded random order), so a drift of the machine lands on all alike."]  # fmt: skip
        for rep in e.repeats:
            last = rep.looks[-1] if rep.looks else None
            lines.append(
                f"Repeat {rep.repeat}: {rep.rounds} rounds, {len(rep.looks)} look(s) at "
                f"{_f((last.confidence if last else 0) * 100, '.2f')}% confidence each; stopped: {rep.stopped}."
            )
    elif (e.nodes or 0) > 1:
        lines = [f"At once on {e.executor}: {e.nodes} nodes, each variant's jobs on a node of its own."]
    else:
        lines = [
            "Not interleaved: one variant after the other" + (f" ({e.why_not})" if e.why_not else "") + "."
        ]
    for r in report.runs:
        node = r.backend.get("node")
        if node:
            lines.append(f"- {r.variant}: node {node.get('host')} ({node.get('ip')}, Ray node "
                         f"{str(node.get('node_id'))[:12]}), {node.get('cpu_model')}, {node.get('cores')} cores")  # fmt: skip
        for why in r.backend.get("retried") or []:
            lines.append(f"- {r.variant}: run again after {why}")
        if len(r.senders) > 1 or any("node_id" in s for s in r.senders):
            lines.append(f"- {r.variant}: {len(r.senders)} senders, each a slice of the schedule")
            for s in r.senders:
                where = (f", on {s.get('host')} ({s.get('ip')}), clock offset {_f(s.get('clock_offset_ms'), '.3f')} ms "
                         f"± {_f((s.get('clock_rtt_ms') or 0) / 2, '.3f')} ms" if "node_id" in s else "")  # fmt: skip
                lines.append(f"  - sender {s['sender']}: {s['queries']} queries, dispatch lag p50 "
                             f"{_f(s.get('lag_p50_ms'), '.3f')} ms, p99 {_f(s.get('lag_p99_ms'), '.3f')} ms{where}")  # fmt: skip
        work = r.cpu_work
        if work:
            lines.append(f"- {r.variant}: tokenizing and templating {_f(work['encode_ms_mean'], '.2f')} ms a query, "
                         f"detokenizing {_f(work['detokenize_ms_mean'], '.2f')} ms: {_f(work['share'] * 100, '.2f')}% of "
                         f"latency, {_f(work['critical_share'] * 100, '.2f')}% on the model's path (the rest ran ahead "
                         "on a CPU thread)")  # fmt: skip
    return ["## How it was measured", "", *lines, ""]


def _decisions(report: Report) -> list[str]:
    """Every pairwise comparison: decided (faster, slower, tied) or not, and what would decide it."""
    if not report.comparisons:
        return []
    band = (report.plan.get("analysis") or {}).get("tie_band", 3.0)
    rows = []
    for c in report.comparisons:
        ci = (f"{c.ratio:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]"
              if c.ratio is not None and c.ci_low is not None and c.ci_high is not None else "-")  # fmt: skip
        more = c.more_samples
        rows.append([f"{c.a} vs {c.b}", c.metric, ci, f"{c.confidence:.1%}", str(c.pairs),
                     f"**{c.state}**", (f"about {more} samples in all" if more else "-")
                     if c.state == "undecided" else "-"])  # fmt: skip
    undecided = [f"{c.a} vs {c.b} ({c.metric})" for c in report.comparisons if c.state == "undecided"]
    return [
        "## Decisions",
        "",
        f"Each pair on paired throughput (output tokens over latency, summed over the samples both answered; BCa "
        f"interval) and on batch-8 decode throughput (rounds in turns; t-interval on log-ratios). Tie band "
        f"+-{band:g}%: **faster**/**slower** = the interval lies wholly outside it, **tied** = wholly inside, "
        "**undecided** = it straddles an edge (the estimate of samples needed assumes the spread seen so far).",
        "",
        *_table(["pair", "metric", "ratio a/b", "confidence", "samples", "state", "would decide"], rows),
        "",
        *(
            [f"Undecided: {', '.join(undecided)}. The recommendations treat these as ties."]
            if undecided
            else []
        ),
        "",
    ]


def _diagnosis(report: Report) -> list[str]:
    runs = [r for r in report.runs if r.diagnosis is not None]
    if not runs:
        return []
    c = report.ceilings
    lines = [
        "## Diagnosis",
        "",
        f"Machine ceilings: {_f(c.get('matmul_gflops'))} GFLOP/s fp32 matmul, {_f(c.get('memory_gbps'), '.2f')} GB/s "
        f"memory read ({c.get('how', '')}). Cache-miss counters: {c.get('cache_counters') or 'not probed'}.",
        "",
    ]
    fams = ["matmul", "attention", "quantize/dequantize", "norm", "other"]
    rows = []
    for r in runs:
        d = r.diagnosis
        assert d is not None
        share = [f"{d.op_share[f]:.0%}" if f in d.op_share else "-" for f in fams]
        batch = " / ".join(
            d.batch_tokens_per_s.get(k) and f"{d.batch_tokens_per_s[k]:.0f}" or "-" for k in ("1", "8", "32")
        )
        roof = "-"
        if d.achieved_gbps is not None and d.ceiling_gbps:
            roof = f"{d.achieved_gbps:.2f} GB/s ({d.achieved_gbps / d.ceiling_gbps:.0%})"
        if d.gpu_idle_share is not None:  # a CUDA device: what bounds the step, and how it was launched
            roof += f"; {bound_phrase(d.achieved_gbps, d.ceiling_gbps, d.gpu_idle_share)} ({d.decode_mode})"
        rows.append(
            [r.variant, _f(d.decode_step_ms, ".2f"), *share, batch, _f(d.achieved_gflops, ".2f"), roof]
        )
    lines += _table(
        ["variant", "decode step ms", *[f"{f} share" for f in fams], "decode tok/s at batch 1 / 8 / 32",
         "achieved GFLOP/s (derived: 2 x params x tokens/s)",
         "achieved bandwidth (derived: bytes of weights read per token x tokens/s; of the measured ceiling)"],
        rows,
    )  # fmt: skip
    lines += [""] + [f"- {r.diagnosis.summary}" for r in runs if r.diagnosis and r.diagnosis.summary]
    notes = {r.diagnosis.profiler for r in runs if r.diagnosis and r.diagnosis.profiler}
    lines += ["", "Profiles: " + "; ".join(sorted(notes)) + ". FBGEMM's dynamic int8 linear quantizes its "
              "activations inside the kernel: that time counts as matmul.", ""]  # fmt: skip
    return lines


def _recommendations(report: Report) -> list[str]:
    if not report.recommendations:
        return []
    lines = ["## Recommendation per scenario", ""]
    for name, rec in report.recommendations.items():
        constraints = ", ".join(
            f"{k}={v}" for k, v in rec.constraints.items() if k not in ("name", "description")
        )
        lines += [f"### {name}", "", f"{rec.description} ({constraints})", "", f"**{rec.summary}**", ""]
        for variant, why in rec.reasons.items():
            lines.append(f"- {variant}: {why}")
        lines.append("")
    return lines


def _cost(report: Report) -> list[str]:
    run = next((r for r in report.runs if r.cost is not None), None)
    if run is None or run.cost is None:
        return []
    i = run.cost.inputs
    lines = [
        "## Cost model",
        "",
        f"Hardware {i.get('cost_per_hour')} {i.get('currency')}/h x {i.get('devices')} device(s); energy "
        f"{i.get('energy_price_kwh')} {i.get('currency')}/kWh"
        + (
            " (**placeholder prices**, the plan's defaults: set cost.per_hour and cost.energy_price_kwh)"
            if i.get("prices") == "placeholder"
            else ""
        )
        + ". Energy of a run = its tracked mean power x its "
        "measured span. Efficiency = quality x throughput / (hardware cost x energy per token), in "
        f"{run.cost.efficiency_units}.",
        "",
    ]
    rows = []
    for r in report.runs:
        if r.cost is None:
            continue
        x = r.cost.inputs
        rows.append([r.variant, _f(x.get("quality"), ".3f"), _f(x.get("throughput_tokens_per_s"), ".2f"),
                     _f(x.get("energy_per_token_j"), ".3f"), _f(x.get("duration_s"), ".1f"),
                     _f(x.get("span_energy_j"), ",.0f"), _f(r.cost.tokens_per_joule, ".3f"),
                     _with_ci(r.cost.per_million_output_tokens, r.cost.per_million_output_tokens_ci)
                     + _said(placeholder=x.get("prices") == "placeholder",
                             estimated="estimate" in (r.resources.energy_source or "")),
                     _with_ci(r.cost.efficiency, r.cost.efficiency_ci)
                     + _said(placeholder=x.get("prices") == "placeholder",
                             estimated="estimate" in (r.resources.energy_source or ""))])  # fmt: skip
    lines += _table(["variant", "quality", "output tok/s", "J / token", "span s", "energy J", "tokens / J",
                     "cost / 1M tokens [95% CI]", "efficiency [95% CI]"], rows)  # fmt: skip
    sources = {r.resources.energy_source for r in report.runs if r.resources.energy_source}
    if any("estimate" in s for s in sources):
        watts = next((r.resources.watts_per_core for r in report.runs if r.resources.watts_per_core), None)
        lines += [
            "",
            f"Energy is an **estimate** (no readable RAPL counter): CPU seconds x {watts} W per busy core.",
        ]
    return lines + [""]


def _said(placeholder: bool = False, estimated: bool = False) -> str:
    """What a cost figure stands on, in its own cell: placeholder prices, estimated energy."""
    notes = [w for w, on in (("placeholder prices", placeholder), ("estimated energy", estimated)) if on]
    return f" ({', '.join(notes)})" if notes else ""


def _with_ci(value: float | None, ci: list[float] | None) -> str:
    return _f(value, ".4g") + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci and value is not None else "")


def _environment(report: Report) -> list[str]:
    e = report.environment
    seeds = {k: v for r in report.runs for k, v in r.seeds.items()}
    lines = ["## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in e.items()]
    lines += [f"- seeds: {seeds or report.plan.get('seed')}", f"- variantbench {report.tool_version}, "
              f"report schema {report.schema_version}, created {report.created_utc}"]  # fmt: skip
    return lines + [""]


def _percentiles(report: Report) -> list[str]:
    """vLLM's view: each chosen metric at each chosen percentile, then goodput against the SLOs."""
    runs = [r for r in report.runs if r.status == "ok" and r.percentiles]
    if not runs:
        return []
    metrics = list(runs[0].percentiles)
    points = list(runs[0].percentiles[metrics[0]]) if metrics else []
    header = ["variant", *(f"{m.upper()} P{p} ms" for m in metrics for p in points), "goodput req/s"]
    rows = []
    for r in runs:
        good = r.goodput
        cells = [_f(r.percentiles[m].get(p)) for m in metrics for p in points]
        rows.append(
            [r.variant, *cells, "-" if good is None else f"{good.requests_per_s:.3f} ({good.met} met)"]
        )
    slos = next((r.goodput.slo_ms for r in runs if r.goodput), None)
    said = (f"Goodput: completed requests per second meeting every SLO ({', '.join(f'{k} <= {v:g} ms' for k, v in slos.items())})."
            if slos else "Goodput: no SLO stated (--goodput ttft:MS tpot:MS e2el:MS, or the latency targets).")  # fmt: skip
    return ["## Percentiles (vLLM's metrics)", "",
            "TTFT, TPOT per request; ITL per gap between tokens; E2EL from issue to the last token.", "",
            *_table(header, rows), "", said, ""]  # fmt: skip


def _server_latency(report: Report) -> list[str]:
    """Served variants: the server's own TTFT and ITL histograms beside the client's measurements."""
    runs = [r for r in report.runs if r.status == "ok" and r.server_latency]
    if not runs:
        return []
    rows = []
    for r in runs:
        v = r.server_latency or {}
        ratio = v.get("client_over_server_p50") or {}
        for key, client in (("ttft_ms", r.ttft_ms.p50), ("itl_ms", r.itl_ms.p50)):
            entry = v.get(key)
            if entry:
                kind = key.removesuffix("_ms")
                rows.append([r.variant, kind.upper(), _f(entry.get("p50")), _f(entry.get("p90")), _f(entry.get("p99")),
                             str(entry.get("count")), _f(client), _f(ratio.get(kind), ".3f"), entry.get("source", "")])  # fmt: skip
    header = ["variant", "metric", "server P50 ms", "P90", "P99", "observations", "client P50 ms",
              "client / server", "server histogram"]  # fmt: skip
    return ["## The server's own latency histograms", "",
            "Read from the server's /metrics after the warm-up and after each measured block "
            "(percentiles interpolated inside buckets, as Prometheus does).", "",
            *_table(header, rows), "",
            *(f"- {r.variant}: {r.server_latency['note']}" for r in runs if (r.server_latency or {}).get("note")), ""]  # fmt: skip


def backend_lines(report: Report) -> list[str]:
    """Which backend measured each variant, when it is not our engine for all of them, and how
    prompts were written when not through the model's chat template."""
    from variantbench.analysis.recommend import engine_of

    by = {r.variant: engine_of(r) for r in report.runs if r.backend}
    plain = sorted(
        {
            str(f)
            for r in report.runs
            if (f := (r.backend or {}).get("prompt_format")) and f != "chat template"
        }
    )
    lines = [f"Prompts: {f}." for f in plain]
    if set(by.values()) <= {"torch"}:
        return lines
    lines.insert(0, f"Measured by: {', '.join(f'{v} on {b}' for v, b in by.items())}.")
    if "transformers" in by.values():
        lines.append(
            "The transformers fallback ran this model's architecture (no engine family): transformers' own "
            "generate, one request at a time; none of the engine's fast paths was used."
        )
    return lines


def _backends(report: Report) -> list[str]:
    lines = backend_lines(report)
    return ["", *lines] if lines else []


def render(report: Report) -> str:
    w = report.workload
    lines = [
        f"# variantbench report: {report.model.get('name')}",
        "",
        f"Standard: **{report.standard}**. Variants: {', '.join(r.variant for r in report.runs)}. Workload: "
        f"{w.get('samples', w.get('n', '?'))} samples ({w.get('source', w.get('kind', 'synthetic'))}), "
        f"scenario {report.scenario}.",
        *_backends(report),
        "",
        *summary_lines(report),
        "",
        "## Comparison",
        "",
        *_comparison(report),
        "",
        *_quality_gates(report),
        *_lm_eval(report),
        *_percentiles(report),
        *_server_latency(report),
        *_ab(report),
        *_execution(report),
        *_decisions(report),
        *_diagnosis(report),
        *_recommendations(report),
        *_cost(report),
        *_environment(report),
    ]
    return "\n".join(lines) + "\n"
