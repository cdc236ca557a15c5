"""MLPerf LoadGen's four scenarios, each an issue pattern in its own class, kept in a registry.

A scenario says how many queries it plans, how many samples make one query, how many waiting
requests an in-process system may batch, whether it has an arrival schedule, and how it issues.
The harness (``harness.py``) owns everything else: the sample order, completion bookkeeping
(exactly once), the drain and the query log. A new load pattern is a new class here, not an
``elif`` in the harness.

- ``single-stream``: the next query is issued when the last completes (batch 1).
- ``multi-stream``: each query is ``samples_per_query`` samples issued together; its latency is the
  slowest sample's; the next query is issued when the last completes.
- ``server``: arrivals on a schedule drawn before the run (Poisson, or gamma with ``burstiness``),
  no cap on outstanding queries unless ``max_concurrency`` is given. Latency counts from the
  *scheduled* time (no coordinated omission); waiting for a concurrency slot is dispatch lag.
- ``offline``: every sample issued at once; the system batches as it likes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import math
import threading
import time
from typing import TYPE_CHECKING, ClassVar, Protocol

from variantbench.loadgen.schedule import arrival_offsets_ns
from variantbench.loadgen.sut import SUT, Pending, Schedules, wait_until

if TYPE_CHECKING:
    from variantbench.loadgen.harness import LoadSettings


@dataclass
class IssueContext:
    """What an issuing function may use; the harness builds it and keeps the books."""

    settings: LoadSettings
    sut: SUT
    planned: int
    started_ns: int
    max_end_ns: int | None
    offsets_ns: list[int] | None
    make: Callable[[int, int], list[Pending]]  # (query index, scheduled ns) -> the query's samples
    issue: Callable[[list[Pending]], None]  # stamp issued_ns and hand to the system
    wait_done: Callable[[list[Pending]], None]  # block until every one of them completed
    limits_met: Callable[[int], bool]  # (queries issued so far) -> stop issuing?
    pendings: list[Pending]  # every pending the harness must see complete
    slots: threading.Semaphore | None  # in-process max_concurrency


class Scenario(Protocol):
    name: ClassVar[str]
    scheduled: ClassVar[bool]  # arrivals on a clock: an achieved rate and late issues mean something

    def planned(self, s: LoadSettings, cap: int) -> int: ...

    def samples_per_query(self, s: LoadSettings) -> int: ...

    def batch_limit(self, s: LoadSettings) -> int: ...

    def schedule(self, s: LoadSettings, planned: int) -> list[int] | None: ...

    def issue(self, ctx: IssueContext) -> int: ...


class _Unscheduled:
    scheduled: ClassVar[bool] = False

    def schedule(self, s: LoadSettings, planned: int) -> list[int] | None:
        return None

    def samples_per_query(self, s: LoadSettings) -> int:
        return 1

    def batch_limit(self, s: LoadSettings) -> int:
        return s.max_batch_size


def _one_query_at_a_time(ctx: IssueContext) -> int:
    query = 0
    while not ctx.limits_met(query):
        group = ctx.make(query, time.perf_counter_ns())
        ctx.issue(group)
        ctx.wait_done(group)
        query += 1
    return query


class SingleStream(_Unscheduled):
    name: ClassVar[str] = "single-stream"

    def planned(self, s: LoadSettings, cap: int) -> int:
        return cap  # issued until the limits are met

    def batch_limit(self, s: LoadSettings) -> int:
        return 1

    def issue(self, ctx: IssueContext) -> int:
        return _one_query_at_a_time(ctx)


class MultiStream(_Unscheduled):
    name: ClassVar[str] = "multi-stream"

    def planned(self, s: LoadSettings, cap: int) -> int:
        return cap

    def samples_per_query(self, s: LoadSettings) -> int:
        return s.samples_per_query

    def issue(self, ctx: IssueContext) -> int:
        return _one_query_at_a_time(ctx)


class Offline(_Unscheduled):
    name: ClassVar[str] = "offline"

    def planned(self, s: LoadSettings, cap: int) -> int:
        return min(cap, s.min_queries)

    def issue(self, ctx: IssueContext) -> int:
        batch = [p for q in range(ctx.planned) for p in ctx.make(q, 0)]
        at = time.perf_counter_ns()  # all are scheduled at the moment they are issued together
        for p in batch:
            p.record.scheduled_ns = at
        ctx.issue(batch)
        return ctx.planned


class Server(_Unscheduled):
    name: ClassVar[str] = "server"
    scheduled: ClassVar[bool] = True

    def planned(self, s: LoadSettings, cap: int) -> int:
        return min(cap, max(s.min_queries, math.ceil((s.rate_qps or 0) * s.min_duration_s)))

    def schedule(self, s: LoadSettings, planned: int) -> list[int] | None:
        # a block's schedule is drawn from the run's seed and the block's place in the run: every
        # variant gets the same arrivals in the same block
        seed = s.schedule_seed if s.first_query == 0 else [s.schedule_seed, s.first_query]
        return arrival_offsets_ns(planned, s.rate_qps or 1.0, seed, s.burstiness)

    def issue(self, ctx: IssueContext) -> int:
        assert ctx.offsets_ns is not None
        query = 0
        if isinstance(ctx.sut, Schedules):  # dispatched inside the event loop(s) of the sender(s)
            # the plan carries offsets; the system picks the start once it holds the whole plan, so
            # building and handing over thousands of queries cannot make the first ones late
            # (measured at 600/s: the first 35 ms of arrivals 1-24 ms late when the start was taken
            # before the plan was built)
            plan: list[Pending] = []
            span = None if ctx.max_end_ns is None else ctx.max_end_ns - ctx.started_ns
            for offset in ctx.offsets_ns:
                if span is not None and offset >= span:
                    break
                plan.extend(ctx.make(query, offset))
                query += 1
            ctx.pendings.extend(plan)
            ctx.sut.run_schedule(plan, ctx.settings.max_concurrency)
            return query
        for offset in ctx.offsets_ns:  # an in-process system: this thread keeps the time
            scheduled = ctx.started_ns + offset
            if ctx.max_end_ns is not None and scheduled >= ctx.max_end_ns:
                break
            group = ctx.make(query, scheduled)
            wait_until(scheduled)
            if ctx.slots is not None:
                ctx.slots.acquire()  # waiting here is dispatch lag, and counts in latency
            ctx.issue(group)
            query += 1
        return query


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (SingleStream(), MultiStream(), Server(), Offline())}
