"""The harness: four MLPerf scenarios as issue patterns over one system under test.

- ``single-stream``: the next query is issued when the last completes.
- ``multi-stream``: each query is ``samples_per_query`` samples issued together; its latency is the
  slowest sample's; the next query is issued when the last completes.
- ``server``: arrivals on a schedule drawn before the run (Poisson, or gamma with ``burstiness``),
  no cap on outstanding queries unless ``max_concurrency`` is given. Latency counts from the
  *scheduled* time, so a system that falls behind is charged for its queue (no coordinated
  omission); time spent waiting for a concurrency slot is dispatch lag, charged too.
- ``offline``: every sample issued at once; the system batches as it likes.

The harness owns time, sample order and the schedule, and completes every issued query exactly
once: an exception or a missing result becomes an error record, and a query still outstanding at
the drain deadline is completed as a timeout. It returns the query records and computes no
statistics. An in-process backend is driven by one executor thread that hands it whatever is
waiting, up to ``max_batch_size`` requests per ``generate`` call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
import gc
import math
import random
import sys
import threading
import time
from typing import Any

from variantbench.backends.base import Backend, ConcurrentBackend, GenerationRequest, GenerationResult
from variantbench.loadgen.schedule import arrival_offsets_ns
from variantbench.records import QueryLog, QueryRecord
from variantbench.workloads.base import Sample, SampleLibrary

SCENARIOS = ("single-stream", "multi-stream", "server", "offline")
Progress = Callable[[str, int, int], None]

# Sleep (releasing the GIL) until this close to an arrival, then spin. Event-loop timers round to
# about 1 ms; a thread's nanosleep wakes within tens of microseconds, and a short spin keeps a
# spinning dispatcher from starving the threads that complete queries of the GIL.
_SPIN_NS = 250_000


@dataclass(frozen=True)
class LoadSettings:
    scenario: str = "single-stream"
    min_queries: int = 10
    max_queries: int | None = None
    min_duration_s: float = 0.0
    max_duration_s: float | None = None
    warmup: int = 1
    rate_qps: float | None = None  # server
    burstiness: float = 1.0  # server: gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None  # server
    samples_per_query: int = 4  # multi-stream
    max_batch_size: int = 8  # how many waiting requests the executor hands the backend at once
    schedule_seed: int = 0
    sample_seed: int = 0
    max_new_tokens: int | None = None
    drain_timeout_s: float = 600.0  # after the last issue, how long outstanding queries may take
    run_id: str = "run"
    # MLPerf's accuracy log: the share of queries whose output is kept and scored (seeded choice)
    accuracy_share: float = 1.0

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; known: {', '.join(SCENARIOS)}")
        if self.scenario == "server" and (self.rate_qps is None or self.rate_qps <= 0):
            raise ValueError("the server scenario needs a positive rate (queries/s)")
        if self.min_queries < 1:
            raise ValueError("min_queries must be at least 1")
        if self.max_queries is not None and self.max_queries < self.min_queries:
            raise ValueError("max_queries must be at least min_queries")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if not 0 < self.accuracy_share <= 1:
            raise ValueError("accuracy_share must be in (0, 1]")


@dataclass
class RunLog:
    """What the harness hands back: the records and the facts needed to interpret them."""

    records: list[QueryRecord]
    scenario: str
    started_ns: int
    ended_ns: int
    seeds: dict[str, int]
    target_qps: float | None = None
    issued_queries: int = 0
    settings: dict[str, object] = field(default_factory=dict)


class _Pending:
    __slots__ = ("record", "request", "done")

    def __init__(self, record: QueryRecord, request: GenerationRequest) -> None:
        self.record = record
        self.request = request
        self.done = False  # set under the harness's lock, exactly once


def _wait_until(deadline_ns: int) -> None:
    while True:
        remaining = deadline_ns - time.perf_counter_ns()
        if remaining <= 0:
            return
        if remaining > _SPIN_NS:
            time.sleep((remaining - _SPIN_NS) / 1e9)


class _Executor:
    """One thread feeding the backend whatever requests are waiting, in batches."""

    def __init__(
        self,
        backend: Backend,
        max_batch: int,
        on_complete: Callable[[list[_Pending], list[GenerationResult]], None],
    ):
        self.backend = backend
        self.max_batch = max_batch
        self.on_complete = on_complete
        self.inbox: deque[_Pending] = deque()
        self.ready = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="variantbench-executor", daemon=True)
        self.thread.start()

    def submit(self, pendings: list[_Pending]) -> None:
        with self.ready:
            self.inbox.extend(pendings)
            self.ready.notify()

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.inbox and not self.closing:
                    self.ready.wait()
                if not self.inbox:
                    return
                take = min(self.max_batch, len(self.inbox))
                batch = [self.inbox.popleft() for _ in range(take)]
            try:
                results = self.backend.generate([p.request for p in batch])
                by_id = {r.request_id: r for r in results}
            except Exception as exc:  # the batch fails, the run goes on
                by_id = {}
                error = f"{type(exc).__name__}: {exc}"
            else:
                error = "backend returned no result"
            self.on_complete(
                batch,
                [by_id.get(p.request.request_id) or GenerationResult(p.request.request_id, status="error", error=error)
                 for p in batch],
            )  # fmt: skip

    def close(self, timeout_s: float = 1.0) -> None:
        # A backend stuck in generate() is abandoned (daemon thread); its queries were already
        # completed as timeouts, and the run must not hang on it.
        with self.ready:
            self.closing = True
            self.ready.notify()
        self.thread.join(timeout=timeout_s)


class _AsyncExecutor:
    """For backends that serve many requests at once (HTTP): one event loop in its own thread.

    The dispatcher keeps its precise timing on the calling thread and hands each request to the
    loop; every request runs as its own task, so nothing queues in the harness.
    """

    def __init__(self, backend: Any, on_complete: Callable[[list[_Pending], list[GenerationResult]], None]):
        self.backend = backend
        self.on_complete = on_complete
        try:  # uvloop spends less time (and GIL) per I/O event than asyncio's own loop
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency, but not on every platform
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="variantbench-loop", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(backend.astart(), self.loop).result()

    async def _one(self, pending: _Pending, slot: asyncio.Semaphore | None = None) -> None:
        # Issued is when the request really starts, on this loop: a loop that falls behind the
        # dispatcher shows up as dispatch lag, not as the server's latency.
        pending.record.issued_ns = time.perf_counter_ns()
        try:
            result = await self.backend.agenerate(pending.request)
        except Exception as exc:  # a backend bug is a failed query, not a dead run
            result = GenerationResult(
                pending.request.request_id, status="error", error=f"{type(exc).__name__}: {exc}"
            )
        finally:
            if slot is not None:
                slot.release()
        self.on_complete([pending], [result])

    async def _dispatch(self, plan: list[_Pending], max_concurrency: int | None) -> int:
        """Issue each request at its scheduled time, from inside the loop.

        Sleep on the loop's timer until about 3 ms before (its timers round to ~1 ms and oversleep
        under load), then yield
        with ``sleep(0)`` until the time: I/O keeps being served while the dispatcher waits, and
        no thread hand-off (nor the GIL) stands between the schedule and the send.
        """
        slot = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        for p in plan:
            target = p.record.scheduled_ns
            remaining = target - time.perf_counter_ns()
            if remaining > 4_000_000:
                await asyncio.sleep((remaining - 3_000_000) / 1e9)
            while time.perf_counter_ns() < target:
                await asyncio.sleep(0)
            if slot is not None:
                await slot.acquire()  # waiting for a slot is dispatch lag, and counts in latency
            self.loop.create_task(self._one(p, slot))
        return len(plan)

    def run_schedule(self, plan: list[_Pending], max_concurrency: int | None) -> int:
        return asyncio.run_coroutine_threadsafe(self._dispatch(plan, max_concurrency), self.loop).result()

    def _start(self, pendings: list[_Pending]) -> None:
        for p in pendings:
            self.loop.create_task(self._one(p))

    def submit(self, pendings: list[_Pending]) -> None:
        self.loop.call_soon_threadsafe(self._start, pendings)

    def close(self, timeout_s: float = 5.0) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.backend.aclose()
            await self.loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - closing must not raise over the run's result
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=timeout_s)
        if not self.thread.is_alive():
            self.loop.close()


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
        request_id=tag,
        prompt=None if sample.messages else sample.prompt,
        messages=sample.messages,
        max_new_tokens=max_new_tokens or sample.max_new_tokens,
    )


def run_scenario(
    backend: Backend,
    library: SampleLibrary,
    settings: LoadSettings,
    log: QueryLog | None = None,
    progress: Progress | None = None,
) -> RunLog:
    say = progress or (lambda *_: None)
    s = settings
    cap = s.max_queries or max(s.min_queries, 1_000_000)
    if s.scenario == "server":
        planned = max(s.min_queries, math.ceil((s.rate_qps or 0) * s.min_duration_s))
        planned = min(planned, cap)
    elif s.scenario == "offline":
        planned = min(cap, s.min_queries)
    else:
        planned = cap  # issued until the limits are met
    per_query = s.samples_per_query if s.scenario == "multi-stream" else 1
    # the sample order is drawn once; a run longer than it cycles through it again
    order = sample_order(
        len(library), min(planned, 4 * max(s.min_queries, len(library))) * per_query, s.sample_seed
    )

    lock = threading.Condition()
    records: list[QueryRecord] = []
    state = {"completed": 0, "last_progress": 0}
    total_for_progress = planned if planned < 1_000_000 else s.min_queries
    is_async = isinstance(backend, ConcurrentBackend) and backend.concurrent
    # in-process systems: a thread semaphore; HTTP systems: an asyncio one inside the loop's dispatcher
    slots = threading.Semaphore(s.max_concurrency) if s.max_concurrency and not is_async else None

    def complete(batch: list[_Pending], results: list[GenerationResult]) -> None:
        now = time.perf_counter_ns()
        freed = 0
        with lock:
            for p, result in zip(batch, results, strict=True):
                if p.done:  # completed already (as a timeout): exactly once
                    continue
                p.done = True
                _fill(p.record, result, now)
                records.append(p.record)
                if log is not None:
                    log.append(p.record)
                freed += 1
            state["completed"] += freed
            done = state["completed"]
            lock.notify_all()
        if slots is not None:
            for _ in range(freed):
                slots.release()
        if now - state["last_progress"] > 100_000_000 or done == total_for_progress:  # at most 10/s
            state["last_progress"] = now
            say("measure", done, total_for_progress)

    def _fill(r: QueryRecord, result: GenerationResult, now: int) -> None:
        ok = result.status == "ok"
        r.status, r.error = result.status, result.error
        r.completed_ns = now
        if ok:
            if result.first_token_ns is not None:
                r.first_token_ns = max(result.first_token_ns, r.issued_ns)
            r.input_tokens = result.input_tokens
            r.output_tokens = result.output_tokens
            r.token_ms = [(max(t, r.issued_ns) - r.issued_ns) / 1e6 for t in result.token_ns]
            r.output = result.text if r.scored else ""  # outside the accuracy log: not kept
            r.engine_timings = result.engine_timings
        else:
            r.input_tokens = result.input_tokens

    executor: _Executor | _AsyncExecutor
    if is_async:
        executor = _AsyncExecutor(backend, complete)
    else:
        executor = _Executor(backend, s.max_batch_size if s.scenario != "single-stream" else 1, complete)
    pendings: list[_Pending] = []
    # The dispatcher shares the interpreter with the executor: on a timed schedule, a short GIL
    # switch interval lets it wake on time (the default 5 ms would make arrivals late by design).
    switch_interval = sys.getswitchinterval()
    # A process that has loaded torch and transformers holds millions of objects: a full garbage
    # collection walks them all and stalls every thread for tens of milliseconds, which shows up
    # as dispatch lag. Freeze what exists now, so collections during the run see only new objects.
    gc.collect()
    gc.freeze()
    if s.scenario == "server":
        sys.setswitchinterval(min(switch_interval, 0.0002))
    try:
        # warm-up: one at a time, never counted or logged
        for i in range(s.warmup):
            sample = library.sample(order[i % len(order)])
            try:
                backend.generate([_request(sample, f"warmup{i}", s.max_new_tokens)])
            except Exception:  # noqa: BLE001 - a failing warm-up shows up in the measured queries
                pass
            say("warmup", i + 1, s.warmup)

        offsets = (
            arrival_offsets_ns(planned, s.rate_qps or 1.0, s.schedule_seed, s.burstiness)
            if s.scenario == "server"
            else None
        )
        started = time.perf_counter_ns()
        max_end = started + int(s.max_duration_s * 1e9) if s.max_duration_s else None
        query = 0
        sample_cursor = 0

        accuracy_pick = random.Random(f"accuracy-log-{s.sample_seed}")

        def make(query_index: int, scheduled: int) -> list[_Pending]:
            nonlocal sample_cursor
            group = []
            for _ in range(per_query):
                sample = library.sample(order[sample_cursor % len(order)])
                sample_cursor += 1
                rec = QueryRecord(
                    run_id=s.run_id, variant=backend.name, scenario=s.scenario, index=sample_cursor - 1,
                    sample_id=sample.sample_id, task=sample.task, status="pending", error=None,
                    scheduled_ns=scheduled, issued_ns=0, first_token_ns=None, completed_ns=0,
                    input_tokens=0, output_tokens=0, reference=sample.reference, query=query_index,
                    alternatives=list(sample.alternatives),
                    scored=s.accuracy_share >= 1 or accuracy_pick.random() < s.accuracy_share,
                )  # fmt: skip
                group.append(_Pending(rec, _request(sample, f"q{sample_cursor - 1}", s.max_new_tokens)))
            return group

        def issue(group: list[_Pending]) -> None:
            now = time.perf_counter_ns()
            for p in group:
                p.record.issued_ns = now
            pendings.extend(group)
            executor.submit(group)

        def limits_met(now: int) -> bool:
            enough = query >= s.min_queries and now - started >= s.min_duration_s * 1e9
            return enough or query >= cap or (max_end is not None and now >= max_end)

        if s.scenario in ("single-stream", "multi-stream"):
            while not limits_met(time.perf_counter_ns()):
                group = make(query, time.perf_counter_ns())
                issue(group)
                with lock:
                    lock.wait_for(lambda g=group: all(p.done for p in g))
                query += 1
        elif s.scenario == "offline":
            batch = [p for q in range(planned) for p in make(q, 0)]
            at = time.perf_counter_ns()  # all are scheduled at the moment they are issued together
            for p in batch:
                p.record.scheduled_ns = at
            issue(batch)
            query = planned
        elif isinstance(executor, _AsyncExecutor):  # server, dispatched inside the event loop
            assert offsets is not None
            plan = []
            for offset in offsets:
                scheduled = started + offset
                if max_end is not None and scheduled >= max_end:
                    break
                plan.extend(make(query, scheduled))
                query += 1
            pendings.extend(plan)
            executor.run_schedule(plan, s.max_concurrency)
        else:  # server, in-process system
            assert offsets is not None
            for offset in offsets:
                scheduled = started + offset
                if max_end is not None and scheduled >= max_end:
                    break
                group = make(query, scheduled)
                _wait_until(scheduled)
                if slots is not None:
                    slots.acquire()  # waiting here is dispatch lag, and counts in latency
                issue(group)
                query += 1

        with lock:
            lock.wait_for(lambda: state["completed"] >= len(pendings), timeout=s.drain_timeout_s)
        late = [p for p in pendings if not p.done]
        if late:
            complete(
                late,
                [GenerationResult(p.request.request_id, status="error", error="timed out") for p in late],
            )
        ended = time.perf_counter_ns()
    finally:
        sys.setswitchinterval(switch_interval)
        gc.unfreeze()
        executor.close()
    records.sort(key=lambda r: r.index)
    return RunLog(
        records=records,
        scenario=s.scenario,
        started_ns=started,
        ended_ns=ended,
        seeds={"schedule": s.schedule_seed, "sample": s.sample_seed},
        target_qps=s.rate_qps if s.scenario == "server" else None,
        issued_queries=query,
        settings={k: v for k, v in s.__dict__.items()},
    )
