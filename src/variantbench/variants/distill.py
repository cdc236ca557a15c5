"""Knowledge distillation: a reduced student learns the standard teacher's next-token distributions.

``distill[:steps=N,lr=X,temperature=T,seq=S,batch=B]``, after structural recipes in a chain
(``prune-heads:0.3+drop-layers:10+distill``). Loss: KL(teacher || student) of the temperature-
softened distributions, times T^2 (Hinton et al.), on windows of text from the workload generator
(seeded; a different seed from the calibration prompts). AdamW, a linear warm-up then cosine decay,
a fixed step budget: CPU-feasible in minutes. The loss of every step is saved beside the artifact
(``distill_loss.json``), and the held-out KL against the teacher before and after goes into the
variant's manifest, so the report can show what distillation recovered.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
import math
from pathlib import Path
import random
import time
from typing import Any, ClassVar, Literal, Protocol

from pydantic import Field
import torch
from torch import nn
import torch.nn.functional as F

from variantbench.errors import UserError
from variantbench.variants.base import EVERY_FAMILY, Recipe, keyword_args, register

Precision = Literal["auto", "fp32", "bf16"]


class Distill(Recipe):
    stage: ClassVar[str] = "build"
    families: ClassVar[frozenset[str] | None] = EVERY_FAMILY
    # defaults sized for a 2-core CPU: 256 tokens a step, a few minutes for a 135M model
    steps: int = Field(60, ge=1, le=100_000)
    lr: float = Field(2e-4, gt=0, lt=1)
    temperature: float = Field(2.0, gt=0)
    seq: int = Field(128, ge=8, le=4096)
    batch: int = Field(2, ge=1, le=256)
    precision: Precision = "auto"

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> Distill:
        values = keyword_args(kind, args, ("steps", "lr", "temperature", "seq", "batch", "precision"))
        return cls(kind=kind, **values)


def _windows(ids: list[int], seq: int, n: int, rng: random.Random) -> torch.Tensor:
    if len(ids) <= seq + 1:
        raise UserError(f"distillation text has {len(ids)} tokens, fewer than one window of {seq}")
    starts = [rng.randrange(0, len(ids) - seq) for _ in range(n)]
    return torch.tensor([ids[s : s + seq] for s in starts])


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    t = temperature
    return (
        F.kl_div(
            F.log_softmax(student_logits.float() / t, -1).flatten(0, -2),
            F.log_softmax(teacher_logits.float() / t, -1).flatten(0, -2),
            log_target=True,
            reduction="batchmean",
        )
        * t
        * t
    )


def held_out_kl(student: nn.Module, teacher: nn.Module, batch: torch.Tensor) -> float:
    with torch.inference_mode():
        return float(kl_loss(student(batch).logits, teacher(batch).logits, 1.0))


class TrainingSettings(Protocol):
    steps: int
    lr: float
    temperature: float
    seq: int
    batch: int
    precision: Precision


@dataclass
class Training:
    losses: list[float]
    precision: str  # what ran, and why
    seconds_per_step: float

    def notes(self) -> dict[str, Any]:
        return {"training_precision": self.precision, "seconds_per_step": round(self.seconds_per_step, 4)}


def autocast_bf16(choice: Precision, device: torch.device) -> tuple[bool, str]:
    """Whether training runs its forward in bf16 (autocast; fp32 master weights and optimizer), and why.
    ``auto``: where the hardware has bf16 matrix instructions; on an AVX2 CPU bf16 matmuls are slower."""
    from variantbench.variants.mixed_precision import bf16_hardware

    if choice == "fp32":
        return False, "fp32 (asked)"
    native, why = bf16_hardware(device)
    if choice == "bf16":
        return True, "bf16 autocast, fp32 master weights (asked)" + ("" if native else f"; {why}")
    return native, "bf16 autocast, fp32 master weights" if native else f"fp32 ({why})"


def train_to_teacher(
    student: nn.Module, teacher: nn.Module, ctx: Any, settings: TrainingSettings, label: str
) -> Training:
    """AdamW on KL(teacher || student) over windows of the build's training text, a linear warm-up
    then cosine decay, gradients clipped at 1, in mixed precision where the hardware pays for it.
    Shared by distill, qat-int8 and linear-attn."""
    device = next(student.parameters()).device
    bf16, precision = autocast_bf16(settings.precision, device)
    rng = random.Random(ctx.seed + 1)
    torch.manual_seed(ctx.seed + 1)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    warmup = max(1, settings.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, settings.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(settings.steps):
        batch = _windows(ctx.distill_ids, settings.seq, settings.batch, rng)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                teacher_logits = teacher(batch).logits
            student_logits = student(batch).logits
        loss = kl_loss(student_logits, teacher_logits, settings.temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        ctx.progress(label, step + 1, settings.steps)
    return Training(losses, precision, (time.perf_counter() - started) / max(1, settings.steps))


@register("distill", Distill, "train the reduced student on the teacher's logits (steps=,lr=,temperature=)")
def distill(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, Distill)
    if ctx is None or not getattr(ctx, "teacher_dir", None) or not getattr(ctx, "distill_ids", None):
        raise UserError("distill needs the teacher and training text (build it through variantbench)")
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(ctx.teacher_dir, dtype=torch.float32).eval()
    if teacher.config.vocab_size != model.config.vocab_size:
        raise UserError("distill: the student and the teacher must share a vocabulary")
    held_out = _windows(ctx.held_out_ids, recipe.seq, 4, random.Random(ctx.seed + 2))
    before = held_out_kl(model, teacher, held_out)
    student = model.float().train()
    training = train_to_teacher(student, teacher, ctx, recipe, "distill")
    losses = training.losses
    student.eval()
    after = held_out_kl(student, teacher, held_out)
    curve = {"steps": recipe.steps, "temperature": recipe.temperature, "lr": recipe.lr, "loss": losses}
    Path(ctx.artifact_dir, "distill_loss.json").write_text(json.dumps(curve))
    ctx.notes["distill"] = {
        "held_out_kl_before": before,
        "held_out_kl_after": after,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_curve": "distill_loss.json",
        **training.notes(),
    }
    del teacher
    return student
