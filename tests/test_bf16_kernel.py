"""The engine's bf16 product for a decode step's rows (issue 42): each build this CPU runs, against
float products of the same bf16 numbers, and the engine taking it where it was chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from variantbench import native
from variantbench.backends import bf16_kernel
from variantbench.environment import cpu_flags


def _builds() -> list[tuple[str, tuple[str, ...]]]:
    flags = cpu_flags()
    out = []
    if "avx2" in flags:
        out.append(("AVX2", bf16_kernel.AVX2))
    if "avx512_bf16" in flags:
        out.append(("AVX-512 BF16", bf16_kernel.AVX512_BF16))
    return out


BUILDS = _builds()


@pytest.mark.skipif(not BUILDS, reason="this CPU has neither AVX2 nor AVX-512 BF16")
@pytest.mark.parametrize("isa", [isa for isa, _ in BUILDS])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (40, 96), (130, 64)])
def test_each_build_rounds_float_sums_of_bf16_products(isa: str, n: int, k: int) -> None:
    """K = 96 and 64 take the AVX-512 one-row loop's 32-wide tail; N = 130 splits unevenly over threads."""
    extra = dict(BUILDS)[isa]
    lib, how = native.build("bf16", bf16_kernel.SOURCE, bf16_kernel.BASE_FLAGS + extra)
    assert lib is not None, how
    run = bf16_kernel.Kernel(lib, isa)
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k).to(torch.bfloat16)
        for b in (None, bias):
            got = run(x, weight, b)
            exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            # float32 sums rounded once to bf16: within half a bf16 step (2^-8 relative) of the exact
            # value, as torch's own bf16 product is
            torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-3)


def test_the_engine_takes_the_kernel_where_chosen_and_keeps_its_numbers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model decoded with every projection on the kernel (chosen, not timed: a test must not
    depend on a timing) gives the logits oneDNN gives, within bf16 rounding; the kernel really ran."""
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import Decoder

    run, how = bf16_kernel.kernel()
    if run is None:
        pytest.skip(f"no bf16 kernel here: {how}")
    calls = []
    real = bf16_kernel.Kernel.__call__

    def counted(self, *args):  # noqa: ANN001, ANN202 - the real kernel, its calls counted
        calls.append(args[0].shape[0])
        return real(self, *args)

    monkeypatch.setattr(bf16_kernel.Kernel, "__call__", counted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    decoder = Decoder(model)
    decoder._fused = None  # the operator path (batched steps, other families): fused_decode takes batch 1
    prompt, forced = [1, 5, 9, 14, 3], [7, 2, 8]
    out = {}
    for pick in ("onednn", "kernel"):
        monkeypatch.setattr(bf16_kernel, "CHOICES", _all(decoder, pick))
        calls.clear()
        prefill, steps = decoder.teacher_forced_logits(prompt, forced)
        out[pick] = (prefill, torch.stack(steps))
        assert bool(calls) == (pick == "kernel")
    assert 1 in calls and 5 in calls  # decode steps (one row) and the 5-token prompt
    for a, b in zip(out["kernel"], out["onednn"], strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert "x64: kernel/kernel" in (bf16_kernel.summary() or "")


def _all(decoder, pick: str) -> dict[tuple[int, int], tuple[str, str]]:  # noqa: ANN001
    from variantbench.backends.engine import _DenseT

    shapes = {}
    projections = [decoder.lm_head] + [
        p for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    for proj in projections:
        assert isinstance(proj, _DenseT) and proj.bf16_kernel
        shapes[(proj.out_features, proj.in_features)] = (pick, pick)
    return shapes


def test_off_by_the_environment_the_engine_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARIANTBENCH_BF16_KERNEL", "0")
    monkeypatch.setattr(bf16_kernel, "CHOICES", {})
    bf16_kernel.kernel.cache_clear()
    try:
        assert bf16_kernel.kernel() == (None, "off (VARIANTBENCH_BF16_KERNEL=0)")
        weight = torch.randn(32, 64).to(torch.bfloat16)
        assert bf16_kernel.choice(weight, None, 1) == "onednn"
        assert bf16_kernel.summary() == (
            "bf16 at 1/2-8 rows, chosen per shape by a timing at first use "
            "(off (VARIANTBENCH_BF16_KERNEL=0)): 32x64: onednn/onednn"
        )
    finally:
        bf16_kernel.kernel.cache_clear()


def test_the_diagnosis_files_the_kernels_time_in_their_families(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ctypes call is no torch operator: each kernel names a profiler range while the profiler runs,
    so a bf16 decode step's products, norms and attention are not counted as Python between ops."""
    from transformers import AutoModelForCausalLM

    from variantbench.analysis.diagnosis import profile_decoder
    from variantbench.backends import attention_kernel, norm_kernel
    from variantbench.backends.engine import Decoder

    if None in (bf16_kernel.kernel()[0], norm_kernel.kernel()[0], attention_kernel.kernel()[0]):
        pytest.skip("a kernel is not built here")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    decoder = Decoder(model)
    monkeypatch.setattr(bf16_kernel, "CHOICES", _all(decoder, "kernel"))
    profile = profile_decoder(decoder, prompt_len=6, steps=3)
    ops = {op["op"]: op["family"] for op in profile["top_ops"]}
    assert ops.get("bf16_gemm") == "matmul"
    assert (
        profile["op_ms"]["matmul"] > 0 and profile["op_ms"]["norm"] > 0 and profile["op_ms"]["attention"] > 0
    )
