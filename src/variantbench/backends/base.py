"""The system under test: the Backend protocol and the records it exchanges with the harness.

A backend knows nothing of load patterns or statistics: it loads, answers ``generate`` with one
result per request carrying that request's own timestamps, describes itself, and closes. Before
``load()`` a backend is plain configuration, so it can be pickled to another process or machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    # Either a plain prompt or chat messages ([{"role": ..., "content": ...}]).
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_new_tokens: int = 64


@dataclass
class GenerationResult:
    request_id: str
    status: str = "ok"  # "ok" | "error"
    error: str | None = None
    text: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    # Integer perf_counter_ns timestamps in the backend's process.
    start_ns: int = 0
    first_token_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    end_ns: int = 0


@dataclass
class LoadInfo:
    startup_s: float
    param_bytes: int
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    name: str

    def load(self) -> LoadInfo: ...

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
