"""Priority that keeps a first-token objective: each step's prompt tokens, pauses, shedding, per-level metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from variantbench.serving.scheduler import (
    MIN_CHUNK,
    Pending,
    QueuePolicy,
    Rejected,
    Scheduler,
    StepCost,
    StepPlan,
    Ticket,
    Urgency,
    lower_chunk,
    plan_prefill,
)


def _cost(prefill_ms_per_token: float = 2.0, step_ms: float = 60.0) -> StepCost:
    cost = StepCost()
    for rows in (1, 2, 4):
        cost.observe(rows, step_ms / 1e3)
    cost.observe_prefill(100, prefill_ms_per_token * 100 / 1e3)
    return cost


def test_without_an_urgent_level_prompts_advance_by_level_then_arrival_within_the_chunk() -> None:
    pending = [
        Pending("late-low", 1, 300, seq=1),
        Pending("high", 0, 50, seq=2),
        Pending("low", 1, 40, seq=0),
    ]
    plan = plan_prefill(pending, chunk=256, rows=3, cost=_cost(), urgency=None)
    assert plan == StepPlan([("high", 50), ("low", 40), ("late-low", 166)], decode=True)


def test_an_urgent_prompt_gets_the_step_alone_and_the_rows_pause() -> None:
    pending = [Pending("batch", 1, 1500, seq=0), Pending("chat", 0, 120, seq=1)]
    urgency = Urgency(priority=0, slo_s=0.5, prompt_tokens=120, waiting=False)
    plan = plan_prefill(pending, chunk=256, rows=6, cost=_cost(), urgency=urgency)
    assert plan == StepPlan([("chat", 120)], decode=False)


def test_urgent_prompts_go_one_per_step_in_order_so_a_later_one_never_delays_an_earlier_one() -> None:
    pending = [
        Pending("second", 0, 60, seq=2),
        Pending("first", 0, 90, seq=1),
        Pending("batch", 1, 900, seq=0),
    ]
    urgency = Urgency(priority=0, slo_s=0.5, prompt_tokens=120, waiting=False)
    plan = plan_prefill(pending, chunk=256, rows=5, cost=_cost(), urgency=urgency)
    assert plan == StepPlan([("first", 90)], decode=False)
    # and admission counts them so: each its own step, the fixed cost paid again
    sched = Scheduler(policies={0: QueuePolicy(ttft_slo_ms=500, shed_late=True)})
    sched.cost = StepCost()
    for rows, tokens, ms in ((1, 0, 60), (4, 0, 72), (0, 100, 260), (0, 20, 100)):  # 60 ms + 2 ms per token
        sched.cost.observe_step(rows, tokens, ms / 1e3)
    assert sched.cost.b == pytest.approx(0.06, rel=0.05) and sched.cost.c == pytest.approx(0.002, rel=0.05)
    ticket = Ticket(key="new", priority=0, arrival_ns=0, prompt_tokens=60, max_new=8)
    expected = sched.expected_ttft_s(ticket, running=3, prefilling={0: [90, 60]}, step_left_s=0.1)
    assert expected == pytest.approx(0.1 + 3 * 0.06 + 0.002 * (90 + 60 + 60), rel=0.05)


def test_while_an_urgent_request_waits_less_urgent_prompts_do_not_start_a_chunk() -> None:
    urgency = Urgency(priority=0, slo_s=0.5, prompt_tokens=120, waiting=True)
    plan = plan_prefill([Pending("batch", 1, 1500, seq=0)], chunk=256, rows=6, cost=_cost(), urgency=urgency)
    assert plan == StepPlan([], decode=True)


def test_a_live_urgent_level_cuts_less_urgent_chunks_to_what_its_objective_leaves() -> None:
    cost = _cost(prefill_ms_per_token=2.0, step_ms=60.0)
    urgency = Urgency(priority=0, slo_s=0.5, prompt_tokens=50, waiting=False)
    # 0.8 x 500 ms - 50 tokens x 2 ms - a 60 ms step = 240 ms of prompt: 120 tokens
    assert lower_chunk(4, cost, urgency) == 120
    plan = plan_prefill([Pending("batch", 1, 1500, seq=0)], chunk=256, rows=4, cost=cost, urgency=urgency)
    assert plan == StepPlan([("batch", 120)], decode=True)
    # an objective the urgent prompt alone nearly fills: the others still move, by the floor
    tight = Urgency(priority=0, slo_s=0.2, prompt_tokens=120, waiting=False)
    assert lower_chunk(4, cost, tight) == MIN_CHUNK
    # the same level as the urgent one is not cut: only less urgent levels yield
    same = plan_prefill([Pending("peer", 0, 400, seq=0)], chunk=256, rows=4, cost=cost, urgency=tight)
    assert same == StepPlan([("peer", 256)], decode=False)


def test_shed_late_turns_away_a_request_that_would_miss_its_objective_and_only_then() -> None:
    policy = QueuePolicy(ttft_slo_ms=500, shed_late=True)
    sched = Scheduler(policies={0: policy, 1: QueuePolicy(ttft_slo_ms=500)})
    sched.cost = _cost(prefill_ms_per_token=2.0, step_ms=50.0)

    def ticket(key: str, prio: int, tokens: int) -> Ticket:
        return Ticket(key=key, priority=prio, arrival_ns=0, prompt_tokens=tokens, max_new=32)

    sched.submit(ticket("fits", 0, 150), 0, running=2)  # a 50 ms step + 150 x 2 ms = 350 ms
    with pytest.raises(Rejected) as err:  # 150 more before it: 650 ms
        sched.submit(ticket("late", 0, 150), 0, running=2)
    assert err.value.status == 503 and err.value.retry_after_s >= 1 and "objective" in str(err.value)
    # prompt tokens still prefilling in the batch count too; less urgent ones do not
    sched.pop(0)
    with pytest.raises(Rejected):
        sched.submit(ticket("behind a prefill", 0, 100), 0, running=2, prefilling={0: [200]})
    sched.submit(ticket("behind batch work", 0, 100), 0, running=2, prefilling={1: [5000]})
    # the running step's remainder, as the worker knows it: a long one turns away what an idle model takes
    sched.pop(0)
    with pytest.raises(Rejected):  # 350 ms of a step left + 100 x 2 ms
        sched.submit(ticket("during a long step", 0, 100), 0, running=2, step_left_s=0.35)
    sched.submit(ticket("between steps", 0, 100), 0, running=2, step_left_s=0.0)
    # a level with an objective but without shed_late queues whatever it expects
    sched.submit(ticket("patient", 1, 2000), 0, running=2)


@pytest.fixture(scope="module")
def decoder(tiny_model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import Decoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return Decoder(model)


def test_rows_paused_for_an_urgent_prefill_decode_as_if_alone(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch

    prompts = {"a": ([5, 9, 14, 30, 2, 8], 14), "b": (list(range(60, 110)), 10), "u": ([7, 3, 11, 4], 8)}
    want = {k: decoder.generate([p], n).token_ids[0] for k, (p, n) in prompts.items()}
    batch = ContinuousBatch(decoder, max_batch=4, max_len=128)
    got = {}
    for key in ("a", "b"):
        first, _ = batch.join(key, *prompts[key])
        got[key] = [first]
    for key, token, _ in batch.step() + batch.step():
        got[key].append(token)
    batch.begin("u", prompts["u"][0], prompts["u"][1], priority=0)
    cur = batch.cur
    out = batch.step(StepPlan([("u", 4)], decode=False))  # the urgent prompt alone: rows pause
    assert [key for key, _, _ in out] == ["u"] and batch.last_rows == 0 and batch.cur == cur
    got["u"] = [out[0][1]]
    while batch.active:
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)
    assert got == want


async def _first_tokens(worker, requests) -> list[str]:  # noqa: ANN001
    order: list[str] = []

    async def run(key: str, events) -> None:  # noqa: ANN001
        while True:
            event = await events.get()
            if event[0] == "token" and key not in order:
                order.append(key)
            if event[0] in ("done", "error"):
                return

    tasks = []
    for key, prompt, max_new, priority in requests:
        tasks.append(asyncio.ensure_future(run(key, worker.submit(key, prompt, max_new, priority=priority))))
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return order


def test_an_urgent_request_overtakes_a_long_prompt_being_prefilled(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    async def main() -> tuple[list[str], list[tuple[int, int]]]:
        batch = ContinuousBatch(decoder, max_batch=4, max_len=512, prefill_chunk=8)
        worker = BatchWorker(batch, policies={0: QueuePolicy(ttft_slo_ms=500)}).start()
        steps: list[tuple[int, int]] = []
        worker.step_listeners.append(lambda rows, s, prompt: steps.append((rows, prompt)))
        try:
            long = [3 + i % 390 for i in range(400)]  # 50 chunks of 8 (the vocabulary holds 400)
            return await _first_tokens(worker, [("batch", long, 4, 1), ("chat", [5, 6, 7, 8], 4, 0)]), steps
        finally:
            worker.drain_and_stop()

    order, steps = asyncio.run(main())
    assert order == ["chat", "batch"]
    # the chat prompt was prefilled alone: no chunk of the long prompt rode along with it
    assert (0, 4) in steps


def test_an_urgent_request_is_not_held_behind_an_older_one_the_batch_size_limit_keeps_out(decoder) -> None:  # noqa: ANN001
    """The soak's deadlock: the batch at the size that still pays, an aged batch request at the head of
    the queue, an interactive one behind it. Admission must take the interactive one past it (its
    objective lets it exceed that size), and its wait must not stop the batch's own prompt."""
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    async def main() -> list[str]:
        batch = ContinuousBatch(decoder, max_batch=4, max_len=512, prefill_chunk=8)
        worker = BatchWorker(batch, aging_ms=1.0, policies={0: QueuePolicy(ttft_slo_ms=500)})
        worker.scheduler.useful_batch = lambda: 1  # one row pays, no more
        worker.start()
        try:
            long = [3 + i % 390 for i in range(400)]
            other = [5 + i % 380 for i in range(400)]
            requests = [("batch", long, 4, 1), ("batch-2", other, 4, 1), ("chat", [5, 6, 7, 8], 4, 0)]
            return await asyncio.wait_for(_first_tokens(worker, requests), timeout=60)
        finally:
            worker.drain_and_stop()

    order = asyncio.run(main())
    assert order.index("chat") < order.index("batch-2")


def test_at_the_useful_size_a_request_waits_for_a_row_of_its_own_level(decoder) -> None:  # noqa: ANN001
    """Past the size that still pays, a request with a first-token objective overtakes only less
    urgent rows: beside rows of its own level it waits for one to end (letting every one in made the
    batch a processor share: at 1.6 req/s on the default GGUF the slowest answer took 10.8-12.9 s)."""
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    async def main() -> list[tuple[str, str]]:
        batch = ContinuousBatch(decoder, max_batch=4, max_len=512, prefill_chunk=8)
        worker = BatchWorker(batch, policies={0: QueuePolicy(ttft_slo_ms=500)})
        worker.scheduler.useful_batch = lambda: 1  # one row pays, no more
        worker.start()
        seen: list[tuple[str, str]] = []

        async def run(key: str, events) -> None:  # noqa: ANN001
            while True:
                event = await events.get()
                if event[0] == "token" and (key, "first") not in seen:
                    seen.append((key, "first"))
                if event[0] in ("done", "error"):
                    seen.append((key, event[0]))
                    return

        try:
            first = asyncio.ensure_future(run("a", worker.submit("a", [5, 6, 7, 8], 6, ignore_eos=True)))
            await asyncio.sleep(0.01)
            second = asyncio.ensure_future(run("b", worker.submit("b", [9, 10, 11], 6, ignore_eos=True)))
            await asyncio.wait_for(asyncio.gather(first, second), timeout=60)
            return seen
        finally:
            worker.drain_and_stop()

    assert asyncio.run(main()) == [("a", "first"), ("a", "done"), ("b", "first"), ("b", "done")]


def test_the_same_traffic_without_priorities_waits_behind_the_long_prompt(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    async def main() -> list[str]:
        worker = BatchWorker(ContinuousBatch(decoder, max_batch=4, max_len=512, prefill_chunk=8)).start()
        try:
            long = [3 + i % 390 for i in range(400)]
            return await _first_tokens(worker, [("batch", long, 4, 0), ("chat", [5, 6, 7, 8], 4, 0)])
        finally:
            worker.drain_and_stop()

    assert asyncio.run(main()) == ["batch", "chat"]


def test_the_prefill_fit_separates_a_steps_fixed_cost_from_each_tokens() -> None:
    cost = _cost(prefill_ms_per_token=4.0, step_ms=60.0)  # a per-token mean that includes the fixed cost
    for tokens, ms in ((20, 94), (60, 162), (120, 270), (20, 94)):  # 60 ms + 1.7 ms per token, alone
        cost.observe_prefill_alone(tokens, ms / 1e3)
    assert cost.prefill_c1 == pytest.approx(1.7e-3, rel=0.05) and cost.prefill_c0 == pytest.approx(
        0.06, rel=0.1
    )
    assert cost.prefill_alone_s(100) == pytest.approx(0.23, rel=0.05)
    # a chunk riding a decode step pays the per-token cost only: 0.8 x 500 - 230 - 60 = 110 ms, 64 tokens
    urgency = Urgency(priority=0, slo_s=0.5, prompt_tokens=100, waiting=False)
    assert lower_chunk(4, cost, urgency) == pytest.approx(64, abs=6)


def test_requests_of_one_level_share_steps_rows_do_not_pause_for_their_peers(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    async def main() -> list[tuple[int, int]]:
        worker = BatchWorker(ContinuousBatch(decoder, max_batch=4, max_len=512, prefill_chunk=8),
                             policies={0: QueuePolicy(ttft_slo_ms=500)}).start()  # fmt: skip
        steps: list[tuple[int, int]] = []
        worker.step_listeners.append(lambda rows, s, prompt: steps.append((rows, prompt)))
        try:
            first = worker.submit("first", [5, 6, 7], 60)
            await first.get()  # decoding
            await _first_tokens(worker, [("peer", [3 + i % 390 for i in range(64)], 4, 0)])
            return steps
        finally:
            worker.drain_and_stop()

    steps = asyncio.run(main())
    assert any(rows and prompt for rows, prompt in steps)  # the peer's chunks rode along the decode row


def test_a_level_stays_live_through_the_long_gaps_of_poisson_traffic() -> None:
    """Arrivals are memoryless: a gap of 8 mean gaps (0.03% of Poisson gaps) is not the traffic's end,
    so the less urgent prompts keep short chunks; after 10 gaps without an arrival the level lapses."""
    from variantbench.serving.worker import _Level

    level = _Level()
    for i in range(20):
        level.arrived(2.0 * i, 64)  # every 2 s
    last = 38.0
    assert level.live(last + 8 * 2.0)
    assert not level.live(last + 10.5 * 2.0)
