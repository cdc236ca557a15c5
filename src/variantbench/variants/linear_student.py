"""The linear-attention student: ``linear-attn[:layers=all|A-B,features=F,transfer_steps=,steps=,...]``.

Attention in the chosen layers becomes linear attention with Hedgehog feature maps
(``linear_attention.py``), trained in LoLCATs' two stages (Zhang et al., 2024):

1. attention transfer: only the feature maps learn, every layer at once, to reproduce the softmax
   attention outputs of the teacher's own stream (mean squared error), the rest frozen;
2. logit distillation: the converted layers' feature maps and q/k/v/o projections learn from the
   fp32 teacher's logits with distill's loop (``train_to_teacher``).

Decoding then keeps, per converted layer and KV head, a state of ``2F x head_dim`` floats in place
of a KV cache that grows with the context (the engine's recurrent form). The manifest records the
loss of every step (``linear_attn_loss.json``) and the held-out KL against the teacher right after
the swap, after the transfer and after distillation: it does not hide what the conversion costs.

Saved as a Hugging Face folder plus the config entry ``variantbench_linear_attention``; loading
puts the modules back (``restore``), since transformers' Llama knows nothing of them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
import random
from typing import Any, ClassVar

from pydantic import Field, field_validator
import torch
from torch import nn

from variantbench.errors import UserError
from variantbench.variants.base import Recipe, keyword_args, register, restorer
from variantbench.variants.calibration import held_out_windows
from variantbench.variants.distill import Precision, _windows, held_out_kl, train_to_teacher
from variantbench.variants.linear_attention import LinearAttention

CONFIG_KEY = "variantbench_linear_attention"


class LinearAttn(Recipe):
    stage: ClassVar[str] = "build"
    # its attention keeps split q/k/v/o and has no q/k norms (qwen3, gemma3, olmo2) nor a fused qkv_proj (phi3)
    families: ClassVar[frozenset[str] | None] = frozenset(
        {"llama", "mistral", "qwen2", "gemma2", "granite", "qwen2_moe", "mixtral"}
    )
    layers: str = "all"
    features: int = Field(64, ge=2, le=1024)
    transfer_steps: int = Field(40, ge=0, le=100_000)
    transfer_lr: float = Field(1e-2, gt=0, lt=10)
    steps: int = Field(40, ge=0, le=100_000)
    lr: float = Field(1e-4, gt=0, lt=1)
    temperature: float = Field(1.0, gt=0)
    seq: int = Field(128, ge=8, le=4096)
    batch: int = Field(2, ge=1, le=256)
    precision: ClassVar[Precision] = "auto"  # distillation's autocast: bf16 where the hardware has it

    @field_validator("layers")
    @classmethod
    def _layers(cls, value: str) -> str:
        if value != "all":
            first, sep, last = value.partition("-")
            if not first.isdigit() or (sep and not last.isdigit()) or (sep and int(last) < int(first)):
                raise ValueError("layers is 'all', one layer (5) or a range (8-29)")
        return value

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> LinearAttn:
        allowed = (
            "layers",
            "features",
            "transfer_steps",
            "transfer_lr",
            "steps",
            "lr",
            "temperature",
            "seq",
            "batch",
        )
        return cls(kind=kind, **keyword_args(kind, args, allowed))

    def chosen(self, total: int) -> list[int]:
        if self.layers == "all":
            return list(range(total))
        first, _, last = self.layers.partition("-")
        chosen = list(range(int(first), int(last or first) + 1))
        if chosen[-1] >= total:
            raise UserError(
                f"linear-attn: layer {chosen[-1]} asked for, the model has {total} (0-{total - 1})"
            )
        return chosen


def install(model: nn.Module, layers: list[int], features: int) -> list[LinearAttention]:
    """Swap the attention of ``layers`` for linear attention (projections shared, maps new)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    made = []
    for i in layers:
        block = model.model.layers[i]
        if isinstance(block.self_attn, LinearAttention):
            raise UserError(f"linear-attn: layer {i} is linear already")
        block.self_attn = LinearAttention(block.self_attn, heads, kv_heads, features)
        made.append(block.self_attn)
    setattr(config, CONFIG_KEY, {"layers": list(layers), "features": features})
    return made


@restorer
def restore(model: nn.Module, folder: str | Path) -> nn.Module:
    """Put the linear attention of a built folder back into a freshly loaded Llama."""
    spec = getattr(model.config, CONFIG_KEY, None)
    if not spec:
        return model
    from safetensors.torch import load_file

    install(model, list(spec["layers"]), int(spec["features"]))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update({k: v for k, v in load_file(str(f)).items() if ".feature_" in k})
    wanted = {k for k in model.state_dict() if ".feature_" in k}
    if wanted - set(state):
        raise UserError(f"{folder}: linear attention weights missing ({sorted(wanted - set(state))[0]})")
    model.load_state_dict(state, strict=False)
    return model


def _transfer(model: nn.Module, made: list[LinearAttention], ctx: Any, recipe: LinearAttn) -> list[float]:
    params = [p for m in made for p in (*m.feature_q.parameters(), *m.feature_k.parameters())]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=recipe.transfer_lr, weight_decay=0.0)
    steps = recipe.transfer_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, steps)))
    )
    rng = random.Random(ctx.seed + 3)
    losses: list[float] = []
    for m in made:
        m.transfer = True
    try:
        for step in range(steps):
            batch = _windows(ctx.distill_ids, recipe.seq, recipe.batch, rng)
            model(batch)
            loss = torch.stack([m.transfer_loss for m in made]).sum()  # type: ignore[misc]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item() / len(made))
            ctx.progress("linear-attn transfer", step + 1, steps)
    finally:
        for m in made:
            m.transfer, m.transfer_loss = False, None
    return losses


@register(
    "linear-attn",
    LinearAttn,
    "linear attention (Hedgehog maps) in chosen layers, trained from the teacher (layers=,features=)",
)
def linear_attn(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, LinearAttn)
    if ctx is None or not getattr(ctx, "teacher_dir", None) or not getattr(ctx, "distill_ids", None):
        raise UserError("linear-attn needs the teacher and training text (build it through variantbench)")
    from transformers import AutoModelForCausalLM

    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise UserError(f"linear-attn needs a Llama-style model (got {type(model).__name__})")
    model = model.float().eval()
    layers = recipe.chosen(len(model.model.layers))
    teacher = AutoModelForCausalLM.from_pretrained(ctx.teacher_dir, dtype=torch.float32).eval()
    held_out = held_out_windows(ctx.held_out_ids, rows=4, length=recipe.seq)
    made = install(model, layers, recipe.features)
    kl_swapped = held_out_kl(model, teacher, held_out)
    transfer = _transfer(model, made, ctx, recipe) if recipe.transfer_steps else []
    kl_transfer = held_out_kl(model, teacher, held_out)
    for p in model.parameters():
        p.requires_grad_(False)
    for m in made:
        for p in m.parameters():
            p.requires_grad_(True)
    model.train()
    training = train_to_teacher(model, teacher, ctx, recipe, "linear-attn distill") if recipe.steps else None
    distilled = training.losses if training else []
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    kl_after = held_out_kl(model, teacher, held_out)
    Path(ctx.artifact_dir, "linear_attn_loss.json").write_text(
        json.dumps({"transfer_mse": transfer, "distill_kl": distilled})
    )
    ctx.notes["linear-attn"] = {
        "layers": layers,
        "features": recipe.features,
        "state_floats_per_layer": model.config.num_key_value_heads * 2 * recipe.features * made[0].head_dim,
        "held_out_kl_swapped": kl_swapped,
        "held_out_kl_after_transfer": kl_transfer,
        "held_out_kl_after": kl_after,
        "transfer_first": transfer[0] if transfer else None,
        "transfer_last": transfer[-1] if transfer else None,
        "distill_first": distilled[0] if distilled else None,
        "distill_last": distilled[-1] if distilled else None,
        "loss_curve": "linear_attn_loss.json",
        **(training.notes() if training else {}),
    }
    del teacher
    return model
