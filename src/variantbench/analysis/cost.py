"""The cost model: what a million output tokens cost, tokens per joule, and the efficiency score.

Inputs (``CostModel``, set on the command line): hardware cost per device-hour, devices, energy
price per kWh, and for machines without an energy counter the watts per busy core of the estimate.
From a run: its measured span (first scheduled query to last completion), output tokens, the
tracker's energy and the wall time it covered, and the quality score.

* energy of the measured span = mean power over the tracked time (energy_j / tracked wall_s) x span
* cost per 1M output tokens = (cost per hour x devices x span / 3600 + span energy in kWh x price)
  / output tokens x 1e6
* tokens per joule = output tokens / span energy
* efficiency (the seeds' score) = quality x throughput / (hardware cost x energy per token), in
  (quality 0-1) x (output tokens/s) / ((currency/h) x (J/output token)). Higher is better; every input
  is written beside it so it can be checked by hand.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CostModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cost_per_hour: float = Field(0.10, ge=0, description="hardware cost per device-hour")
    devices: int = Field(1, ge=1)
    currency: str = "USD"
    energy_price_kwh: float = Field(0.15, ge=0, description="energy price per kWh")
    watts_per_core: float = Field(10.0, gt=0, description="energy estimate: watts per busy core")
    # True when the prices are the plan's built-in defaults, not a user's: every cost figure says so
    placeholder_prices: bool = False


def derive(cost: CostModel, *, duration_s: float | None, output_tokens: int, energy_j: float | None,
           tracked_wall_s: float | None, quality: float | None) -> dict[str, Any]:  # fmt: skip
    """The run's cost numbers and the inputs they came from (units in the names)."""
    inputs: dict[str, Any] = {
        "cost_per_hour": cost.cost_per_hour,
        "devices": cost.devices,
        "currency": cost.currency,
        "energy_price_kwh": cost.energy_price_kwh,
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "tracked_energy_j": energy_j,
        "tracked_wall_s": tracked_wall_s,
        "quality": quality,
        "prices": "placeholder" if cost.placeholder_prices else "given",
    }
    out: dict[str, Any] = {
        "per_million_output_tokens": None,
        "tokens_per_joule": None,
        "efficiency": None,
        "efficiency_units": (f"(quality 0-1) x (output tokens/s) / (({cost.currency}/h) x (J/output token))"),
        "inputs": inputs,
    }
    if not duration_s or duration_s <= 0 or output_tokens <= 0:
        return out
    span_energy = None
    if energy_j is not None and tracked_wall_s and tracked_wall_s > 0:
        span_energy = energy_j / tracked_wall_s * duration_s
    inputs["span_energy_j"] = span_energy
    hardware = cost.cost_per_hour * cost.devices * duration_s / 3600
    energy_cost = (span_energy or 0.0) / 3.6e6 * cost.energy_price_kwh
    inputs["hardware_cost"] = hardware
    inputs["energy_cost"] = energy_cost
    out["per_million_output_tokens"] = (hardware + energy_cost) / output_tokens * 1e6
    if span_energy:
        out["tokens_per_joule"] = output_tokens / span_energy
        throughput = output_tokens / duration_s
        joules_per_token = span_energy / output_tokens
        inputs["throughput_tokens_per_s"] = throughput
        inputs["energy_per_token_j"] = joules_per_token
        hourly = cost.cost_per_hour * cost.devices
        if quality is not None and hourly > 0:
            out["efficiency"] = quality * throughput / (hourly * joules_per_token)
    return out
