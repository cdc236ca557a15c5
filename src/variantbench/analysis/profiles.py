"""The deployment profiles as data: the constraints one kind of deployment puts on a variant.

A profile is a set of constraints, one per dimension of the seeds' matrix:

* latency sensitivity: P99 latency at most ``p99_latency_ms``, or at most ``p99_vs_standard`` x the
  standard's P99 (measured on this machine, so the profile travels between machines);
* resource constraint: peak resident memory at most ``memory_budget_bytes``; ``gpu`` False = the
  variant must run without a GPU;
* task complexity: quality at least ``quality_floor`` x the standard's (composite score on the
  same samples), and optionally per task (``task_floors``);
* update frequency: the variant's build time at most ``build_budget_s`` (a model that is re-trained
  often cannot wait for a long distillation);
* throughput need: at least ``min_qps`` queries/s, or ``min_throughput_vs_standard`` x the standard's
  output tokens/s.

Called "profiles", not "scenarios": a scenario is a load pattern (single-stream, server, ...).
Pure data, so the plan can name and validate profiles without importing any measuring code.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    p99_latency_ms: float | None = Field(None, gt=0)
    p99_vs_standard: float | None = Field(None, gt=0)
    memory_budget_bytes: int | None = Field(None, gt=0)
    gpu: bool = True  # False: must run without a GPU
    quality_floor: float | None = Field(None, ge=0)  # x the standard's composite quality
    task_floors: dict[str, float] = Field(default_factory=dict)  # task -> x the standard's task score
    build_budget_s: float | None = Field(None, ge=0)
    min_qps: float | None = Field(None, gt=0)
    min_throughput_vs_standard: float | None = Field(None, gt=0)


GIB = 1 << 30
PROFILES: dict[str, Profile] = {
    "edge": Profile(
        name="edge",
        description="edge device: no GPU, 1 GiB of memory, quality within 10% of the standard",
        memory_budget_bytes=GIB,
        gpu=False,
        quality_floor=0.90,
    ),
    "cloud": Profile(
        name="cloud",
        description="cloud service under frequent model updates: standard quality (99%), builds under 10 min",
        quality_floor=0.99,
        build_budget_s=600,
    ),
    "latency": Profile(
        name="latency",
        description="latency-sensitive: P99 no worse than the standard's, quality within 5%",
        p99_vs_standard=1.0,
        quality_floor=0.95,
    ),
    "batch": Profile(
        name="batch",
        description="batch/offline: at least the standard's output tokens/s, quality within 5%",
        min_throughput_vs_standard=1.0,
        quality_floor=0.95,
    ),
}
