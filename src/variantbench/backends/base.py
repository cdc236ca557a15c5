"""The system under test: the Backend protocol and the records it exchanges with the harness.

A backend knows nothing of load patterns or statistics: it loads, answers ``generate`` with one
result per request carrying that request's own timestamps, describes itself, and closes. Before
``load()`` a backend is plain configuration, so it can be pickled to another process or machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import time
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
    # When the answer was complete on the harness's clock, where it was received elsewhere (a sender
    # on another machine, its clock offset taken out): the harness's end of the query, not the moment
    # the answer reached it. None: the harness stamps the end itself.
    arrived_ns: int | None = None
    # The engine's own account of the request where it keeps one (llama.cpp's perf counters), to
    # cross-check our clock; never used for the latency itself.
    engine_timings: dict[str, float] | None = None
    # CPU work around the model (see EncodesAhead): encode_ms (chat template + tokenizer),
    # encode_waited_ms (the part of it the model's thread waited for), detokenize_ms
    cpu_work: dict[str, float] | None = None


@dataclass(frozen=True)
class Encoded:
    """A request's token ids (or why it has none), how long encoding took and how long the model's
    thread waited for it: all of it when encoded inline, little when encoded ahead."""

    ids: list[int] | None
    error: str | None
    encode_ns: int
    waited_ns: int


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


# ---- optional capabilities, declared: the pipeline checks them with isinstance, never hasattr ------


@runtime_checkable
class ReportsStatus(Protocol):
    """Says what a long step of ``load()`` is doing (a build, an export) through ``status(message)``."""

    status: Any


@runtime_checkable
class CudaGraphs(Protocol):
    """Can replay its decode steps from CUDA graphs on a CUDA device (``model.cuda_graphs``), or
    decode eagerly; set before ``load()``, and its load info says which it does and why."""

    cuda_graphs: bool


@runtime_checkable
class CompactsWeights(Protocol):
    """Can drop a second, speed-only copy of its weights (a server's memory over batch-1 speed);
    returns the bytes it freed (0: it keeps one copy already)."""

    def compact_weights(self) -> int: ...


@runtime_checkable
class LogProbs(Protocol):
    """Next-token log-probabilities of given token ids (logit fidelity)."""

    def token_log_probs(self, ids: list[int]) -> Any: ...


@runtime_checkable
class ScoresLikelihood(Protocol):
    """Log-probabilities of a sample's own text: its request encoded as the harness sends it, a
    continuation tokenized, and the next-token log-probs of both (``metrics/likelihood.py``)."""

    def encode(self, request: GenerationRequest) -> list[int]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def token_log_probs(self, ids: list[int]) -> Any: ...


@runtime_checkable
class ScoresServed(Protocol):
    """Log-probabilities of text after a request's prompt, asked of a server: the prompt as the server
    sees the request, each continuation's tokens after it, one token log-probability each (at most
    ``max_tokens`` of them). Raises ``ScoringUnavailable`` where the server cannot say."""

    def continuation_logprobs(self, request: GenerationRequest, continuations: list[str],
                              max_tokens: int) -> list[list[float]]: ...  # fmt: skip


@runtime_checkable
class ServedAt(Protocol):
    """A model behind an HTTP server: the server's base URL, the model's name there and the headers
    every request carries (lm-evaluation-harness's API model evaluates it there)."""

    def address(self) -> tuple[str, str | None, dict[str, str]]: ...


@runtime_checkable
class EvaluationModel(Protocol):
    """A transformers model of the variant as built (its load-time recipes applied) and its tokenizer,
    for lm-evaluation-harness's ``hf`` model (``metrics/lm_eval.py``)."""

    def evaluation_model(self) -> tuple[Any, Any]: ...


@runtime_checkable
class Profilable(Protocol):
    """Our own decoder, whose labelled regions the diagnosis profiles by operator family."""

    @property
    def decoder(self) -> Any: ...


@runtime_checkable
class EncodesAhead(Protocol):
    """Encoding (chat template, tokenizer) can run apart from generation: the runner encodes the
    next requests on a CPU thread while the model computes the current ones."""

    def encode_ahead(self, request: GenerationRequest) -> Encoded: ...

    def generate_encoded(
        self, requests: list[GenerationRequest], encoded: list[Encoded]
    ) -> list[GenerationResult]: ...


@runtime_checkable
class ConcurrentBackend(Protocol):
    """Serves many requests at once (HTTP): the harness drives ``agenerate`` from an event loop."""

    concurrent: bool

    async def astart(self) -> None: ...

    async def agenerate(self, request: GenerationRequest) -> GenerationResult: ...

    async def aclose(self) -> None: ...


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


def failed_result(request_id: str, exc: BaseException, start_ns: int) -> GenerationResult:
    """A request that failed: an error record, timed from its start (errors are data)."""
    return GenerationResult(request_id, status="error", error=f"{type(exc).__name__}: {exc}", start_ns=start_ns,
                            end_ns=time.perf_counter_ns())  # fmt: skip


def sequential_result(
    request_id: str, tok: Any, ids: list[int], tokens: list[int], token_ns: list[int], start_ns: int,
    stop_ids: tuple[int, ...], engine_timings: dict[str, float] | None = None,
) -> GenerationResult:  # fmt: skip
    """The result of a request generated token by token: text without stop tokens, each token's time."""
    shown = [t for t in tokens if t not in stop_ids]
    return GenerationResult(
        request_id,
        text=tok.decode(shown, skip_special_tokens=True).strip(),
        input_tokens=len(ids),
        output_tokens=len(tokens),
        start_ns=start_ns,
        first_token_ns=token_ns[0] if token_ns else None,
        token_ns=token_ns,
        end_ns=token_ns[-1] if token_ns else time.perf_counter_ns(),
        engine_timings=engine_timings,
    )
