"""Workloads and quality: the synthetic generator, user files, metrics, the gates, logit fidelity."""

from __future__ import annotations

import json
from pathlib import Path
import statistics

import pytest
from rouge_score import rouge_scorer
import sacrebleu

from variantbench.errors import UserError
from variantbench.metrics.quality import (
    Scored,
    exact_match,
    label_of,
    summarize_quality,
    token_f1,
)
from variantbench.records import QueryRecord
from variantbench.report.schema import Resources
from variantbench.report.summary import compare_to_standard, summarize_run
from variantbench.workloads import LengthDistribution, build_synthetic, parse_lengths, parse_mix
from variantbench.workloads.counting import tokenizer_counter
from variantbench.workloads.files import load_workload_file
from variantbench.workloads.synthetic import _NEGATIVE, _POSITIVE, _TOPICS


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path):
    return tokenizer_counter(str(tiny_model_dir))


# ---- the synthetic generator ---------------------------------------------------------------------


def test_generator_is_deterministic_for_a_seed(counter) -> None:
    lengths = parse_lengths("uniform:128-512")
    one = build_synthetic(12, seed=5, lengths=lengths, counter=counter)
    two = build_synthetic(12, seed=5, lengths=lengths, counter=counter)
    assert one.samples == two.samples
    assert build_synthetic(12, seed=6, lengths=lengths, counter=counter).samples != one.samples


def test_fixed_lengths_are_hit_within_a_word(counter) -> None:
    w = build_synthetic(16, seed=1, lengths=parse_lengths("fixed:400"), counter=counter)
    for s in w.samples:
        assert s.input_tokens == counter(s.prompt)  # counted with the tokenizer, not estimated
        assert 400 - 12 <= s.input_tokens <= 400, (s.task, s.input_tokens)


def test_uniform_and_normal_distributions(counter) -> None:
    uni = build_synthetic(60, seed=2, lengths=parse_lengths("uniform:128-2048"), counter=counter)
    counts = [s.input_tokens for s in uni.samples]
    assert min(counts) >= 100 and max(counts) <= 2048
    # uniform over 128-2048: mean 1088, std 554; 60 draws land near them
    assert 900 < statistics.mean(counts) < 1300 and 400 < statistics.stdev(counts) < 700
    assert sum(c < 600 for c in counts) >= 8 and sum(c > 1600 for c in counts) >= 8
    norm = build_synthetic(60, seed=3, lengths=parse_lengths("normal:700,60"), counter=counter)
    counts = [s.input_tokens for s in norm.samples]
    assert 670 < statistics.mean(counts) < 720 and 35 < statistics.stdev(counts) < 90
    assert uni.describe()["input_tokens"]["max"] == max(s.input_tokens for s in uni.samples)


def test_mix_is_allocated_exactly() -> None:
    w = build_synthetic(10, seed=0, mix=parse_mix("qa=0.4,summarization=0.3,generation=0.3", ("qa", "summarization", "generation")),
                        lengths=LengthDistribution("fixed", 128, 128))  # fmt: skip
    assert w.describe()["tasks"] == {"qa": 4, "summarization": 3, "generation": 3}
    w = build_synthetic(8, seed=0, lengths=LengthDistribution("fixed", 128, 128))
    assert set(w.describe()["tasks"]) == {"qa", "summarization", "generation", "classification"}


def test_references_are_answerable_from_the_documents(counter) -> None:
    w = build_synthetic(40, seed=4, lengths=parse_lengths("uniform:128-1024"), counter=counter)
    for s in w.samples:
        if s.task == "qa":
            assert any(a in s.prompt for a in (s.reference, *s.alternatives))  # a span of the document
        elif s.task == "summarization":
            town = s.reference.split(",")[0]
            founded = s.reference.split("founded in ")[1][:4]
            assert f"{town} was founded in {founded}." in s.prompt
        elif s.task == "classification":
            pool = _POSITIVE if s.reference == "positive" else _NEGATIVE
            other = _NEGATIVE if s.reference == "positive" else _POSITIVE
            sentences = [p.format(topic=t) for p in pool for t in _TOPICS]
            wrong = [p.format(topic=t) for p in other for t in _TOPICS]
            assert sum(x in s.prompt for x in sentences) == 2 and not any(x in s.prompt for x in wrong)


# ---- user files ------------------------------------------------------------------------------------


def test_jsonl_with_bad_lines_names_them(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "Say hi.", "reference": "hi"},
        {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 8},
        "{not json",
        {"prompt": "x", "max_tokens": -3},
        {"reference": "no prompt"},
        {
            "context": "Paris is in France.",
            "question": "Where is Paris?",
            "answers": {"text": ["France", "in France"]},
        },
        {"article": "A long story.", "highlights": "Short."},
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(UserError) as err:
        load_workload_file(path)
    message = str(err.value)
    assert "3 bad of 7" in message and "line 3: not valid JSON" in message
    assert "line 4: 'max_tokens'" in message and "line 5: needs 'prompt'" in message
    assert "--skip-bad-lines" in message and "\n" not in message
    warnings: list[str] = []
    w = load_workload_file(path, skip_bad=True, warn=warnings.append)
    assert len(w) == 4 and "skipping 3 bad of 7" in warnings[0]
    tasks = [s.task for s in w.samples]
    assert tasks == ["custom", "custom", "qa", "summarization"]
    assert (
        w.samples[1].messages == ({"role": "user", "content": "Hello?"},) and w.samples[1].max_new_tokens == 8
    )
    assert w.samples[2].reference == "France" and w.samples[2].alternatives == ("in France",)
    assert [r["line"] for r in w.describe()["skipped_records"]] == [3, 4, 5]


def test_hostile_workload_files_are_one_line_errors(tmp_path: Path) -> None:
    """Issue 41: separators inside JSON strings, lone surrogates, NULs, deep nesting, huge CSV fields."""
    from variantbench.workloads.files import MAX_FIELD_CHARS

    # U+2028 and U+0085 are JSON string content, not record separators; CRLF ends a record
    (tmp_path / "sep.jsonl").write_bytes(
        json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False).encode()
        + b"\r\n"
        + b'{"prompt": "d"}\r\n'
    )
    w = load_workload_file(tmp_path / "sep.jsonl")
    assert [s.prompt for s in w.samples] == ["a\u2028b\u0085c", "d"]
    cases = {
        "sur.jsonl": ('{"prompt": "ok"}\n{"messages": [{"role": "user", "content": "x\\ud800"}]}\n',
                      "line 2: 'messages[0].content' is not valid Unicode"),
        "deep.jsonl": ('{"prompt": "x", "extra": ' + "[" * 5000 + "]" * 5000 + "}\n", "line 1: nested more than 64"),
        "deep2.jsonl": ('{"prompt": "x", "extra": ' + "[" * 70 + "]" * 70 + "}\n", "line 1: nested more than 64"),
        "deep.json": ("[" * 100_000 + "]" * 100_000, "nested more than 64"),
        "nul.csv": ("prompt\nab\x00cd\n", "line 2: 'prompt' holds a NUL character"),
        "big.csv": ('prompt\n"' + "x" * (MAX_FIELD_CHARS + 1) + '"\n', "field larger than field limit"),
        "bad.jsonl": (b'{"prompt": "\xff\xfe"}\n', "not UTF-8"),
    }  # fmt: skip
    for name, (content, said) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        with pytest.raises(UserError) as err:
            load_workload_file(path)
        assert said in str(err.value) and "\n" not in str(err.value), (name, str(err.value)[:200])
    # a 200 KB field (over the csv module's own 128 KiB limit) is a fine article
    (tmp_path / "long.csv").write_text('article,highlights\n"' + "word " * 40_000 + '",short\n')
    assert len(load_workload_file(tmp_path / "long.csv").samples) == 1


def test_squad_file_and_cnn_csv(tmp_path: Path) -> None:
    squad = {"data": [{"title": "t", "paragraphs": [{"context": "The sky is blue.", "qas": [
        {"id": "1", "question": "What colour is the sky?", "answers": [{"text": "blue", "answer_start": 11}]},
        {"id": "2", "question": "Unanswerable?", "answers": [], "is_impossible": True},
    ]}]}]}  # fmt: skip
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    w = load_workload_file(tmp_path / "squad.json")
    assert len(w) == 1 and w.samples[0].task == "qa" and w.samples[0].reference == "blue"
    assert "The sky is blue." in w.samples[0].prompt and "What colour" in w.samples[0].prompt
    (tmp_path / "cnn.csv").write_text(
        'id,article,highlights\n1,"Line one.\nLine two.",Short summary.\n2,,Nothing\n'
    )
    with pytest.raises(UserError, match="line 4: 'article' must be a non-empty string"):
        load_workload_file(tmp_path / "cnn.csv")
    w = load_workload_file(tmp_path / "cnn.csv", skip_bad=True)
    assert len(w) == 1 and w.samples[0].task == "summarization" and w.samples[0].reference == "Short summary."
    with pytest.raises(UserError, match="no usable records"):
        (tmp_path / "empty.jsonl").write_text("\n\n")
        load_workload_file(tmp_path / "empty.jsonl")


# ---- metrics ---------------------------------------------------------------------------------------


def test_metrics_agree_with_the_libraries_and_squad() -> None:
    items = [
        Scored("summarization", "the cat sat on the mat", "the cat sat on a mat"),
        Scored("qa", "The Vien River.", "the Vien River", ("Vien River",)),
        Scored("qa", "Ana", "Ana Novak"),
        Scored("classification", "Negative, clearly.", "negative"),
        Scored("classification", "It is positive", "negative"),
        Scored("generation", "", "something"),  # a failed query scores as empty
    ]
    q = summarize_quality(items)
    outs, refs = [i.output for i in items], [i.reference for i in items]
    assert q["bleu"] == pytest.approx(sacrebleu.corpus_bleu(outs, [refs]).score)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    assert q["rougeL"] == pytest.approx(
        sum(scorer.score(r, o)["rougeL"].fmeasure for o, r in zip(outs, refs, strict=True)) / 6
    )
    assert q["exact_match"] == pytest.approx(0.5)  # "The Vien River." normalizes to "vien river"
    assert q["f1"] == pytest.approx((1.0 + 2 * (1 * 0.5) / 1.5) / 2)  # "ana" vs "ana novak": P=1, R=0.5
    assert q["accuracy"] == pytest.approx(0.5)
    assert q["composite"] == pytest.approx(0.5 * q["bleu"] / 100 + 0.5 * q["rougeL"])
    assert exact_match("an apple!", ["Apple"]) == 1.0 and token_f1("red apple", ["green apple"]) == 0.5
    assert label_of("I'd say POSITIVE.") == "positive" and label_of("no idea") is None


def _rec(
    i: int, sample: str, output: str, tokens: int, task: str = "summarization", ref: str = "a b c d"
) -> QueryRecord:
    return QueryRecord(run_id="r", variant="v", scenario="offline", index=i, sample_id=sample, task=task,
                       status="ok", error=None, scheduled_ns=0, issued_ns=0, first_token_ns=1_000_000,
                       completed_ns=10_000_000, input_tokens=5, output_tokens=tokens, token_ms=[1.0] * tokens,
                       output=output, reference=ref)  # fmt: skip


def test_truncated_answers_fail_the_length_gate() -> None:
    full = "the town lies on the river and is known for its bridge"
    std_records = [_rec(i, f"s{i}", full, 12, ref=full) for i in range(6)]
    short = [_rec(i, f"s{i}", " ".join(full.split()[:6]), 6, ref=full) for i in range(6)]
    same = [_rec(i, f"s{i}", full, 12, ref=full) for i in range(6)]
    std = summarize_run("fp32", std_records, Resources(), scenario="offline")
    cut = summarize_run("int8", short, Resources(), scenario="offline")
    ok = summarize_run("bf16", same, Resources(), scenario="offline")
    verdict = compare_to_standard(cut, short, std, std_records)
    assert verdict.gate == "FAIL" and verdict.length_ratio == pytest.approx(0.5)
    assert any("output length" in r for r in verdict.reasons) and any("quality" in r for r in verdict.reasons)
    verdict = compare_to_standard(ok, same, std, std_records)
    assert verdict.gate == "PASS" and verdict.ratio == pytest.approx(1.0) and verdict.agreement_rougeL == 1.0
    assert compare_to_standard(std, std_records, std, std_records).gate == "n/a"
    # the per-task breakdown carries the task's own latency and quality
    assert std.per_task["summarization"].queries == 6 and std.per_task["summarization"].latency_ms.p50 == 10.0
    assert std.per_task["summarization"].output_tokens_per_s == pytest.approx(12 / 0.01)


# ---- the accuracy log ------------------------------------------------------------------------------


def test_accuracy_log_keeps_a_seeded_share() -> None:
    from variantbench.loadgen.harness import LoadSettings, run_scenario
    from variantbench.selftest import NullSystem
    from variantbench.workloads import SyntheticLibrary

    library = SyntheticLibrary(n=20, seed=0, tokens=(16, 32))

    def run(share: float, seed: int = 0) -> list[QueryRecord]:
        settings = LoadSettings(scenario="offline", min_queries=400, max_queries=400, warmup=0,
                                accuracy_share=share, sample_seed=seed)  # fmt: skip
        return run_scenario(NullSystem(), library, settings).records

    records = run(0.25)
    kept = [r for r in records if r.scored]
    assert 70 <= len(kept) <= 130 and all(r.output == "x" for r in kept)
    assert all(r.output == "" for r in records if not r.scored)
    assert [r.scored for r in run(0.25)] == [r.scored for r in records]  # seeded
    assert [r.scored for r in run(0.25, seed=1)] != [r.scored for r in records]
    report = summarize_run("null", records, Resources(), scenario="offline")
    assert report.quality.scored == len(kept)
    assert all(r.scored for r in run(1.0))
