"""The decode loop against transformers' own greedy generate, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from variantbench.backends.engine import Decoder

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


def _reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_tied_model_dir"])
def test_batched_decode_matches_generate(fixture: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [_reference(model, p, 24) for p in PROMPTS]
    decoder = Decoder(model)
    batched = decoder.generate(PROMPTS, 24)  # left-padded batch of three lengths
    assert batched.token_ids == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert decoder.generate([prompt], 24).token_ids[0] == want  # and one at a time


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_tied_model_dir"])
def test_one_weight_copy_decodes_the_same_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """``serve``'s default layout: each layer keeps only its packed weights, for every row count."""
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), dtype=torch.float32).eval()
    expected = [_reference(model, p, 16) for p in PROMPTS]
    decoder = Decoder(model)
    del model
    if not torch.backends.mkldnn.is_available():
        assert decoder.drop_plain_copies() == 0  # nothing packed: the plain copy is the only one
        return
    plain = sum(
        p.weight.numel() * 4
        for layer in decoder.layers
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    assert decoder.drop_plain_copies() == plain
    assert all(p.weight is None and p.packed is not None
               for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))  # fmt: skip
    assert decoder.lm_head.weight is not None  # the head keeps the copy tied embeddings look up
    assert decoder.generate(PROMPTS, 16).token_ids == expected  # several rows
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert decoder.generate([prompt], 16).token_ids[0] == want  # one row
    assert decoder.drop_plain_copies() == 0


def test_timings_are_ordered_and_positive(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = Decoder(model).generate(PROMPTS, [5, 9, 16])
    assert [len(t) for t in out.token_ids] == [5, 9, 16]
    assert out.prefill_ns > 0
    for timing, tokens in zip(out.timings, out.token_ids, strict=True):
        assert len(timing.token_ns) == len(tokens)
        assert timing.start_ns < timing.token_ns[0]
        assert all(b > a for a, b in zip(timing.token_ns, timing.token_ns[1:], strict=False))
        assert timing.end_ns == timing.token_ns[-1]


def test_stop_token_ends_one_sequence_not_the_batch(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    decoder = Decoder(model)
    free = decoder.generate(PROMPTS, 12).token_ids
    stop = free[0][3]  # the 4th token of the first sequence becomes a stop id
    out = decoder.generate(PROMPTS, 12, stop_ids=[stop])
    first = free[0].index(stop) + 1
    assert out.token_ids[0] == free[0][:first]
    for got, full in zip(out.token_ids[1:], free[1:], strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]


def test_empty_prompt_is_rejected(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="empty prompt"):
        Decoder(model).generate([[]], 4)


def test_reduced_precision_prompts_run_in_fp32_where_the_cpu_has_no_instructions_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 42: bf16 on an AVX2 CPU took oneDNN's slow path (a 512-token prompt 7x fp32's time);
    from UPCAST_MIN_ROWS rows the projection is computed in fp32 and gives bf16 out, the same values."""
    from variantbench.backends import engine

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    for native in (False, True):
        monkeypatch.setattr(engine, "native_on_cpu", lambda _dtype, n=native: n)
        dense = engine._DenseT([linear])
        assert dense.upcast_rows == (None if native else engine.UPCAST_MIN_ROWS)
        for rows in (1, engine.UPCAST_MIN_ROWS, 64):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            out = dense(x)
            want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
