"""Admission and order: priority queue with aging, per-priority queue policy, and a learned step cost.

* Priority: an integer, lower first (vLLM's field). Aging: a waiting request's effective priority
  falls by one level every ``aging_ms``, so a stream of urgent requests cannot starve the others.
  Ties go to the earlier arrival.
* Queue policy per priority level (Triton's shape): a maximum queue size (a full queue rejects:
  HTTP 429 with Retry-After) and a timeout (a request waiting longer is rejected, or, with
  ``on_timeout="delay"``, kept but sent to the back of its level).
* Cost model: decode step time = a x batch size + b, fitted by least squares over recent steps
  (BentoML's adaptive batching fits the same shape); with a request's prompt and output length it
  estimates when the request would finish, so one that cannot meet its deadline is shed at once
  (HTTP 503 with Retry-After) instead of wasting a batch slot. The same fit sizes the batch: rows
  are added only while one more row still raises the requests/s, a request costing its own prefill
  and its share of the decode steps (``useful_batch``, with the typical request of ``RequestMix``).

* Time to first token per level (``ttft_slo_ms``, the seeds' "99% of interactive requests within
  500 ms"): once a long prompt's prefill chunks run, an urgent request that arrives waits for the
  running step, then for its own prefill. ``plan_prefill`` decides each step's prompt tokens so that
  wait stays short: while an urgent level is live, a less urgent prompt advances in chunks sized
  from the cost model to leave the urgent request its objective, and not at all while an urgent
  prompt is waiting or prefilling (its decode rows go on; its keys/values stay in place). With
  ``shed_late``, admission rejects (503) a request whose expected first token would miss the
  objective anyway, so the admitted ones keep it under overload. Measured with ``benchmarks/priority.py``.

Pure Python and a clock passed in: the tests drive it with their own time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
import itertools
from typing import Any

# admission sheds what it expects past this share of the objective: the cost model predicts the next
# step within -21%..+25% (p10..p90, int8 SmolLM2-135M at 10x overload), and the client's own HTTP
# and tokenization add to its time to first token; at 1.0, 11 of 101 admitted requests took 508-634 ms
SHED_MARGIN = 0.85


class Rejected(Exception):  # noqa: N818 - an answer, not a failure
    """The request is not admitted: ``status`` 429 (overload) or 503 (cannot meet its deadline)."""

    def __init__(self, status: int, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class QueuePolicy:
    max_queue: int = 256  # per priority level
    timeout_ms: float | None = None  # longest wait in the queue
    on_timeout: str = "reject"  # "reject" | "delay"
    # first token within this: the prefill of less urgent levels is cut into chunks short enough to
    # keep it (``plan_prefill``), /metrics counts its attainment, and with ``shed_late`` admission
    # rejects (503) what cannot make it, so the admitted ones keep it under overload
    ttft_slo_ms: float | None = None
    shed_late: bool = False


@dataclass
class Ticket:
    key: Any
    priority: int
    arrival_ns: int
    prompt_tokens: int
    max_new: int
    deadline_ns: int | None = None  # absolute, same clock as arrival_ns
    payload: Any = None
    seq: int = 0
    requeued_ns: int | None = None  # a delayed request's new place in line


@dataclass
class StepCost:
    """One model of a step's time for every kind of step: time = b + a x decode rows + c x prompt tokens,
    non-negative least squares (scipy's nnls) of the relative error over the recent mean time of each
    step shape (decode rows, 16-token bucket of prompt tokens), so shapes seen long ago still count once
    a cap keeps the batch small.

    Why relative: the host's noise scales with a step's time, and prompt steps take 30-80x a decode
    step. Fitted on absolute error, the step log of our server on the default GGUF at 1.6 req/s
    (llama.cpp, 2 AVX-512 cores) swung between a 9.0 / b 0 ms (the batch held to one row: every row
    looked as dear as a batch) and a 4.3 / b 21 ms (14 rows) within the run; on relative error the same
    steps give a 5.0-5.3, b 5.5-6.5, c 3.2-3.9 ms from the 120th step on.

    Why one model and not a decode fit and a prefill fit: the fixed cost ``b`` (every weight read
    once) is the same whether a step decodes rows or prefills a prompt alone, so each kind of step
    teaches the other. Fitted apart, a server under overload that decoded only at one batch size (25
    rows, 0.29 s) predicted 0.29 s for a step of one row (0.12 s measured) and turned away every
    interactive request for half a minute; int8 SmolLM2-135M on 2 AVX2 cores fits b 75-90 ms for both
    kinds. ``prefill_s_per_token`` is the plain per-token mean, for engines that prefill at join.
    """

    prefill_s_per_token: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=200))  # (rows, prompt tokens, seconds)
    shapes: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)
    a: float = 0.0  # per decode row
    b: float = 0.0  # per step
    c: float = 0.0  # per prompt token in a step (0: no step with a prompt seen yet)

    def observe_step(self, rows: int, tokens: int, seconds: float) -> None:
        """A step that decoded ``rows`` rows and prefilled ``tokens`` prompt tokens in ``seconds``."""
        if rows <= 0 and tokens <= 0:
            return
        self.samples.append((rows, tokens, seconds))
        key = (rows, tokens // 16)
        old = self.shapes.get(key)
        self.shapes[key] = (
            (rows, tokens, seconds)
            if old is None
            else (rows, 0.8 * old[1] + 0.2 * tokens, 0.8 * old[2] + 0.2 * seconds)
        )
        self._fit()

    def _fit(self) -> None:
        import numpy as np
        from scipy.optimize import nnls

        points = np.array(list(self.shapes.values()), dtype=float)
        design = np.column_stack([np.ones(len(points)), points[:, 0], points[:, 1]])
        names = ["b", "a", "c"]
        if not points[:, 1].any():  # no prompt tokens seen: no per-token term
            design, names = design[:, :2], names[:2]
        # not identifiable from what was seen (one batch size and no prompt alone): decode is flat
        while len(names) > 1 and np.linalg.matrix_rank(design) < len(names):
            drop = names.index("a") if "a" in names else len(names) - 1
            design, names = np.delete(design, drop, axis=1), names[:drop] + names[drop + 1 :]
        # relative errors: the host's noise is proportional to a step's time (10-40% here), so an
        # unweighted fit let the 0.3-0.7 s prompt steps' noise set the 5-10 ms decode terms
        weight = 1 / np.maximum(points[:, 2], 1e-4)
        coef, _ = nnls(design * weight[:, None], points[:, 2] * weight)
        fitted = dict(zip(names, coef.tolist(), strict=True))
        self.a, self.b, self.c = fitted.get("a", 0.0), fitted.get("b", 0.0), fitted.get("c", 0.0)

    @property
    def by_size(self) -> dict[int, float]:
        """Decode-only steps: batch size -> recent mean seconds."""
        return {rows: s for (rows, bucket), (_, _, s) in self.shapes.items() if bucket == 0 and rows}

    def observe(self, batch: int, seconds: float) -> None:
        self.observe_step(batch, 0, seconds)

    def observe_prefill_alone(self, tokens: int, seconds: float) -> None:
        self.observe_step(0, tokens, seconds)

    def useful_batch(self, max_batch: int, min_gain: float = 0.02, prefill_s: float = 0.0,
                     answer_tokens: float = 1.0) -> int:  # fmt: skip
        """The largest batch worth running: beyond it one more row raises the requests/s by less than
        ``min_gain``, a request costing ``prefill_s`` of its own (its prompt: the batch does not
        share it) and ``answer_tokens`` decode steps shared by the rows. With no prefill this is the
        decode tokens/s. An engine whose step costs n times one row's (b = 0) gets 1: batching it
        only makes every request share the time, so each finishes later. Until two batch sizes have
        been seen the limit is ``max_batch`` (the model is still learning).

        Why the prefill counts: every row in the batch stretches every other row's steps, so a row
        that adds little throughput adds only latency. On the default GGUF through llama.cpp (2
        AVX-512 cores) a prompt token costs 3.2-3.8 ms in any chunk of 8 or more, as much as a row of
        a big decode step, so a request's ~90 computed prompt tokens (0.3 s) outweigh its ~37 decode
        steps' share (a 5.1, b 5.8 ms): decode tokens/s grows by 2% a row up to 7 rows, requests/s
        only up to 4-5. A queue simulation of that server's costs and answer lengths, 60 Poisson
        requests at 1.8/s, 40 schedules: the slowest request took 6.8 s (median) at 4 rows, 8.4 s at
        8 and 11.2 s with 32, the batch acting as a processor share in which the longest answers
        wait for every newcomer's prompt. Measured on that server (60 requests a rate, one schedule
        each, a noisy host): with every request let in, the slowest took 10.75 and 12.86 s at 1.6 req/s
        (14-16 rows at times); held to this size (3-5 rows), 6.38 s at 1.6 and 11.33 s at 1.8, at
        1.42-1.45 done/s against 1.48-1.63: the tail shorter, the throughput a little lower."""
        if len(self.by_size) < 2 or self.a <= 0:
            return max_batch
        decode = max(answer_tokens, 1.0)

        def rate(n: int) -> float:  # requests/s with n rows
            return 1 / (prefill_s + decode * (self.a * n + self.b) / n)

        n = 1
        while n < max_batch and rate(n + 1) >= rate(n) * (1 + min_gain):
            n += 1
        return n

    @property
    def prefill_c0(self) -> float:
        """A prompt step's fixed cost (the step's, shared with decode steps); 0 until a prompt step is seen."""
        return self.b if self.c else 0.0

    @property
    def prefill_c1(self) -> float:
        return self.c

    def prefill_alone_s(self, tokens: int) -> float:
        """A prompt's prefill in a step of its own."""
        if self.c:
            return self.b + self.c * tokens
        return tokens * self.prefill_s_per_token

    def prefill_steps_s(self, tokens: int, chunk: int | None, rows: int = 0) -> float:
        """A prompt of ``tokens`` prefilled in steps of at most ``chunk`` tokens, ``rows`` decode rows
        riding each: every step pays the fixed cost and the rows once."""
        steps = max(1, -(-tokens // chunk)) if chunk else 1
        if not self.c:
            return tokens * self.prefill_s_per_token + (steps * self.a * rows if rows else 0.0)
        return steps * (self.b + self.a * rows) + self.c * tokens

    @property
    def prefill_marginal_s(self) -> float:
        """One more prompt token in a step that runs anyway."""
        return self.c or self.prefill_s_per_token

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            rate = seconds / tokens
            self.prefill_s_per_token = (
                rate if not self.prefill_s_per_token else 0.8 * self.prefill_s_per_token + 0.2 * rate
            )

    def step_s(self, batch: int) -> float:
        return self.a * batch + self.b

    def request_s(self, prompt_tokens: int, max_new: int, batch: int) -> float:
        """Expected service time of one request running in a batch of ``batch``."""
        return prompt_tokens * self.prefill_s_per_token + max(0, max_new - 1) * self.step_s(batch)

    @property
    def known(self) -> bool:
        return len(self.samples) >= 3


@dataclass
class RequestMix:
    """The typical recent request: its prompt tokens and answer tokens, as decayed means over about the
    last 30 requests (``decay`` per request), for ``StepCost.useful_batch``. Tokens, not seconds: the
    cost model's price per token moves as it learns. The prompt tokens are the ones the cost model
    prices: those computed in chunked batches (the prefix cache's share not counted), the whole prompt
    where a prompt is prefilled at join (whose price, ``prefill_s_per_token``, is per whole prompt
    token, so the product is the request's prefill seconds either way)."""

    decay: float = 0.97
    _prompt: tuple[float, float] = (0.0, 0.0)  # decayed (tokens, requests)
    _answer: tuple[float, float] = (0.0, 0.0)

    def prompted(self, tokens: int, requests: int = 1) -> None:
        """``tokens`` prompt tokens computed, in a step where ``requests`` prompts were completed (a
        chunked prompt's tokens come over several steps, its completion in one)."""
        keep = self.decay**requests
        self._prompt = (self._prompt[0] * keep + tokens, self._prompt[1] * keep + requests)

    def answered(self, tokens: int) -> None:
        self._answer = (self._answer[0] * self.decay + tokens, self._answer[1] * self.decay + 1)

    @property
    def prompt_tokens(self) -> float:
        return self._prompt[0] / self._prompt[1] if self._prompt[1] else 0.0

    @property
    def answer_tokens(self) -> float | None:
        """None until a request has finished."""
        return self._answer[0] / self._answer[1] if self._answer[1] else None


class Scheduler:
    def __init__(self, policies: dict[int, QueuePolicy] | None = None, default: QueuePolicy | None = None,
                 aging_ms: float = 1000.0, max_batch: int = 32, max_total: int | None = None) -> None:  # fmt: skip
        self.policies = policies or {}
        # all levels together: per-level limits alone let a client that spreads its requests over
        # the levels queue levels x max_queue of them (issue 41: 2,000 levels were 2,000 queues)
        self.max_total = max_total
        self.default = default or QueuePolicy()
        self.aging_ns = aging_ms * 1e6
        self.max_batch = max_batch
        self.prefill_chunk: int | None = None  # prompt tokens per step (None: a prompt in one step)
        self.cost = StepCost()
        self.mix = RequestMix()
        self._waiting: list[Ticket] = []  # order is decided at pop time (aging changes it)
        self._counts: dict[int, int] = {}
        self._seq = itertools.count()

    def policy(self, priority: int) -> QueuePolicy:
        return self.policies.get(priority, self.default)

    def __len__(self) -> int:
        return len(self._waiting)

    def depth(self, priority: int | None = None) -> int:
        return len(self._waiting) if priority is None else self._counts.get(priority, 0)

    def queued_by_level(self) -> dict[int, int]:
        return {level: n for level, n in sorted(self._counts.items()) if n}

    def useful_batch(self) -> int:
        """The batch size worth running for the recent requests (``StepCost.useful_batch``): their
        prompts priced at the cost model's marginal prompt token; until one has finished, the size
        that still raises the decode tokens/s."""
        answer = self.mix.answer_tokens
        if answer is None:
            return self.cost.useful_batch(self.max_batch)
        prefill_s = self.mix.prompt_tokens * self.cost.prefill_marginal_s
        return self.cost.useful_batch(self.max_batch, prefill_s=prefill_s, answer_tokens=answer)

    # ---- admission ------------------------------------------------------------------------------

    def submit(
        self,
        ticket: Ticket,
        now_ns: int,
        running: int = 0,
        prefilling: dict[int, list[int]] | None = None,
        step_left_s: float | None = None,
        decode_rows: int = 0,
    ) -> None:
        """Queue the request, or raise Rejected (429 when its level is full, 503 if it cannot make it).

        For the TTFT objective: ``prefilling``, the prompt tokens each request in the batch has still to
        prefill after the running step, by level; ``step_left_s``, what the running step has left (0:
        none runs; None: unknown, a whole step); ``decode_rows``, the rows that decode in the prompt
        steps (0 where urgent prompts pause them)."""
        pol = self.policy(ticket.priority)
        if self.max_total is not None and len(self._waiting) >= self.max_total:
            raise Rejected(429, f"the queue is full ({self.max_total} waiting in all levels)",
                           self.retry_after_s(running))  # fmt: skip
        if self._counts.get(ticket.priority, 0) >= pol.max_queue:
            raise Rejected(429, f"queue for priority {ticket.priority} is full ({pol.max_queue})",
                           self.retry_after_s(running))  # fmt: skip
        if (
            pol.ttft_slo_ms is not None
            and pol.shed_late
            and self.cost.known
            and self.cost.prefill_s_per_token
        ):
            expected = self.expected_ttft_s(ticket, running, prefilling or {}, step_left_s, decode_rows)
            if expected * 1e3 > SHED_MARGIN * pol.ttft_slo_ms:
                why = (
                    "no free row in the batch"
                    if expected == float("inf")
                    else f"expected {expected * 1e3:.0f} ms"
                )
                raise Rejected(503, f"cannot meet its first-token objective: {why}, objective {pol.ttft_slo_ms:g} ms",
                               self.retry_after_s(running))  # fmt: skip
        if ticket.deadline_ns is not None and self.cost.known:
            ahead = sum(1 for t in self._waiting if t.priority <= ticket.priority)
            batch = min(self.max_batch, running + ahead + 1)
            # requests ahead beyond a full batch must finish first; each full round costs one request's time
            rounds = (running + ahead) // self.max_batch
            expected = (rounds + 1) * self.cost.request_s(ticket.prompt_tokens, ticket.max_new, batch)
            if now_ns + expected * 1e9 > ticket.deadline_ns:
                raise Rejected(503, f"cannot meet its deadline: expected {expected * 1e3:.0f} ms of queue and "
                               f"compute, {max(0, (ticket.deadline_ns - now_ns) / 1e6):.0f} ms left",
                               self.retry_after_s(running))  # fmt: skip
        ticket.seq = next(self._seq)
        self._waiting.append(ticket)
        self._counts[ticket.priority] = self._counts.get(ticket.priority, 0) + 1

    def expected_ttft_s(self, ticket: Ticket, running: int, prefilling: dict[int, list[int]],
                        step_left_s: float | None = None, decode_rows: int = 0) -> float:  # fmt: skip
        """What the running step has left, then the prompts before it at its level or a more urgent
        one (still prefilling in the batch, then queued), then its own: each in steps of its own of
        at most ``prefill_chunk`` tokens (``plan_prefill``), its first token out of its last one. No
        slot for it in the batch (every row taken by requests that decode for many steps yet): it
        cannot start in time.

        Measured (``benchmarks/priority.py``, int8 SmolLM2-135M, 2 AVX2 cores, 10x overload): counting
        two whole decode steps instead of the running step's remainder turned away every interactive
        request of 60-180 prompt tokens even with the server idle (0.53 s expected, about 0.4 s real)."""
        ahead = [t for t in self._waiting if t.priority <= ticket.priority]
        if running + len(ahead) >= self.max_batch:
            return float("inf")
        residual = self.cost.step_s(max(1, running)) if step_left_s is None else max(0.0, step_left_s)
        prompts = [n for level, left in prefilling.items() if level <= ticket.priority for n in left]
        prompts += [t.prompt_tokens for t in ahead] + [ticket.prompt_tokens]
        return residual + sum(self.cost.prefill_steps_s(n, self.prefill_chunk, decode_rows) for n in prompts)

    def requeue(self, ticket: Ticket) -> None:
        """Put back a request that was taken but could not start (no KV-cache room): no admission checks."""
        self._waiting.append(ticket)
        self._counts[ticket.priority] = self._counts.get(ticket.priority, 0) + 1

    def retry_after_s(self, running: int) -> float:
        """When the queue is likely to have room: one typical request's time, at least a second."""
        if not self.cost.known:
            return 1.0
        return max(1.0, self.cost.request_s(0, 64, max(1, running)))

    # ---- order ----------------------------------------------------------------------------------

    def _effective(self, t: Ticket, now_ns: int) -> tuple[float, int, int]:
        since = t.requeued_ns if t.requeued_ns is not None else t.arrival_ns
        return (t.priority - (now_ns - since) / self.aging_ns, since, t.seq)  # a delayed one ages anew

    def expire(self, now_ns: int) -> list[tuple[Ticket, str]]:
        """Requests past their level's queue timeout or their own deadline: rejected (or delayed)."""
        out: list[tuple[Ticket, str]] = []
        keep: list[Ticket] = []
        for t in self._waiting:
            pol = self.policy(t.priority)
            waited_ms = (now_ns - (t.requeued_ns or t.arrival_ns)) / 1e6
            if t.deadline_ns is not None and now_ns > t.deadline_ns:
                out.append((t, "deadline passed in the queue"))
            elif pol.timeout_ms is not None and waited_ms > pol.timeout_ms:
                if pol.on_timeout == "delay":
                    t.requeued_ns = now_ns
                    keep.append(t)
                else:
                    out.append((t, f"waited {waited_ms:.0f} ms > the queue timeout {pol.timeout_ms:.0f} ms"))
            else:
                keep.append(t)
        self._waiting = keep
        for t, _ in out:
            self._counts[t.priority] -= 1
        return out

    def peek(self, now_ns: int, allowed: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The request ``pop`` would return, left in the queue; with ``allowed``, the first in that
        order that it allows (the others keep their places)."""
        candidates = [t for t in self._waiting if allowed is None or allowed(t)]
        if not candidates:
            return None
        return min(candidates, key=lambda t: self._effective(t, now_ns))

    def pop(self, now_ns: int) -> Ticket | None:
        """The request to run next: lowest aged priority, then earliest arrival (or requeue)."""
        t = self.peek(now_ns)
        return None if t is None else self.take(t)

    def take(self, ticket: Ticket) -> Ticket:
        """Take this queued request out to run (``peek`` chose it)."""
        i = next(i for i, t in enumerate(self._waiting) if t is ticket)
        self._waiting.pop(i)
        self._counts[ticket.priority] -= 1
        return ticket

    def remove(self, key: Any) -> Ticket | None:
        """Drop a queued request (its client went away)."""
        for i, t in enumerate(self._waiting):
            if t.key == key:
                self._waiting.pop(i)
                self._counts[t.priority] -= 1
                return t
        return None


# ---- each step's prompt tokens -------------------------------------------------------------------


@dataclass(frozen=True)
class Pending:
    """A request in the batch whose prompt is still being prefilled."""

    key: Any
    priority: int
    left: int  # prompt tokens still to compute
    seq: int  # order taken in


@dataclass(frozen=True)
class Urgency:
    """The most urgent level with a TTFT objective whose traffic is live (recent, queued or prefilling)."""

    priority: int
    slo_s: float
    prompt_tokens: int  # a typical (high quantile) prompt of that level
    waiting: bool  # one of its requests is queued now


MIN_CHUNK = 16  # a deferred-by-size prompt still advances this much per step: it is never starved


@dataclass
class StepPlan:
    """What the next step computes: prompt tokens per request, and whether the decode rows step too."""

    prefill: list[tuple[Any, int]] = field(default_factory=list)  # [(key, tokens)]
    decode: bool = True


def plan_prefill(pending: list[Pending], chunk: int, rows: int, cost: StepCost,
                 urgency: Urgency | None) -> StepPlan:  # fmt: skip
    """The next step's prompt tokens per request, most urgent level first.

    Without urgency: up to ``chunk`` tokens, by level then order taken in (chunked prefill as vLLM's).
    With an urgent level live:
      * while an urgent prompt is prefilling, the step is its prefill alone: less urgent prompts
        wait, and the decode rows pause for this one step (their keys/values stay where they are).
        Urgent prompts go one per step, in order: sharing a step would put a later arrival's tokens
        into an earlier one's time to first token, which admission had promised without them.
        On a CPU a prompt's prefill is compute-bound, so riding decode rows along saves little and
        delays its first token: a 128-token prompt took 251 ms alone, 320 ms beside 4 decode rows
        and 381 ms beside 8 (fp32 SmolLM2-135M, 2 AVX2 cores), while the rows' own step took 86-106;
      * while an urgent request is queued, less urgent prompts wait (it joins at the next step);
      * otherwise a less urgent prompt takes only what keeps a step short enough that an urgent
        request arriving during it still gets its first token within the objective: the objective,
        less the urgent request's own prefill, less a fifth for the model's error, at the learned
        prefill rate (and at least ``MIN_CHUNK`` tokens, so it always progresses).
    """
    order = sorted(pending, key=lambda p: (p.priority, p.seq))
    out = StepPlan()
    budget = chunk
    if urgency is None:
        for p in order:
            if budget and p.left:
                take = min(p.left, budget)
                out.prefill.append((p.key, take))
                budget -= take
        return out
    protected = next((p for p in order if p.priority <= urgency.priority and p.left), None)
    if protected is not None:  # one at a time: a later arrival never delays an earlier one's first token
        out.prefill.append((protected.key, min(protected.left, chunk)))
    if out.prefill:
        out.decode = False
        return out
    if urgency.waiting and rows > len([p for p in pending if p.left]):
        return out  # the others wait one step (the decode rows run it)
    # nothing else would run: the less urgent prompts go on rather than leave the step empty
    low = min(chunk, lower_chunk(rows, cost, urgency))
    for p in order:
        if p.priority > urgency.priority and low and p.left:
            take = min(p.left, low)
            out.prefill.append((p.key, take))
            low -= take
    return out


def lower_chunk(rows: int, cost: StepCost, urgency: Urgency) -> int:
    """Prompt tokens of a less urgent request one step may carry while ``urgency`` is live."""
    rate = cost.prefill_marginal_s
    if not cost.known or not rate:
        return 4 * MIN_CHUNK  # until the model has learned: short steps
    own = cost.prefill_alone_s(urgency.prompt_tokens)  # its prefill step, alone (the rows pause for it)
    spare = 0.8 * urgency.slo_s - own - cost.step_s(rows)  # what a step may add beyond the rows' decode
    return max(MIN_CHUNK, int(spare / rate))
