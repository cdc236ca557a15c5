"""One variant's executor: a thread that admits queued requests into the continuous batch and steps it.

The event loop side calls ``submit`` (admission: may raise ``Rejected``) and reads the request's
``asyncio.Queue`` of events: ``("token", id, t_ns)`` per token, then ``("done", reason)`` or
``("error", message)``. ``cancel`` (client disconnected) frees the request's queue entry or batch
slot at the next step boundary.

Never delays work when the model is idle: the thread sleeps on a condition that ``submit`` signals,
so a lone request starts at once. While a batch runs, newcomers join between decode steps
(continuous batching), so a long generation does not hold short ones hostage. Each step's time is
fed to the scheduler's cost model, which sheds requests that cannot meet their deadline.
A batch of ``max_batch=1`` turns batching off (the baseline the serving benchmark compares against).
A failing step fails only the requests in that batch; the thread goes on. Any other exception
(outside the step and admission) is the supervisor's (``_run``): it is logged and recorded, every
request the worker held fails with a 500 saying why, and the loop starts again with an empty batch;
while it is down (and for good after ``MAX_RESTARTS`` failures within ``RESTART_WINDOW_S``) it
refuses requests with 503 and ``down`` says why (``/health`` answers 503). Before issue 41 one such
exception ended the thread: its requests hung forever and ``/health`` still said ok.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
import logging
import threading
import time
from typing import Any

from variantbench.serving.batching import ChunkedPrefill
from variantbench.serving.continuous import NoRoom
from variantbench.serving.scheduler import (
    QueuePolicy,
    Rejected,
    Scheduler,
    StepPlan,
    Ticket,
    Urgency,
    plan_prefill,
)

RECENT_STEPS = 4096  # decode-step sizes and hold-opens kept for inspection (tests, debugging)
LIVE_S = 5.0  # a level with a TTFT objective counts as live this long after its last arrival (at least)
# ... and for this many of its mean gaps: arrivals are memoryless, so a long gap does not mean the
# traffic stopped. At 4 gaps (P(gap > 4 x mean) = 1.8% for Poisson arrivals) the level lapsed after
# such a gap, a less urgent prompt took a whole 256-token chunk (0.57 s, int8 SmolLM2-135M, 2 AVX2
# cores) and the interactive request arriving during it waited 446 ms for its first token (in a
# run with the step log; the soak's per-window p99s, not logged, reached 968 ms). At 10 gaps the
# chance is 0.005%; the price is short chunks for 10 gaps after the traffic really stops
LIVE_GAPS = 10.0
# the supervisor restarts a failed loop, unless it failed this often lately: then the fault is not a
# passing one, and the server should stop (non-zero) rather than fail every request it takes
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
LOG = logging.getLogger("variantbench.serving")


def _deliver(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


class _Level:
    """One priority level's recent traffic: when its requests arrive and how long their prompts are."""

    def __init__(self) -> None:
        self.last_s: float | None = None
        self.gap_s: float | None = None
        self.prompts: deque[int] = deque(maxlen=64)

    def arrived(self, t: float, prompt_tokens: int) -> None:
        if self.last_s is not None:
            gap = t - self.last_s
            self.gap_s = gap if self.gap_s is None else 0.8 * self.gap_s + 0.2 * gap
        self.last_s = t
        self.prompts.append(prompt_tokens)

    def live(self, now_s: float) -> bool:
        """An arrival is still expected: the last one is recent against the level's own rhythm."""
        if self.last_s is None:
            return False
        return now_s - self.last_s < max(LIVE_S, LIVE_GAPS * (self.gap_s or 0.0))

    def typical_prompt(self) -> int:
        ranked = sorted(self.prompts)
        return ranked[int(0.9 * (len(ranked) - 1))] if ranked else 0


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False
    priority: int = 0
    stops: frozenset[int] | None = None  # None: the model's stop tokens; empty: ``ignore_eos``
    tokens: int = 0  # sent so far


class BatchWorker:
    def __init__(self, batch: Any, max_queue: int = 256, aging_ms: float = 1000.0,
                 queue_timeout_ms: float | None = None, max_wait_ms: float = 10.0,
                 policies: dict[int, QueuePolicy] | None = None, name: str = "variant",
                 max_total: int | None = None) -> None:  # fmt: skip
        """``batch``: a ``ContinuousBatch`` (our torch engine) or a ``LlamaCppBatch``, or anything with
        their join / step / leave contract."""
        self.name = name
        self.batch = batch
        self.scheduler = Scheduler(policies=policies, default=QueuePolicy(max_queue=max_queue, timeout_ms=queue_timeout_ms),
                                   aging_ms=aging_ms, max_batch=batch.max_batch, max_total=max_total)  # fmt: skip
        self.down: str | None = None  # why the loop is not running (restarting, or for good: ``fatal``)
        self.fatal: str | None = None
        self.failures: list[tuple[float, str]] = []  # (monotonic time, why) of each loop failure
        self.on_fatal: list[Callable[[str], None]] = []  # told once the worker stops for good
        self.max_len = batch.max_len
        self.max_wait_s = max(0.0, max_wait_ms) / 1e3
        self._live: dict[Any, _Live] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False
        self._thread = threading.Thread(target=self._run, name=f"variantbench-batch-{name}", daemon=True)
        # the most recent decode-step sizes and hold-opens (seconds), bounded: a server that runs for
        # weeks must not grow with every step; /metrics' histograms keep the whole distribution
        self.batch_sizes: deque[int] = deque(maxlen=RECENT_STEPS)
        self.holds: deque[float] = deque(maxlen=RECENT_STEPS)
        self.step_listeners: list[Any] = []  # callables(decode rows, seconds, prompt tokens) after each step
        self._last_arrival: float | None = None
        self._gap_s: float | None = None  # moving average of the gaps between arrivals
        self._started: dict[Any, float] = {}  # taken in, first token not out yet: key -> queue wait (s)
        self._levels: dict[int, _Level] = {}  # by priority: recent arrivals (for the TTFT objectives)
        self._prefilling: dict[
            int, list[int]
        ] = {}  # per prompt, tokens left after the running step, by priority
        self._step_end: float | None = None  # when the running step is expected to end (perf_counter s)
        if isinstance(batch, ChunkedPrefill):
            self.scheduler.prefill_chunk = batch.prefill_chunk
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        # work for the model outside the batch (scoring a prompt), run on this thread between steps
        self._side: deque[tuple[Callable[[], Any], Future]] = deque()

    def start(self) -> BatchWorker:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def warm_up(self, passes: int = 2) -> None:
        """A few steps of made-up prompts before the first request (call before ``start``): a prompt
        alone, one row decoding, a prompt beside it, two rows; the last pass is fed to the cost model.

        Until the model has seen three steps, shedding admits blind: at 10x overload the one admitted
        request that came 117 ms late arrived in the server's first second. And the first steps are
        cold: the first prompt step took 0.46-0.68 s against 0.36 s warm (int8 SmolLM2-135M, 2 AVX2
        cores). The prompts differ between passes, so the prefix cache cannot shorten the counted one."""
        chunked = isinstance(self.batch, ChunkedPrefill)
        counters = getattr(self.batch, "prompt_tokens", None)
        before = dict(counters) if isinstance(counters, dict) else None
        cost = self.scheduler.cost

        def step(counted: bool) -> None:
            rows = self.batch.active
            t0 = time.perf_counter()
            self.batch.step()
            seconds = time.perf_counter() - t0
            tokens = 0
            if chunked:
                rows, tokens = self.batch.last_rows, self.batch.last_prompt_tokens
            if counted:
                cost.observe_step(rows, tokens, seconds)

        for n in range(passes):
            counted = n == passes - 1
            for i, length in enumerate((64, 16)[: self.batch.max_batch]):
                prompt = [3 + (n * 131 + i * 17 + j * 7) % 297 for j in range(length)]
                t0 = time.perf_counter()
                if chunked:
                    self.batch.begin(("warm-up", n, i), prompt, 8)
                else:
                    self.batch.join(("warm-up", n, i), prompt, 8)
                    if counted:
                        cost.observe_prefill(length, time.perf_counter() - t0)
                step(counted)
                step(counted)
            step(counted)
            for key in list(self.batch.keys()):
                self.batch.leave(key)
        if before is not None:  # /metrics counts the requests' prompt tokens only
            counters.clear()
            counters.update(before)

    # ---- event-loop side ------------------------------------------------------------------------

    def submit(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
               deadline_s: float | None = None, ignore_eos: bool = False) -> asyncio.Queue:  # fmt: skip
        """Queue a request from the event loop; its events arrive on the returned queue.
        ``ignore_eos`` (vLLM's): it runs to ``max_new`` tokens past the model's stop tokens."""
        if self._draining:
            raise Rejected(503, "the server is shutting down", 1.0)
        if self.down is not None:
            raise Rejected(503, f"the worker of {self.name} is down ({self.down})", 1.0)
        if not self.batch.fits(len(prompt), max_new):
            raise ValueError(
                f"prompt of {len(prompt)} tokens + {max_new} new exceeds the context of {self.max_len}"
            )
        now = time.perf_counter_ns()
        ticket = Ticket(key=key, priority=priority, arrival_ns=now, prompt_tokens=len(prompt), max_new=max_new,
                        deadline_ns=now + int(deadline_s * 1e9) if deadline_s else None, payload=prompt)  # fmt: skip
        live = _Live(asyncio.get_running_loop(), asyncio.Queue(), priority=priority,
                     stops=frozenset() if ignore_eos else None)  # fmt: skip
        with self._cond:
            self._levels.setdefault(priority, _Level()).arrived(now / 1e9, len(prompt))
            # may raise Rejected
            step_left = 0.0 if self._step_end is None else self._step_end - now / 1e9
            # its prompt pauses the decode rows if its level is the urgent one (``plan_prefill``)
            chunked = isinstance(self.batch, ChunkedPrefill)
            urgency = self.urgency(now / 1e9) if chunked else None
            urgent = not chunked or (urgency is not None and priority <= urgency.priority)
            rows = self.batch.active - sum(len(v) for v in self._prefilling.values())
            self.scheduler.submit(ticket, now, running=self.batch.active, prefilling=dict(self._prefilling),
                                  step_left_s=step_left, decode_rows=0 if urgent else max(0, rows))  # fmt: skip
            self._live[key] = live
            t = now / 1e9
            if self._last_arrival is not None:
                gap = t - self._last_arrival
                self._gap_s = gap if self._gap_s is None else 0.8 * self._gap_s + 0.2 * gap
            self._last_arrival = t
            self._cond.notify()
        return live.events

    def cancel(self, key: Any) -> None:
        with self._cond:
            live = self._live.get(key)
            if live is not None:
                live.cancelled = True
            self._cond.notify()

    def queue_depth(self) -> int:
        return len(self.scheduler)

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on this worker's thread before its next step; its result (or exception) in the
        future. The model is the thread's: a forward from another thread would compete with the
        batch's steps for the same cores and weights, and a scoring request waits one step at most."""
        future: Future = Future()
        with self._cond:
            if self._stopping or self._draining:
                future.set_exception(RuntimeError("the server is stopping"))
                return future
            self._side.append((fn, future))
            self._cond.notify()
        return future

    def _run_side(self) -> None:
        while True:
            with self._cond:
                if not self._side:
                    return
                fn, future = self._side.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - the caller's error, not the worker's
                    future.set_exception(exc)

    def drain_and_stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish the admitted ones, stop the thread."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                if not self._live:
                    break
            time.sleep(0.01)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=5)

    # ---- thread side ----------------------------------------------------------------------------

    def _stops(self, key: Any) -> frozenset[int] | None:
        live = self._live.get(key)
        return None if live is None else live.stops

    def _done(self, key: Any, token: int) -> tuple:
        """The finish event of a request whose last token was ``token``."""
        stops = self._stops(key)
        return ("done", "stop" if token in (self.batch.stop_ids if stops is None else stops) else "length")

    def _emit(self, key: Any, event: tuple) -> None:
        live = self._live.get(key)
        if live is not None:
            live.tokens += event[0] == "token"
            self._outbox.setdefault(live.loop, []).append((live.events, event))

    def _flush(self) -> None:
        """Hand the events of this turn to their event loops: one wake-up per loop, not per token.

        Each wake-up is a thread switch on a machine whose cores the model's threads fill; posting
        every token on its own woke the server's loop ten times per step at ten rows."""
        outbox, self._outbox = self._outbox, {}
        for loop, events in outbox.items():
            loop.call_soon_threadsafe(_deliver, events)

    def _finish(self, key: Any, event: tuple) -> None:
        """Free the request's slot, then tell its client (who may look at the batch at once)."""
        with self._cond:
            live = self._live.pop(key, None)
            self._started.pop(key, None)
        self.batch.leave(key)
        if live is not None:
            if event[0] == "done":  # the batch's sizing learns the answers' length
                self.scheduler.mix.answered(live.tokens)
            self._outbox.setdefault(live.loop, []).append((live.events, event))

    def _take(self) -> tuple[list[Ticket], list[tuple[Ticket, str]], list[Any]] | None:
        """Under the lock: wait for work; then (tickets to admit, expired, cancelled keys), or None to stop."""
        with self._cond:
            while (
                not self._stopping and self.batch.active == 0 and not len(self.scheduler) and not self._side
            ):
                self._cond.wait()
            if self._stopping:
                return None
            cancelled = [key for key, live in self._live.items() if live.cancelled]
            for key in cancelled:  # disconnected clients free their queue entry or batch slot
                self.scheduler.remove(key)
                self._live.pop(key, None)
            now = time.perf_counter_ns()
            expired = self.scheduler.expire(now)
            tickets: list[Ticket] = []
            limit = self.scheduler.useful_batch()  # adaptive: what still pays

            # the levels of the rows in the batch (its priority, not its aged place in the queue)
            levels = [self._live[key].priority for key in self.batch.keys() if key in self._live]

            def allowed(t: Ticket) -> bool:
                # a request with a first-token objective joins even beyond the size that still pays
                # when less urgent rows hold the batch, and past an older one held back by that
                # size: a 30-minute soak deadlocked when an aged batch request at the head kept the
                # interactive ones behind it out of the batch while the batch's prompts waited for
                # them (every TTFT 500+ s, the server 40% busy). Among rows of its own level it
                # waits for a row to end, as every request does: letting each one in at once made
                # the batch a processor share in which the longest answers waited for every
                # newcomer's prompt (see ``StepCost.useful_batch``)
                return self.batch.active + len(tickets) < limit or (
                    self.scheduler.policy(t.priority).ttft_slo_ms is not None
                    and any(level > t.priority for level in levels)
                )

            while self.batch.active + len(tickets) < self.batch.max_batch:
                ticket = self.scheduler.peek(now, allowed)
                if ticket is None:
                    break
                taken = self.scheduler.take(ticket)
                tickets.append(taken)
                # prefilling from now on: admission counts its prompt before the next step says so
                self._prefilling.setdefault(taken.priority, []).append(taken.prompt_tokens)
            return tickets, expired, cancelled

    def urgency(self, now_s: float) -> Urgency | None:
        """The most urgent level with a TTFT objective whose traffic is live, if any (under the lock),
        and only while a less urgent request is queued or in the batch: requests of one level share
        the steps as chunked prefill does (pausing decode rows for every prompt of the same level
        would only trade their inter-token gaps for each other's first tokens)."""
        held = [live.priority for live in self._live.values()]
        if not held:
            return None
        # from what the lock guards, not the batch: submit asks this while a step may be running
        pending = {level for level, left in self._prefilling.items() if left}
        for level in sorted(self._levels):
            if level >= max(held):
                return None
            slo = self.scheduler.policy(level).ttft_slo_ms
            info = self._levels[level]
            waiting = self.scheduler.depth(level) > 0
            if slo is not None and (waiting or level in pending or info.live(now_s)):
                return Urgency(level, slo / 1e3, info.typical_prompt(), waiting)
        return None

    def _admit(self, tickets: list[Ticket]) -> None:
        chunked = isinstance(
            self.batch, ChunkedPrefill
        )  # prefilled by the next steps, beside the decode rows
        for i, ticket in enumerate(tickets):
            t0 = time.perf_counter_ns()
            try:
                if chunked:
                    self.batch.begin(ticket.key, ticket.payload, ticket.max_new, priority=ticket.priority,
                                     stops=self._stops(ticket.key))  # fmt: skip
                    self._started[ticket.key] = (t0 - ticket.arrival_ns) / 1e9
                    continue
                first, done = self.batch.join(
                    ticket.key, ticket.payload, ticket.max_new, self._stops(ticket.key)
                )
            except NoRoom:  # back in line, in their places, until running requests finish
                with self._cond:
                    for t in tickets[i:]:
                        self.scheduler.requeue(t)
                return
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._finish(ticket.key, ("error", 500, f"{type(exc).__name__}: {exc}"))
                continue
            now = time.perf_counter_ns()
            self.scheduler.cost.observe_prefill(ticket.prompt_tokens, (now - t0) / 1e9)
            self.scheduler.mix.prompted(ticket.prompt_tokens)
            self._emit(ticket.key, ("token", first, now, (t0 - ticket.arrival_ns) / 1e9))
            if done:
                self._finish(ticket.key, self._done(ticket.key, first))

    def _left_after(self, plan: StepPlan) -> dict[int, int]:
        """Prompt tokens left to prefill by level once ``plan``'s chunks are computed."""
        planned = dict(plan.prefill)
        left: dict[int, list[int]] = {}
        for p in sorted(self.batch.pending_prefills(), key=lambda p: p.seq):
            rest = p.left - planned.get(p.key, 0)
            if rest > 0:
                left.setdefault(p.priority, []).append(rest)
        return left

    def _expected_step_s(self, rows: int, plan: StepPlan | None) -> float | None:
        """The step about to run, by the cost model (None until it has learned)."""
        cost = self.scheduler.cost
        if not cost.known:
            return None
        if plan is None:
            return cost.step_s(rows)
        tokens = sum(n for _, n in plan.prefill)
        decoding = rows - sum(1 for p in self.batch.pending_prefills() if p.left) if plan.decode else 0
        if decoding <= 0:
            return cost.prefill_alone_s(tokens)
        return cost.step_s(decoding) + tokens * cost.prefill_marginal_s

    def hold_s(self, running: int) -> float:
        """How long to hold the next decode step open for an expected newcomer (0: step now).

        With continuous batching a newcomer joins at the next step boundary anyway, so holding can
        only win one step: it pays when the next arrival is expected (mean gap of recent arrivals)
        sooner than one step takes, i.e. when the ``running`` rows together lose less waiting
        (running x gap) than the newcomer gains (one step at the fitted cost a x (n+1) + b), and
        never longer than ``max_wait_ms``. An idle model is never held: a lone request starts at once.
        """
        limit = self.scheduler.useful_batch()
        if running == 0 or running >= limit or not self.scheduler.cost.known:
            return 0.0
        gap = self._gap_s
        if gap is None or self._last_arrival is None:
            return 0.0
        # expected wait to the next arrival from now (memoryless: the mean gap, less what has passed
        # only when that is already overdue, in which case arrivals have stopped and we do not wait)
        since = time.perf_counter() - self._last_arrival
        if since > 2 * gap:
            return 0.0
        if gap > self.max_wait_s or running * gap >= self.scheduler.cost.step_s(running + 1):
            return 0.0
        return gap

    def _run(self) -> None:
        """The thread: the loop, started again after an exception it did not expect."""
        while True:
            try:
                self._loop()
                return
            except Exception as exc:  # noqa: BLE001 - recorded, its requests failed, the loop restarted
                why = f"{type(exc).__name__}: {exc}"
                LOG.error("the worker of %s failed: %s", self.name, why, exc_info=exc)
                now = time.monotonic()
                self.failures.append((now, why))
                self.down = why
                try:
                    self._fail_held(f"the worker of {self.name} failed ({why}); it restarts")
                except Exception as again:  # noqa: BLE001 - it cannot even clean up: stop for good
                    why = f"{why}; then, failing its requests: {type(again).__name__}: {again}"
                    self.failures.append((now, why))
                recent = sum(1 for t, _ in self.failures if now - t < RESTART_WINDOW_S)
                if self._stopping or recent > MAX_RESTARTS:
                    self.fatal = f"the worker of {self.name} failed {recent} times in {RESTART_WINDOW_S:g} s; last: {why}"
                    self.down = self.fatal
                    LOG.error("%s: it stops", self.fatal)
                    for listener in self.on_fatal:
                        listener(self.fatal)
                    return
                self.down = None

    def _fail_held(self, message: str) -> None:
        """Every request the worker holds (queued or in the batch) ends with a 500 and ``message``;
        the batch is emptied and the side calls are failed."""
        with self._cond:
            keys = list(self._live)
            for key in keys:
                self.scheduler.remove(key)
            side, self._side = list(self._side), deque()
            self._prefilling = {}
            self._step_end = None
        self._started.clear()
        for key in [*keys, *self.batch.keys()]:
            self._finish(key, ("error", 500, message))
        self._flush()
        for _, future in side:
            future.set_exception(RuntimeError(message))

    def _loop(self) -> None:
        held = False
        while True:
            self._flush()  # before _take, which may wait
            self._run_side()
            work = self._take()
            if work is None:
                for key in list(self._live):
                    self._finish(key, ("error", 503, "the server stopped"))
                self._flush()
                with self._cond:
                    side, self._side = list(self._side), deque()
                for _, future in side:
                    future.set_exception(RuntimeError("the server stopped"))
                return
            tickets, expired, cancelled = work
            for key in cancelled:
                self._started.pop(key, None)
                self.batch.leave(key)
            for ticket, why in expired:
                self._finish(ticket.key, ("error", 503, why))
            self._admit(tickets)
            if self.batch.active == 0:
                continue
            if not held:
                hold = self.hold_s(self.batch.active)
                if hold > 0:
                    self._flush()
                    with self._cond:
                        if not len(self.scheduler) and not self._stopping:
                            self._cond.wait(hold)  # a newcomer's submit wakes it
                    self.holds.append(hold)
                    held = True
                    continue  # admit whoever came, then step
            held = False
            size = self.batch.active
            plan = None
            if isinstance(self.batch, ChunkedPrefill):
                with self._cond:
                    urgency = self.urgency(time.perf_counter())
                plan = plan_prefill(self.batch.pending_prefills(), self.batch.prefill_chunk, len(self.batch.keys()),
                                    self.scheduler.cost, urgency)  # fmt: skip
            expect = self._expected_step_s(size, plan)
            t0 = time.perf_counter()
            with self._cond:  # admission reads what this step leaves and when it ends
                self._step_end = None if expect is None else t0 + expect
                if plan is not None:
                    self._prefilling = self._left_after(plan)
            try:
                produced = self.batch.step(plan) if plan is not None else self.batch.step()
            except Exception as exc:  # noqa: BLE001 - a failing step fails only this batch
                with self._cond:
                    self._step_end = None
                for key in self.batch.keys():
                    self._started.pop(key, None)
                    self._finish(key, ("error", 500, f"{type(exc).__name__}: {exc}"))
                continue
            seconds = time.perf_counter() - t0
            prompt_tokens = 0
            with self._cond:
                self._step_end = None
            if isinstance(self.batch, ChunkedPrefill):
                size, prompt_tokens = self.batch.last_rows, self.batch.last_prompt_tokens
                with self._cond:
                    self._prefilling = self._left_after(StepPlan())
            cost = self.scheduler.cost
            if prompt_tokens:  # a mixed step: what the decode rows alone would have cost is not prefill
                decode_s = cost.step_s(size) if size and cost.known else 0.0
                cost.observe_prefill(prompt_tokens, max(seconds - decode_s, 0.0))
            cost.observe_step(size, prompt_tokens, seconds)
            if size:
                self.batch_sizes.append(size)
            for listener in self.step_listeners:
                listener(size, seconds, prompt_tokens)
            now = time.perf_counter_ns()
            firsts = 0
            for key, token, done in produced:
                waited = self._started.pop(key, None)
                firsts += waited is not None
                self._emit(key, ("token", token, now, waited))
                if done:
                    self._finish(key, self._done(key, token))
            # chunked prefill: a prompt's tokens come over steps, its end in one
            if prompt_tokens or firsts:
                self.scheduler.mix.prompted(prompt_tokens, firsts)
