"""How much of a decode step the GPU sat idle between kernels (issue 43): the question Nsight
Systems answers in the seeds ("idle compute cycles"), from the torch profiler's CUDA activity.

A small model's decode step is many short kernels; between two of them the device waits for the
host to launch the next. ``idle_share`` is the part of the steps' span (first kernel start to last
kernel end) that no kernel covers, kernels that overlap (several streams) counted once. A share
near 0 means the device was kept busy (the step is bound by the kernels themselves: compare the
achieved bandwidth with the device's); a large share means it is bound by launches and host work,
what CUDA graphs remove. ``cuda_kernels`` is the thin part that reads the profiler's events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def idle_share(intervals: list[tuple[float, float]]) -> float | None:
    """The share of the span from the first kernel's start to the last one's end with no kernel."""
    if not intervals:
        return None
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return 0.0 if span <= 0 else max(0.0, 1.0 - busy_us(intervals) / span)


def cuda_kernels(events: Any, after_us: float = float("-inf")) -> list[tuple[float, float]]:
    """[start, end) in microseconds of the profiler's CUDA kernels that began after ``after_us``."""
    out = []
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.start >= after_us:
            out.append((float(e.time_range.start), float(e.time_range.end)))
    return out


def bound_phrase(achieved_gbps: float | None, ceiling_gbps: float | None, idle: float | None) -> str | None:
    """What bounds a GPU decode step, in words, from the measured numbers."""
    parts = []
    if achieved_gbps and ceiling_gbps:
        parts.append(f"{achieved_gbps / ceiling_gbps:.0%} of the device's measured bandwidth")
    if idle is not None:
        parts.append(f"idle between kernels {idle:.0%} of the step")
    if not parts:
        return None
    head = (
        "launch-bound"
        if idle is not None and idle >= 0.3
        else "memory-bound"
        if parts[0][0] != "i"
        else "busy"
    )
    return f"{head}: " + ", ".join(parts)
