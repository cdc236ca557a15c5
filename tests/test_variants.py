"""Recipes change what they claim: dtype, module types, bytes; unknown names list the known ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from variantbench.errors import UserError
from variantbench.variants import apply_recipes, known_kinds, parse_variant, weight_format
from variantbench.variants.measure import param_bytes


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_fp32_bytes_are_four_per_parameter(tiny_model_dir) -> None:
    model = apply_recipes(_load(tiny_model_dir), parse_variant("fp32"))
    n_params = sum(p.numel() for p in model.parameters())
    assert param_bytes(model) == 4 * n_params


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_halves_bytes(tiny_model_dir, name: str, dtype: torch.dtype) -> None:
    fp32_bytes = param_bytes(_load(tiny_model_dir))
    model = apply_recipes(_load(tiny_model_dir), parse_variant(name))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert param_bytes(model) == fp32_bytes // 2
    assert weight_format(parse_variant(name)) == str(dtype).replace("torch.", "")


def test_int8_quantizes_every_linear(tiny_model_dir) -> None:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    base = _load(tiny_model_dir)
    n_linear = sum(isinstance(m, nn.Linear) for m in base.modules())
    fp32_bytes = param_bytes(base)
    embed_bytes = base.get_input_embeddings().weight.numel() * 4
    model = apply_recipes(base, parse_variant("int8"))
    quantized = [m for m in model.modules() if isinstance(m, DynamicLinear)]
    assert len(quantized) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert quantized[0].weight().dtype == torch.qint8
    # int8 Linear weights (1 byte each + per-channel scales) plus the float embedding table and norms
    linear_fp32 = fp32_bytes - embed_bytes
    assert embed_bytes + linear_fp32 / 4 < param_bytes(model) < embed_bytes + linear_fp32 / 2


def test_int8_decodes_close_to_fp32(tiny_model_dir) -> None:
    from variantbench.backends.engine import Decoder

    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    fp32 = Decoder(_load(tiny_model_dir)).generate(prompt, 8).token_ids[0]
    int8 = (
        Decoder(apply_recipes(_load(tiny_model_dir), parse_variant("int8"))).generate(prompt, 8).token_ids[0]
    )
    assert int8[:3] == fp32[:3]  # quantization noise may flip later tokens, not the first ones


def test_unknown_variant_lists_known_kinds() -> None:
    with pytest.raises(UserError) as err:
        parse_variant("int3")
    message = str(err.value)
    assert "unknown variant 'int3'" in message
    for kind in ("fp32", "bf16", "fp16", "int8"):
        assert kind in message
    assert set(known_kinds()) >= {"fp32", "bf16", "fp16", "int8"}


def test_parameters_on_a_kind_without_parameters_are_rejected() -> None:
    with pytest.raises(UserError, match="takes no parameters"):
        parse_variant("bf16:4")


def test_recipe_chain_parses_in_order() -> None:
    chain = parse_variant("fp32+int8")
    assert [r.kind for r in chain] == ["fp32", "int8"]
    assert weight_format(chain) == "int8"
