"""Statistics and quality against the libraries and hand-computed values."""

from __future__ import annotations

import pytest
from rouge_score import rouge_scorer
import sacrebleu

from variantbench.metrics.latency import distribution, percentile
from variantbench.metrics.quality import Scored, summarize_quality


def test_loadgen_percentiles_truncate_n_times_p() -> None:
    """sorted[int(n * p)], 0-based: where n * p is whole it is one past nearest rank (as LoadGen)."""
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 5) == 15
    assert percentile(values, 30) == 20
    assert percentile(values, 40) == 35  # nearest rank would say 20
    assert percentile(values, 50) == 35
    assert percentile(values, 100) == 50
    hundred = list(range(1, 101))
    assert percentile(hundred, 99) == 100
    assert percentile(hundred, 90) == 91
    assert distribution([1.0, 2.0, 3.0, 4.0])["mean"] == 2.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 0)


def test_quality_matches_sacrebleu_and_rouge_score() -> None:
    outputs = ["the cat sat on the mat", "Paris is the capital of France", "copper"]
    refs = ["the cat is on the mat", "The capital of France is Paris.", "copper and tin"]
    got = summarize_quality([Scored("custom", o, r) for o, r in zip(outputs, refs, strict=True)])
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(outputs, [refs]).score)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for name in ("rouge1", "rouge2", "rougeL"):
        want = sum(scorer.score(r, o)[name].fmeasure for o, r in zip(outputs, refs, strict=True)) / 3
        assert got[name] == pytest.approx(want)
    assert summarize_quality([Scored("custom", "x", "x")])["rougeL"] == 1.0
