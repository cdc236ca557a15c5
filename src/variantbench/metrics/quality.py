"""Output quality against references, per sample and aggregated per task and overall.

- BLEU: sacrebleu's corpus BLEU, 0-100.
- ROUGE-1/2/L: rouge-score's F-measure with its Porter stemmer, mean over samples, 0-1. (We use its
  scorer, not its bootstrap aggregator, so there is no resampling to seed: the means are exact.)
- Exact match and token F1 (QA): the SQuAD v1.1 evaluation's normalization (lower case, no
  punctuation, no articles, single spaces) and its max over the accepted answers, 0-1.
- Accuracy (classification): the first label word in the output is the reference label, 0-1.
- Composite: ``0.5 * BLEU/100 + 0.5 * ROUGE-L``, the seeds' "BLEU+ROUGE" score on one 0-1 scale.

A failed query scores as an empty answer, so errors never flatter a variant's quality.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
import re
import string

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
COMPOSITE_WEIGHTS = {"bleu": 0.5, "rougeL": 0.5}  # BLEU taken on 0-1 (BLEU/100)
LABELS = ("positive", "negative")
QUALITY_KEYS = ("bleu", "rouge1", "rouge2", "rougeL", "exact_match", "f1", "accuracy", "composite")


@dataclass(frozen=True)
class Scored:
    """One answer to score: its task, what came out, what was expected."""

    task: str
    output: str
    reference: str
    alternatives: tuple[str, ...] = ()


@lru_cache(maxsize=1)
def _scorer():  # noqa: ANN202 - rouge_score has no type hints
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge(output: str, reference: str) -> dict[str, float]:
    scores = _scorer().score(reference, output)
    return {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}


def corpus_bleu(outputs: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    if not outputs:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(outputs), [list(references)]).score)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1: lower case, drop punctuation and the articles a/an/the, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(output: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(output)
    return float(any(pred == normalize_answer(a) for a in answers))


def token_f1(output: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(output).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = Counter(pred) & Counter(gold)
        same = sum(common.values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def label_of(output: str, labels: Sequence[str] = LABELS) -> str | None:
    """The first label word in the output (whole words, any case), or None."""
    found = re.search(r"\b(" + "|".join(re.escape(label) for label in labels) + r")\b", output.lower())
    return found.group(1) if found else None


def composite(bleu: float | None, rouge_l: float | None) -> float | None:
    if bleu is None or rouge_l is None:
        return None
    return COMPOSITE_WEIGHTS["bleu"] * bleu / 100 + COMPOSITE_WEIGHTS["rougeL"] * rouge_l


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_quality(items: Sequence[Scored]) -> dict[str, float | int | None]:
    """The quality block of one group of answers (a task, or all of them)."""
    empty: dict[str, float | int | None] = dict.fromkeys(QUALITY_KEYS)
    with_ref = [i for i in items if i.reference]
    out = {**empty, "scored": len(with_ref)}
    if not with_ref:
        return out
    per = [rouge(i.output, i.reference) for i in with_ref]
    out["bleu"] = corpus_bleu([i.output for i in with_ref], [i.reference for i in with_ref])
    for name in ROUGE_TYPES:
        out[name] = _mean([p[name] for p in per])
    qa = [i for i in with_ref if i.task == "qa"]
    if qa:
        out["exact_match"] = _mean([exact_match(i.output, (i.reference, *i.alternatives)) for i in qa])
        out["f1"] = _mean([token_f1(i.output, (i.reference, *i.alternatives)) for i in qa])
    cls = [i for i in with_ref if i.task == "classification"]
    if cls:
        out["accuracy"] = _mean([float(label_of(i.output) == i.reference.lower()) for i in cls])
    out["composite"] = composite(out["bleu"], out["rougeL"])  # type: ignore[arg-type]
    return out


def agreement(outputs: Sequence[str], standard_outputs: Sequence[str]) -> dict[str, float | None]:
    """How close a variant's answers are to the standard's on the same samples (ROUGE-L, exact)."""
    if not outputs:
        return {"agreement_rougeL": None, "identical": None}
    pairs = list(zip(outputs, standard_outputs, strict=True))
    return {
        "agreement_rougeL": _mean([rouge(o, s)["rougeL"] if (o or s) else 1.0 for o, s in pairs]),
        "identical": _mean([float(o.strip() == s.strip()) for o, s in pairs]),
    }
