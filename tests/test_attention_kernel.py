"""The engine's decode-step attention kernel (issue 42) against torch's SDPA, and the engine taking it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from variantbench.backends import attention_kernel


@pytest.fixture(scope="module")
def run() -> attention_kernel.Kernel:
    kernel, how = attention_kernel.kernel()
    if kernel is None:
        pytest.skip(f"no attention kernel here: {how}")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bsz", "heads", "group", "d", "n"), [(1, 3, 3, 64, 1), (1, 3, 3, 64, 300), (2, 4, 1, 16, 33),
                                                              (3, 2, 4, 24, 9)])  # fmt: skip
def test_the_kernel_attends_as_sdpa_does(
    run, dtype: torch.dtype, bsz: int, heads: int, group: int, d: int, n: int
) -> None:  # noqa: ANN001
    """Keys and values read in place from a cache view (spare heads and positions around them)."""
    torch.manual_seed(n + d)
    cache = (torch.randn(2, bsz, heads + 1, n + 7, d) * 2).to(dtype)
    keys, values = cache[0, :, :heads, :n], cache[1, :, :heads, :n]
    q = (torch.randn(bsz, heads, group, d) * 2).to(dtype)
    assert attention_kernel.usable(q, keys, values)
    exact = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), scale=0.3)
    got = run(q, keys, values, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    else:  # float32 inside, one rounding to bf16: as close as SDPA's own bf16 result
        sdpa = F.scaled_dot_product_attention(q, keys, values, scale=0.3).float()
        assert (got.float() - exact).abs().max() <= 1.5 * (sdpa - exact).abs().max() + 1e-3


def test_the_kernel_refuses_what_it_cannot_read(run) -> None:  # noqa: ANN001
    q = torch.randn(1, 2, 2, 8)
    keys = torch.randn(1, 2, 5, 8)
    assert attention_kernel.usable(q, keys, keys)
    assert not attention_kernel.usable(q.half(), keys.half(), keys.half())  # fp16: SDPA
    assert not attention_kernel.usable(q, keys.transpose(-1, -2).contiguous().transpose(-1, -2), keys)
    assert not attention_kernel.usable(q, keys[:, :, :0], keys[:, :, :0])


def test_the_engine_decodes_through_it_with_sdpas_numbers(
    run, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """A tiny GQA Llama's decode steps with the kernel and with SDPA: the same logits within float32
    rounding, the same greedy tokens; the kernel really ran (a prompt and a compiled step never take it)."""
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import Decoder

    calls = []
    real = attention_kernel.Kernel.__call__

    def counted(self, q, *args):  # noqa: ANN001, ANN202 - the real kernel, its calls counted
        calls.append(tuple(q.shape))
        return real(self, q, *args)

    monkeypatch.setattr(attention_kernel.Kernel, "__call__", counted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    decoder = Decoder(model)
    decoder._fused = None  # the operator path (batched steps, other families): fused_decode takes batch 1
    assert decoder._attn_kernel is not None
    prompt, forced = [1, 5, 9, 14, 3], [7, 2, 8, 4]
    with_kernel = decoder.teacher_forced_logits(prompt, forced)
    tokens = decoder.generate([prompt], 6).token_ids
    assert calls and all(shape == (1, 2, 2, 16) for shape in calls)  # 2 KV heads, 2 queries each
    decoder._attn_kernel = None
    calls.clear()
    with_sdpa = decoder.teacher_forced_logits(prompt, forced)
    assert not calls
    torch.testing.assert_close(with_kernel[0], with_sdpa[0], rtol=0, atol=0)  # the prompt: SDPA both times
    torch.testing.assert_close(torch.stack(with_kernel[1]), torch.stack(with_sdpa[1]), rtol=1e-5, atol=1e-5)
    assert decoder.generate([prompt], 6).token_ids == tokens
