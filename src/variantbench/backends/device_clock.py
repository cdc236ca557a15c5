"""When each phase of a generation ended, as the device saw it (issue 43).

A CUDA kernel returns to Python when it is queued, not when it is done: a host clock read after a
prefill measures its launch, a few hundred microseconds, whatever the prefill took. So the engine
places marks in the device's stream (``mark``) and converts them to host nanoseconds at the end
(``resolve``): on the CPU a mark is the host clock itself; on CUDA it is a ``torch.cuda.Event``
recorded behind the kernels, and its time is the host time of an anchor event (recorded on an idle
stream, so it ran when it was queued) plus the device's own elapsed time between the two. Token
timestamps stay on the harness's clock (``perf_counter_ns``), so TTFT and TPOT mean the same on
both devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class PhaseClock(Protocol):
    def mark(self) -> int:
        """Place a mark after everything queued so far; returns its index."""

    def resolve(self) -> list[int]:
        """Host nanoseconds of every mark, in order (waits for the device)."""


class HostClock:
    """The CPU: work is done when the call returns, so a mark reads the clock."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.times: list[int] = []

    def mark(self) -> int:
        self.times.append(self.clock())
        return len(self.times) - 1

    def resolve(self) -> list[int]:
        return list(self.times)


def event_times_ns(anchor_ns: int, elapsed_ms: Sequence[float]) -> list[int]:
    """Host times of events ``elapsed_ms`` after an anchor event that ran at host time ``anchor_ns``
    (CUDA reports milliseconds as floats, resolved to about half a microsecond)."""
    return [anchor_ns + round(ms * 1e6) for ms in elapsed_ms]


class CudaEventClock:
    """A CUDA device: marks are events in the current stream, timed by the device."""

    def __init__(self, device: Any, clock: Callable[[], int]) -> None:
        import torch

        self.torch = torch
        torch.cuda.synchronize(device)  # an idle stream: the anchor runs the moment it is recorded
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record()
        self.anchor_ns = clock()
        self.events: list[Any] = []

    def mark(self) -> int:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return len(self.events) - 1

    def resolve(self) -> list[int]:
        if not self.events:
            return []
        self.events[-1].synchronize()
        return event_times_ns(self.anchor_ns, [self.anchor.elapsed_time(e) for e in self.events])


def phase_clock(device: Any, clock: Callable[[], int]) -> PhaseClock:
    """The clock for work on ``device`` (a torch.device)."""
    return CudaEventClock(device, clock) if device.type == "cuda" else HostClock(clock)
