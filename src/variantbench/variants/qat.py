"""Quantization-aware training for the int8 that follows: ``qat-int8[:steps=,lr=,act=,...]``.

A build step before ``int8`` (``smooth+qat-int8+int8:act=token``): every Linear that int8 will
quantize computes, during training, on fake-quantized weights and activations (straight-through
gradients), and the model is trained on KL(teacher || student) against the fp32 teacher's logits
with distill's loop (``train_to_teacher``). What is saved is float32 weights that round well: the
``int8`` step converts them. The held-out KL of the converted int8 model before and after, and the
loss of every step (``qat_loss.json``), go into the manifest.

The fake quantizer copies the kernel the variant runs on, not a generic one: FBGEMM's dynamic
linear quantizes activations to 7 bits (``reduce_range``) over the tensor's [min, max] (with
``act=token`` each row is first scaled to an absolute maximum of 1), and weights per output channel
symmetrically to int8 with scale max|w| / 127.5 (torch's per-channel observer). torchao's QAT
configs round on other grids (8-bit per-token), so they would train for a kernel we do not run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field
import torch
from torch import nn
import torch.nn.functional as F

from variantbench.errors import UserError
from variantbench.variants.base import EVERY_FAMILY, Recipe, keyword_args, register
from variantbench.variants.calibration import held_out_windows, int8_kl, linears
from variantbench.variants.distill import Precision, train_to_teacher
from variantbench.variants.int8 import FLOAT_LAYERS


class QatInt8(Recipe):
    stage: ClassVar[str] = "build"
    families: ClassVar[frozenset[str] | None] = EVERY_FAMILY
    steps: int = Field(40, ge=1, le=100_000)
    lr: float = Field(1e-5, gt=0, lt=1)
    temperature: float = Field(1.0, gt=0)
    seq: int = Field(128, ge=8, le=4096)
    batch: int = Field(2, ge=1, le=256)
    act: Literal["tensor", "token"] = "token"
    precision: Precision = "auto"

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> QatInt8:
        return cls(
            kind=kind,
            **keyword_args(kind, args, ("steps", "lr", "temperature", "seq", "batch", "act", "precision")),
        )


def _straight_through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return x + (q - x).detach()


def fake_activations(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """FBGEMM's dynamic activation rounding: the step of 7-bit affine over [min(x, 0), max(x, 0)] of
    the tensor (after each row is scaled to an absolute maximum of 1 when per token), stored in 8
    bits: the maximum may round to 128, which a clamp at 127 would cut (measured: 0.5% output
    error against the kernel with the clamp, 0.04% without)."""
    row = x.detach().abs().amax(-1, keepdim=True).clamp(min=1e-12) if per_token else None
    v = x / row if row is not None else x
    lo, hi = v.detach().min().clamp(max=0), v.detach().max().clamp(min=0)
    scale = ((hi - lo) / 127).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    q = (torch.clamp(torch.round(v / scale) + zero, 0, 255) - zero) * scale
    q = _straight_through(v, q)
    return q * row if row is not None else q


def fake_weight(w: torch.Tensor) -> torch.Tensor:
    scale = (w.detach().abs().amax(1, keepdim=True) / 127.5).clamp(min=1e-12)
    return _straight_through(w, torch.clamp(torch.round(w / scale), -128, 127) * scale)


class FakeInt8Linear(nn.Module):
    """A Linear that computes as its int8 form will (see the module docstring); same parameters."""

    def __init__(self, linear: nn.Linear, per_token: bool) -> None:
        super().__init__()
        self.linear, self.per_token = linear, per_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            fake_activations(x, self.per_token), fake_weight(self.linear.weight), self.linear.bias
        )


def _swap(model: nn.Module, kind: type[nn.Module], make: Any, keep: set[str]) -> None:
    """Every child module of exactly ``kind`` not named in ``keep`` becomes ``make(child)``."""
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, FakeInt8Linear):
            continue
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is kind and full not in keep:
                setattr(parent, child_name, make(child))


@register(
    "qat-int8", QatInt8, "quantization-aware training against the fp32 teacher, for the int8 that follows"
)
def qat_int8(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, QatInt8)
    if ctx is None or not getattr(ctx, "teacher_dir", None) or not getattr(ctx, "distill_ids", None):
        raise UserError("qat-int8 needs the teacher and training text (build it through variantbench)")
    from transformers import AutoModelForCausalLM

    model = model.float().eval()
    if not any(True for _ in linears(model)):
        raise UserError("qat-int8 found no float Linear layers: put it before any quantizing step")
    teacher = AutoModelForCausalLM.from_pretrained(ctx.teacher_dir, dtype=torch.float32).eval()
    if teacher.config.vocab_size != model.config.vocab_size:
        raise UserError("qat-int8: the model and the teacher must share a vocabulary")
    per_token = recipe.act == "token"
    keep = set(getattr(model.config, FLOAT_LAYERS, None) or ())
    windows = held_out_windows(ctx.held_out_ids, length=recipe.seq)
    with torch.inference_mode():
        reference = teacher(windows).logits
    before = int8_kl(model, reference, windows, per_token, keep)
    head, embed = model.lm_head, model.model.embed_tokens
    if head.weight is embed.weight:  # the head learns its own rounding; the lookup table stays put
        head.weight = nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    embed.weight.requires_grad_(False)
    _swap(model, nn.Linear, lambda lin: FakeInt8Linear(lin, per_token), keep)
    model.train()
    training = train_to_teacher(model, teacher, ctx, recipe, "qat-int8")
    losses = training.losses
    _swap(model, FakeInt8Linear, lambda fake: fake.linear, set())
    model.eval()
    embed.weight.requires_grad_(True)
    after = int8_kl(model, reference, windows, per_token, keep)
    curve = {"steps": recipe.steps, "lr": recipe.lr, "temperature": recipe.temperature, "loss": losses}
    Path(ctx.artifact_dir, "qat_loss.json").write_text(json.dumps(curve))
    ctx.notes["qat-int8"] = {
        "act": recipe.act,
        "held_out_int8": {
            "kl_before": round(before[0], 5),
            "top1_before": round(before[1], 4),
            "kl_after": round(after[0], 5),
            "top1_after": round(after[1], 4),
        },
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_curve": "qat_loss.json",
        **training.notes(),
    }
    del teacher
    return model
