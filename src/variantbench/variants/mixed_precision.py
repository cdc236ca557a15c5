"""Mixed precision: bf16 matmuls, everything else in float32 (``mixed-bf16``).

Every Linear of the decoder blocks keeps a bfloat16 weight and computes in bfloat16; its input is
rounded to bf16 on the way in and its output returned as float32. The embeddings, RMSNorms, the
residual stream, attention's softmax (it reads the float32 q/k/v) and the output projection (the
logits) stay float32: the rounding lands only where bf16 hardware pays for it, unlike ``bf16``,
which rounds the residual stream at every layer.

It pays only where the hardware has bf16 matrix instructions (AVX-512 BF16 or AMX on x86, CUDA);
elsewhere oneDNN runs bf16 through a slow path: on this project's AVX2 CPU, ``bf16`` decoded at
5.9 tokens/s against 17.5 for fp32. The recipe still runs there, so the report can show the cost,
and its caveat (printed at load, kept in the run's details) says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
import torch.nn.functional as F

from variantbench.devices import AMPERE_BF16, DeviceNeed
from variantbench.variants.base import EVERY_FAMILY, Recipe, register
from variantbench.variants.int8 import joined_biases


def bf16_hardware(device: torch.device) -> tuple[bool, str]:
    """(whether bf16 matmuls are native here, what decided it)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name(device)}" + ("" if ok else " without bf16")
    from variantbench.environment import cpu_flags

    flags = [f for f in cpu_flags() if "bf16" in f]
    ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and bool(flags)
    return ok, f"CPU with {', '.join(flags)}" if ok else (
        f"this CPU has no bf16 matrix instructions (AVX-512 BF16 or AMX; torch reports "
        f"{torch.backends.cpu.get_cpu_capability()}): bf16 matmuls run through a slow path"
    )


class MixedBf16(Recipe):
    weight_format: ClassVar[str] = "bfloat16 matmuls; float32 norms, residual, softmax, logits"
    families: ClassVar[frozenset[str] | None] = EVERY_FAMILY
    devices: ClassVar[DeviceNeed] = AMPERE_BF16

    def caveat(self, device: torch.device) -> str | None:
        ok, why = bf16_hardware(device)
        return None if ok else f"mixed-bf16: {why}"


class Bf16Linear(nn.Module):
    """A Linear computing in bfloat16 between float32 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = self.weight.shape

    @classmethod
    def fuse(cls, modules: Sequence[Bf16Linear]) -> Bf16Linear:
        """One module computing ``cat([m(x) for m in modules], -1)`` in one matmul."""
        if len(modules) == 1:
            return modules[0]
        bias = joined_biases([m.bias for m in modules], modules)
        return cls(torch.cat([m.weight for m in modules]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y.add_(self.bias)


@register("mixed-bf16", MixedBf16, "bf16 matmuls with float32 norms, residual stream, softmax and logits")
def to_mixed_bf16(model: nn.Module, recipe: Recipe) -> nn.Module:
    model = model.to(torch.float32)
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, Bf16Linear(child.weight, child.bias))
    return model
