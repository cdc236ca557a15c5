"""Senders as Ray actors on several nodes: load from more machines than one, for an endpoint run
(``--executor ray`` with served variants) when one machine cannot saturate the server.

Each sender is the unit ``senders.py`` defines (a slice of the pre-drawn schedule, its own event
loop and connection pool, one agreed start), placed as an actor spread over the cluster's nodes.
What changes across machines is the clock: every process on one host shares ``perf_counter_ns``
(CLOCK_MONOTONIC), while two hosts' monotonic clocks are unrelated. Before a run the driver
measures each sender's offset from its own clock by round trips (``now()``, NTP's way: of 16
tries, the one with the shortest round trip; the offset is known to within half of it), hands
each sender the start on its own clock, and turns every timestamp that comes back (issued, first
token, tokens, end) into the driver's clock. The report keeps each sender's node, offset and round
trip beside its dispatch lag.

Completions come back by polling (every ``POLL_S``), so the harness takes each query's end from
its own timestamp (``GenerationResult.arrived_ns``), not from when the poll brought it. Exactly
once: the driver keeps the books as ``SendersSUT`` does; a sender's second answer to a request is
dropped, and a sender lost mid-run leaves its queries to the harness's drain, as timeouts.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

from variantbench.backends.base import GenerationRequest, GenerationResult
from variantbench.loadgen.sut import OnComplete, Pending, rebase, send_slice
from variantbench.ray_cluster import NODE_RESOURCE, connect

POLL_S = 0.005
PROBES = 16
# the start goes out by a remote call to every sender: further ahead than a local process needs
START_LEAD_NS = 100_000_000


class _Sender:
    """The actor: a loop in a thread of its own sends a slice of the schedule; completions wait in a
    list until the driver drains them."""

    def __init__(self, sender: int, backend: Any) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.sender, self.backend = sender, backend
        self.done: list[tuple[str, int, GenerationResult]] = []
        self.lock = threading.Lock()
        self.held: tuple[list[tuple[str, int, GenerationRequest]], int | None] | None = None
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.backend.astart())
            started.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True, name=f"variantbench-ray-sender-{sender}").start()
        started.wait(timeout=60)

    def node(self) -> dict[str, Any]:
        from variantbench.ray_cluster import fingerprint

        return fingerprint()

    def now(self) -> int:
        return time.perf_counter_ns()

    def arm(self, items: list[tuple[str, int, GenerationRequest]], cap: int | None) -> bool:
        self.held = (items, cap)
        return True

    def start(self, start_ns: int) -> None:
        assert self.held is not None, "start before arm"
        items, cap = self.held
        self.held = None
        asyncio.run_coroutine_threadsafe(
            send_slice(self.backend, items, cap, start_ns, self._done), self.loop
        )

    def send_now(self, items: list[tuple[str, int, GenerationRequest]]) -> None:
        now = time.perf_counter_ns()
        asyncio.run_coroutine_threadsafe(send_slice(self.backend, items, None, now, self._done), self.loop)

    def drain(self) -> list[tuple[str, int, GenerationResult]]:
        with self.lock:
            done, self.done = self.done, []
        return done

    def _done(self, request_id: str, issued: int, result: GenerationResult) -> None:
        if not result.end_ns:
            result.end_ns = time.perf_counter_ns()
        with self.lock:
            self.done.append((request_id, issued, result))

    def close(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.backend.aclose(), self.loop)
        try:
            fut.result(timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


def clock_offset(now: Any, probes: int = PROBES) -> tuple[int, int]:
    """(offset of a remote clock from ours, round trip) in ns, from ``now()`` round trips: the
    shortest one's midpoint (the offset is then known within half its round trip)."""
    best: tuple[int, int] | None = None
    for _ in range(probes):
        t0 = time.perf_counter_ns()
        remote = now()
        t1 = time.perf_counter_ns()
        rtt = t1 - t0
        if best is None or rtt < best[1]:
            best = (remote - (t0 + t1) // 2, rtt)
    assert best is not None
    return best


def _shift(result: GenerationResult, by: int) -> GenerationResult:
    """A result's timestamps moved from the sender's clock to ours (``by``: its offset)."""
    result.start_ns = result.start_ns - by if result.start_ns else 0
    result.first_token_ns = None if result.first_token_ns is None else result.first_token_ns - by
    result.token_ns = [t - by for t in result.token_ns]
    result.end_ns = result.end_ns - by if result.end_ns else 0
    result.arrived_ns = result.end_ns or None
    return result


class RaySendersSUT:
    """The harness's adapter with N sender actors spread over a Ray cluster's nodes."""

    concurrent = True

    def __init__(
        self, backend: Any, senders: int, on_complete: OnComplete, address: str | None = None
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = connect(address)
        self.on_complete = on_complete
        alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE)]
        self.senders = senders or nodes
        actor = ray.remote(num_cpus=0)(_Sender)
        self.actors = []
        for i in range(self.senders):  # round-robin over the nodes: sender k on node k mod n
            node = alive[i % len(alive)]["NodeID"] if alive else None
            strategy = NodeAffinitySchedulingStrategy(node, soft=False) if node else "SPREAD"
            self.actors.append(actor.options(scheduling_strategy=strategy, name=None).remote(i, backend))
        self.info: list[dict[str, Any]] = []
        self.offsets: list[int] = []
        for i, a in enumerate(self.actors):
            where = ray.get(a.node.remote(), timeout=120)
            offset, rtt = clock_offset(lambda a=a: ray.get(a.now.remote()))
            self.offsets.append(offset)
            self.info.append({"sender": i, "where": "ray", "node_id": where["node_id"], "ip": where["ip"],
                              "host": where["host"], "clock_offset_ms": round(offset / 1e6, 3),
                              "clock_rtt_ms": round(rtt / 1e6, 3)})  # fmt: skip
        self.waiting: dict[str, Pending] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.next_sender = 0
        self.collector = threading.Thread(target=self._collect, name="variantbench-ray-senders", daemon=True)
        self.collector.start()

    def senders_info(self) -> list[dict[str, Any]]:
        return self.info

    def _collect(self) -> None:
        import ray

        while not self.stop.is_set():
            try:
                batches = ray.get([a.drain.remote() for a in self.actors], timeout=30)
            except ray.exceptions.RayError:  # a lost sender: its queries end as timeouts in the drain
                time.sleep(POLL_S)
                continue
            for sender, done in enumerate(batches):
                for request_id, issued, result in done:
                    with self.lock:
                        pending = self.waiting.pop(request_id, None)
                    if pending is None:  # a second answer to one request: never counted twice
                        continue
                    pending.record.issued_ns = issued - self.offsets[sender]
                    pending.record.sender = sender
                    self.on_complete([pending], [_shift(result, self.offsets[sender])])
            time.sleep(POLL_S)

    def _items(self, group: list[Pending]) -> list[tuple[str, int, GenerationRequest]]:
        with self.lock:
            for p in group:
                self.waiting[p.request.request_id] = p
        return [(p.request.request_id, p.record.scheduled_ns, p.request) for p in group]

    def run_schedule(self, plan: list[Pending], max_concurrency: int | None) -> int:
        """Query k to sender k mod N; every sender armed with its slice (offsets), then each given
        the one start on its own clock."""
        import ray

        slices: list[list[Pending]] = [[] for _ in range(self.senders)]
        for k, p in enumerate(plan):
            slices[k % self.senders].append(p)
        cap = math.ceil(max_concurrency / self.senders) if max_concurrency else None
        ray.get([a.arm.remote(self._items(group), cap) for a, group in zip(self.actors, slices, strict=True)])
        start = rebase(plan, lead_ns=START_LEAD_NS)
        for a, offset in zip(self.actors, self.offsets, strict=True):
            a.start.remote(start + offset)
        return start

    def submit(self, pendings: list[Pending]) -> None:
        """Unscheduled queries: now, to the senders in turn."""
        for p in pendings:
            p.record.scheduled_ns = p.record.scheduled_ns or time.perf_counter_ns()
            self.actors[self.next_sender].send_now.remote(self._items([p]))
            self.next_sender = (self.next_sender + 1) % self.senders

    def close(self, timeout_s: float = 5.0) -> None:
        import ray

        self.stop.set()
        self.collector.join(timeout=timeout_s + 30)
        for a in self.actors:
            try:
                ray.get(a.close.remote(), timeout=timeout_s)
            except ray.exceptions.RayError:
                pass
            ray.kill(a)
