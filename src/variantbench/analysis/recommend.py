"""The recommendation: which measured variant to deploy for a deployment profile, and why.

Among the variants that meet every constraint of the profile (``analysis/profiles.py``), the one
that ranks first wins: the cheapest per million output tokens, or for a profile that asks for
throughput (``batch``), the highest batching throughput (batch-8 decode, measured in turns). Both
respect their own uncertainty:

* a constraint that compares with the standard is met only when the interval says so (the P99
  ratio's upper end within the limit plus the tie band; the batch throughput ratio's lower end);
* the first-ranked variant is compared with every other eligible one (``report.comparisons``); those
  it is not shown to beat beyond the tie band (tied, or undecided) are tied with it, and the tie is
  broken by a stated secondary criterion: lower peak memory, then fewer weight bytes, then a
  shorter build, each by more than the tie band; still tied, the standard (no change) or the first.

Every other variant gets one line saying which constraint it failed, with the numbers. Placeholder
prices and estimated energy are said in the same line as the cost they stand under.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from variantbench.analysis.profiles import PROFILES, Profile
from variantbench.metrics.sequential import Comparison

__all__ = ["PROFILES", "Profile", "check", "recommend"]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def _ci(r: Any) -> str:
    """A ratio with its interval: an A/B ``Ratio`` (``value``) or a pairwise comparison (``ratio``)."""
    value = getattr(r, "value", None)
    value = value if value is not None else getattr(r, "ratio", None)
    lo, hi = r.ci_low, r.ci_high
    if value is None:
        return "n/a"
    return (
        f"{value:.2f} [{lo:.2f}, {hi:.2f}]"
        if lo is not None and hi is not None
        else f"{value:.2f} (no interval)"
    )


def find(comparisons: Sequence[Any], x: str, y: str, metric: str) -> Comparison | None:
    """``x`` against ``y`` on ``metric`` (the report's ``PairComparison``s, or the metrics'
    ``Comparison``s), turned around when the report holds ``y`` against ``x``."""
    flip = {"faster": "slower", "slower": "faster"}
    for c in comparisons:
        if c.metric != metric or {c.a, c.b} != {x, y}:
            continue
        inv = (lambda v: 1 / v if v else None) if c.a == y else (lambda v: v)  # noqa: E731
        lo, hi = (inv(c.ci_high), inv(c.ci_low)) if c.a == y else (c.ci_low, c.ci_high)
        return Comparison(a=x, b=y, metric=metric, ratio=inv(c.ratio), ci_low=lo, ci_high=hi,
                          confidence=c.confidence, pairs=c.pairs, more_samples=c.more_samples,
                          state=flip.get(c.state, c.state) if c.a == y else c.state)  # fmt: skip
    return None


def batch_rate(run: Any) -> float | None:
    b = run.batch_throughput
    return b.tokens_per_s if b else None


def check(run: Any, standard: Any, s: Profile, comparisons: Sequence[Any] = (),
          band: float = 0.03) -> list[str]:  # fmt: skip
    """The constraints ``run`` (a RunReport) fails in profile ``s``, one line each (empty: it fits)."""
    if run.status != "ok":
        return [f"did not run: {run.error}"]
    fails: list[str] = []
    is_standard = standard is not None and run.variant == standard.variant
    p99 = run.latency_ms.p99
    if s.p99_latency_ms is not None and (p99 is None or p99 > s.p99_latency_ms):
        fails.append(f"P99 latency {p99 or float('nan'):,.0f} ms > target {s.p99_latency_ms:,.0f} ms")
    if s.p99_vs_standard is not None and standard is not None and not is_standard:
        ratio = run.ab_vs_standard.latency_p99_ratio if run.ab_vs_standard else None
        limit = s.p99_vs_standard * (1 + band)
        upper = (
            ratio.ci_high
            if ratio is not None and ratio.ci_high is not None
            else (ratio.value if ratio else None)
        )
        if upper is None or upper > limit:
            fails.append(f"P99 latency vs the standard's {_ci(ratio) if ratio else 'n/a'}: not shown to be at most "
                         f"{s.p99_vs_standard:g}x (+{band:.0%} tie band)")  # fmt: skip
    rss = run.resources.peak_rss_bytes
    if s.memory_budget_bytes is not None and rss is None:
        fails.append(
            f"peak memory not measured (a served model's memory is the server's), budget {_mb(s.memory_budget_bytes)}"
        )
    elif s.memory_budget_bytes is not None and rss is not None and rss > s.memory_budget_bytes:
        fails.append(f"peak memory {_mb(rss)} > budget {_mb(s.memory_budget_bytes)}")
    if not s.gpu and str(run.backend.get("device", "cpu")).startswith("cuda"):
        fails.append("runs on a GPU; this profile has none")
    if s.quality_floor is not None and not is_standard:
        fails.extend(quality_fails(run.quality_vs_standard, s.quality_floor))
    for task, floor in s.task_floors.items():
        mine = run.per_task.get(task).quality.composite if run.per_task.get(task) else None
        theirs = (standard.per_task.get(task).quality.composite
                  if standard is not None and standard.per_task.get(task) else None)  # fmt: skip
        if mine is None or not theirs:
            fails.append(f"no {task} quality to compare")
        elif mine / theirs < floor:
            fails.append(f"{task} quality {mine / theirs:.1%} of the standard's < floor {floor:.0%}")
    if s.build_budget_s is not None:
        build_s = run.resources.build_s or (run.backend.get("built") or {}).get("build_s") or 0.0
        if build_s > s.build_budget_s:
            fails.append(f"build time {build_s:,.0f} s > budget {s.build_budget_s:,.0f} s")
    qps = run.throughput.qps
    if s.min_qps is not None and (qps is None or qps < s.min_qps):
        fails.append(f"{qps or 0:.3g} queries/s < needed {s.min_qps:g}")
    if s.min_throughput_vs_standard is not None and standard is not None and not is_standard:
        fails.extend(_throughput_fails(run, standard, s.min_throughput_vs_standard, comparisons, band))
    return fails


UNDECIDED_QUALITY = "quality undecided"


def quality_fails(vs: Any, floor: float) -> list[str]:
    """The profile's quality floor read on the paired intervals (``metrics/quality_compare.py``):
    the gate's deciding comparison's state at this floor. An undecided one is neither a pass nor a
    fail: it keeps the variant out and its line says so (``UNDECIDED_QUALITY``), with the samples
    likely to decide it. Without an interval (under 3 paired samples), the point ratio, said as such."""
    from variantbench.metrics.quality_compare import ratio_state, samples_to_decide

    if vs is None:
        return ["no quality measured against the standard"]
    if vs.state == "tied":
        return []
    damaged = next((c for c in vs.comparisons if c.metric == "fidelity" and c.state == "fails"), None)
    if damaged is not None:
        return [f"quality below the floor {floor:.0%}: KL(standard || variant) {damaged.value:.3g} "
                f"[{damaged.ci_low:.3g}, {damaged.ci_high:.3g}] nats on {damaged.pairs} samples, above the "
                f"damage level {damaged.damage:g}"]  # fmt: skip
    deciding = next((c for c in vs.comparisons if c.state is not None and c.metric != "fidelity"), None)
    if deciding is None:
        if vs.ratio is None:
            return ["no quality measured against the standard"]
        return ([f"quality {vs.ratio:.1%} of the standard's < floor {floor:.0%} (a point estimate: too few "
                 "samples for an interval)"] if vs.ratio < floor else [])  # fmt: skip
    lo, hi = deciding.ci_low, deciding.ci_high
    state = ratio_state(lo, hi, floor)
    shown = (f"{deciding.metric} {deciding.value:.1%} [{lo:.1%}, {hi:.1%}] of the standard's on {deciding.pairs} "
             "samples" if deciding.value is not None and lo is not None and hi is not None
             else f"{deciding.metric}: no interval")  # fmt: skip
    if state == "meets":
        return []
    if state == "fails":
        return [f"quality below the floor {floor:.0%}: {shown}"]
    more = samples_to_decide(deciding.pairs, deciding.value, lo, hi, floor)
    return [
        f"{UNDECIDED_QUALITY} against the {floor:.0%} floor: {shown}"
        + (f"; about {more} samples would decide it" if more else "")
    ]


def _throughput_fails(run: Any, standard: Any, need: float, comparisons: Sequence[Any],
                      band: float) -> list[str]:  # fmt: skip
    """Throughput vs the standard: the batching throughput's ratio where it was measured (its interval's
    lower end at least ``need`` less the tie band), else the run's own output tokens/s."""
    c = find(comparisons, run.variant, standard.variant, "batch throughput")
    if c is not None:
        low = c.ci_low if c.ci_low is not None else c.ratio
        if low is None or low < need / (1 + band):
            return [f"batch-8 throughput vs the standard's {_ci(c)}: not shown to be at least {need:g}x "
                    f"(-{band:.0%} tie band)"]  # fmt: skip
        return []
    mine, theirs = run.throughput.output_tokens_per_s, standard.throughput.output_tokens_per_s
    if mine is None or not theirs or mine < theirs * need:
        return [f"{mine or 0:,.1f} output tokens/s < {need:g}x the standard's ({(theirs or 0) * need:,.1f})"]
    return []


def _labels(run: Any) -> str:
    """What the cost figure stands on, said in the same line: placeholder prices, estimated energy."""
    notes = []
    if run.cost and run.cost.inputs.get("prices") == "placeholder":
        notes.append("at placeholder prices: set cost.per_hour and cost.energy_price_kwh")
    if run.resources.energy_source == "estimate":
        notes.append("energy estimated from CPU time")
    return f" ({'; '.join(notes)})" if notes else ""


def _price(run: Any) -> float:
    c = run.cost.per_million_output_tokens if run.cost else None
    return c if c is not None else float("inf")


def _cost_words(run: Any) -> str:
    c = _price(run)
    if c == float("inf"):
        return "cost unknown"
    ci = run.cost.per_million_output_tokens_ci
    interval = f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
    return f"{c:.4g}{interval} {run.cost.inputs.get('currency', '')} per 1M output tokens{_labels(run)}"


# the secondary criteria that break a tie, in order: (words, value of a run, unit)
TIE_BREAKS: tuple[tuple[str, Any], ...] = (
    ("memory", lambda r: r.resources.peak_rss_bytes),
    ("weight bytes", lambda r: r.resources.param_bytes),
    ("build time", lambda r: r.resources.build_s or 0.0),
)


def _break_tie(group: list[Any], standard_name: str, band: float) -> tuple[Any, str]:
    """The tied variant to deploy and the sentence why: the first criterion that separates them."""
    for words, value in TIE_BREAKS:
        values = {r.variant: value(r) for r in group}
        if any(v is None for v in values.values()):
            continue
        low = min(values.values())
        best = [r for r in group if values[r.variant] <= low * (1 + band)]
        if len(best) == 1:
            chosen = best[0]
            other = max((r for r in group if r is not chosen), key=lambda r: values[r.variant])
            theirs = values[other.variant]
            share = 1 - values[chosen.variant] / theirs if theirs else 0.0
            amount = (f"{_mb(values[chosen.variant])} vs {_mb(theirs)}" if words != "build time"
                      else f"{values[chosen.variant]:,.0f} s vs {theirs:,.0f} s")  # fmt: skip
            return chosen, f"{chosen.variant} needs {share:.0%} less {words} ({amount})"
        group = best
    chosen = next((r for r in group if r.variant == standard_name), group[0])
    return chosen, f"no secondary criterion separates them: {chosen.variant}" + (
        " (the standard: no change)" if chosen.variant == standard_name else " (listed first)"
    )


def engine_of(run: Any) -> str:
    """The backend that measured a run ("torch" for our engine, "transformers" for the fallback, ...)."""
    return str((run.backend or {}).get("backend") or "torch")


def recommend(runs: list[Any], standard_name: str, s: Profile, comparisons: Sequence[Any] = (),
              band: float = 0.03, mix_backends: bool = False) -> dict[str, Any]:  # fmt: skip
    """Rank the measured variants for one profile; ties (by the intervals) named and broken.

    A variant measured on another backend than the standard's is a different system under test
    (our engine against transformers' generate measures the engines as much as the variants), so
    it is not recommended unless the plan says ``decision.mix_backends``."""
    standard = next((r for r in runs if r.variant == standard_name and r.status == "ok"), None)
    reasons: dict[str, str] = {}
    fit = []
    held_back = []  # variants that meet every constraint but an undecided quality gate
    for run in runs:
        fails = check(run, standard, s, comparisons, band)
        if standard is not None and not mix_backends and engine_of(run) != engine_of(standard):
            fails.append(
                f"measured on the {engine_of(run)} backend, the standard on {engine_of(standard)}: a different "
                "system under test (decision.mix_backends: true compares them)"
            )
        if fails:
            reasons[run.variant] = "; ".join(fails)
            if all(f.startswith(UNDECIDED_QUALITY) for f in fails):
                held_back.append(run.variant)
        else:
            fit.append(run)
    by_batch = s.min_throughput_vs_standard is not None and all(batch_rate(r) for r in fit)
    metric = "batch throughput" if by_batch else "throughput"
    if by_batch:
        fit.sort(key=lambda r: -(batch_rate(r) or 0.0))
    else:
        fit.sort(key=_price)
    for run in fit:
        rank = (f"batch-8 decode {batch_rate(run):,.1f} tokens/s; {_cost_words(run)}" if by_batch
                else _cost_words(run))  # fmt: skip
        reasons[run.variant] = f"meets every constraint; {rank}"
    chosen, why, ties = None, "", []
    if fit:
        best = fit[0]
        tied = []
        for other in fit[1:]:
            c = find(comparisons, best.variant, other.variant, metric)
            if c is None or c.state != "faster":
                tied.append((other, c))
        if tied:
            group = [best] + [o for o, _ in tied]
            chosen_run, because = _break_tie(group, standard_name, band)
            said = "; ".join(
                f"{best.variant} and {o.variant} are {'tied' if c and c.state == 'tied' else 'not told apart'} "
                f"on {metric} ({_ci(c) if c else 'no comparison'})"
                for o, c in tied
            )  # fmt: skip
            why = f"{said}; {because}"
            ties = [o.variant for o, _ in tied] + [best.variant]
        else:
            chosen_run = best
            nxt = fit[1] if len(fit) > 1 else None
            c = find(comparisons, best.variant, nxt.variant, metric) if nxt else None
            why = (f"{'highest batch throughput' if by_batch else 'cheapest'}"
                   + (f", faster than {nxt.variant} on {metric} ({_ci(c)})" if c else ""))  # fmt: skip
        chosen = chosen_run.variant
        reasons[chosen] = f"{why}; {reasons[chosen]}"
    undecided = [f"{name} ({reasons[name]})" for name in held_back]
    summary = (
        f"deploy {chosen} ({reasons[chosen]})" if chosen else "no measured variant meets every constraint"
    )
    if undecided:
        summary += "; undecided on quality, so not recommended: " + "; ".join(undecided)
    return {
        "variant": chosen,
        "reasons": reasons,
        "undecided_quality": held_back,
        "eligible": [r.variant for r in fit],
        "tied": sorted(ties),
        "ranked_by": "batch-8 decode tokens/s" if by_batch else "cost per 1M output tokens",
        "constraints": s.model_dump(exclude_defaults=True),
        "description": s.description,
        "summary": summary,
    }
