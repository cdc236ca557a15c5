"""The plan of a run, validated by pydantic. Pure: no environment writes, no network, no probing."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from variantbench.errors import UserError

DEFAULT_VARIANTS = ("fp32", "bf16", "int8")


class RunPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(None, description="HF folder, GGUF file, or None for the bundled default")
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    tasks: PositiveInt = 10
    warmup: int = Field(1, ge=0)
    out: Path = Path("variantbench-out")
    seed: int = Field(0, description="seed of the workload and of the sample order")
    max_new_tokens: PositiveInt | None = Field(None, description="override the tasks' own output caps")
    device: str = "cpu"
    threads: PositiveInt | None = None
    isolate: bool = Field(True, description="run each variant in its own process")

    @field_validator("variants")
    @classmethod
    def _variants(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        cleaned = tuple(v.strip() for v in value if v.strip())
        if not cleaned:
            raise ValueError("at least one variant is required")
        dupes = sorted({v for v in cleaned if cleaned.count(v) > 1})
        if dupes:
            raise ValueError(f"variant listed twice: {', '.join(dupes)}")
        return cleaned

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
        return value

    @property
    def standard(self) -> str:
        return "fp32" if "fp32" in self.variants else self.variants[0]


def make_plan(**kwargs: object) -> RunPlan:
    """Build a plan, turning validation errors into one readable line."""
    try:
        return RunPlan(**kwargs)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "plan"
        raise UserError(f"--{field.replace('_', '-')}: {err['msg']}") from None
