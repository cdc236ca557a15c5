"""Quality decided as speed is: paired intervals by sample, a margin, and an undecided state that
reaches the recommendation; likelihood scores computed as a direct forward computes them."""

from __future__ import annotations

import numpy as np
import pytest

from variantbench.analysis.profiles import Profile
from variantbench.analysis.recommend import recommend
from variantbench.metrics import quality_compare as qc
from variantbench.records import QueryRecord
from variantbench.report.schema import Likelihood, Resources, SampleLikelihood
from variantbench.report.summary import compare_to_standard, summarize_run

WORDS = "the town lies on the river and is known for its stone bridge and a spring festival".split()


def _rec(i: int, output: str, reference: str, variant: str = "v") -> QueryRecord:
    n = max(1, len(output.split()))
    return QueryRecord(run_id="r", variant=variant, scenario="offline", index=i, sample_id=f"s{i}", task="summarization",
                       status="ok", error=None, scheduled_ns=0, issued_ns=0, first_token_ns=1_000_000,
                       completed_ns=10_000_000, input_tokens=5, output_tokens=n, token_ms=[1.0] * n, output=output,
                       reference=reference)  # fmt: skip


def _answers(keep: list[int], n: int = 12) -> tuple[list[QueryRecord], list[QueryRecord]]:
    """The standard answers every reference whole; the variant keeps ``keep[i]`` of its words."""
    refs = [" ".join(WORDS[: 8 + i % 6]) for i in range(n)]
    std = [_rec(i, refs[i], refs[i], "fp32") for i in range(n)]
    var = [_rec(i, " ".join(refs[i].split()[: keep[i]]), refs[i], "int8") for i in range(n)]
    return std, var


def test_the_composites_interval_is_scipys_bca_bootstrap_of_the_paired_differences() -> None:
    from scipy.stats import bootstrap

    rng = np.random.default_rng(4)
    std, var = _answers([int(k) for k in rng.integers(4, 14, 12)])
    (composite,) = [c for c in qc.compare("int8", var, None, "fp32", std, None, floor=0.95, seed=7)
                    if c.metric == "composite"]  # fmt: skip
    order = sorted(range(12), key=lambda i: f"s{i}")  # paired by sample id, in the ids' order
    a = np.array([qc.sample_scores(var[i])["composite"] for i in order])
    b = np.array([qc.sample_scores(std[i])["composite"] for i in order])
    want = bootstrap((a - b,), np.mean, method="BCa", n_resamples=10_000, confidence_level=0.95,
                     rng=np.random.default_rng(7))  # fmt: skip
    assert composite.value == pytest.approx(a.mean() / b.mean())
    assert composite.ci_low == pytest.approx(1 + want.confidence_interval.low / b.mean())
    assert composite.ci_high == pytest.approx(1 + want.confidence_interval.high / b.mean())
    assert composite.pairs == 12 and composite.state == qc.ratio_state(
        composite.ci_low, composite.ci_high, 0.95
    )


def test_a_standard_that_scores_0_on_most_samples_still_gets_an_interval() -> None:
    """The default model's composites are 0 on most samples: a ratio's own resamples divided by zero."""
    a = [0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.1, 0.0]
    b = [0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0]
    value, low, high = qc.paired_mean_ratio(a, b)
    assert value == pytest.approx(1.0) and low is not None and low < 1 < high


def test_a_margin_gives_meets_fails_and_undecided_with_the_samples_that_would_decide() -> None:
    assert qc.ratio_state(0.97, 1.04, 0.95) == "meets"
    assert qc.ratio_state(0.60, 0.80, 0.95) == "fails"
    assert qc.ratio_state(0.80, 1.10, 0.95) == "undecided"
    # half-width 0.16 in log terms, 0.05 from the margin: (0.16/0.05)^2 x 12 samples
    more = qc.samples_to_decide(12, 1.0, np.exp(-0.16), np.exp(0.16), np.exp(-0.05))
    assert more == pytest.approx(12 * (0.16 / 0.05) ** 2, rel=0.01)


def test_identical_answers_pass_truncated_ones_fail_and_noisy_ones_stay_undecided() -> None:
    std, same = _answers([99] * 12)
    _, cut = _answers([3] * 12)
    # a quarter of the answers cut short, the rest whole: 0.88 [0.75, 0.96] of the standard on 12 samples
    _, noisy = _answers([99, 99, 99, 99, 99, 6, 6, 6, 6, 99, 99, 99])
    base = summarize_run("fp32", std, Resources(), scenario="offline")

    def gate(recs: list[QueryRecord]):  # noqa: ANN202
        run = summarize_run("int8", recs, Resources(), scenario="offline")
        return run, compare_to_standard(run, recs, base, std, threshold=0.95, length_tolerance=5.0)

    assert gate(same)[1].gate == "PASS" and gate(same)[1].state == "meets"
    assert gate(cut)[1].gate == "FAIL" and gate(cut)[1].state == "fails"
    run, vs = gate(noisy)
    assert vs.state == "undecided" and vs.gate == "UNDECIDED", vs
    composite = next(c for c in vs.comparisons if c.metric == "composite")
    assert composite.ci_low < 0.95 < composite.ci_high and composite.more_samples > 12
    # the recommendation names it, and never treats it as a pass or a fail
    run.quality_vs_standard = vs
    base.quality_vs_standard = compare_to_standard(base, std, base, std)
    verdict = recommend([base, run], "fp32", Profile(name="q", quality_floor=0.95))
    assert verdict["variant"] == "fp32" and verdict["undecided_quality"] == ["int8"]
    assert (
        "undecided on quality, so not recommended: int8 (quality undecided against the 95% floor"
        in verdict["summary"]
    )
    assert "samples would decide it" in verdict["summary"]


def test_a_fidelity_interval_below_the_tie_level_is_a_tie_whatever_the_text_says() -> None:
    from variantbench.report.schema import Likelihood, SampleLikelihood

    std, _ = _answers([99] * 12)
    _, cut = _answers([3] * 12)
    close = Likelihood(
        per_sample=[SampleLikelihood(sample_id=f"s{i}", kl=0.002 + 0.0005 * (i % 3)) for i in range(12)]
    )
    state, why = qc.gate_state(qc.compare("int8", cut, close, "fp32", std, None, floor=0.95))
    assert state == "tied" and "fidelity" in why
    far = Likelihood(per_sample=[SampleLikelihood(sample_id=f"s{i}", kl=0.02 + 0.001 * i) for i in range(12)])
    assert qc.gate_state(qc.compare("int8", cut, far, "fp32", std, None, floor=0.95))[0] == "fails"


def test_a_fidelity_interval_above_the_damage_level_fails_whatever_the_text_says() -> None:
    """Plain int8 on the 12-question file: KL 1.56 [1.07, 2.63], its composite undecided. Above the
    damage level the gate fails at every floor, the recommendation says why; an interval across it
    leaves the gate to the composite."""
    std, same = _answers([99] * 12)
    damaged = Likelihood(
        per_sample=[SampleLikelihood(sample_id=f"s{i}", kl=1.0 + 0.1 * i) for i in range(12)]
    )
    comparisons = qc.compare("int8", same, damaged, "fp32", std, None, floor=0.95)
    state, why = qc.gate_state(comparisons)
    assert state == "fails" and why.startswith("fidelity") and qc.decided_at(comparisons, (0.9, 0.95, 0.99))
    base = summarize_run("fp32", std, Resources(), scenario="offline")
    run = summarize_run("int8", same, Resources(), scenario="offline")
    run.quality_vs_standard = compare_to_standard(run, same, base, std, threshold=0.95, likelihood=damaged)
    base.quality_vs_standard = compare_to_standard(base, std, base, std)
    assert run.quality_vs_standard.gate == "FAIL"
    verdict = recommend([base, run], "fp32", Profile(name="q", quality_floor=0.90))
    assert verdict["variant"] == "fp32"
    assert "above the damage level 0.5" in verdict["reasons"]["int8"], verdict["reasons"]
    # across the damage level (drop-layers:2 measured 0.49 [0.25, 1.34]): the composite decides
    across = Likelihood(
        per_sample=[SampleLikelihood(sample_id=f"s{i}", kl=0.1 + 0.15 * (i % 7)) for i in range(12)]
    )
    assert qc.gate_state(qc.compare("int8", same, across, "fp32", std, None, floor=0.95))[0] == "meets"


def test_the_top_k_kl_is_zero_against_itself_and_a_lower_bound_of_the_full_kl() -> None:
    import torch

    from variantbench.metrics.likelihood import kl_from_top_k, top_k

    torch.manual_seed(0)
    standard = torch.log_softmax(torch.randn(5, 1000) * 3, -1)
    variant = torch.log_softmax(standard + torch.randn(5, 1000) * 0.3, -1)
    kept = top_k(standard)
    same, agree = kl_from_top_k(kept, standard)
    assert max(same) < 1e-5 and agree == [1.0] * 5
    approx, _ = kl_from_top_k(kept, variant)
    full = (standard.exp() * (standard - variant)).sum(-1).tolist()
    assert all(a <= f + 1e-6 for a, f in zip(approx, full, strict=True))
    assert all(a > 0.5 * f for a, f in zip(approx, full, strict=True))  # most of the mass is in the top 256


def test_choices_are_scored_by_their_log_probability_as_a_direct_forward_computes_it(tiny_model_dir) -> None:  # noqa: ANN001
    import torch

    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.torch_backend import TorchBackend
    from variantbench.metrics.likelihood import score_sample
    from variantbench.workloads.base import Sample

    backend = TorchBackend(str(tiny_model_dir), "fp32")
    backend.load()
    try:
        sample = Sample("c1", "classification", "Is this letter positive or negative? The bridge is lovely.",
                        "positive", 4)  # fmt: skip
        prompt = backend.encode(GenerationRequest("x", prompt=sample.prompt, max_new_tokens=1))
        forwards: list[int] = []
        real = backend.token_log_probs
        backend.token_log_probs = lambda ids: forwards.append(len(ids)) or real(ids)  # count the prefills
        scores, positions = score_sample(backend, sample, prompt)
        # a form whose every token but the last follows the prompt in a forward already run is read
        # off it (the reference's "positive"): one prefill for it, one for each other form
        reusable = {
            f
            for f in ("positive", "Positive", "negative", "Negative")
            if backend.tokenize(f)[:-1] == backend.tokenize("positive")[: len(backend.tokenize(f)) - 1]
        }
        assert len(forwards) <= 1 + 4 - len(reusable) and "positive" in reusable, (forwards, reusable)
        for choice in ("positive", "negative"):  # the label's two surface forms together
            forms = []
            for form in (choice, choice.capitalize()):
                ids = backend.tokenize(form)
                lp = backend.decoder.log_probs(prompt + ids)
                forms.append(sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)))
            direct = float(torch.logsumexp(torch.tensor(forms), 0))
            assert scores["choice_logprobs"][choice] == pytest.approx(direct, abs=1e-4)
        best = max(("positive", "negative"), key=lambda c: scores["choice_logprobs"][c])
        assert scores["choice"] == best and scores["acc"] == float(best == "positive")
        ref = backend.tokenize("positive")
        assert scores["ref_tokens"] == len(ref) and positions.shape == (len(ref), lp.shape[-1])
        assert scores["ref_logprob"] < scores["choice_logprobs"]["positive"]  # one form of the two
        assert torch.isfinite(positions).all()
    finally:
        backend.close()


LM_EVAL_TASK = """task: vb_sentiment
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Letter: {{{{text}}}}\\nIs the writer's opinion positive or negative? Answer:"
doc_to_choice: [positive, negative]
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LETTERS = [("The bridge repairs were finished early and the park is lovely.", 0),
           ("The council ignored every letter and the roads are worse than ever.", 1),
           ("What a wonderful festival, the whole town enjoyed it.", 0),
           ("The new bus schedule is a disaster and nobody was asked.", 1),
           ("Thank you to the library staff for their kind help.", 0)]  # fmt: skip


def _task_folder(tmp_path):  # noqa: ANN001, ANN202
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "letters.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in LETTERS))
    (tmp_path / "vb_sentiment.yaml").write_text(LM_EVAL_TASK.format(data=data))
    return tmp_path


def test_an_lm_eval_custom_task_over_a_local_jsonl_is_scored_as_the_model_scores_its_choices(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:  # noqa: ANN001
    """lm-eval's own harness, through ``metrics/lm_eval.py`` on the tiny model: each document's acc is
    1 exactly when our decoder finds the target choice the more likely continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from variantbench.backends.engine import Decoder
    from variantbench.metrics.lm_eval import LmEvalSpec, evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _task_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = evaluate(model, tok, LmEvalSpec(tasks=("vb_sentiment",), include_path=str(folder)))
    docs = {d["doc_id"]: d["acc"] for d in out["docs"]["vb_sentiment"]}
    assert len(docs) == len(LETTERS) and out["tasks"]["vb_sentiment"]["acc"] == pytest.approx(
        np.mean(list(docs.values()))
    )
    assert out["tasks"]["vb_sentiment"]["acc_stderr"] is not None
    assert [docs[i] for i in range(len(LETTERS))] == direct_accuracies(tok, Decoder(model).log_probs)


def direct_accuracies(tok, log_probs) -> list[float]:  # noqa: ANN001
    """Each letter's accuracy as one forward a choice computes it: 1 where the target choice (after
    lm-eval's target delimiter " ") is the more likely continuation of the task's prompt."""
    out = []
    for text, label in LETTERS:
        prompt = f"Letter: {text}\nIs the writer's opinion positive or negative? Answer:"
        context = tok(prompt)["input_ids"]
        scores = []
        for choice in (" positive", " negative"):
            whole = tok(prompt + choice)["input_ids"]
            lp = log_probs(whole)
            scores.append(
                sum(float(lp[len(context) - 1 + j, t]) for j, t in enumerate(whole[len(context) :]))
            )
        out.append(float(int(np.argmax(scores)) == label))
    return out


@pytest.mark.slow  # 58 s: a whole run with lm-eval; its scoring is proved by the custom-task test beside
def test_a_run_puts_lm_evals_scores_beside_ours_and_pairs_them_by_document(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    import json
    import os
    import subprocess
    import sys

    folder = _task_folder(tmp_path / "tasks")
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"model: {{source: {tiny_model_dir}}}\nvariants: [fp32, int8]\nload: {{tasks: 3}}\n"
        "analysis: {cold_start: false, diagnose: false, until_decided: false, batch_rounds: 0}\n"
        f"quality: {{lm_eval: {{tasks: [vb_sentiment], include_path: {folder}}}}}\nout: {tmp_path / 'out'}\n"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "variantbench", "run", str(plan)], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    for run in runs.values():
        task = run["lm_eval"]["tasks"]["vb_sentiment"]
        assert 0 <= task["acc"] <= 1 and task["acc_stderr"] is not None
        assert len(run["lm_eval"]["docs"]["vb_sentiment"]) == len(LETTERS)
    metrics = {c["metric"] for c in runs["int8"]["quality_vs_standard"]["comparisons"]}
    assert "lm-eval vb_sentiment acc" in metrics and "fidelity" in metrics
    assert "## lm-evaluation-harness" in (tmp_path / "out" / "report.md").read_text()


def test_a_look_waits_for_an_undecided_quality_gate_and_not_for_a_decided_or_tied_one() -> None:
    std, same = _answers([99] * 12)
    _, cut = _answers([3] * 12)
    _, noisy = _answers([99, 99, 99, 99, 99, 6, 6, 6, 6, 99, 99, 99])
    floors = (0.90, 0.95, 0.99)

    def waits(recs: list[QueryRecord], rows: dict | None = None) -> list[str]:
        reports = {
            n: Likelihood(per_sample=[SampleLikelihood(**r) for r in rs]) for n, rs in (rows or {}).items()
        }
        return qc.undecided_quality({"fp32": std, "int8": recs}, reports, "fp32", floors, 0.99, 0.95)

    assert waits(noisy) == ["int8"]  # 0.88 [0.75, 0.96]: undecided at the 90% and 95% floors
    assert waits(same) == [] and waits(cut) == []  # meets / fails every floor
    tie = {"int8": [{"sample_id": f"s{i}", "kl": 0.002} for i in range(12)]}
    assert waits(noisy, tie) == []  # the fidelity tie decides without the text


def test_each_pass_of_the_synthetic_workload_brings_new_samples_in_the_mix() -> None:
    from collections import Counter

    from variantbench.loadgen.harness import sample_order
    from variantbench.workloads import build_synthetic

    one = build_synthetic(5, seed=3)
    three = build_synthetic(5, seed=3, passes=3)
    assert three.pass_size == 5 and three.passes == 3 and len(three) == 15
    assert three.samples[:5] == one.samples  # a one-pass run measures what a three-pass run starts with
    assert len({s.sample_id for s in three.samples}) == 15
    mixes = [Counter(s.task for s in three.samples[k * 5 : (k + 1) * 5]) for k in range(3)]
    assert mixes[0] == mixes[1] == mixes[2]  # every pass in the mix's proportions
    order = sample_order(15, 30, seed=1, pass_size=5)
    for k in range(3):  # pass k's queries ask pass k's samples, each once
        assert sorted(order[k * 5 : (k + 1) * 5]) == list(range(k * 5, (k + 1) * 5))
    assert sorted(order[15:]) == list(range(15))  # past the last pass: the library again
    assert sample_order(8, 16, seed=1) == sample_order(8, 16, seed=1, pass_size=None)
