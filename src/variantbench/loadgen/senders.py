"""Sender processes: the pre-drawn schedule of a server-scenario run split across N processes, each
with its own event loop and connection pool, so parsing one response never delays the next send.

One event loop that both sends and parses streamed answers falls behind as the rate grows: here
``variantbench selftest`` held 100 requests/s with a p99 dispatch lag under 1 ms on one loop, and
1.9 ms at 200/s. A sender is the unit a distributed load generator will place on other machines
(Ray, later): it takes a slice of the schedule (offsets), says it is armed, and is then given one
start time on this host's monotonic clock (which every process here shares), a little ahead;
it sends each request at its time, reporting each completion as it happens. The parent keeps the
books: every query is issued by exactly one sender and completed exactly once (a sender that dies leaves its queries to the harness's drain, as timeouts).

``--max-concurrency`` is shared out: each of N senders holds at most ceil(C / N) requests.
"""

from __future__ import annotations

import asyncio
import gc
import math
import multiprocessing as mp
import pickle
import queue
import threading
import time
from typing import Any, Protocol, runtime_checkable

from variantbench.backends.base import Backend, ConcurrentBackend, GenerationRequest, GenerationResult
from variantbench.loadgen.sut import AsyncSUT, OnComplete, Pending, ThreadedSUT, rebase, send_slice

READY_TIMEOUT_S = 120.0


def _sender_main(sender: int, backend_blob: bytes, inbox: Any, outbox: Any) -> None:
    """A sender process: its own loop; slices arrive on ``inbox``, completions leave on ``outbox``."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    backend = pickle.loads(backend_blob)
    loop.run_until_complete(backend.astart())
    gc.collect()
    gc.freeze()  # no full collection walking the imports mid-schedule

    def done(request_id: str, issued: int, result: GenerationResult) -> None:
        outbox.put(("done", sender, request_id, issued, result))

    def dispatch(items: list[tuple[str, int, GenerationRequest]], cap: int | None, start: int) -> Any:
        return send_slice(backend, items, cap, start, done)

    def reader() -> None:
        held = None  # a slice taken in, waiting for the start every sender agrees on
        while True:
            msg = inbox.get()
            if msg is None:
                loop.call_soon_threadsafe(loop.stop)
                return
            kind, *rest = msg
            if kind == "slice":
                items, cap, start = rest
                if start is None:
                    held = (items, cap)
                    outbox.put(("armed", sender, None, 0, None))
                    continue
                asyncio.run_coroutine_threadsafe(dispatch(items, cap, start), loop)
            elif kind == "start" and held is not None:
                asyncio.run_coroutine_threadsafe(dispatch(*held, rest[0]), loop)
                held = None

    threading.Thread(target=reader, daemon=True).start()
    outbox.put(("ready", sender, None, 0, None))
    loop.run_forever()
    loop.run_until_complete(backend.aclose())


class SendersSUT:
    """The harness's adapter for a concurrent (HTTP) backend with N sender processes."""

    concurrent = True

    def __init__(self, backend: Any, senders: int, on_complete: OnComplete) -> None:
        self.on_complete = on_complete
        self.senders = senders
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(senders)]
        blob = pickle.dumps(backend)
        self.procs = [ctx.Process(target=_sender_main, args=(i, blob, self.inboxes[i], self.outbox), daemon=True,
                                  name=f"variantbench-sender-{i}") for i in range(senders)]  # fmt: skip
        for p in self.procs:
            p.start()
        ready = 0
        deadline = time.monotonic() + READY_TIMEOUT_S
        while ready < senders:
            try:
                kind, *_ = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self._stop()
                raise RuntimeError(f"{senders - ready} of {senders} sender processes did not start") from None
            ready += kind == "ready"
        self.waiting: dict[str, Pending] = {}
        self.lock = threading.Lock()
        self.armed = threading.Semaphore(0)
        self.next_sender = 0
        self.collector = threading.Thread(target=self._collect, name="variantbench-senders", daemon=True)
        self.collector.start()

    def _collect(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            kind, sender, request_id, issued, result = msg
            if kind == "armed":
                self.armed.release()
                continue
            with self.lock:
                pending = self.waiting.pop(request_id, None)
            if pending is None:  # a second answer to one request: never counted twice
                continue
            pending.record.issued_ns = issued
            pending.record.sender = sender
            self.on_complete([pending], [result])

    def _send(self, slices: list[list[Pending]], cap: int | None, start: int | None) -> None:
        """Each sender its slice: ``(request id, time, request)``; the times are offsets from a
        start still to come when ``start`` is None, else from ``start``."""
        with self.lock:
            for group in slices:
                for p in group:
                    self.waiting[p.request.request_id] = p
        for i, group in enumerate(slices):
            self.inboxes[i].put(
                (
                    "slice",
                    [(p.request.request_id, p.record.scheduled_ns, p.request) for p in group],
                    cap,
                    start,
                )
            )

    def run_schedule(self, plan: list[Pending], max_concurrency: int | None) -> int:
        """Query k to sender k mod N (every sender sees the whole rate's shape, 1/N of it). Every
        sender takes its slice in first; then one start time, a little ahead, goes to all of them."""
        slices: list[list[Pending]] = [[] for _ in range(self.senders)]
        for k, p in enumerate(plan):
            slices[k % self.senders].append(p)
        self._send(slices, math.ceil(max_concurrency / self.senders) if max_concurrency else None, None)
        for _ in range(self.senders):
            if not self.armed.acquire(timeout=READY_TIMEOUT_S):
                raise RuntimeError("a sender process did not take its slice of the schedule")
        start = rebase(plan)
        for inbox in self.inboxes:
            inbox.put(("start", start))
        return start

    def submit(self, pendings: list[Pending]) -> None:
        """Unscheduled queries (warm-up aside): now, to the senders in turn."""
        slices: list[list[Pending]] = [[] for _ in range(self.senders)]
        for p in pendings:
            p.record.scheduled_ns = p.record.scheduled_ns or time.perf_counter_ns()
            slices[self.next_sender].append(p)
            self.next_sender = (self.next_sender + 1) % self.senders
        self._send(slices, None, 0)

    def _stop(self, timeout_s: float = 5.0) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop(timeout_s)
        self.outbox.put(None)
        self.collector.join(timeout=timeout_s)


@runtime_checkable
class DescribesSenders(Protocol):
    """An adapter whose senders run elsewhere and say where (node, clock offset) for the report."""

    def senders_info(self) -> list[dict[str, Any]]: ...


def adapter_for(backend: Backend, batch_limit: int, on_complete: OnComplete, senders: int = 1,
                ray_address: str | None = None) -> Any:  # fmt: skip
    """The adapter a backend needs: for concurrent (HTTP) backends an event loop, or ``senders``
    processes with one each (a timed schedule), or sender actors on a Ray cluster (``ray_address``
    not None; "" a local cluster); else a feeding thread."""
    if isinstance(backend, ConcurrentBackend) and backend.concurrent:
        if ray_address is not None:
            from variantbench.loadgen.ray_senders import RaySendersSUT

            return RaySendersSUT(backend, senders, on_complete, ray_address or None)
        if senders > 1:
            return SendersSUT(backend, senders, on_complete)
        return AsyncSUT(backend, on_complete)
    return ThreadedSUT(backend, batch_limit, on_complete)
