"""The recipes that make int8 keep its quality: per-token activations, smoothing, layers kept in
float32 by measured sensitivity, quantization-aware training. On the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from variantbench.errors import UserError
from variantbench.variants import apply_recipes, parse_variant
from variantbench.variants.build import manifest_of, materialize
from variantbench.variants.calibration import calibration_batch, int8_errors
from variantbench.variants.int8 import FLOAT_LAYERS, Int8Linear
from variantbench.variants.qat import FakeInt8Linear
from variantbench.variants.smooth import smooth_model

IDS = torch.tensor([[5, 17, 33, 8, 91, 44, 12, 7, 150, 3, 66, 21]])


def _load(folder: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


def _outlier_input(rows: int = 6, features: int = 64) -> torch.Tensor:
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(0))
    x[2] *= 80.0  # one outlier token, as an attention sink's row
    return x


def test_per_token_activations_hold_an_outlier_row_that_per_tensor_loses() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = _outlier_input()
    want = linear(x).detach()
    quiet = [0, 1, 3, 4, 5]  # the rows the outlier shares a tensor with

    def error(per_token: bool) -> float:
        got = Int8Linear.from_linear(_copy(linear), per_token)(x)
        return float((got[quiet] - want[quiet]).norm() / want[quiet].norm())

    tensor, token = error(False), error(True)
    assert token < 0.02 and tensor > 3 * token


def _copy(linear: nn.Linear) -> nn.Linear:
    import copy

    return copy.deepcopy(linear)


@pytest.mark.parametrize("per_token", [False, True])
def test_fused_int8_projection_equals_its_parts(per_token: bool) -> None:
    torch.manual_seed(1)
    parts = [
        Int8Linear.from_linear(nn.Linear(64, n, bias=bias), per_token)
        for n, bias in ((32, True), (16, False), (16, True))
    ]
    x = _outlier_input()
    fused = Int8Linear.fuse(parts)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_the_training_fake_quantizer_computes_what_the_kernel_does(per_token: bool) -> None:
    torch.manual_seed(2)
    linear = nn.Linear(64, 32)
    x = _outlier_input(rows=12)  # a prompt's rows: FBGEMM's kernel (a decode step's few run the q8 kernel)
    fake = FakeInt8Linear(_copy(linear), per_token)(x).detach()
    real = Int8Linear.from_linear(_copy(linear), per_token)(x)
    # same grids; only float rounding of the scales differs
    assert float((fake - real).norm() / real.norm()) < 2e-3


def test_engine_fuses_int8_projections_and_decodes_as_the_model(tiny_model_dir: Path) -> None:
    from variantbench.backends.engine import Decoder

    model = apply_recipes(_load(tiny_model_dir), parse_variant("int8:act=token"))
    decoder = Decoder(model)
    assert len(decoder.layers[0].qkv.modules) == 1 and isinstance(
        decoder.layers[0].qkv.modules[0], Int8Linear
    )
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    want = model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    assert decoder.generate(prompt, 6).token_ids[0] == want


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_tied_model_dir"])
def test_smoothing_leaves_the_float_model_unchanged(fixture: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    original = _load(folder)
    model = _load(folder)
    batch = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    batch[:, 3] = 7
    smooth_model(model, batch, alpha=0.65)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # the head's columns were scaled
    assert not torch.equal(
        model.model.layers[0].input_layernorm.weight, original.model.layers[0].input_layernorm.weight
    )
    torch.testing.assert_close(_logits(model), _logits(original), rtol=1e-4, atol=1e-4)


def test_smooth_builds_a_folder_that_reloads_equal_and_reports_the_int8_error(
    tiny_tied_model_dir: Path, tmp_path: Path
) -> None:
    folder = materialize(tiny_tied_model_dir, parse_variant("smooth"), cache=tmp_path)
    torch.testing.assert_close(
        _logits(_load(folder)), _logits(_load(tiny_tied_model_dir)), rtol=1e-4, atol=1e-4
    )
    notes = manifest_of(folder)["notes"]["smooth"]
    assert notes["alpha"] == 0.65 and notes["float_drift"] < 1e-3
    for when in ("int8_error_before", "int8_error_after"):
        summary = notes[when]
        assert set(summary["by_kind"]) >= {"q_proj", "down_proj", "lm_head"}
        assert summary["worst"][0]["int8_error"] >= summary["worst"][-1]["int8_error"] > 0
    assert {"kl_before", "kl_after", "top1_before", "top1_after"} <= set(notes["held_out_int8_token"])


def test_keep_fp32_keeps_the_most_sensitive_layers_in_float(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = materialize(tiny_model_dir, parse_variant("keep-fp32:3"), cache=tmp_path)
    notes = manifest_of(folder)["notes"]["keep-fp32"]
    kept = [r["layer"] for r in notes["kept"]]
    # the three worst of a ranking measured here again, on the same calibration text
    from transformers import AutoTokenizer

    from variantbench.variants.build import _context

    ctx = _context(
        str(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir), 0, tmp_path, lambda *_: None
    )
    ranking = int8_errors(_load(tiny_model_dir), calibration_batch(ctx.calibration), per_token=True)
    assert kept == [r["layer"] for r in ranking[:3]]
    config = json.loads((folder / "config.json").read_text())
    assert sorted(config[FLOAT_LAYERS]) == sorted(kept)
    model = apply_recipes(_load(folder), parse_variant("int8:act=token"))
    modules = dict(model.named_modules())
    assert all(type(modules[name]) is nn.Linear for name in kept)
    others = [m for name, m in modules.items() if isinstance(m, Int8Linear)]
    assert len(others) == notes["of_layers"] - 3 and all(m.per_token for m in others)
    assert notes["held_out_int8"]["kl_mixed"] < notes["held_out_int8"]["kl_all_int8"]


def test_qat_reduces_the_held_out_kl_of_the_int8_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = materialize(tiny_model_dir, parse_variant("qat-int8:steps=100,batch=8,lr=1e-4"), cache=tmp_path)
    manifest = manifest_of(folder)
    held_out = manifest["notes"]["qat-int8"]["held_out_int8"]
    assert held_out["kl_after"] < held_out["kl_before"]
    assert len(json.loads((folder / "qat_loss.json").read_text())["loss"]) == 100
    assert (
        manifest["notes"]["qat-int8"]["seconds_per_step"] > 0
        and manifest["notes"]["qat-int8"]["training_precision"]
    )
    # saved as float weights that the int8 step converts; the lookup table is the original's
    model = _load(folder)
    assert all(type(m) is not FakeInt8Linear for m in model.modules())
    torch.testing.assert_close(
        model.model.embed_tokens.weight, _load(tiny_model_dir).model.embed_tokens.weight
    )


def test_bad_int8_recipe_arguments_are_one_line_errors() -> None:
    for name, message in (("int8:act=channel", "bad parameters"), ("keep-fp32", "takes a count"),
                          ("keep-fp32:0", "bad parameters"), ("smooth:alpha=2", "bad parameters"),
                          ("int8+smooth", "must come before")):  # fmt: skip
        with pytest.raises(UserError, match=message):
            from variantbench.variants.spec import VariantSpec

            VariantSpec.parse(name)


def test_mixed_bf16_keeps_norms_residual_and_logits_in_float32(tiny_model_dir: Path) -> None:
    from variantbench.backends.engine import Decoder
    from variantbench.variants.mixed_precision import Bf16Linear

    model = apply_recipes(_load(tiny_model_dir), parse_variant("mixed-bf16"))
    block = model.model.layers[0]
    assert (
        isinstance(block.self_attn.q_proj, Bf16Linear)
        and block.self_attn.q_proj.weight.dtype == torch.bfloat16
    )
    assert isinstance(block.mlp.down_proj, Bf16Linear)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    for norm in (block.input_layernorm, block.post_attention_layernorm, model.model.norm):
        assert norm.weight.dtype == torch.float32
    seen: dict[str, torch.dtype] = {}
    hooks = [
        module.register_forward_hook(
            lambda _m, inp, out, name=name: seen.update(
                {name: (out[0] if isinstance(out, tuple) else out).dtype}
            )
        )
        for name, module in (
            ("norm", block.input_layernorm),
            ("residual", block),
            ("q_proj", block.self_attn.q_proj),
            ("final_norm", model.model.norm),
            ("logits", model.lm_head),
        )  # fmt: skip
    ]
    logits = _logits(model)
    for h in hooks:
        h.remove()
    assert set(seen.values()) == {torch.float32} and len(seen) == 5 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, _logits(_load(tiny_model_dir)), rtol=0.05, atol=0.05)
    decoder = Decoder(model)
    assert (
        isinstance(decoder.layers[0].qkv.modules[0], Bf16Linear) and len(decoder.layers[0].qkv.modules) == 1
    )
    want = model.generate(IDS[:, :8], max_new_tokens=4, do_sample=False)[0, 8:].tolist()
    assert decoder.generate([IDS[0, :8].tolist()], 4).token_ids[0] == want


def test_training_runs_in_bf16_only_where_the_hardware_has_it() -> None:
    from variantbench.variants.distill import autocast_bf16
    from variantbench.variants.mixed_precision import bf16_hardware

    cpu = torch.device("cpu")
    native, why = bf16_hardware(cpu)
    on, said = autocast_bf16("auto", cpu)
    assert on == native and (said.startswith("bf16") if native else why in said)
    assert autocast_bf16("fp32", cpu) == (False, "fp32 (asked)")
    assert autocast_bf16("bf16", cpu)[0] is True


@pytest.mark.parametrize("per_token", [False, True])
def test_a_decode_steps_rows_run_the_q8_kernel_close_to_fbgemm(per_token: bool) -> None:
    """The few rows of a decode step go to the AVX2 q8 kernel where it is built and timed faster for
    the shape; its products stay within int8's error of FBGEMM's and of float, weights at -128 too."""
    from variantbench.variants import int8, q8_kernel

    run, how = q8_kernel.kernel()
    if run is None:
        pytest.skip(f"no q8 kernel here: {how}")
    torch.manual_seed(3)
    linear = nn.Linear(576, 96)
    with torch.no_grad():
        linear.weight[0, 0] = -4.0  # the row's largest magnitude, negative: its int8 is -128 in FBGEMM's grid
    module = Int8Linear.from_linear(_copy(linear), per_token)
    assert module.inner.weight().int_repr().min() == -128
    int8.Q8_CHOICES[(96, 576)] = (
        "q8"  # as the timing would choose here (not timed: a test must not depend on it)
    )
    fbgemm = Int8Linear.from_linear(_copy(linear), per_token)
    fbgemm._q8 = False
    for rows in (1, 3, 8) if per_token else (1,):
        x = torch.randn(rows, 576)
        with torch.no_grad():
            got, want, theirs = module(x), linear(x), fbgemm(x)
        assert module._q8_path() is not None
        error = float((got - want).norm() / want.norm())  # row 0's -4.0 coarsens its grid: ~2.7% here
        assert (
            error < 1.5 * float((theirs - want).norm() / want.norm()) + 0.005
        )  # FBGEMM's 7-bit rows err more
        assert error < 0.04
    assert "96x576: q8" in (int8.kernel_summary() or "")


def test_without_the_q8_kernel_int8_keeps_fbgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from variantbench.variants import int8, q8_kernel

    monkeypatch.setenv("VARIANTBENCH_Q8_KERNEL", "0")
    q8_kernel.kernel.cache_clear()
    monkeypatch.setattr(int8, "Q8_CHOICES", {})
    try:
        assert q8_kernel.kernel() == (None, "off (VARIANTBENCH_Q8_KERNEL=0)")
        module = Int8Linear.from_linear(nn.Linear(64, 32), True)
        x = torch.randn(1, 64)
        assert module._q8_path() is None and int8.Q8_CHOICES == {(32, 64): "fbgemm"}
        torch.testing.assert_close(module(x), module.inner(x / x.abs().amax()) * x.abs().amax() + module.bias)
    finally:
        q8_kernel.kernel.cache_clear()
