"""The plan of a run, validated by pydantic. Pure: no environment writes, no network, no probing."""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

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
    endpoint: str | None = Field(None, description="measure a running OpenAI-compatible server instead")
    endpoint_model: str | None = None
    api: str = Field("completions", pattern="^(completions|chat)$")
    request_timeout: float = Field(120.0, gt=0)
    scenario: str = "single-stream"
    rate: float | None = Field(None, gt=0, description="server: target queries/s")
    burstiness: float = Field(1.0, gt=0, description="server: gamma shape of the arrival gaps; 1.0 = Poisson")
    max_concurrency: PositiveInt | None = None
    samples_per_query: PositiveInt = 4
    min_queries: PositiveInt | None = Field(None, description="default: --tasks")
    max_queries: PositiveInt | None = None
    min_duration: float = Field(0.0, ge=0)
    max_duration: float | None = Field(None, gt=0)
    latency_target_ms: float | None = Field(None, gt=0)
    ttft_target_ms: float | None = Field(None, gt=0)
    tpot_target_ms: float | None = Field(None, gt=0)
    latency_percentile: float = Field(99.0, gt=0, lt=100)
    window: PositiveInt = 50
    schedule_seed: int = 0
    max_batch_size: PositiveInt = 8
    find_peak: bool = False
    device: str = "cpu"
    threads: PositiveInt | None = None
    isolate: bool = Field(True, description="run each variant in its own process")
    # workload and quality (issue 4)
    workload: Path | None = Field(
        None, description="JSONL / JSON (SQuAD) / CSV (CNN) file instead of synthetic"
    )
    skip_bad_lines: bool = False
    mix: str | None = Field(
        None, description="synthetic task mix, e.g. qa=0.4,summarization=0.3,generation=0.3"
    )
    input_lengths: str = Field("uniform:128-2048", description="synthetic input lengths in tokens")
    tokenizer: str | None = Field(None, description="tokenizer folder to count lengths (endpoint runs)")
    quality_threshold: float = Field(99.0, gt=0, le=100, description="gate: % of the standard's quality")
    length_tolerance: float = Field(10.0, ge=0, le=100, description="gate: mean output length within ±%")
    accuracy_log: float = Field(1.0, gt=0, le=1, description="share of timed queries whose output is scored")
    accuracy_only: bool = False
    fidelity: bool = True
    fidelity_text: Path | None = None
    # resources, cost and the decision (analysis/)
    repeats: PositiveInt = Field(1, description="run each variant N times: mean and CI across runs")
    diagnose: bool = Field(True, description="profile each variant and measure batch efficiency")
    cold_start: bool = Field(True, description="measure start-to-first-token in a fresh process")
    cost_per_hour: float = Field(0.10, ge=0, description="hardware cost per device-hour")
    devices: PositiveInt = 1
    currency: str = "USD"
    energy_price_kwh: float = Field(0.15, ge=0)
    watts_per_core: float = Field(10.0, gt=0, description="energy estimate where RAPL/NVML are missing")
    scenario_profile: str | None = Field(None, description="edge | cloud | latency | batch")
    need_p99_ms: float | None = Field(None, gt=0)
    need_memory_mb: float | None = Field(None, gt=0)
    need_quality: float | None = Field(None, gt=0, le=100, description="% of the standard's quality")
    need_qps: float | None = Field(None, gt=0)
    need_build_s: float | None = Field(None, ge=0)
    need_no_gpu: bool = False

    @field_validator("scenario_profile")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        from variantbench.analysis.recommend import PROFILES

        if value is not None and value not in PROFILES:
            raise ValueError(f"unknown scenario profile {value!r}; known: {', '.join(PROFILES)}")
        return value

    def cost_model(self):  # noqa: ANN201 - analysis.cost.CostModel
        from variantbench.analysis.cost import CostModel

        return CostModel(cost_per_hour=self.cost_per_hour, devices=self.devices, currency=self.currency,
                         energy_price_kwh=self.energy_price_kwh, watts_per_core=self.watts_per_core)  # fmt: skip

    def custom_scenario(self):  # noqa: ANN201 - analysis.recommend.Scenario, or None
        """The scenario given by the --need-* constraints, or None when none was given."""
        from variantbench.analysis.recommend import Scenario

        if not any((self.need_p99_ms, self.need_memory_mb, self.need_quality, self.need_qps,
                    self.need_build_s is not None, self.need_no_gpu)):  # fmt: skip
            return None
        return Scenario(
            name="custom",
            description="the constraints given on the command line",
            p99_latency_ms=self.need_p99_ms,
            memory_budget_bytes=int(self.need_memory_mb * 1e6) if self.need_memory_mb else None,
            gpu=not self.need_no_gpu,
            quality_floor=self.need_quality / 100 if self.need_quality else None,
            build_budget_s=self.need_build_s,
            min_qps=self.need_qps,
        )

    @field_validator("mix")
    @classmethod
    def _mix(cls, value: str | None) -> str | None:
        if value is not None:
            from variantbench.workloads import TASKS, parse_mix

            parse_mix(value, TASKS)
        return value

    @field_validator("input_lengths")
    @classmethod
    def _lengths(cls, value: str) -> str:
        from variantbench.workloads import parse_lengths

        parse_lengths(value)
        return value

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

    @field_validator("scenario")
    @classmethod
    def _scenario(cls, value: str) -> str:
        from variantbench.loadgen.harness import SCENARIOS

        if value not in SCENARIOS:
            raise ValueError(f"unknown scenario {value!r}; known: {', '.join(SCENARIOS)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RunPlan:
        if self.scenario == "server" and self.rate is None:
            raise ValueError("the server scenario needs --rate (queries/s)")
        if self.find_peak and (self.scenario != "server" or not self.latency_target_ms):
            raise ValueError("--find-peak needs --scenario server, a starting --rate and --latency-target-ms")
        if self.max_queries is not None and self.max_queries < (self.min_queries or self.tasks):
            raise ValueError("--max-queries is below the minimum number of queries")
        if self.max_duration is not None and self.max_duration < self.min_duration:
            raise ValueError("--max-duration is below --min-duration")
        if self.workload is not None and self.mix is not None:
            raise ValueError("--mix shapes the synthetic workload; a --workload file brings its own tasks")
        if self.accuracy_only and self.find_peak:
            raise ValueError("--accuracy-only scores every sample once, untimed: it has no peak to find")
        return self

    @property
    def standard(self) -> str:
        return "fp32" if "fp32" in self.variants else self.variants[0]


def make_plan(**kwargs: object) -> RunPlan:
    """Build a plan, turning validation errors into one readable line."""
    try:
        return RunPlan(**kwargs)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise UserError(f"--{field.replace('_', '-')}: {message}" if field else message) from None
