"""SingleStream: the next query is issued when the last completes (MLPerf's single-stream).

The harness owns time and sample order, and completes every issued query exactly once: a backend
that raises, or returns no result for a query, yields an error record and the run goes on. It
returns the query log; it computes no statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import random
import time

from variantbench.backends.base import Backend, GenerationRequest, GenerationResult
from variantbench.loadgen.records import QueryLog, QueryRecord
from variantbench.workloads.base import Sample, SampleLibrary

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class SingleStreamSettings:
    queries: int
    warmup: int = 2
    sample_seed: int = 0
    run_id: str = "run"
    max_new_tokens: int | None = None  # override the samples' own caps


def sample_order(n_library: int, n_queries: int, seed: int) -> list[int]:
    """Seeded order: a permutation of the library, repeated (and reshuffled) as often as needed."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < n_queries:
        block = list(range(n_library))
        rng.shuffle(block)
        order.extend(block)
    return order[:n_queries]


def _request(sample: Sample, tag: str, max_new_tokens: int | None) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{tag}:{sample.sample_id}", prompt=sample.prompt, max_new_tokens=max_new_tokens or sample.max_new_tokens
    )


def _issue(backend: Backend, request: GenerationRequest) -> tuple[int, int, GenerationResult]:
    issued = time.perf_counter_ns()
    try:
        results = backend.generate([request])
        result = results[0] if results else None
        if result is None:
            raise RuntimeError("backend returned no result")
    except Exception as exc:  # the query still completes, as an error
        result = GenerationResult(request.request_id, status="error", error=f"{type(exc).__name__}: {exc}")
    return issued, time.perf_counter_ns(), result


def run_single_stream(
    backend: Backend,
    library: SampleLibrary,
    settings: SingleStreamSettings,
    log: QueryLog | None = None,
    progress: Progress | None = None,
) -> list[QueryRecord]:
    say = progress or (lambda *_: None)
    order = sample_order(len(library), settings.queries, settings.sample_seed)
    for i in range(settings.warmup):  # not counted, not logged
        _issue(backend, _request(library.sample(order[i % len(order)]), f"warmup{i}", settings.max_new_tokens))
        say("warmup", i + 1, settings.warmup)
    records: list[QueryRecord] = []
    for index, sample_index in enumerate(order):
        sample = library.sample(sample_index)
        issued, completed, result = _issue(backend, _request(sample, f"q{index}", settings.max_new_tokens))
        ok = result.status == "ok"
        first = result.first_token_ns if ok and result.first_token_ns is not None else None
        record = QueryRecord(
            run_id=settings.run_id,
            variant=backend.name,
            scenario="single-stream",
            index=index,
            sample_id=sample.sample_id,
            task=sample.task,
            status=result.status,
            error=result.error,
            scheduled_ns=issued,
            issued_ns=issued,
            first_token_ns=max(first, issued) if first is not None else None,
            completed_ns=completed,
            input_tokens=result.input_tokens,
            output_tokens=result.output_tokens if ok else 0,
            token_ms=[(t - issued) / 1e6 for t in result.token_ns] if ok else [],
            output=result.text if ok else "",
            reference=sample.reference,
        )
        records.append(record)
        if log is not None:
            log.append(record)
        say("measure", index + 1, settings.queries)
    return records
