"""Dynamic int8: int8 weights, activations quantized per batch, on every Linear layer.

API choice, by measurement on this project's CPU (AVX2, no VNNI): ``torch.ao.quantization.
quantize_dynamic`` (FBGEMM kernels) is deprecated but still shipped, and it was the only PyTorch
int8 path faster than fp32 at decode; torchao's int8 configs ran slower than fp32 here. It runs on
the CPU only. Weights are quantized per output channel (``per_channel_dynamic_qconfig``): with
one scale per tensor, this model's answers on 400+ token prompts fell apart (repetition, empty
answers) in our check; per channel degraded far less at the same speed (the quality columns show what is
still lost). The embedding table stays float32 (quantize_dynamic does not touch it); a tied output
projection gets its own int8 copy (the float table stays for lookups).
"""

from __future__ import annotations

from typing import ClassVar
import warnings

import torch
from torch import nn

from variantbench.errors import UserError
from variantbench.variants.base import Recipe, register


class Int8Dynamic(Recipe):
    weight_format: ClassVar[str] = "int8"


@register("int8", Int8Dynamic, "dynamic int8 weights and activations on Linear layers (CPU, FBGEMM)")
def to_int8(model: nn.Module, recipe: Recipe) -> nn.Module:
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise UserError("int8 (dynamic quantization) runs on the CPU only; use --device cpu")
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    model = model.to(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice, once per module
        from torch.ao.quantization import per_channel_dynamic_qconfig

        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )
