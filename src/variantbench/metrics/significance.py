"""A/B comparison of a variant with the standard: ratios with bootstrap intervals, and a rank test.

* Ratios of medians and of P99 latency: percentile bootstrap (10,000 resamples, seeded), each side
  resampled on its own, 95% interval.
* Throughput ratio: output tokens / summed latency on each side (a ratio estimator, so a few long
  answers weigh what they cost), bootstrapped the same way.
* Mann-Whitney U (scipy, two-sided) on per-query latencies: is one distribution shifted?

The verdict needs both: "faster" when the latency-median interval lies wholly below 1 and the
rank test rejects at 5%; "slower" when above 1 and rejected; otherwise "no significant difference".
Across ``--repeats`` runs: the mean of each run's ratio and a t-interval over runs.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any

import numpy as np

RESAMPLES = 10_000
ALPHA = 0.05


def _interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [ALPHA / 2, 1 - ALPHA / 2])
    return float(lo), float(hi)


def bootstrap_ratio(
    a: Sequence[float], b: Sequence[float], q: float = 50.0, seed: int = 0, resamples: int = RESAMPLES
) -> dict[str, float | None]:
    """Percentile ``q`` of ``a`` over that of ``b``, with a 95% percentile-bootstrap interval."""
    if len(a) == 0 or len(b) == 0:
        return {"value": None, "ci_low": None, "ci_high": None}
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    xs = np.percentile(x[rng.integers(0, len(x), (resamples, len(x)))], q, axis=1)
    ys = np.percentile(y[rng.integers(0, len(y), (resamples, len(y)))], q, axis=1)
    lo, hi = _interval(xs / ys)
    return {"value": float(np.percentile(x, q) / np.percentile(y, q)), "ci_low": lo, "ci_high": hi}


def bootstrap_rate_ratio(
    tokens_a: Sequence[float], time_a: Sequence[float], tokens_b: Sequence[float], time_b: Sequence[float],
    seed: int = 0, resamples: int = RESAMPLES,
) -> dict[str, float | None]:  # fmt: skip
    """(sum tokens_a / sum time_a) / (sum tokens_b / sum time_b), queries resampled on each side."""
    if len(tokens_a) == 0 or len(tokens_b) == 0 or sum(time_a) <= 0 or sum(time_b) <= 0:
        return {"value": None, "ci_low": None, "ci_high": None}
    ta, sa = np.asarray(tokens_a, float), np.asarray(time_a, float)
    tb, sb = np.asarray(tokens_b, float), np.asarray(time_b, float)
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(ta), (resamples, len(ta)))
    ib = rng.integers(0, len(tb), (resamples, len(tb)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (ta[ia].sum(1) / sa[ia].sum(1)) / (tb[ib].sum(1) / sb[ib].sum(1))
    ratios = ratios[np.isfinite(ratios)]
    value = (ta.sum() / sa.sum()) / (tb.sum() / sb.sum())
    lo, hi = _interval(ratios) if len(ratios) else (None, None)
    return {"value": float(value), "ci_low": lo, "ci_high": hi}


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided Mann-Whitney U p-value, or None with fewer than 2 values on a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


def verdict(latency_ratio: dict[str, Any], p_value: float | None) -> str:
    lo, hi = latency_ratio.get("ci_low"), latency_ratio.get("ci_high")
    if lo is None or hi is None or p_value is None or p_value >= ALPHA:
        return "no significant difference"
    if hi < 1.0:
        return "faster"
    if lo > 1.0:
        return "slower"
    return "no significant difference"


def describe(variant: str, standard: str, lat: dict[str, Any], tput: dict[str, Any], p: float | None,
             word: str) -> str:  # fmt: skip
    """One sentence: the verdict in words with its interval."""
    if lat.get("value") is None:
        return f"{variant}: no latencies to compare with {standard}"
    speed = 1 / lat["value"] if lat["value"] else float("nan")
    text = (
        f"{variant} vs {standard}: median latency x{lat['value']:.2f} (95% CI {lat['ci_low']:.2f}-"
        f"{lat['ci_high']:.2f}; {speed:.2f}x the speed)"
    )
    if tput.get("value") is not None:
        text += f", throughput x{tput['value']:.2f} (CI {tput['ci_low']:.2f}-{tput['ci_high']:.2f})"
    text += f", Mann-Whitney p={p:.3g}" if p is not None else ", too few queries for a rank test"
    return f"{text}: {word}"


def across_runs(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and 95% t-interval of one number measured in several repeated runs."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci_low": None, "ci_high": None}
    mean = float(np.mean(values))
    if n < 2:
        return {"n": 1, "mean": mean, "ci_low": None, "ci_high": None}
    from scipy.stats import t

    half = float(t.ppf(1 - ALPHA / 2, n - 1) * np.std(values, ddof=1) / math.sqrt(n))
    return {"n": n, "mean": mean, "ci_low": mean - half, "ci_high": mean + half}
