"""Validity of a run, MLPerf-style: latency targets, binomial early stopping, dispatch lag.

Early stopping (MLPerf LoadGen's rule): with ``n`` queries of which ``h`` exceeded the latency
target, the run may claim the target at percentile ``p`` with confidence ``c`` only if, were the true
share of over-target queries as large as ``1 - p/100``, seeing ``h`` or fewer would have probability
at most ``1 - c``: ``BinomialCDF(h; n, 1 - p/100) <= 1 - c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from variantbench.metrics.latency import percentile


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p): scipy's, which matches LoadGen's summaries (see the tests)."""
    from scipy.stats import binom

    return float(binom.cdf(k, n, p))


def early_stopping_passes(overlatency: int, n: int, pct: float, confidence: float = 0.99) -> bool:
    return binomial_cdf(overlatency, n, 1 - pct / 100) <= 1 - confidence


def min_queries_for(
    overlatency: int, pct: float, confidence: float = 0.99, limit: int = 10_000_000
) -> int | None:
    """The fewest queries with which ``overlatency`` over-target queries would still pass."""
    lo, hi = overlatency + 1, max(overlatency + 1, 16)
    while not early_stopping_passes(overlatency, hi, pct, confidence):
        hi *= 2
        if hi > limit:
            return None
    while lo < hi:
        mid = (lo + hi) // 2
        if early_stopping_passes(overlatency, mid, pct, confidence):
            hi = mid
        else:
            lo = mid + 1
    return lo


def early_stopping_estimate(latencies: Sequence[float], pct: float, confidence: float = 0.99) -> float | None:
    """A conservative ``pct`` percentile: the latency that early stopping can vouch for.

    MLPerf LoadGen's convention: report the (h+1)-th largest latency, for the largest ``h`` such that
    the h+1 queries at or above it would still pass: BinomialCDF(h + 1; n, 1 - p) <= 1 - c. Checked
    against LoadGen's own summaries (2048 queries at p90: it discards the 172 highest).
    """
    n = len(latencies)
    if n == 0:
        return None
    q = 1 - pct / 100
    h = -1
    while h + 2 <= n and binomial_cdf(h + 2, n, q) <= 1 - confidence:
        h += 1
    if h < 0:
        return None  # too few queries to vouch for any value at this percentile
    ordered = sorted(latencies)
    return float(ordered[n - 1 - h])


@dataclass
class Target:
    name: str  # "latency" | "ttft" | "tpot"
    limit_ms: float


@dataclass
class Verdict:
    verdict: str = "VALID"  # "VALID" | "INVALID"
    reasons: list[str] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    checks: dict[str, object] = field(default_factory=dict)


def judge(
    values_ms: dict[str, Sequence[float]],
    targets: Sequence[Target],
    pct: float,
    *,
    issued: int,
    min_queries: int,
    duration_s: float,
    min_duration_s: float,
    late_share: float,
    errors: int,
    confidence: float = 0.99,
) -> Verdict:
    v = Verdict()
    if issued < min_queries:
        v.reasons.append(f"only {issued} queries issued, {min_queries} required")
        v.recommendations.append("run longer (raise --max-duration or --max-queries)")
    if duration_s < min_duration_s:
        v.reasons.append(f"ran {duration_s:.1f} s, {min_duration_s:.1f} s required")
        v.recommendations.append("run longer")
    if late_share > 0.01:
        v.reasons.append(
            f"{late_share:.1%} of queries were issued more than 1 ms late (harness could not keep up)"
        )
        v.recommendations.append("reduce target QPS")
    if errors:
        v.reasons.append(f"{errors} queries failed")
    for target in targets:
        values = values_ms.get(target.name, [])
        n = len(values)
        over = sum(1 for x in values if x > target.limit_ms)
        observed = percentile(values, pct) if values else None
        passes = early_stopping_passes(over, n, pct, confidence) if n else False
        v.checks[target.name] = {
            "target_ms": target.limit_ms,
            "percentile": pct,
            "observed_ms": observed,
            "over_target": over,
            "queries": n,
            "early_stopping_estimate_ms": early_stopping_estimate(values, pct, confidence),
            "result": "PASS" if passes else "FAIL",
        }
        if not passes:
            if observed is not None and observed > target.limit_ms:
                v.reasons.append(
                    f"{target.name} p{pct:g} {observed:.1f} ms exceeds the {target.limit_ms:g} ms target"
                )
                v.recommendations.append("reduce target QPS")
            else:
                need = min_queries_for(over, pct, confidence)
                v.reasons.append(
                    f"{target.name}: {over} of {n} queries over {target.limit_ms:g} ms; early stopping needs "
                    f"{need if need else 'many more'} queries to vouch for p{pct:g} at {confidence:.0%} confidence"
                )
                v.recommendations.append(f"run longer (at least {need} queries)" if need else "run longer")
    if v.reasons:
        v.verdict = "INVALID"
    v.recommendations = list(dict.fromkeys(v.recommendations))
    return v
