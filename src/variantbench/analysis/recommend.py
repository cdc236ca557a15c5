"""The recommendation: which measured variant to deploy for a deployment profile, and why.

Among the variants that meet every constraint of the profile (``analysis/profiles.py``), the
cheapest per million output tokens wins; every other variant gets one line saying which constraint
it failed, with the numbers.
"""

from __future__ import annotations

from typing import Any

from variantbench.analysis.profiles import PROFILES, Profile

__all__ = ["PROFILES", "Profile", "check", "recommend"]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def check(run: Any, standard: Any, s: Profile) -> list[str]:
    """The constraints ``run`` (a RunReport) fails in profile ``s``, one line each (empty: it fits)."""
    if run.status != "ok":
        return [f"did not run: {run.error}"]
    fails: list[str] = []
    p99 = run.latency_ms.p99
    if s.p99_latency_ms is not None and (p99 is None or p99 > s.p99_latency_ms):
        fails.append(f"P99 latency {p99 or float('nan'):,.0f} ms > target {s.p99_latency_ms:,.0f} ms")
    if s.p99_vs_standard is not None and standard is not None:
        limit = (standard.latency_ms.p99 or 0) * s.p99_vs_standard
        if p99 is None or p99 > limit:
            fails.append(f"P99 latency {p99 or float('nan'):,.0f} ms > {s.p99_vs_standard:g}x the standard's "
                         f"({limit:,.0f} ms)")  # fmt: skip
    rss = run.resources.peak_rss_bytes
    if s.memory_budget_bytes is not None and (rss is None or rss > s.memory_budget_bytes):
        fails.append(f"peak memory {_mb(rss or 0)} > budget {_mb(s.memory_budget_bytes)}")
    if not s.gpu and str(run.backend.get("device", "cpu")).startswith("cuda"):
        fails.append("runs on a GPU; this profile has none")
    if s.quality_floor is not None:
        vs = run.quality_vs_standard
        ratio = 1.0 if run.variant == (standard.variant if standard else None) else (vs.ratio if vs else None)
        if ratio is None:
            fails.append("no quality measured against the standard")
        elif ratio < s.quality_floor:
            fails.append(f"quality {ratio:.1%} of the standard's < floor {s.quality_floor:.0%}")
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
    if s.min_throughput_vs_standard is not None and standard is not None:
        mine, theirs = run.throughput.output_tokens_per_s, standard.throughput.output_tokens_per_s
        if mine is None or not theirs or mine < theirs * s.min_throughput_vs_standard:
            fails.append(f"{mine or 0:,.1f} output tokens/s < {s.min_throughput_vs_standard:g}x the standard's "
                         f"({(theirs or 0) * s.min_throughput_vs_standard:,.1f})")  # fmt: skip
    return fails


def _labels(run: Any) -> str:
    """What the cost figure stands on, said in the same line: placeholder prices, estimated energy."""
    notes = []
    if run.cost and run.cost.inputs.get("prices") == "placeholder":
        notes.append("at placeholder prices: set cost.per_hour and cost.energy_price_kwh")
    if run.resources.energy_source == "estimate":
        notes.append("energy estimated from CPU time")
    return f" ({'; '.join(notes)})" if notes else ""


def recommend(runs: list[Any], standard_name: str, s: Profile) -> dict[str, Any]:
    """Rank the measured variants for one profile: the cheapest that meets every constraint."""
    standard = next((r for r in runs if r.variant == standard_name and r.status == "ok"), None)
    reasons: dict[str, str] = {}
    fit = []
    for run in runs:
        fails = check(run, standard, s)
        if fails:
            reasons[run.variant] = "; ".join(fails)
        else:
            fit.append(run)

    def price(run: Any) -> float:
        c = run.cost.per_million_output_tokens if run.cost else None
        return c if c is not None else float("inf")

    fit.sort(key=price)
    for rank, run in enumerate(fit):
        c = price(run)
        cost = (
            f"{c:.4g} {run.cost.inputs.get('currency', '')} per 1M output tokens"
            if c != float("inf")
            else "cost unknown"
        )
        reasons[run.variant] = f"meets every constraint; {cost}{_labels(run)}" + (
            " (cheapest)" if rank == 0 else ""
        )
    chosen = fit[0].variant if fit else None
    return {
        "variant": chosen,
        "reasons": reasons,
        "eligible": [r.variant for r in fit],
        "constraints": s.model_dump(exclude_defaults=True),
        "description": s.description,
        "summary": (
            f"deploy {chosen} ({reasons[chosen]})" if chosen else "no measured variant meets every constraint"
        ),
    }
