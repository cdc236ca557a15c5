"""What a variant search optimizes: a registry of objectives, each read off a trial's run report.

An objective is a number the report already holds (nothing is measured here), with its direction
and whether it is known part-way through a trial's measurement (``interim``): the early stop of a
clearly dominated trial compares interim values, so an objective measured only at the end (the
logit KL, the batch-8 decode) turns that stop off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from variantbench.errors import UserError
from variantbench.report.schema import RunReport


@dataclass(frozen=True)
class Objective:
    name: str
    direction: Literal["maximize", "minimize"]
    label: str  # axis title and table header, with the unit
    read: Callable[[RunReport], float | None]
    interim: bool = True  # known after the first part of the queries (before fidelity and batch rounds)
    scale: float = 1.0  # shown as value / scale (bytes as MB)

    def value(self, run: RunReport) -> float | None:
        v = self.read(run)
        return None if v is None else float(v)

    def shown(self, value: float | None) -> str:
        """The value in the objective's unit, for tables and the front's comments."""
        return "-" if value is None else f"{value / self.scale:.4g}"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b


def _quality(run: RunReport) -> float | None:
    """Composite quality over the standard's (the standard itself: 1); where the standard scored 0
    there is no ratio, and every run, the standard too, falls back to its composite."""
    q = run.quality_vs_standard
    if q is not None and q.ratio is not None:
        return q.ratio
    if q is not None and q.standard == run.variant and run.quality.composite:
        return 1.0
    return run.quality.composite


def _batch(run: RunReport) -> float | None:
    return run.batch_throughput.tokens_per_s if run.batch_throughput else None


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("quality", "maximize", "composite quality / the standard's", _quality),
        Objective(
            "kl",
            "minimize",
            "KL(standard || variant), nats/token",
            lambda r: r.quality.kl_mean,
            interim=False,
        ),  # fmt: skip
        Objective("tokens_per_s", "maximize", "output tokens/s", lambda r: r.throughput.output_tokens_per_s),
        Objective("latency_p90", "minimize", "latency p90 (ms)", lambda r: r.latency_ms.p90),
        Objective("ttft_p50", "minimize", "TTFT p50 (ms)", lambda r: r.ttft_ms.p50),
        Objective("peak_rss", "minimize", "peak RSS (MB)", lambda r: r.resources.peak_rss_bytes, scale=1e6),
        Objective(
            "weights", "minimize", "weights in memory (MB)", lambda r: r.resources.param_bytes, scale=1e6
        ),
        Objective("batch_tokens_per_s", "maximize", "batch-8 decode tokens/s", _batch, interim=False),
    )
}


def parse_objectives(text: str) -> list[Objective]:
    """``"quality,tokens_per_s,peak_rss"`` -> objectives; an unknown or repeated name is one line."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) < 2:
        raise UserError(f"--objectives needs at least two of: {', '.join(OBJECTIVES)} (got {text!r})")
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown:
        raise UserError(f"unknown objective {unknown[0]!r}; known: {', '.join(OBJECTIVES)}")
    if len(set(names)) != len(names):
        raise UserError(f"--objectives names one twice: {text!r}")
    return [OBJECTIVES[n] for n in names]


def dominates(
    a: Sequence[float], b: Sequence[float], objectives: Sequence[Objective], margin: float = 0.0
) -> bool:
    """``a`` is at least as good as ``b`` in every objective and better in one; with ``margin``
    (0.1: 10%), better than ``b`` by that share in every objective (clearly dominated)."""
    if margin:
        return all(_clearly(x, y, o, margin) for x, y, o in zip(a, b, objectives, strict=True))
    no_worse = all(not o.better(y, x) for x, y, o in zip(a, b, objectives, strict=True))
    return no_worse and any(o.better(x, y) for x, y, o in zip(a, b, objectives, strict=True))


def _clearly(x: float, y: float, o: Objective, margin: float) -> bool:
    scale = max(abs(x), abs(y), 1e-12)
    return (x - y if o.direction == "maximize" else y - x) >= margin * scale


def beaten_by(mine: dict[str, float], others: dict[str, dict[str, float]], objectives: Sequence[Objective],
              margin: float) -> str | None:  # fmt: skip
    """The first of ``others`` (name -> values) that beats ``mine`` by ``margin`` in every objective;
    None where none does, or where either lacks a value."""
    names = [o.name for o in objectives]
    if margin <= 0 or any(n not in mine for n in names):
        return None
    for other, theirs in others.items():
        if all(n in theirs for n in names) and dominates([theirs[n] for n in names], [mine[n] for n in names],
                                                         objectives, margin=margin):  # fmt: skip
            return other
    return None
