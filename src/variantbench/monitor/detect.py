"""Change points in a probe series: a one-sided CUSUM per metric, in the metric's bad direction.

Each probe gives one value per metric (its P99 latency, TTFT, tokens/s, quality on fixed prompts
with references). The first ``baseline`` probes set the level: the median of their logs, and a
spread, the larger of 1.4826 x their MAD and their standard deviation, floored (a few identical
probes would make any wobble look huge). After that every probe adds its excess over the level in
the bad direction (a log ratio for latencies and rates; for quality, the drop in score) to

    S_t = max(0, S_{t-1} + d_t - k)

with k half the smallest shift worth an alert (the textbook choice for detecting a shift of that
size), and alerts when S_t passes h = max(5 x spread, 2 x the threshold's shift) while the mean
excess since S last left zero is past the threshold. The change is dated to that probe, the
classic CUSUM estimate of when the shift began. One alert per shift: after it, the new level is
learned as a fresh baseline.

Why this and not a two-sample test per window: a probe already summarizes its queries, and on
fixed prompts its values are steady; CUSUM accumulates small consistent excesses (a 30% slowdown
alerts within three probes) while a single noisy probe (a host hiccup) stays below h.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
import statistics
from typing import Any

# metric -> (higher is worse, kind): "ratio" compares logs, "score" compares differences (0-1)
DIRECTIONS: dict[str, tuple[bool, str]] = {
    "p99_ms": (True, "ratio"),
    "ttft_p99_ms": (True, "ratio"),
    "tokens_per_s": (False, "ratio"),
    "quality": (False, "score"),
}
# default thresholds: the smallest shift worth an alert (relative; quality: absolute drop, 0-1)
THRESHOLDS = {"p99_ms": 0.20, "ttft_p99_ms": 0.20, "tokens_per_s": 0.15, "quality": 0.02}
SPREAD_FLOOR = {"ratio": 0.03, "score": 0.005}  # 3% in log terms; half a point of quality


@dataclass
class Alert:
    metric: str
    probe: int  # the probe the alert was raised at
    started_probe: int  # where the shift began (the CUSUM's estimate)
    started_at: str  # that probe's time (UTC, ISO)
    baseline: float
    current: float  # the mean value since the shift began
    change: float  # relative change (quality: absolute drop)

    def line(self) -> str:
        what = (f"{self.change:+.1%}" if DIRECTIONS[self.metric][1] == "ratio"
                else f"{-self.change:+.3f} (score)")  # fmt: skip
        return (f"ALERT {self.metric}: {what} against the baseline ({self.current:,.4g} vs {self.baseline:,.4g}), "
                f"started at probe {self.started_probe} ({self.started_at}), detected at probe {self.probe}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Cusum:
    """One metric's detector."""

    metric: str
    threshold: float
    baseline_probes: int = 5
    learning: list[float] = field(default_factory=list)
    level: float | None = None
    spread: float | None = None
    s: float = 0.0
    run: list[tuple[int, str, float, float]] = field(
        default_factory=list
    )  # since S left 0: probe, time, d, value

    @property
    def worse_up(self) -> bool:
        return DIRECTIONS[self.metric][0]

    @property
    def kind(self) -> str:
        return DIRECTIONS[self.metric][1]

    def _x(self, value: float) -> float:
        return math.log(value) if self.kind == "ratio" else value

    @property
    def shift(self) -> float:
        """The threshold as a shift on the detector's scale."""
        return math.log1p(self.threshold) if self.kind == "ratio" else self.threshold

    def state(self) -> dict[str, Any]:
        return {"level": self.level, "spread": self.spread, "s": round(self.s, 4),
                "h": self.h if self.spread is not None else None, "learning": len(self.learning)}  # fmt: skip

    @property
    def h(self) -> float:
        return max(5 * (self.spread or 0.0), 2 * self.shift)

    def update(self, probe: int, at: str, value: float | None) -> Alert | None:
        if value is None or (self.kind == "ratio" and value <= 0) or not math.isfinite(value):
            return None  # a probe without this metric (failed queries): no evidence either way
        x = self._x(value)
        if self.level is None:
            self.learning.append(x)
            if len(self.learning) >= self.baseline_probes:
                self.level = statistics.median(self.learning)
                mad = statistics.median(abs(v - self.level) for v in self.learning)
                # the larger of the robust and the plain spread: a MAD of five probes can be near
                # zero while two of them wander (tiny-model probes: MAD 0.03, stdev 0.11 in logs),
                # and a spread too small cries wolf at the next wander
                spread = max(1.4826 * mad, statistics.stdev(self.learning))
                self.spread = max(spread, SPREAD_FLOOR[self.kind])
                self.learning = []
            return None
        excess = (x - self.level) if self.worse_up else (self.level - x)
        self.s = max(0.0, self.s + excess - self.shift / 2)
        if self.s == 0.0:
            self.run = []
            return None
        self.run.append((probe, at, excess, value))
        mean_excess = statistics.fmean(d for _, _, d, _ in self.run)
        if self.s <= self.h or mean_excess <= self.shift:
            return None
        first = self.run[0]
        current = statistics.fmean(v for _, _, _, v in self.run)
        base = math.exp(self.level) if self.kind == "ratio" else self.level
        change = current / base - 1 if self.kind == "ratio" else current - base
        alert = Alert(self.metric, probe, first[0], first[1], base, current, change)
        # one alert per shift: learn the new level from the next probes
        self.level, self.spread, self.s, self.run = None, None, 0.0, []
        return alert


def detectors(thresholds: dict[str, float] | None = None, baseline_probes: int = 5) -> dict[str, Cusum]:
    chosen = {**THRESHOLDS, **(thresholds or {})}
    return {m: Cusum(m, chosen[m], baseline_probes) for m in DIRECTIONS}
