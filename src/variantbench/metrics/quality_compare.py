"""Quality against the standard with the care speed gets: per-sample pairs, intervals, and a margin.

Every score is taken per sample on both sides (the first answer each variant gave to a sample; greedy
decoding answers a repeated sample the same way) and compared as a paired interval (BCa, by
``scipy.stats.bootstrap`` over the samples, ``significance._bootstrap``):

* ``composite`` and ``task score``: the mean per-sample difference (variant minus standard), its BCa
  interval read as a ratio of the standard's mean (``paired_mean_ratio``);
* ``reference likelihood``: exp of the mean per-sample difference of the reference's log-probability
  per token (variant minus standard): the ratio of per-token likelihoods, 1.0 when equal;
* ``choice accuracy``: the variant's accuracy over the standard's on the samples scored by choices;
* ``fidelity``: KL(standard || variant) on the samples' own positions, the one-sample interval of its
  mean (``metrics/likelihood.py``).

The profile's quality floor (``need_quality``, 90-99%) is a non-inferiority margin for a ratio:
*meets* when the interval's lower end clears it, *fails* when its upper end lies below it, and
*undecided* otherwise, with the samples likely needed to decide (the half-width shrinks as
1/sqrt(n)). The gate reads, in order: fidelity first, a **tie** when the KL interval lies wholly
below ``TIE_KL`` (the variant's distributions are the standard's for every purpose a generated
text could show: a tie without waiting for generation noise), a **fail** when it lies wholly above
``DAMAGE_KL``; else the composite's state (what a user's answers are scored by); where the
composite carries no information (no references, or the standard scores 0 on every sample), the
reference likelihood's. The other scores are shown beside it as evidence, never overriding it.

Why a damage level, and why 0.5 nats: generated text on a few samples cannot see a drop the
distributions show plainly. Measured on a 12-question factual file (benchmarks/data/factual_qa12.jsonl,
SmolLM2-135M, fp32 the standard): plain ``int8`` had KL 1.56 [1.07, 2.63] on the samples' own
positions and kept 0.20 [0.09, 0.55] of the gold answers' per-token likelihood, yet its composite
read 0.50 [-0.19, 1.13] of fp32's: undecided at every floor; ``prune-heads:0.25``, KL 1.44, kept
0.10. The variants that kept their quality sat two orders of magnitude lower: ``int8-wo`` 0.003
(likelihood 1.00), ``smooth+int8:act=token`` 0.043 (0.90, composite 1.02). ``drop-layers:2``,
0.49 [0.25, 1.34] (likelihood 0.72), is left to its composite: 0.5 nats lies between the two
groups, and only an interval wholly above it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
import math
from typing import Any

import numpy as np

from variantbench.metrics import significance as sig
from variantbench.metrics.quality import label_of, rouge, token_f1

TIE_KL = 0.01  # nats: below this on every sample's positions, a variant ties the standard on quality
DAMAGE_KL = 0.5  # nats: above this, the variant fails on quality at every floor (the module's why)
STATES = ("meets", "fails", "undecided", "tied")


@dataclass
class QualityComparison:
    variant: str
    standard: str
    metric: str  # "composite" | "task score" | "reference likelihood" | "choice accuracy" | "fidelity"
    value: float | None  # a ratio (1.0: equal), or the mean KL for fidelity
    ci_low: float | None
    ci_high: float | None
    confidence: float
    pairs: int
    floor: float | None  # the margin a ratio must clear (fidelity: the tie level)
    state: str | None  # one of STATES; None: shown as evidence, not decided on
    more_samples: int | None = None
    damage: float | None = None  # fidelity: the KL above which the variant fails

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def words(self) -> str:
        ci = (f"{self.value:.3g} [{self.ci_low:.3g}, {self.ci_high:.3g}]" if self.value is not None
              and self.ci_low is not None and self.ci_high is not None else "no interval")  # fmt: skip
        tail = f"; about {self.more_samples} samples would decide it" if self.more_samples else ""
        return f"{self.metric} {ci} on {self.pairs} samples ({self.state or 'shown'}){tail}"


def _sentence_bleu(output: str, reference: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_bleu(output, [reference]).score)


def sample_scores(record: Any) -> dict[str, float]:
    """One answer's per-sample scores: the composite (sentence BLEU/100 and ROUGE-L, halves) and the
    task's own score (QA: token F1; classification: the first label word; else ROUGE-L)."""
    r_l = rouge(record.output, record.reference)["rougeL"]
    out = {"composite": 0.5 * _sentence_bleu(record.output, record.reference) / 100 + 0.5 * r_l}
    if record.task == "qa":
        out["task score"] = token_f1(record.output, (record.reference, *record.alternatives))
    elif record.task == "classification":
        out["task score"] = float(label_of(record.output) == record.reference.lower())
    else:
        out["task score"] = r_l
    return out


def first_answers(records: Sequence[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records:
        if r.status == "ok" and r.scored and r.reference:
            out.setdefault(r.sample_id, r)
    return out


def ratio_state(low: float | None, high: float | None, floor: float) -> str:
    if low is None or high is None:
        return "undecided"
    if low >= floor:
        return "meets"
    if high < floor:
        return "fails"
    return "undecided"


def samples_to_decide(
    n: int, value: float | None, low: float | None, high: float | None, floor: float
) -> int | None:
    """Samples likely needed for the interval to clear the floor on one side (log scale, 1/sqrt(n))."""
    if value is None or low is None or high is None or n < 2 or low <= 0 or value <= 0:
        return None
    half = (math.log(high) - math.log(low)) / 2
    gap = abs(math.log(value) - math.log(floor))
    if gap < 1e-6:
        return None  # on the margin itself: no number of samples is likely to settle it
    return max(n + 1, math.ceil(n * (half / gap) ** 2))


def paired_mean_ratio(a: Sequence[float], b: Sequence[float], seed: int = 0,
                      confidence: float = 0.95) -> tuple[float | None, float | None, float | None]:  # fmt: skip
    """mean(a) / mean(b) with the interval of the per-sample differences' mean (BCa), read relative to
    the standard's mean: 1 + [low, high] / mean(b). The difference is what a sample tells; a ratio's
    own resamples divide by zero wherever the standard scored 0 on every resampled sample (on the
    default model most composites are 0: the ratio's bootstrap gave no interval at all)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    base = float(y.mean()) if len(y) else 0.0
    if len(x) < 3 or base <= 0:
        return None, None, None
    lo, hi = sig.mean_interval(x - y, seed, confidence=confidence)
    value = float(x.mean()) / base
    if lo is None or hi is None:
        return value, None, None
    return value, 1 + lo / base, 1 + hi / base


def _ratio(metric: str, a: Sequence[float], b: Sequence[float], floor: float, confidence: float,
           names: tuple[str, str], seed: int, decides: bool) -> QualityComparison:  # fmt: skip
    value, low, high = paired_mean_ratio(a, b, seed, confidence)
    st = ratio_state(low, high, floor)
    more = samples_to_decide(len(a), value, low, high, floor) if st == "undecided" else None
    return QualityComparison(names[0], names[1], metric, value, low, high, confidence, len(a), floor,
                             st if decides else None, more if decides else None)  # fmt: skip


def compare(variant: str, records: Sequence[Any], likelihood: Any, standard: str, std_records: Sequence[Any],
            std_likelihood: Any, *, floor: float, confidence: float = 0.95, tie_kl: float = TIE_KL,
            damage_kl: float = DAMAGE_KL, seed: int = 0, lm_eval: Any = None,
            standard_lm_eval: Any = None) -> list[QualityComparison]:  # fmt: skip
    """Every paired quality comparison of ``variant`` with ``standard`` (records, and ``Likelihood``
    reports or None), the deciding ones carrying a state against ``floor``."""
    names = (variant, standard)
    out: list[QualityComparison] = []
    mine, theirs = first_answers(records), first_answers(std_records)
    common = sorted(set(mine) & set(theirs))
    scores_a = [sample_scores(mine[k]) for k in common]
    scores_b = [sample_scores(theirs[k]) for k in common]
    mine_lk = {s.sample_id: s for s in (likelihood.per_sample if likelihood else [])}
    theirs_lk = {s.sample_id: s for s in (std_likelihood.per_sample if std_likelihood else [])}
    kl = [s.kl for s in mine_lk.values() if s.kl is not None]
    if kl:
        lo, hi = sig.mean_interval(kl, seed, confidence=confidence)
        state = ("tied" if hi is not None and hi < tie_kl
                 else "fails" if lo is not None and lo > damage_kl else None)  # fmt: skip
        out.append(QualityComparison(variant, standard, "fidelity", float(np.mean(kl)), lo, hi, confidence, len(kl),
                                     tie_kl, state, damage=damage_kl))  # fmt: skip
    # a composite the standard scores 0 on every sample carries no information (a tiny model, or
    # a task the model cannot do): shown, and the reference likelihood decides instead
    has_refs = len(common) >= 3 and sum(s["composite"] for s in scores_b) > 0
    if len(common) >= 3:
        for i, metric in enumerate(("composite", "task score")):
            out.append(_ratio(metric, [s[metric] for s in scores_a], [s[metric] for s in scores_b], floor,
                              confidence, names, seed + i, decides=has_refs and metric == "composite"))  # fmt: skip
    both = [k for k in mine_lk if k in theirs_lk and mine_lk[k].ref_logprob_per_token is not None
            and theirs_lk[k].ref_logprob_per_token is not None]  # fmt: skip
    if len(both) >= 3:
        diff = [mine_lk[k].ref_logprob_per_token - theirs_lk[k].ref_logprob_per_token for k in both]
        lo, hi = sig.mean_interval(diff, seed + 2, confidence=confidence)
        value = math.exp(float(np.mean(diff)))
        low, high = (math.exp(lo), math.exp(hi)) if lo is not None and hi is not None else (None, None)
        decides = not has_refs
        st = ratio_state(low, high, floor) if decides else None
        more = samples_to_decide(len(both), value, low, high, floor) if st == "undecided" else None
        out.append(QualityComparison(variant, standard, "reference likelihood", value, low, high, confidence,
                                     len(both), floor, st, more))  # fmt: skip
    choice = [
        k for k in mine_lk if k in theirs_lk and mine_lk[k].acc is not None and theirs_lk[k].acc is not None
    ]
    if len(choice) >= 3:
        out.append(_ratio("choice accuracy", [mine_lk[k].acc for k in choice], [theirs_lk[k].acc for k in choice],
                          floor, confidence, names, seed + 3, decides=False))  # fmt: skip
    out.extend(_lm_eval_pairs(names, lm_eval, standard_lm_eval, floor, confidence, seed + 4))
    return out


def _lm_eval_pairs(names: tuple[str, str], mine: Any, theirs: Any, floor: float, confidence: float,
                   seed: int) -> list[QualityComparison]:  # fmt: skip
    """lm-eval's tasks paired by document (its first per-document metric: acc, acc_norm, ...): shown
    beside ours as evidence, never deciding the gate."""
    from variantbench.metrics.lm_eval import PER_DOC_METRICS

    out = []
    for task, docs in sorted((mine.docs if mine else {}).items()):
        other = {d["doc_id"]: d for d in (theirs.docs.get(task, []) if theirs else [])}
        metric = next((m for m in PER_DOC_METRICS if docs and m in docs[0]), None)
        pairs = [(d[metric], other[d["doc_id"]][metric]) for d in docs
                 if metric and d["doc_id"] in other and metric in other[d["doc_id"]]]  # fmt: skip
        if len(pairs) >= 3:
            out.append(_ratio(f"lm-eval {task} {metric}", [a for a, _ in pairs], [b for _, b in pairs], floor,
                              confidence, names, seed, decides=False))  # fmt: skip
    return out


def decided_at(comparisons: Sequence[QualityComparison], floors: Sequence[float]) -> bool:
    """Whether the gate is decided at every floor the recommendation reads (the profiles' 90-99%):
    a fidelity tie or fail, or the deciding comparison's interval wholly above or below each floor.
    What a look asks of quality before the run may stop (``pipeline/interleave.py``)."""
    if any(c.metric == "fidelity" and c.state is not None for c in comparisons):
        return True
    deciding = next((c for c in comparisons if c.state is not None and c.metric != "fidelity"), None)
    if deciding is None:
        return False
    return all(ratio_state(deciding.ci_low, deciding.ci_high, f) != "undecided" for f in floors)


def undecided_quality(records: dict[str, Sequence[Any]], likelihood: dict[str, Any], standard: str,
                      floors: Sequence[float], threshold: float, confidence: float) -> list[str]:  # fmt: skip
    """The variants whose quality gate against ``standard`` is not yet decided at every floor, from
    the records and likelihood reports (``per_sample`` rows) so far: a look's question."""
    return [name for name in records if name != standard and not decided_at(
        compare(name, records[name], likelihood.get(name), standard, records[standard], likelihood.get(standard),
                floor=threshold, confidence=confidence), floors)]  # fmt: skip


def gate_state(comparisons: Sequence[QualityComparison]) -> tuple[str | None, str]:
    """The quality gate's state and the comparison that decided it (see the module's order)."""
    for c in comparisons:
        if c.metric == "fidelity" and c.state is not None:
            return c.state, c.words()
    for c in comparisons:
        if c.state is not None and c.metric != "fidelity":
            return c.state, c.words()
    return None, "no paired quality score to decide on"
