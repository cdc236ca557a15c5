"""Output quality against references: BLEU (sacrebleu) and ROUGE-1/2/L F-measures (rouge-score).

BLEU is corpus-level on a 0-100 scale (sacrebleu's own); ROUGE is the mean per-sample F-measure on a
0-1 scale, with rouge-score's Porter stemmer. No hand-written metric code.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@lru_cache(maxsize=1)
def _scorer():  # noqa: ANN202 - rouge_score has no type hints
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def sample_scores(output: str, reference: str) -> dict[str, float]:
    scores = _scorer().score(reference, output)
    return {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}


def corpus_bleu(outputs: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    if not outputs:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(outputs), [list(references)]).score)


def quality_summary(outputs: Sequence[str], references: Sequence[str]) -> dict[str, float | None]:
    """BLEU and mean ROUGE over paired outputs and references."""
    if not outputs:
        return {"bleu": None, **{name: None for name in ROUGE_TYPES}}
    per_sample = [sample_scores(o, r) for o, r in zip(outputs, references, strict=True)]
    summary: dict[str, float | None] = {"bleu": corpus_bleu(outputs, references)}
    for name in ROUGE_TYPES:
        summary[name] = sum(s[name] for s in per_sample) / len(per_sample)
    return summary
