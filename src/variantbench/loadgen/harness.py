"""The harness: runs one scenario (``scenarios.py``) over one system under test (``sut.py``).

The harness owns time, the sample order and the books: it completes every issued query exactly
once (an exception or a missing result becomes an error record, and a query still outstanding at
the drain deadline is completed as a timeout), appends each to the query log as it completes, and
returns the records. It computes no statistics. How queries are issued is the scenario's; how they
reach the backend (and whether they are batched) is the system-under-test adapter's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
import gc
import random
import sys
import threading
import time

from variantbench.backends.base import Backend, ConcurrentBackend, GenerationRequest, GenerationResult
from variantbench.loadgen.scenarios import SCENARIOS, IssueContext
from variantbench.loadgen.senders import DescribesSenders, adapter_for
from variantbench.loadgen.sut import Pending
from variantbench.plan import default_of
from variantbench.records import QueryLog, QueryRecord
from variantbench.workloads.base import Sample, SampleLibrary

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class LoadSettings:
    """One measurement's load, built from the plan by ``pipeline/settings.py``; a default here is the
    plan's (``default_of``), except the harness's own mechanics (a block's queries, the run id)."""

    scenario: str = default_of("load.scenario")
    min_queries: int = 10  # the plan derives its own from load.tasks (Plan.min_queries)
    max_queries: int | None = default_of("limits.max_queries")
    min_duration_s: float = default_of("limits.min_duration_s")
    max_duration_s: float | None = default_of("limits.max_duration_s")
    warmup: int = default_of("limits.warmup")
    rate_qps: float | None = None  # server (the plan requires one)
    burstiness: float = default_of("load.burstiness")  # server: gamma shape; 1.0 = Poisson
    max_concurrency: int | None = default_of("load.max_concurrency")  # server
    samples_per_query: int = default_of("load.samples_per_query")  # multi-stream
    # how many waiting requests an in-process system is handed at once
    max_batch_size: int = default_of("load.max_batch_size")
    schedule_seed: int = default_of("seeds.schedule")
    sample_seed: int = default_of("seeds.workload")
    max_new_tokens: int | None = default_of("workload.max_new_tokens")
    # after the last issue, how long outstanding queries may take
    drain_timeout_s: float = default_of("limits.drain_timeout_s")
    run_id: str = "run"
    # MLPerf's accuracy log: the share of queries whose output is kept and scored (seeded choice)
    accuracy_share: float = default_of("quality.accuracy_log")
    # an interleaved block: queries [first_query, first_query + min_queries) of the run's one sample
    # order, so every variant answers the same samples in the same block; -1: the whole run at once
    first_query: int = 0
    block: int = -1
    # server scenario over HTTP: sender processes, each with its own event loop (loadgen/senders.py)
    senders: int = 1
    # ... or sender actors on a Ray cluster's nodes (loadgen/ray_senders.py; senders 0: one a node)
    ray_senders: bool = False
    ray_address: str | None = None

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
    senders: list[dict[str, object]] = field(default_factory=list)  # remote senders: node, clock offset


def sample_order(n_library: int, n_queries: int, seed: int, pass_size: int | None = None) -> list[int]:
    """Seeded order: a permutation of the library, repeated (and reshuffled) as often as needed; a
    library of passes is permuted pass by pass (pass j's samples are queries j * pass_size on)."""
    rng = random.Random(seed)
    step = pass_size or n_library
    order: list[int] = []
    while len(order) < n_queries:
        for start in range(0, n_library, step):
            block = list(range(start, min(start + step, n_library)))
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


def _fill(r: QueryRecord, result: GenerationResult, now: int) -> None:
    r.status, r.error = result.status, result.error
    r.completed_ns = result.arrived_ns or now
    r.input_tokens = result.input_tokens
    if result.status != "ok":
        return
    if result.first_token_ns is not None:
        r.first_token_ns = max(result.first_token_ns, r.issued_ns)
    r.output_tokens = result.output_tokens
    r.token_ms = [(max(t, r.issued_ns) - r.issued_ns) / 1e6 for t in result.token_ns]
    r.output = result.text if r.scored else ""  # outside the accuracy log: not kept
    r.engine_timings = result.engine_timings
    r.cpu_work = result.cpu_work


def run_scenario(
    backend: Backend,
    library: SampleLibrary,
    settings: LoadSettings,
    log: QueryLog | None = None,
    progress: Progress | None = None,
) -> RunLog:
    say = progress or (lambda *_: None)
    s = settings
    scenario = SCENARIOS[s.scenario]
    cap = s.max_queries or max(s.min_queries, 1_000_000)
    planned = scenario.planned(s, cap)
    per_query = scenario.samples_per_query(s)
    # the sample order is drawn once; a run longer than it cycles through it again. A block reads
    # its slice of the same order (a prefix of the order does not depend on its length).
    order = sample_order(
        len(library),
        (s.first_query + min(planned, 4 * max(s.min_queries, len(library)))) * per_query,
        s.sample_seed,
        library.pass_size,
    )

    lock = threading.Condition()
    records: list[QueryRecord] = []
    state = {"completed": 0, "last_progress": 0}
    total_for_progress = planned if planned < 1_000_000 else s.min_queries
    concurrent = isinstance(backend, ConcurrentBackend) and backend.concurrent
    # in-process systems: a thread semaphore; concurrent (HTTP) systems: one inside their event loop
    slots = threading.Semaphore(s.max_concurrency) if s.max_concurrency and not concurrent else None

    def complete(batch: list[Pending], results: list[GenerationResult]) -> None:
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

    remote = s.ray_senders and scenario.scheduled
    sut = adapter_for(backend, scenario.batch_limit(s), complete, senders=s.senders if scenario.scheduled else 1,
                      ray_address=(s.ray_address or "") if remote else None)  # fmt: skip
    senders_info: list[dict[str, object]] = sut.senders_info() if isinstance(sut, DescribesSenders) else []
    pendings: list[Pending] = []
    # The dispatcher shares the interpreter with the system's thread: on a timed schedule, a short GIL
    # switch interval lets it wake on time (the default 5 ms would make arrivals late by design).
    switch_interval = sys.getswitchinterval()
    # A process that has loaded torch and transformers holds millions of objects: a full garbage
    # collection walks them all and stalls every thread for tens of milliseconds, which shows up
    # as dispatch lag. Freeze what exists now, so collections during the run see only new objects.
    # An interleaved block keeps what the session's first block froze: walking millions of objects
    # again before every one-query block cost about 0.2 s a block with torch loaded.
    if not (s.block >= 0 and gc.get_freeze_count()):
        gc.collect()
        gc.freeze()
    try:
        # warm-up: one at a time, never counted or logged
        for i in range(s.warmup):
            sample = library.sample(order[i % len(order)])
            try:
                backend.generate([_request(sample, f"warmup{i}", s.max_new_tokens)])
            except Exception:  # noqa: BLE001 - a failing warm-up shows up in the measured queries
                pass
            say("warmup", i + 1, s.warmup)

        offsets = scenario.schedule(s, planned)
        if offsets is not None:
            sys.setswitchinterval(min(switch_interval, 0.0002))
        started = time.perf_counter_ns()
        max_end = started + int(s.max_duration_s * 1e9) if s.max_duration_s else None
        cursor = s.first_query * per_query
        accuracy_pick = random.Random(f"accuracy-log-{s.sample_seed}-{s.first_query}")

        def make(query_index: int, scheduled: int) -> list[Pending]:
            nonlocal cursor
            query_index += s.first_query
            group = []
            for _ in range(per_query):
                sample = library.sample(order[cursor % len(order)])
                cursor += 1
                rec = QueryRecord(
                    run_id=s.run_id, variant=backend.name, scenario=s.scenario, index=cursor - 1,
                    sample_id=sample.sample_id, task=sample.task, status="pending", error=None,
                    scheduled_ns=scheduled, issued_ns=0, first_token_ns=None, completed_ns=0,
                    input_tokens=0, output_tokens=0, reference=sample.reference, query=query_index,
                    alternatives=list(sample.alternatives),
                    scored=s.accuracy_share >= 1 or accuracy_pick.random() < s.accuracy_share,
                    block=s.block,
                )  # fmt: skip
                group.append(Pending(rec, _request(sample, f"q{cursor - 1}", s.max_new_tokens)))
            return group

        def issue(group: list[Pending]) -> None:
            now = time.perf_counter_ns()
            for p in group:
                p.record.issued_ns = now
            pendings.extend(group)
            sut.submit(group)

        def wait_done(group: list[Pending]) -> None:
            with lock:
                lock.wait_for(lambda: all(p.done for p in group))

        def limits_met(issued: int) -> bool:
            now = time.perf_counter_ns()
            enough = issued >= s.min_queries and now - started >= s.min_duration_s * 1e9
            return enough or issued >= cap or (max_end is not None and now >= max_end)

        ctx = IssueContext(settings=s, sut=sut, planned=planned, started_ns=started, max_end_ns=max_end,
                           offsets_ns=offsets, make=make, issue=issue, wait_done=wait_done,
                           limits_met=limits_met, pendings=pendings, slots=slots)  # fmt: skip
        query = scenario.issue(ctx)

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
        if s.block < 0:
            gc.unfreeze()
        sut.close()
    records.sort(key=lambda r: r.index)
    return RunLog(
        records=records,
        scenario=s.scenario,
        started_ns=started,
        ended_ns=ended,
        seeds={"schedule": s.schedule_seed, "sample": s.sample_seed},
        target_qps=s.rate_qps if offsets is not None else None,
        issued_queries=query,
        settings=dict(s.__dict__),
        senders=senders_info,
    )
