"""The fused float32 and bf16 decode steps (issue 42): transformers' logits, the operator path's tokens, and the
torch path wherever the kernel does not compute a model exactly."""

from __future__ import annotations

import pytest
import torch

from variantbench.backends import fused_decode
from variantbench.backends.engine import Decoder
from variantbench.models.tiny import tiny_config, tiny_model

VOCAB = 400


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    fn, how = fused_decode.kernel()
    if fn is None:
        pytest.skip(f"no fused decode kernel here: {how}")


def _forget() -> None:
    """The next decoder builds its kernels anew (under the test's CPU flags or switch)."""
    for cached in (fused_decode.kernel, fused_decode._library, fused_decode.row_product):
        cached.cache_clear()


def _counted(dec: Decoder, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = dec._fused.step  # type: ignore[union-attr]
    monkeypatch.setattr(dec._fused, "step", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("tie", [False, True])
def test_a_qwen2_shaped_model_with_biases_decodes_as_transformers(
    tie: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Biased QKV, grouped heads, tied or untied head: each fused step's logits within 1e-4 of
    transformers' (teacher-forced), the greedy tokens equal, and the fused step really ran."""
    model = tiny_model(tiny_config("qwen2", VOCAB, use_sliding_window=False, tie_word_embeddings=tie), seed=5)
    dec = Decoder(model)
    assert dec._fused is not None, dec.fused_how
    assert any(layer.qkv.bias is not None for layer in dec.layers)  # type: ignore[attr-defined]
    calls = _counted(dec, monkeypatch)
    prompt = list(range(3, 20))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    want = out.sequences[0, len(prompt) :].tolist()
    _, steps = dec.teacher_forced_logits(prompt, want)
    diff = max((a - b).abs().max().item() for a, b in zip(steps[1:], out.logits[1:], strict=True))
    assert diff < 1e-4
    assert len(calls) == len(want) - 1
    assert dec.generate([prompt], 12).token_ids[0] == want
    assert "one C call" in dec.batch1_step


def test_the_fused_and_operator_paths_agree_past_the_first_rope_table() -> None:
    """A prompt that crosses the 256 positions the first rotary table holds: the tables grow and the
    kernel is pointed at the new ones; the tokens equal the operator path's."""
    model = tiny_model(tiny_config("llama", VOCAB), seed=2)
    dec = Decoder(model)
    prompt = [7 + (i * 13) % 350 for i in range(250)]
    fused = dec.generate([prompt], 20).token_ids
    dec._fused = None
    assert dec.generate([prompt], 20).token_ids == fused


def test_batches_masks_and_one_weight_copy_take_the_operator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(tiny_config("llama", VOCAB), seed=4)
    dec = Decoder(model)
    calls = _counted(dec, monkeypatch)
    alone = [dec.generate([p], 8).token_ids[0] for p in ([5, 6, 7, 8], [9, 10])]
    assert len(calls) == 14
    assert dec.generate([[5, 6, 7, 8], [9, 10]], 8).token_ids == alone  # a padded batch: masked
    assert len(calls) == 14
    dec.drop_plain_copies()  # a server's one packed copy: the kernel reads the plain one
    assert dec._fused is None and "operator by operator" in dec.batch1_step
    assert dec.generate([[5, 6, 7, 8]], 8).token_ids[0] == alone[0]


@pytest.mark.parametrize(
    ("family", "overrides", "why"),
    [("gemma2", {}, "not SiLU"), ("qwen3", {}, "q/k norms"), ("phi3", {"sliding_window": None}, "partial"), ("granite", {}, "residual scale")],
)  # fmt: skip
def test_what_the_kernel_does_not_compute_stays_on_the_operator_path(
    family: str, overrides: dict, why: str
) -> None:
    dec = Decoder(tiny_model(tiny_config(family, VOCAB, **overrides)))
    assert dec._fused is None and why in dec.fused_how


def _builds() -> list[tuple[str, tuple[str, ...]]]:
    from variantbench.backends import bf16_kernel
    from variantbench.environment import cpu_flags

    flags, out = cpu_flags(), []
    if "avx512_bf16" in flags:
        out.append(("AVX-512 BF16", bf16_kernel.AVX512_BF16))
    if "avx2" in flags:
        out.append(("AVX2", bf16_kernel.AVX2))
    return out


@pytest.mark.parametrize("build", _builds(), ids=lambda b: b[0])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_bf16_step_rounds_where_the_operator_path_rounds(
    build: tuple[str, tuple[str, ...]], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 (each build this CPU runs): every step's logits as the operator path's within a bf16
    rounding of a few of them (measured: equal bit for bit on AVX-512 BF16), the same greedy tokens."""
    from variantbench.backends import bf16_kernel

    monkeypatch.setattr(bf16_kernel, "isa", lambda: build)
    _forget()
    try:
        overrides = {"use_sliding_window": False} if family == "qwen2" else {}
        dec = Decoder(tiny_model(tiny_config(family, VOCAB, **overrides), seed=3).to(torch.bfloat16))
        assert dec._fused is not None and build[0] in dec.fused_how
        prompt = list(range(3, 30))
        with torch.inference_mode():
            tokens = dec.generate([prompt], 24).token_ids[0]
            _, fused = dec.teacher_forced_logits(prompt, tokens)
            dec._fused = None
            _, ops = dec.teacher_forced_logits(prompt, tokens)
            assert dec.generate([prompt], 24).token_ids[0] == tokens
        for a, b in zip(fused, ops, strict=True):
            assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item()
    finally:
        _forget()


@pytest.mark.parametrize(("family", "per_token"), [("llama", True), ("qwen2", True), ("llama", False)])
def test_int8_projections_decode_as_the_q8_operator_path(
    family: str, per_token: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 (q8) weights in a float32 model: the step quantizes each product's input row as the q8
    kernel does, so its logits are the operator path's (q8 chosen for every shape there) but where a
    float32 rounding flips one quantized activation, whose key then stays in the cache (measured: 0 to
    1e-6 for most steps, 0.1 of 4.9 once in 24 on the biased model); the same greedy tokens."""
    from variantbench.environment import cpu_flags
    from variantbench.variants import int8

    if "avx2" not in cpu_flags():
        pytest.skip("the q8 product needs AVX2")
    monkeypatch.setattr(int8, "q8_choice", lambda module: "q8")
    overrides = {"use_sliding_window": False} if family == "qwen2" else {}
    model = int8.quantize_linears(tiny_model(tiny_config(family, VOCAB, **overrides), seed=3), per_token)
    dec = Decoder(model)
    assert dec._fused is not None and "int8 (q8) weights" in dec.fused_how
    calls = _counted(dec, monkeypatch)
    prompt = list(range(3, 30))
    with torch.inference_mode():
        tokens = dec.generate([prompt], 24).token_ids[0]
        _, fused = dec.teacher_forced_logits(prompt, tokens)
        assert len(calls) == 23 + 23
        dec._fused = None
        _, ops = dec.teacher_forced_logits(prompt, tokens)
        assert dec.generate([prompt], 24).token_ids[0] == tokens
    for a, b in zip(fused, ops, strict=True):
        assert (a - b).abs().max().item() <= 0.03 * b.abs().max().item()


def test_fp16_and_the_switch_keep_the_operator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(tiny_config("llama", VOCAB)).to(torch.float16)
    assert Decoder(model)._fused is None
    monkeypatch.setenv("VARIANTBENCH_FUSED_DECODE", "0")
    _forget()
    try:
        dec = Decoder(tiny_model(tiny_config("llama", VOCAB)))
        assert dec._fused is None and "VARIANTBENCH_FUSED_DECODE=0" in dec.fused_how
    finally:
        _forget()


def test_families_the_step_does_not_take_use_its_row_product_at_one_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gemma2 (GELU, soft-caps) decodes operator by operator; its float32 one-row projections run
    through the fused library's row product (test_families holds their logits to transformers')."""
    rows: list[int] = []
    real = fused_decode.RowProduct.__call__
    monkeypatch.setattr(
        fused_decode.RowProduct, "__call__", lambda self, x, w, b: rows.append(1) or real(self, x, w, b)
    )
    dec = Decoder(tiny_model(tiny_config("gemma2", VOCAB)))
    assert dec._fused is None
    dec.generate([[5, 6, 7]], 4)
    # 3 decode steps (4 projections a layer), and the head at each of them and after the prompt
    assert len(rows) == 3 * 4 * len(dec.layers) + 4
