"""Two runs compared (B against A), variant by variant, metric by metric, and a regression gate.

Both runs answered the same seeded samples when they ran the same plan, so the comparison pairs
queries by sample (the k-th answer to a sample in A with the k-th in B), as the A/B within a run
does: latency per sample (geometric mean of the ratios), P99 latency (pairs resampled together),
throughput per query, each with a 95% BCa interval from ``scipy.stats.bootstrap``; quality is a
ratio of the two composite scores (deterministic under greedy decoding: no interval). With no
common samples, the intervals are unpaired. Runs on different machines are compared only with a
loud warning (``machine_differs``), or refused under ``strict``.

The gate (``check``): a metric regressed when its interval lies wholly beyond its threshold in the
bad direction (P99 and latency up, throughput and quality down), so noise within the interval
never fails a build. The interval covers the pairs within the two runs, not a shift of the whole
run (the host's state a minute later): two equal runs of the tiny test model measured B/A latency
0.80-0.92 on one host and 1.38 [1.33, 1.45] on a CI runner, so a threshold belongs above the
host's run-to-run noise (or the two runs belong in one plan, where variants interleave).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
import json
from pathlib import Path
from typing import Any

from variantbench.errors import UserError
from variantbench.metrics import significance as sig
from variantbench.records import QueryRecord, read_log
from variantbench.report.schema import Report

MIN_P99_PAIRS = 20
# metric -> (what it is, higher is better?)
METRICS: dict[str, tuple[str, bool]] = {
    "latency": ("latency per sample, geometric mean of B/A", False),
    "p99": ("P99 latency B/A, pairs resampled together", False),
    "tokens_per_s": ("output tokens over latency, summed over the pairs, B/A", True),
    "quality": ("composite quality B/A (greedy: no interval)", True),
}


@dataclass
class MetricChange:
    variant: str
    metric: str
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    pairs: int
    verdict: str  # "better" | "worse" | "no significant change" | "n/a"


@dataclass
class Comparison:
    a: str
    b: str
    machine_differs: bool
    machine_a: dict[str, Any]
    machine_b: dict[str, Any]
    changes: list[MetricChange]

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "changes"},
                "changes": [asdict(c) for c in self.changes]}  # fmt: skip


def load_run(folder: Path) -> tuple[Report, list[QueryRecord]]:
    report_path, log_path = folder / "report.json", folder / "queries.jsonl"
    for needed in (report_path, log_path):
        if not needed.is_file():
            raise UserError(f"{folder} is not a run folder: {needed.name} is missing")
    try:
        return Report.read(report_path), read_log(log_path)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read the run in {folder}: {str(exc).splitlines()[0]}") from None


def _machine(report: Report) -> dict[str, Any]:
    from variantbench.history import machine_fingerprint

    return machine_fingerprint(report.environment)[1]


def _verdict(ratio: dict[str, Any], higher_is_better: bool) -> str:
    lo, hi = ratio.get("ci_low"), ratio.get("ci_high")
    if ratio.get("value") is None:
        return "n/a"
    if lo is None or hi is None:
        return "no interval"
    if lo > 1:
        return "better" if higher_is_better else "worse"
    if hi < 1:
        return "worse" if higher_is_better else "better"
    return "no significant change"


def resolve(arg: str, history: Path | None = None) -> tuple[Path, str | None]:
    """A run folder, or a history id (the folder and the variant recorded under that id)."""
    if Path(arg).is_dir() or not arg.isdigit():
        return Path(arg), None
    from variantbench.history import History

    with History(history) as h:
        row = h.get(int(arg))
    if row is None:
        raise UserError(f"{arg} is neither a run folder nor an id in the history ({history or 'default'})")
    return Path(row["folder"]), row["variant"]


def compare_runs(folder_a: Path, folder_b: Path, strict: bool = False, variant_a: str | None = None,
                 variant_b: str | None = None) -> Comparison:  # fmt: skip
    """B against A for every variant both measured, or for the one variant each names (history ids:
    then the two may differ, e.g. yesterday's fp32 against today's int8)."""
    report_a, log_a = load_run(folder_a)
    report_b, log_b = load_run(folder_b)
    machine_a, machine_b = _machine(report_a), _machine(report_b)
    differs = machine_a != machine_b
    if differs and strict:
        changed = sorted(k for k in machine_a if machine_a.get(k) != machine_b.get(k))
        raise UserError(f"the runs were made on different machines ({', '.join(changed)} differ); "
                        "compare without --strict to see the numbers anyway")  # fmt: skip
    changes: list[MetricChange] = []
    for run_b in report_b.runs:
        if variant_b is not None and run_b.variant != variant_b:
            continue
        if variant_a is not None and variant_b is None and run_b.variant != variant_a:
            continue
        run_a = report_a.run(variant_a or run_b.variant)
        if run_a is None or run_a.status != "ok" or run_b.status != "ok":
            continue
        ok_a = [r for r in log_a if r.variant == run_a.variant and r.status == "ok"]
        ok_b = [r for r in log_b if r.variant == run_b.variant and r.status == "ok"]
        matched = sig.pairs(ok_b, ok_a, key=lambda r: r.sample_id)
        mine, theirs = [m for m, _ in matched], [t for _, t in matched]
        if len(matched) >= 3:
            lat_b, lat_a = (
                [r.latency_from_scheduled_ms for r in mine],
                [r.latency_from_scheduled_ms for r in theirs],
            )
            ratios = {
                "latency": sig.paired_ratio(lat_b, lat_a),
                "p99": sig.paired_quantile_ratio(lat_b, lat_a, 99),  # interval dropped below MIN_P99_PAIRS
                "tokens_per_s": sig.paired_rate_ratio([r.output_tokens for r in mine], [r.latency_ms for r in mine],
                                                      [r.output_tokens for r in theirs], [r.latency_ms for r in theirs]),
            }  # fmt: skip
        else:  # different samples: unpaired
            lat_b, lat_a = (
                [r.latency_from_scheduled_ms for r in ok_b],
                [r.latency_from_scheduled_ms for r in ok_a],
            )
            ratios = {
                "latency": sig.bootstrap_ratio(lat_b, lat_a, 50),
                "p99": sig.bootstrap_ratio(lat_b, lat_a, 99, seed=1),
                "tokens_per_s": sig.bootstrap_rate_ratio([r.output_tokens for r in ok_b], [r.latency_ms for r in ok_b],
                                                         [r.output_tokens for r in ok_a], [r.latency_ms for r in ok_a]),
            }  # fmt: skip
        if len(matched if len(matched) >= 3 else ok_b) < MIN_P99_PAIRS:
            # the P99 of so few is the largest value or next to it: an interval would claim too much
            ratios["p99"] = {**ratios["p99"], "ci_low": None, "ci_high": None}
        qa, qb = run_a.quality.composite, run_b.quality.composite
        ratios["quality"] = {
            "value": qb / qa if qa and qb is not None else None,
            "ci_low": None,
            "ci_high": None,
        }
        for metric, (_, higher) in METRICS.items():
            r = ratios[metric]
            verdict = (
                _verdict(r, higher) if metric != "quality" else ("n/a" if r["value"] is None else "point")
            )
            label = run_b.variant if run_a.variant == run_b.variant else f"{run_b.variant} vs {run_a.variant}"
            changes.append(MetricChange(label, metric, r["value"], r["ci_low"], r["ci_high"], len(matched),
                                        verdict))  # fmt: skip
    if not changes:
        which = f" ({variant_a or variant_b} vs {variant_b or variant_a})" if variant_a or variant_b else ""
        raise UserError(f"no variant measured in both {folder_a} and {folder_b}{which}")
    return Comparison(str(folder_a), str(folder_b), differs, machine_a, machine_b, changes)


def parse_thresholds(
    text: str, known: Iterable[str] = METRICS, option: str = "--max-regression"
) -> dict[str, float]:
    """``p99=5%,tokens_per_s=5%,quality=1%`` -> {metric: 0.05, ...}; one-line errors naming ``option``."""
    names = list(known)
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name not in names:
            raise UserError(f"{option}: {part!r}; use METRIC=PCT% with METRIC one of {', '.join(names)}")
        try:
            pct = float(value.rstrip("%"))
        except ValueError:
            raise UserError(f"{option}: {value!r} is not a percentage") from None
        if pct < 0:
            raise UserError(f"{option}: {name} threshold must not be negative")
        out[name] = pct / 100
    return out


def gate(comparison: Comparison, thresholds: dict[str, float]) -> list[tuple[MetricChange, float, bool]]:
    """(change, threshold, regressed) for every gated metric of every variant."""
    rows = []
    for c in comparison.changes:
        if c.metric not in thresholds or c.ratio is None:
            continue
        limit = thresholds[c.metric]
        higher = METRICS[c.metric][1]
        if c.metric == "quality":  # no interval: the point value against the threshold
            regressed = c.ratio < 1 - limit
        elif higher:
            regressed = c.ci_high is not None and c.ci_high < 1 - limit
        else:
            regressed = c.ci_low is not None and c.ci_low > 1 + limit
        rows.append((c, limit, regressed))
    return rows


def write_json(comparison: Comparison, path: Path) -> None:
    path.write_text(json.dumps(comparison.to_json(), indent=2), encoding="utf-8")
