"""Floating-point precision variants: the fp32 standard, and bf16 / fp16 weights and activations.

On CPUs without native bf16/fp16 matrix units (AVX2 only, as on our CI machine) these halve the
bytes read per decoded token but run prefill through slower kernels: the report keeps prefill and
decode speeds apart, and records ``torch.backends.cpu.get_cpu_capability()``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from variantbench.devices import AMPERE_BF16, DeviceNeed
from variantbench.variants.base import Recipe, register


class Fp32(Recipe):
    weight_format: ClassVar[str] = "float32"


class Bf16(Recipe):
    weight_format: ClassVar[str] = "bfloat16"
    devices: ClassVar[DeviceNeed] = AMPERE_BF16


class Fp16(Recipe):
    weight_format: ClassVar[str] = "float16"


@register("fp32", Fp32, "the standard: float32 weights and activations")
def to_fp32(model: nn.Module, recipe: Recipe) -> nn.Module:
    return model.to(torch.float32)


@register("bf16", Bf16, "bfloat16 weights and activations")
def to_bf16(model: nn.Module, recipe: Recipe) -> nn.Module:
    return model.to(torch.bfloat16)


@register("fp16", Fp16, "float16 weights and activations")
def to_fp16(model: nn.Module, recipe: Recipe) -> nn.Module:
    return model.to(torch.float16)
