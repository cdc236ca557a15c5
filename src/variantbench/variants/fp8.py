"""fp8: float8 (e4m3) weights and activations on every Linear but the output projection (issue 43).

The GPU user's cheapest precision on Ada and Hopper: ``torch._scaled_mm`` multiplies e4m3 operands
on the fp8 tensor cores (compute capability 8.9 and up) and returns bf16. Written on torch's own op,
not torchao's config, so the device check runs with only the torch a GPU machine has.

Scales: weights per output row, activations per token (each row's absolute maximum over 448, e4m3's
largest value), as torchao's ``PerRow``. cuBLAS computes row-wise scales on Hopper (9.0); on Ada
(8.9) the product takes one scale per tensor, so there the weight gets one scale and each call's
activations one. The output projection stays bf16 (vLLM and torchao leave it so: its logits decide
every token). q/k/v and gate/up are fused into one product each (``Fp8Linear.fuse``), as the
engine fuses its dense layers. On a CPU the same op runs (torch emulates e4m3): tokens, quality and
parity are real there, speed is not, and the variant says so (``caveat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from variantbench.devices import DeviceNeed
from variantbench.variants.base import Recipe, register
from variantbench.variants.int8 import joined_biases

E4M3_MAX = 448.0
ALIGN = 16  # cuBLAS's fp8 products want both matrix dimensions a multiple of 16


class Fp8(Recipe):
    weight_format: ClassVar[str] = "float8 e4m3 weights and activations (scaled), bf16 output projection"
    devices: ClassVar[DeviceNeed] = DeviceNeed(
        min_capability=(8, 9), for_what="fp8 tensor cores, Ada and Hopper"
    )

    def caveat(self, device: Any) -> str | None:
        if device.type == "cpu":
            return "fp8 on the CPU: torch emulates e4m3 products (no fp8 instructions); tokens and quality are real, speed is not"
        return None


def row_wise(device: torch.device) -> bool:
    """Whether ``_scaled_mm`` takes a scale per row on ``device`` (CPU and Hopper) or one per tensor (Ada)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (9, 0)


def quantize(t: torch.Tensor, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [M, K] as e4m3 and its float32 scales ([M, 1] per row, or a [] per tensor)."""
    t = t.float()
    amax = t.abs().amax(-1, keepdim=True) if rows else t.abs().amax()
    scale = amax.clamp(min=1e-12) / E4M3_MAX
    return (t / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` and each call's ``x`` in e4m3, out in ``out_dtype``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, rows: bool,
                 out_dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K] e4m3, row-major (its .t() is column-major)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.to(out_dtype), requires_grad=False)
        self.rows, self.out_dtype = rows, out_dtype
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, rows: bool, out_dtype: torch.dtype = torch.bfloat16) -> Fp8Linear:
        with torch.no_grad():
            weight, scale = quantize(linear.weight.detach(), rows)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, rows, out_dtype)

    @classmethod
    def fuse(cls, modules: Sequence[Fp8Linear]) -> Fp8Linear:
        """One product for several (q/k/v, gate/up); row-wise scales only (a tensor's one scale differs)."""
        if len(modules) == 1 or not all(m.rows for m in modules):
            return modules[0] if len(modules) == 1 else _Joined(modules)  # type: ignore[return-value]
        bias = joined_biases([m.bias for m in modules], modules)
        return cls(torch.cat([m.weight for m in modules]), torch.cat([m.scale for m in modules]),
                   bias, True, modules[0].out_dtype)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q, scale = quantize(x.reshape(-1, self.in_features), self.rows)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.scale.t() if self.rows else self.scale,
                             bias=self.bias, out_dtype=self.out_dtype)  # fmt: skip
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


class _Joined(nn.Module):
    """Per-tensor fp8 layers that cannot share one product: called in turn, outputs joined."""

    def __init__(self, modules: Sequence[Fp8Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)


@register("fp8", Fp8, "float8 e4m3 weights and activations, scaled (torch._scaled_mm; CUDA 8.9+)")
def to_fp8(model: nn.Module, recipe: Recipe) -> nn.Module:
    model = model.to(torch.bfloat16)
    device = next(model.parameters()).device
    rows = row_wise(device)
    head = getattr(model, "lm_head", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not head and \
                    child.in_features % ALIGN == 0 and child.out_features % ALIGN == 0:  # fmt: skip
                setattr(parent, name, Fp8Linear.from_linear(child, rows))
    return model
