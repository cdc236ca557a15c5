"""Which backend runs a model, which recipes apply to it, and the transformers fallback end to end.

The fallback's model is a real architecture the engine does not register (GPT-2: learned positions,
LayerNorm, a fused c_attn): the backend, its timings and its serving batch are checked against
transformers' own greedy decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from variantbench.backends.base import GenerationRequest
from variantbench.errors import UserError
from variantbench.models.tiny import build_tiny, tiny_model, tiny_tokenizer
from variantbench.variants.spec import VariantSpec
from variantbench.variants.support import check_support, kinds_for


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    tok = tiny_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)  # fmt: skip
    model = tiny_model(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("gemma2", tmp_path_factory.mktemp("gemma2"))


def test_the_registry_picks_our_engine_for_a_family_and_the_fallback_otherwise(gpt2_dir, gemma2_dir) -> None:  # noqa: ANN001
    from variantbench.backends.registry import FALLBACK_BACKEND, TORCH_BACKEND, backend_path

    assert backend_path(VariantSpec.parse("int8"), str(gemma2_dir)) == TORCH_BACKEND
    assert backend_path(VariantSpec.parse("int8"), str(gpt2_dir)) == FALLBACK_BACKEND


def test_a_recipe_a_family_cannot_take_is_refused_in_one_line_naming_what_applies(
    gpt2_dir, gemma2_dir
) -> None:  # noqa: ANN001
    with pytest.raises(
        UserError, match=r"smooth cannot transform family gemma2; recipes that apply: .*drop-layers"
    ):
        check_support(VariantSpec.parse("smooth+int8").recipes, gemma2_dir, "smooth+int8")
    with pytest.raises(UserError, match=r"drop-layers cannot transform model type 'gpt2' \(no engine family"):
        check_support(VariantSpec.parse("drop-layers:1").recipes, gpt2_dir, "drop-layers:1")
    check_support(VariantSpec.parse("bf16").recipes, gpt2_dir, "bf16")  # plain-module recipes apply anywhere
    yes, no = kinds_for(None)
    assert {"fp32", "bf16", "int8", "compile"} <= set(yes) and {
        "smooth",
        "prune-heads",
        "linear-attn",
    } <= set(no)
    assert "smooth" in kinds_for("qwen3")[0] and "smooth" in kinds_for("gemma3")[1]


def _hf_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_fallback_decodes_as_transformers_with_a_stamp_per_token_and_serves_one_request_at_a_time(
    gpt2_dir: Path,
) -> None:
    from variantbench.backends.registry import make_backend
    from variantbench.serving.batching import batch_for

    backend = make_backend(VariantSpec.parse("fp32"), None, str(gpt2_dir))
    info = backend.load().details
    try:
        assert info["backend"] == "transformers" and info["engine_fast_paths"] is False
        assert any("transformers fallback" in c for c in info["caveats"])
        prompts = [[5, 9, 14, 30, 8, 8], [40, 41, 42]]
        backend._stop_ids = ()  # run to max_new_tokens, as transformers' reference below
        from variantbench.backends.base import Encoded

        requests = [GenerationRequest(f"r{i}", prompt="x", max_new_tokens=12) for i in range(2)]
        results = backend.generate_encoded(requests, [Encoded(ids, None, 0, 0) for ids in prompts])
        for result in results:
            assert result.status == "ok" and result.output_tokens == 12
            assert len(result.token_ns) == 12 and result.first_token_ns == result.token_ns[0]
            assert all(b > a for a, b in zip(result.token_ns, result.token_ns[1:], strict=False))
            assert result.start_ns < result.first_token_ns
        want = _hf_greedy(gpt2_dir, prompts[0], 12)
        direct = backend.token_log_probs(prompts[0] + want)
        assert direct.shape[0] == len(prompts[0]) + 12
        assert direct[len(prompts[0]) - 1 :].argmax(-1).tolist()[:12] == want
        batch = batch_for(backend, max_batch=8, max_len=256)
        assert batch.max_batch == 1 and "one request at a time" in batch.describe()
        first, done = batch.join("a", prompts[0], 12, stops=frozenset())
        got = [first]
        while not done:
            ((_, token, done),) = batch.step()
            got.append(token)
        assert got == want
        with pytest.raises(RuntimeError, match="full"):
            batch.join("b", prompts[1], 4)
        batch.leave("a")
        assert batch.active == 0
    finally:
        backend.close()


def test_variants_command_says_which_recipes_apply_and_which_backend_runs_the_model(
    gpt2_dir, gemma2_dir
) -> None:  # noqa: ANN001
    from variantbench.cli import app

    out = CliRunner().invoke(app, ["variants", "--model", str(gemma2_dir)])
    assert out.exit_code == 0, out.output
    assert "run by our engine (family gemma2)" in out.output and "do not apply: " in out.output
    assert "smooth" in out.output.split("do not apply: ")[1]
    out = CliRunner().invoke(app, ["variants", "--model", str(gpt2_dir)])
    assert out.exit_code == 0 and "the transformers fallback" in out.output
    refused = CliRunner().invoke(app, ["run", "--model", str(gpt2_dir), "--variants", "fp32,prune-heads:0.5",
                                       "--tasks", "1", "--out", str(gpt2_dir.parent / "refused")])  # fmt: skip
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "prune-heads cannot transform model type 'gpt2'" in refused.output
