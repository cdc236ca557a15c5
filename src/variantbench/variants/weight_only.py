"""Weight-only quantization with torchao: int8-wo and int4-wo (activations float32 on the CPU, bf16 on CUDA).

``quantize_(model, Int8WeightOnlyConfig())`` swaps every Linear weight for torchao's Int8Tensor;
matmuls dequantize on the fly. A tied output projection is untied first, so the embedding table stays
a float lookup. ``int4-wo`` asks for torchao's default int4 weight-only config; here (torchao 0.18,
AVX2 CPU) it needs the ``mslk`` package and its CPU kernel AVX-512/AMX, so the recipe fails with a
message that names what is missing, and the run keeps the variant's row as failed with that reason.
torchao is the ``torchao`` extra (in ``dev``).
"""

from __future__ import annotations

from typing import ClassVar
import warnings

import torch
from torch import nn

from variantbench.devices import DeviceNeed
from variantbench.errors import UserError
from variantbench.variants.base import Recipe, register


class Int8WeightOnly(Recipe):
    weight_format: ClassVar[str] = "int8 weight-only (torchao)"


class Int4WeightOnly(Recipe):
    weight_format: ClassVar[str] = "int4 weight-only (torchao)"
    devices: ClassVar[DeviceNeed] = DeviceNeed(
        min_capability=(8, 0), for_what="tinygemm's int4 kernel, Ampere and newer"
    )


def _torchao(what: str = "weight-only variants"):  # noqa: ANN202 - the module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization as q
    except ImportError:
        raise UserError(f"{what} needs torchao: pip install 'variantbench[torchao]'") from None
    return q


def _untie(model: nn.Module) -> None:
    """Give a tied output projection its own weight, so the embedding table stays a float lookup."""
    head, embed = (
        getattr(model, "lm_head", None),
        getattr(getattr(model, "model", None), "embed_tokens", None),
    )
    if head is not None and embed is not None and head.weight is embed.weight:
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)


@register("int8-wo", Int8WeightOnly, "int8 weight-only on Linear layers (torchao), float activations")
def to_int8_wo(model: nn.Module, recipe: Recipe) -> nn.Module:
    q = _torchao()
    # float32 activations on the CPU (its bf16 products are slow without AMX); bf16 on CUDA
    cuda = next(model.parameters()).device.type == "cuda"
    model = model.to(torch.bfloat16 if cuda else torch.float32)
    _untie(model)
    q.quantize_(model, q.Int8WeightOnlyConfig())
    return model


@register(
    "int4-wo", Int4WeightOnly, "int4 weight-only on Linear layers (torchao; needs a working int4 kernel)"
)
def to_int4_wo(model: nn.Module, recipe: Recipe) -> nn.Module:
    q = _torchao()
    device = next(model.parameters()).device
    try:
        model = model.to(torch.bfloat16)
        _untie(model)
        # CUDA: tinygemm's tile-packed layout; the default (plain) needs the mslk/fbgemm-genai kernels
        packing = {"int4_packing_format": "tile_packed_to_4d"} if device.type == "cuda" else {}
        q.quantize_(model, q.Int4WeightOnlyConfig(group_size=32, **packing))
        probe = next(m for m in model.modules() if isinstance(m, nn.Linear))
        probe(torch.zeros(1, probe.in_features, dtype=torch.bfloat16, device=device))
    except Exception as exc:  # noqa: BLE001 - any kernel or import failure means: no int4 path here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"int4-wo: torchao has no int4 weight-only kernel that runs on this {device.type} "
            f"({type(exc).__name__}: {first[:120]}; its CPU int4 kernel needs AVX-512/AMX, this CPU has "
            f"{torch.backends.cpu.get_cpu_capability()})"
        ) from None
    return model
