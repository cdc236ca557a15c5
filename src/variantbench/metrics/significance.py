"""A/B comparison of a variant with the standard: ratios with bootstrap intervals, and a rank test.

Paired, when both answered the same samples (the default: one workload, one seeded sample order):
* ``paired_ratio``: the geometric mean of the per-sample ratios (variant / standard) of latency,
  TTFT or tokens/s, with a 95% BCa interval by ``scipy.stats.bootstrap`` over the samples. Pairing
  removes the samples' own spread (a 2,000-token prompt against a 100-token one), which in unpaired
  intervals swamps the variants' difference.
* ``paired_quantile_ratio``: a percentile of one side over the same percentile of the other, the
  pairs resampled together (``paired=True``), BCa.
* Wilcoxon signed-rank (scipy, two-sided) on the paired log-ratios: is one side shifted?

Unpaired, when the samples differ (two endpoint runs, say):
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


def no_ratio() -> dict[str, float | None]:
    """A ratio that could not be measured (too few values)."""
    return {"value": None, "ci_low": None, "ci_high": None}


def _interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [ALPHA / 2, 1 - ALPHA / 2])
    return float(lo), float(hi)


def bootstrap_ratio(
    a: Sequence[float], b: Sequence[float], q: float = 50.0, seed: int = 0, resamples: int = RESAMPLES
) -> dict[str, float | None]:
    """Percentile ``q`` of ``a`` over that of ``b``, with a 95% percentile-bootstrap interval."""
    if len(a) == 0 or len(b) == 0:
        return no_ratio()
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
        return no_ratio()
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


def pairs(a: Sequence[Any], b: Sequence[Any], key: Any) -> list[tuple[Any, Any]]:
    """Match items of ``a`` and ``b`` by ``key`` (the k-th occurrence of a key with the k-th)."""
    seen: dict[Any, list[Any]] = {}
    for item in b:
        seen.setdefault(key(item), []).append(item)
    out, used = [], {k: 0 for k in seen}
    for item in a:
        k = key(item)
        if k in seen and used[k] < len(seen[k]):
            out.append((item, seen[k][used[k]]))
            used[k] += 1
    return out


def _bootstrap(
    data: tuple[np.ndarray, ...],
    statistic: Any,
    seed: int,
    resamples: int,
    paired: bool,
    confidence: float = 1 - ALPHA,
) -> tuple:
    """BCa interval, falling back to the percentile method where BCa is undefined (ties, tiny n)."""
    import warnings

    from scipy.stats import bootstrap

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = bootstrap(data, statistic, n_resamples=resamples, paired=paired, vectorized=True,
                            method=method, confidence_level=confidence,
                            rng=np.random.default_rng(seed))  # fmt: skip
        lo, hi = res.confidence_interval
        if np.isfinite(lo) and np.isfinite(hi):
            return float(lo), float(hi)
    return None, None


def mean_interval(values: Sequence[float], seed: int = 0, resamples: int = RESAMPLES,
                  confidence: float = 1 - ALPHA) -> tuple[float | None, float | None]:  # fmt: skip
    """BCa interval of a mean over samples (a constant sample: the constant itself; under 3: none)."""
    data = np.asarray(values, dtype=float)
    if len(data) < 3:
        return None, None
    if np.all(data == data[0]):
        return float(data[0]), float(data[0])
    return _bootstrap(
        (data,), lambda x, axis=-1: x.mean(axis), seed, resamples, paired=False, confidence=confidence
    )


def _log_ratios(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """log(a_i / b_i) over the pairs where both are positive."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = (x > 0) & (y > 0)
    return np.log(x[keep] / y[keep])


def paired_ratio(
    a: Sequence[float], b: Sequence[float], seed: int = 0, resamples: int = RESAMPLES
) -> dict[str, float | None]:
    """Geometric mean of a_i / b_i with a 95% BCa interval; None below 3 positive pairs."""
    logs = _log_ratios(a, b)
    if len(logs) < 3:
        return no_ratio()
    value = float(np.exp(logs.mean()))
    if np.all(logs == logs[0]):  # every pair the same ratio: no spread to resample
        return {"value": value, "ci_low": value, "ci_high": value}
    lo, hi = _bootstrap((logs,), lambda v, axis=-1: np.mean(v, axis=axis), seed, resamples, paired=False)
    return {"value": value, "ci_low": None if lo is None else float(np.exp(lo)),
            "ci_high": None if hi is None else float(np.exp(hi))}  # fmt: skip


def paired_quantile_ratio(a: Sequence[float], b: Sequence[float], q: float = 50.0, seed: int = 0,
                          resamples: int = RESAMPLES) -> dict[str, float | None]:  # fmt: skip
    """Percentile ``q`` of ``a`` over that of ``b`` (pairs resampled together), 95% BCa interval."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) < 3 or len(x) != len(y) or np.percentile(y, q) <= 0:
        return no_ratio()

    def ratio(u: np.ndarray, v: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.percentile(u, q, axis=axis) / np.percentile(v, q, axis=axis)

    value = float(ratio(x, y))
    lo, hi = _bootstrap((x, y), ratio, seed, resamples, paired=True)
    return {"value": value, "ci_low": lo, "ci_high": hi}


def paired_rate_ratio(tokens_a: Sequence[float], time_a: Sequence[float], tokens_b: Sequence[float],
                      time_b: Sequence[float], seed: int = 0, resamples: int = RESAMPLES,
                      confidence: float = 1 - ALPHA) -> dict[str, float | None]:  # fmt: skip
    """(sum tokens_a / sum time_a) / (sum tokens_b / sum time_b), the samples resampled as pairs, BCa."""
    arrays = tuple(np.asarray(v, dtype=float) for v in (tokens_a, time_a, tokens_b, time_b))
    if len(arrays[0]) < 3 or arrays[1].sum() <= 0 or arrays[3].sum() <= 0 or arrays[2].sum() <= 0:
        return no_ratio()

    def rate_ratio(
        ta: np.ndarray, sa: np.ndarray, tb: np.ndarray, sb: np.ndarray, axis: int = -1
    ) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return (ta.sum(axis) / sa.sum(axis)) / (tb.sum(axis) / sb.sum(axis))

    value = float(rate_ratio(*arrays))
    lo, hi = _bootstrap(arrays, rate_ratio, seed, resamples, paired=True, confidence=confidence)
    return {"value": value, "ci_low": lo, "ci_high": hi}


def wilcoxon(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value on paired log-ratios, or None below 3 pairs or with no differences."""
    d = _log_ratios(a, b)
    if len(d) < 3 or np.all(d == 0):
        return None
    from scipy.stats import wilcoxon as signed_rank

    return float(signed_rank(d, alternative="two-sided").pvalue)


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
             word: str, test: str = "mann-whitney", pairs: int | None = None) -> str:  # fmt: skip
    """One sentence: the verdict in words with its interval."""
    if lat.get("value") is None:
        return f"{variant}: no latencies to compare with {standard}"
    speed = 1 / lat["value"] if lat["value"] else float("nan")
    what = f"latency per sample, paired over {pairs} samples," if pairs else "median latency"
    ci = (
        f"95% CI {lat['ci_low']:.2f}-{lat['ci_high']:.2f}" if lat.get("ci_low") is not None else "no interval"
    )
    text = f"{variant} vs {standard}: {what} x{lat['value']:.2f} ({ci}; {speed:.2f}x the speed)"
    if tput.get("value") is not None:
        tci = f" (CI {tput['ci_low']:.2f}-{tput['ci_high']:.2f})" if tput.get("ci_low") is not None else ""
        text += f", throughput x{tput['value']:.2f}{tci}"
    return f"{text}{_test_words(test, p)}: {word}"


def _test_words(test: str, p: float | None) -> str:
    name = {"wilcoxon": "Wilcoxon signed-rank", "mann-whitney": "Mann-Whitney"}.get(test, test)
    return f", {name} p={p:.3g}" if p is not None else ", too few queries for a rank test"


def across_runs(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and 95% t-interval of one number measured in several repeated runs."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci_low": None, "ci_high": None}
    mean = float(np.mean(values))
    if n < 2:
        return {"n": 1, "mean": mean, "ci_low": None, "ci_high": None}
    from scipy.stats import t

    sd = float(np.std(values, ddof=1))
    if sd == 0:
        return {"n": n, "mean": mean, "ci_low": mean, "ci_high": mean}
    lo, hi = t.interval(1 - ALPHA, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return {"n": n, "mean": mean, "ci_low": float(lo), "ci_high": float(hi)}


def rate_interval(tokens: Sequence[float], times: Sequence[float], seed: int = 0, resamples: int = RESAMPLES,
                  confidence: float = 1 - ALPHA) -> dict[str, float | None]:  # fmt: skip
    """sum(tokens) / sum(times) over queries with a BCa interval, the queries resampled."""
    t, s = np.asarray(tokens, dtype=float), np.asarray(times, dtype=float)
    if len(t) < 3 or s.sum() <= 0 or t.sum() <= 0:
        return no_ratio()

    def rate(u: np.ndarray, v: np.ndarray, axis: int = -1) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return u.sum(axis) / v.sum(axis)

    value = float(rate(t, s))
    lo, hi = _bootstrap((t, s), rate, seed, resamples, paired=True, confidence=confidence)
    return {"value": value, "ci_low": lo, "ci_high": hi}


def log_ratio_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = 1 - ALPHA
) -> dict[str, float | None]:
    """Geometric mean of a_i / b_i over repeated paired measurements, t-interval on the logs (scipy)."""
    logs = _log_ratios(a, b)
    if len(logs) < 2:
        return no_ratio()
    from scipy.stats import t

    mean = float(logs.mean())
    if np.all(logs == logs[0]):
        return {"value": math.exp(mean), "ci_low": math.exp(mean), "ci_high": math.exp(mean)}
    lo, hi = t.interval(
        confidence, len(logs) - 1, loc=mean, scale=float(logs.std(ddof=1) / math.sqrt(len(logs)))
    )
    return {"value": math.exp(mean), "ci_low": math.exp(lo), "ci_high": math.exp(hi)}


def quantile_interval(values: Sequence[float], q: float, seed: int = 0, resamples: int = RESAMPLES,
                      confidence: float = 1 - ALPHA) -> dict[str, float | None]:  # fmt: skip
    """Percentile ``q`` of ``values`` (LoadGen's definition) with a bootstrap interval (scipy; BCa,
    else the percentile method); None below 3 values."""
    from variantbench.metrics.latency import percentile

    x = np.asarray(values, dtype=float)
    if len(x) < 3:
        return no_ratio()
    value = percentile(list(x), q)
    if np.all(x == x[0]):
        return {"value": value, "ci_low": value, "ci_high": value}

    def stat(v: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.percentile(v, q, axis=axis, method="inverted_cdf")

    lo, hi = _bootstrap((x,), stat, seed, resamples, paired=False, confidence=confidence)
    return {"value": value, "ci_low": lo, "ci_high": hi}
