"""System-under-test adapters: how issued queries reach a backend. They decide batching, not the harness.

- ``ThreadedSUT``: an in-process backend (our engine, ONNX Runtime, llama.cpp) is driven by one
  thread that hands it whatever requests are waiting, up to a batch limit per ``generate`` call.
- ``AsyncSUT``: a backend that serves many requests at once (HTTP) gets one event loop in its own
  thread; every request runs as its own task, so nothing queues in the harness, and a timed
  schedule is dispatched from inside the loop.

Both call ``on_complete(pendings, results)`` for every request they were handed, exactly once per
request as far as they are concerned (the harness still guards against a late second completion).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
import threading
import time
from typing import Any, Protocol, runtime_checkable

from variantbench.backends.base import Backend, Encoded, EncodesAhead, GenerationRequest, GenerationResult
from variantbench.records import QueryRecord

# Sleep (releasing the GIL) until this close to an arrival, then spin. Event-loop timers round to
# about 1 ms; a thread's nanosleep wakes within tens of microseconds, and a short spin keeps a
# spinning dispatcher from starving the threads that complete queries of the GIL.
SPIN_NS = 250_000


# The loop's timers round to about 1 ms and oversleep under load: sleep on them until this close to
# the time, then yield (``sleep(0)``) until it, serving I/O meanwhile. Measured (selftest, the no-op
# server pinned to the other core): spinning the last 3 ms held 400 requests/s at a p99 dispatch
# lag of 0.81 ms and 600/s at 1.49 ms; the last 1.5 ms, 600/s at 0.87-0.91 ms (less spinning leaves
# the loop more time to read answers); 0.8 ms woke late on the timer's rounding (400/s: 1.73 ms).
LOOP_SPIN_NS = 1_500_000

# A schedule starts this long after the system holds the whole plan (its offsets rebased then): time
# to stamp the absolute times, and for the first arrival's timer to be set.
START_LEAD_NS = 2_000_000


def rebase(plan: list[Pending], lead_ns: int = START_LEAD_NS) -> int:
    """Turn the plan's offsets into times on the monotonic clock, from a start ``lead_ns`` (plus
    a microsecond a query) from now; returns the start."""
    start = time.perf_counter_ns() + lead_ns + 1_000 * len(plan)
    for p in plan:
        p.record.scheduled_ns += start
    return start


async def until(at_ns: int) -> None:
    """Return at ``at_ns`` (perf_counter_ns) from inside an event loop, without blocking it."""
    remaining = at_ns - time.perf_counter_ns()
    if remaining > LOOP_SPIN_NS + 1_000_000:
        await asyncio.sleep((remaining - LOOP_SPIN_NS) / 1e9)
    while time.perf_counter_ns() < at_ns:
        await asyncio.sleep(0)


Done = Callable[[str, int, GenerationResult], None]  # (request id, issued at, result)


async def send_slice(backend: Any, items: list[tuple[str, int, GenerationRequest]], cap: int | None, start: int,
                     done: Done) -> None:  # fmt: skip
    """A sender's slice on its loop: each request at ``start`` + its offset, at most ``cap`` at once;
    ``done`` hears each answer (a backend that raises gives a failed result). A sender process and a
    Ray sender actor both send this way."""
    loop = asyncio.get_running_loop()
    slot = asyncio.Semaphore(cap) if cap else None

    async def one(request_id: str, request: GenerationRequest) -> None:
        issued = time.perf_counter_ns()
        try:
            result = await backend.agenerate(request)
        except Exception as exc:  # noqa: BLE001 - a backend bug is a failed query
            result = GenerationResult(request_id, status="error", error=f"{type(exc).__name__}: {exc}")
        finally:
            if slot is not None:
                slot.release()
        done(request_id, issued, result)

    for request_id, offset, request in items:
        await until(start + offset)
        if slot is not None:
            await slot.acquire()
        loop.create_task(one(request_id, request))


class Pending:
    __slots__ = ("record", "request", "done")

    def __init__(self, record: QueryRecord, request: GenerationRequest) -> None:
        self.record = record
        self.request = request
        self.done = False  # set under the harness's lock, exactly once


OnComplete = Callable[[list[Pending], list[GenerationResult]], None]


def wait_until(deadline_ns: int) -> None:
    while True:
        remaining = deadline_ns - time.perf_counter_ns()
        if remaining <= 0:
            return
        if remaining > SPIN_NS:
            time.sleep((remaining - SPIN_NS) / 1e9)


class ThreadedSUT:
    """One thread feeding an in-process backend whatever requests are waiting, in batches.

    A backend that encodes apart (``EncodesAhead``) gets its requests encoded on a CPU thread as
    they are submitted, so the chat template and tokenizer of the next requests run while the model
    computes the current ones (``preprocess=False``: inline, on the model's thread, for comparison).
    On this project's 2-core CPU a 2,030-token prompt encodes in 5.4 ms against seconds of prefill;
    on an accelerator the same 5.4 ms is the size of the prefill itself (``benchmarks/preprocessing.py``).
    """

    concurrent = False

    def __init__(self, backend: Backend, max_batch: int, on_complete: OnComplete, preprocess: bool = True):
        self.backend = backend
        self.max_batch = max_batch
        self.on_complete = on_complete
        self.inbox: deque[Pending] = deque()
        self.ready = threading.Condition()
        self.closing = False
        self.encoder: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="variantbench-preprocess")
            if preprocess and isinstance(backend, EncodesAhead)
            else None
        )
        self.encoding: dict[str, Future[Encoded]] = {}
        self.thread = threading.Thread(target=self._loop, name="variantbench-executor", daemon=True)
        self.thread.start()

    def submit(self, pendings: list[Pending]) -> None:
        if self.encoder is not None:
            encode = self.backend.encode_ahead  # type: ignore[attr-defined]
            for p in pendings:
                self.encoding[p.request.request_id] = self.encoder.submit(encode, p.request)
        with self.ready:
            self.inbox.extend(pendings)
            self.ready.notify()

    def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self.encoder is None:
            return self.backend.generate(requests)
        encoded = []
        for r in requests:
            t0 = time.perf_counter_ns()
            enc = self.encoding.pop(r.request_id).result()
            encoded.append(dataclasses.replace(enc, waited_ns=time.perf_counter_ns() - t0))
        return self.backend.generate_encoded(requests, encoded)  # type: ignore[attr-defined]

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
                results = self._generate([p.request for p in batch])
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
        if self.encoder is not None:
            self.encoder.shutdown(wait=False, cancel_futures=True)


class AsyncSUT:
    """For backends that serve many requests at once (HTTP): one event loop in its own thread.

    The dispatcher keeps its precise timing inside the loop and starts each request as its own task.
    """

    concurrent = True

    def __init__(self, backend: Any, on_complete: OnComplete):
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

    async def _one(self, pending: Pending, slot: asyncio.Semaphore | None = None) -> None:
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

    async def _dispatch(self, plan: list[Pending], max_concurrency: int | None) -> int:
        """Issue each request at its scheduled time (the plan's offsets from a start taken here),
        from inside the loop.

        Sleep on the loop's timer until about 3 ms before (its timers round to ~1 ms and oversleep
        under load), then yield with ``sleep(0)`` until the time: I/O keeps being served while the
        dispatcher waits, and no thread hand-off (nor the GIL) stands between the schedule and the send.
        """
        slot = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = rebase(plan)
        for p in plan:
            await until(p.record.scheduled_ns)
            if slot is not None:
                await slot.acquire()  # waiting for a slot is dispatch lag, and counts in latency
            self.loop.create_task(self._one(p, slot))
        return start

    def run_schedule(self, plan: list[Pending], max_concurrency: int | None) -> int:
        return asyncio.run_coroutine_threadsafe(self._dispatch(plan, max_concurrency), self.loop).result()

    def _start(self, pendings: list[Pending]) -> None:
        for p in pendings:
            self.loop.create_task(self._one(p))

    def submit(self, pendings: list[Pending]) -> None:
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


@runtime_checkable
class Schedules(Protocol):
    """An adapter that keeps a timed schedule itself (inside its event loop, or its senders'): the
    plan's ``scheduled_ns`` are offsets until it has taken the plan in and fixed the start (which it
    returns), then times on the monotonic clock."""

    def run_schedule(self, plan: list[Pending], max_concurrency: int | None) -> int: ...


SUT = Any  # ThreadedSUT | AsyncSUT | senders.SendersSUT: submit(), close(), maybe run_schedule()
