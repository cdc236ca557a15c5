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
    # The engine's own account of the request where it keeps one (llama.cpp's perf counters), to
    # cross-check our clock; never used for the latency itself.
    engine_timings: dict[str, float] | None = None


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


def encode_request(tok: Any, request: GenerationRequest) -> list[int]:
    """Token ids of a request with a Hugging Face tokenizer, through its chat template if it has one.

    Every in-process engine encodes the same way, so the same sample is the same token ids for all.
    """
    messages = list(request.messages) if request.messages else None
    if messages is None:
        if request.prompt is None:
            raise ValueError("request has neither prompt nor messages")
        if getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": request.prompt}]
    if messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ValueError("chat messages given but the tokenizer has no chat template")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(request.prompt)["input_ids"])
