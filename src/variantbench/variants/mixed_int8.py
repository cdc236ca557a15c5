"""Mixed int8/fp32 by measured sensitivity: the Linear layers int8 hurts most stay float32.

``keep-fp32:N[,act=token|tensor]``, a build step before ``int8`` (``smooth+keep-fp32:8+int8:act=token``):
N layers (or a fraction of them when N < 1), ranked by the relative output error of their int8 form
on the workload's calibration prompts, measured with the activation scheme of the int8 step that
follows. The names go into the model config (``variantbench_float_layers``), which ``int8`` honours;
the manifest lists each kept layer with its error and the held-out KL of the int8 model with and
without them. Put it after structural steps: a later ``drop-layers`` renumbers the layers.

Why a ranking and not a threshold: on SmolLM2-135M with per-tensor activations the int8 error is
spread over every down_proj (median 21%, worst 52%), and keeping the worst 24 of 211 layers in
float32 took held-out KL from 1.10 to 0.50 nats; after ``smooth`` with per-token activations the
worst 32 took it from 0.24 to 0.07 (per-tensor). The count is the user's trade of speed for quality.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field
import torch
from torch import nn

from variantbench.errors import UserError
from variantbench.variants.base import EVERY_FAMILY, Recipe, register, split_args
from variantbench.variants.calibration import (
    calibration_batch,
    held_out_windows,
    int8_errors,
    int8_kl,
)
from variantbench.variants.int8 import FLOAT_LAYERS


class KeepFp32(Recipe):
    stage: ClassVar[str] = "build"
    families: ClassVar[frozenset[str] | None] = EVERY_FAMILY
    layers: float = Field(gt=0)
    act: Literal["tensor", "token"] = "token"

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> KeepFp32:
        positional, named = split_args(args)
        wrong = [k for k in named if k not in ("layers", "act")] + positional[1:]
        if wrong or (not positional and "layers" not in named):
            raise UserError(
                f"{kind} takes a count (or fraction) of layers and act=token|tensor, e.g. {kind}:8"
            )
        if positional:
            named["layers"] = positional[0]
        return cls(kind=kind, **named)

    def written(self) -> str:
        count = int(self.layers) if self.layers == int(self.layers) else self.layers
        return f"{self.kind}:{count}" + ("" if self.act == "token" else f",act={self.act}")


def chosen_count(layers: float, total: int) -> int:
    return min(total, int(layers) if layers >= 1 else max(1, math.ceil(layers * total)))


@register("keep-fp32", KeepFp32, "keep the N Linear layers int8 hurts most in float32 (before int8)")
def keep_fp32(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, KeepFp32)
    if ctx is None or not getattr(ctx, "calibration", None):
        raise UserError("keep-fp32 needs calibration text (build it through variantbench)")
    model = model.float().eval()
    per_token = recipe.act == "token"
    ctx.progress("keep-fp32", 0, 2)
    errors = int8_errors(model, calibration_batch(ctx.calibration), per_token)
    if not errors:
        raise UserError("keep-fp32 found no float Linear layers: put it before any quantizing step")
    count = chosen_count(recipe.layers, len(errors))
    kept = errors[:count]
    ctx.progress("keep-fp32", 1, 2)
    windows = held_out_windows(ctx.held_out_ids)
    names = sorted(r["layer"] for r in kept)
    with torch.inference_mode():
        reference = model(windows).logits
    everything = int8_kl(model, reference, windows, per_token)
    mixed = int8_kl(model, reference, windows, per_token, set(names))
    setattr(model.config, FLOAT_LAYERS, names)
    ctx.progress("keep-fp32", 2, 2)
    ctx.notes["keep-fp32"] = {
        "act": recipe.act,
        "kept": kept,
        "of_layers": len(errors),
        "held_out_int8": {
            "kl_all_int8": round(everything[0], 5),
            "top1_all_int8": round(everything[1], 4),
            "kl_mixed": round(mixed[0], 5),
            "top1_mixed": round(mixed[1], 4),
        },
    }
    return model
