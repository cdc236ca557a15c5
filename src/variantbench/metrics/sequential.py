"""Pairwise comparisons that are decided, tied or undecided, and the sequential rule that uses them.

A comparison of two variants is the paired throughput ratio (output tokens over latency, summed over
the samples both answered; ``significance.paired_rate_ratio``, BCa by ``scipy.stats.bootstrap``)
with an interval, read against a tie band (default +-3%):

* ``faster`` / ``slower``: the interval lies wholly above / below the band: a difference that matters;
* ``tied``: the interval lies wholly inside the band: shown to be equivalent (two one-sided checks);
* ``undecided``: the interval straddles an edge of the band: more samples would tell.

Repeated looks: under ``until_decided`` the run looks at its data after every pass through the
workload, at most ``looks`` times, and every look uses the interval at confidence ``1 - alpha/looks``
(a Bonferroni split of alpha over the fixed number of looks). Whatever happens at any look, the
chance that some look calls a false difference is then at most alpha. The split is conservative
(the looks are correlated), which costs samples, not correctness; chosen over an alpha-spending
function because its guarantee needs no assumption about the looks' spacing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
import math
from typing import Any

from variantbench.metrics import significance as sig

STATES = ("faster", "slower", "tied", "undecided")


@dataclass
class Comparison:
    a: str
    b: str
    metric: str  # "throughput": a's output tokens/s over b's, paired per sample
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float
    pairs: int
    state: str  # one of STATES, a relative to b
    more_samples: int | None = None  # undecided: pairs in all likely needed to decide, from the spread seen

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def words(self) -> str:
        ci = (f"{self.ratio:.2f} [{self.ci_low:.2f}, {self.ci_high:.2f}]"
              if self.ratio is not None and self.ci_low is not None else "no interval")  # fmt: skip
        what = {"faster": "faster than", "slower": "slower than", "tied": "tied with",
                "undecided": "not yet told apart from"}[self.state]  # fmt: skip
        return f"{self.a} {what} {self.b} on {self.metric} ({ci}, {self.confidence:.1%} CI, {self.pairs} samples)"


def state(low: float | None, high: float | None, band: float) -> str:
    """Where an interval of a ratio lies against the tie band ``[1/(1+band), 1+band]``."""
    if low is None or high is None:
        return "undecided"
    up, down = 1 + band, 1 / (1 + band)
    if low > up:
        return "faster"
    if high < down:
        return "slower"
    if low >= down and high <= up:
        return "tied"
    return "undecided"


def more_samples(
    n: int, ratio: float | None, low: float | None, high: float | None, band: float
) -> int | None:
    """Pairs likely needed to decide: the interval's half-width shrinks as 1/sqrt(n) (log scale)."""
    if ratio is None or low is None or high is None or n < 2 or low <= 0:
        return None
    half = (math.log(high) - math.log(low)) / 2
    edge = math.log(1 + band)
    gap = abs(abs(math.log(ratio)) - edge)  # how far the estimate is from the band's nearer edge
    if half <= 0:
        return n
    if gap < 1e-3 * edge:
        return None  # on the edge: no number of samples is likely to settle it
    return max(n + 1, math.ceil(n * (half / gap) ** 2))


def compare(a: str, b: str, tokens_a: Sequence[float], time_a: Sequence[float], tokens_b: Sequence[float],
            time_b: Sequence[float], *, confidence: float, band: float, seed: int = 0) -> Comparison:  # fmt: skip
    """``a`` against ``b`` on paired throughput (the k-th values of each side are one sample)."""
    r = sig.paired_rate_ratio(tokens_a, time_a, tokens_b, time_b, seed=seed, confidence=confidence)
    st = state(r["ci_low"], r["ci_high"], band)
    n = len(tokens_a)
    extra = more_samples(n, r["value"], r["ci_low"], r["ci_high"], band) if st == "undecided" else None
    return Comparison(a, b, "throughput", r["value"], r["ci_low"], r["ci_high"], confidence, n, st, extra)


def compare_records(a: str, recs_a: Sequence[Any], b: str, recs_b: Sequence[Any], *, confidence: float,
                    band: float, seed: int = 0) -> Comparison:  # fmt: skip
    """Two variants' query records, paired by sample (the k-th answer to a sample with the k-th)."""
    ok_a = [r for r in recs_a if r.status == "ok" and r.latency_ms > 0]
    ok_b = [r for r in recs_b if r.status == "ok" and r.latency_ms > 0]
    matched = sig.pairs(ok_a, ok_b, key=lambda r: r.sample_id)
    return compare(a, b, [m.output_tokens for m, _ in matched], [m.latency_ms for m, _ in matched],
                   [t.output_tokens for _, t in matched], [t.latency_ms for _, t in matched],
                   confidence=confidence, band=band, seed=seed)  # fmt: skip


def all_pairs(records: dict[str, Sequence[Any]], *, confidence: float, band: float) -> list[Comparison]:
    """Every pair of variants (in the given order, each earlier one as ``a``)."""
    names = list(records)
    return [compare_records(x, records[x], y, records[y], confidence=confidence, band=band, seed=i)
            for i, (x, y) in enumerate((x, y) for k, x in enumerate(names) for y in names[k + 1:])]  # fmt: skip


def look_confidence(alpha: float, looks: int) -> float:
    """The confidence every look uses so that ``looks`` looks together err at most ``alpha``."""
    return 1 - alpha / looks


def compare_repeated(a: str, b: str, values_a: Sequence[float], values_b: Sequence[float], *, metric: str,
                     confidence: float, band: float) -> Comparison:  # fmt: skip
    """Repeated paired measurements (round i of ``a`` beside round i of ``b``), a t-interval on the
    log-ratios (scipy): for numbers measured a few times each, such as the batch throughput."""
    n = min(len(values_a), len(values_b))
    r = sig.log_ratio_interval(values_a[:n], values_b[:n], confidence=confidence)
    st = state(r["ci_low"], r["ci_high"], band)
    extra = more_samples(n, r["value"], r["ci_low"], r["ci_high"], band) if st == "undecided" else None
    return Comparison(a, b, metric, r["value"], r["ci_low"], r["ci_high"], confidence, n, st, extra)


def settled(comparisons: Sequence[Comparison]) -> bool:
    """Every comparison decided (faster, slower or tied): the sequential rule may stop."""
    return all(c.state != "undecided" for c in comparisons)
