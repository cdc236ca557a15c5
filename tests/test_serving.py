"""Serving: continuous batching gives the same greedy tokens as decoding each request alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def decoder(tiny_model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import Decoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return Decoder(model)


def _alone(decoder, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    return decoder.generate([prompt], n).token_ids[0]


def test_requests_joining_and_leaving_between_steps_decode_as_if_alone(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch

    prompts = {
        "a": ([5, 9, 14, 30, 2, 8], 12),
        "b": ([40, 41, 42], 5),
        "c": (list(range(60, 100)), 9),  # longer than the cache index when it joins: shifts right
        "d": ([7, 7, 7, 7], 6),
    }
    want = {k: _alone(decoder, p, n) for k, (p, n) in prompts.items()}
    batch = ContinuousBatch(decoder, max_batch=4, max_len=80)
    got: dict[str, list[int]] = {}
    order = ["a", "b", None, "c", None, None, "d"]  # joins between steps
    pending = list(order)
    steps = 0
    while pending or batch.active:
        if pending:
            key = pending.pop(0)
            if key is not None:
                p, n = prompts[key]
                first, done = batch.join(key, p, n)
                got[key] = [first]
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)
        steps += 1
        assert steps < 100
    assert got == want


def test_prompts_prefilled_in_chunks_beside_decode_rows_decode_as_if_alone(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch

    prompts = {
        "a": ([5, 9, 14, 30, 2, 8], 12),
        "b": (list(range(60, 100)), 9),  # 40 tokens: six chunks of 7, each riding with a decode step
        "c": ([40, 41, 42], 5),
        "d": (list(range(20, 45)), 6),
        "e": ([3], 4),
    }
    want = {k: _alone(decoder, p, n) for k, (p, n) in prompts.items()}
    batch = ContinuousBatch(decoder, max_batch=5, max_len=96, prefill_chunk=7)
    got: dict[str, list[int]] = {}
    order = ["a", None, "b", "c", None, "d", "e"]
    mixed = 0
    while order or batch.active:
        if order and (key := order.pop(0)) is not None:
            batch.begin(key, *prompts[key])
        for key, token, done in batch.step():
            got.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
        assert batch.last_prompt_tokens <= 7
        mixed += bool(batch.last_rows and batch.last_prompt_tokens)
        assert len(got) <= 5 and sum(len(v) for v in got.values()) < 200
    assert got == want
    assert mixed >= 6  # prompt chunks really ran in the same forward as decode rows


def test_a_cached_prefix_is_copied_not_recomputed_and_decodes_the_same(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch

    system = list(range(100, 140))  # a shared 40-token "system prompt": two full blocks of 16
    one, two = [*system, 7, 8, 9], [*system, 50, 51]
    batch = ContinuousBatch(decoder, max_batch=2, max_len=96, prefix_cache_mb=1)
    got = {"one": [batch.join("one", one, 6)[0]]}
    assert batch.prompt_tokens == {"computed": 43, "cached": 0}
    batch.begin("two", two, 6)  # joins the running one: 32 tokens copied, 10 computed
    assert batch.prompt_tokens == {"computed": 53, "cached": 32}
    while batch.active:
        for key, token, done in batch.step():
            got.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
    assert got == {"one": _alone(decoder, one, 6), "two": _alone(decoder, two, 6)}
    # the whole prompt again: every full block but the one holding the last token comes from the cache
    batch.join("three", one, 2)
    assert batch.prompt_tokens["cached"] == 32 + 32


def test_prefix_cache_keeps_its_budget_and_matches_whole_prefixes_only() -> None:
    from variantbench.serving.prefix_cache import PrefixCache

    def kv(prompt: list[int]) -> torch.Tensor:  # a stand-in for keys/values: position-wise, [2, len, 3]
        return torch.tensor(prompt, dtype=torch.float32)[None, :, None].expand(2, -1, 3).clone()

    cache = PrefixCache(budget_bytes=4 * 2 * 4 * 3 * 4, block=4)  # room for 4 blocks
    a = list(range(12))
    assert cache.insert(a, kv(a)) == 3 and cache.nbytes == 3 * 96
    hit, blocks = cache.lookup([*a[:8], 99, 99, 99, 99])  # shares two blocks, then differs
    assert hit == 8 and torch.equal(torch.cat(blocks, dim=1), kv(a)[:, :8])
    assert cache.lookup(a, limit=11)[0] == 8  # the block holding token 11 is beyond the limit
    assert cache.lookup([1, *a[1:]])[0] == 0  # a differing first token: nothing matches after it
    b = [*a[:4], 40, 41, 42, 43, 44, 45, 46, 47]
    cache.insert(b, kv(b))  # two new blocks; over budget: the stalest (a's deepest) goes first
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 4
    assert cache.lookup(b)[0] == 12 and cache.lookup(a)[0] == 8
    off = PrefixCache(budget_bytes=0)
    assert off.insert(a, kv(a)) == 0 and off.lookup(a) == (0, [])


def test_a_full_cache_is_compacted_and_refuses_what_cannot_fit(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch, NoRoom

    batch = ContinuousBatch(decoder, max_batch=2, max_len=40)
    batch.join("x", list(range(10, 30)), 15)
    for _ in range(5):
        batch.step()
    with pytest.raises(NoRoom):  # x spans 25 positions and needs 9 more steps: 34 + 9 > 40
        batch.join("y", list(range(30, 64)), 5)
    assert batch.cur == 25  # refused before anything moved
    with pytest.raises(ValueError, match="does not fit"):
        batch.join("z", list(range(50)), 1)
    # a short one fits beside it, after x's unused head is compacted away when needed
    batch.join("y", list(range(30, 40)), 6)
    got = {"x": list(batch.slots[0].tokens), "y": list(batch.slots[1].tokens)}
    while batch.active:
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)
    assert got["x"] == _alone(decoder, list(range(10, 30)), 15)
    assert got["y"] == _alone(decoder, list(range(30, 40)), 6)
    assert batch.active == 0 and batch.cur == 0


def test_rows_left_behind_by_finished_requests_are_compacted_away(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch

    batch = ContinuousBatch(decoder, max_batch=3, max_len=34)
    got = {"a": [batch.join("a", list(range(10, 30)), 2)[0]], "b": [batch.join("b", [3, 4, 5, 6], 14)[0]]}

    def run_step() -> None:
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)

    run_step()  # a finishes and leaves; b's four prompt positions sit at 16..19
    assert batch.active == 1 and batch.cur == 21
    got["c"] = [batch.join("c", [9, 8, 7, 6, 5, 4, 3, 2], 15)[0]]  # 21 + 14 > 34: compact, then fit
    assert batch.cur == 8
    while batch.active:
        run_step()
    assert got["b"] == _alone(decoder, [3, 4, 5, 6], 14)
    assert got["c"] == _alone(decoder, [9, 8, 7, 6, 5, 4, 3, 2], 15)


# ---- scheduling ----------------------------------------------------------------------------------

MS = 1_000_000


def _ticket(key: str, priority: int, at_ms: float, deadline_ms: float | None = None, new: int = 16):  # noqa: ANN202
    from variantbench.serving.scheduler import Ticket

    return Ticket(key=key, priority=priority, arrival_ns=int(at_ms * MS), prompt_tokens=100, max_new=new,
                  deadline_ns=int(deadline_ms * MS) if deadline_ms is not None else None)  # fmt: skip


def test_priority_order_holds_under_a_backlog_and_aging_prevents_starvation() -> None:
    from variantbench.serving.scheduler import Scheduler

    s = Scheduler(aging_ms=1000)
    for i, prio in enumerate([2, 0, 1, 0, 2, 1]):
        s.submit(_ticket(f"r{i}-p{prio}", prio, at_ms=i), now_ns=i * MS)
    order = [s.pop(10 * MS).key for _ in range(6)]
    assert order == ["r1-p0", "r3-p0", "r2-p1", "r5-p1", "r0-p2", "r4-p2"]  # by priority, then arrival
    # a low-priority request that has waited long enough goes before a fresh urgent one
    s.submit(_ticket("old-p3", 3, at_ms=0), now_ns=0)
    s.submit(_ticket("new-p0", 0, at_ms=2500), now_ns=2500 * MS)
    assert s.pop(2500 * MS).key == "new-p0"  # after 2.5 s the old one is at 3 - 2.5 = 0.5, still behind
    s.submit(_ticket("new2-p0", 0, at_ms=4100), now_ns=4100 * MS)
    assert s.pop(4100 * MS).key == "old-p3"  # after 4.1 s its effective priority is -1.1 < 0


def test_a_full_queue_rejects_with_429_and_a_hopeless_deadline_with_503() -> None:
    from variantbench.serving.scheduler import QueuePolicy, Rejected, Scheduler

    s = Scheduler(default=QueuePolicy(max_queue=2), policies={0: QueuePolicy(max_queue=5)}, max_batch=4)
    s.submit(_ticket("a", 1, 0), 0)
    s.submit(_ticket("b", 1, 0), 0)
    with pytest.raises(Rejected) as err:
        s.submit(_ticket("c", 1, 0), 0)
    assert err.value.status == 429 and err.value.retry_after_s >= 1
    s.submit(_ticket("d", 0, 0), 0)  # another level has its own room
    for batch, seconds in [(1, 0.011), (2, 0.012), (4, 0.014), (8, 0.018)]:
        s.cost.observe(batch, seconds)
    s.cost.observe_prefill(100, 0.05)
    assert s.cost.a == pytest.approx(0.001) and s.cost.b == pytest.approx(0.010)
    # 100 prompt tokens (50 ms) + 63 steps at ~13 ms: ~0.87 s; a 200 ms deadline cannot be met
    with pytest.raises(Rejected) as err:
        s.submit(_ticket("e", 0, 0, deadline_ms=200, new=64), 0)
    assert err.value.status == 503 and "deadline" in str(err.value)
    s.submit(_ticket("f", 0, 0, deadline_ms=5000, new=64), 0)  # a reachable one is admitted


def test_queue_timeout_rejects_or_delays_by_policy() -> None:
    from variantbench.serving.scheduler import QueuePolicy, Scheduler

    s = Scheduler(
        policies={0: QueuePolicy(timeout_ms=100), 1: QueuePolicy(timeout_ms=100, on_timeout="delay")}
    )
    s.submit(_ticket("x", 0, 0), 0)
    s.submit(_ticket("y", 1, 0), 0)
    s.submit(_ticket("z", 1, 50), 50 * MS)
    expired = s.expire(150 * MS)
    assert [t.key for t, _ in expired] == ["x"] and "queue timeout" in expired[0][1]
    assert s.depth() == 2 and s.pop(150 * MS).key == "z"  # y was sent to the back of its level
    assert s.remove("y") is not None and s.depth() == 0


# ---- the batch worker ----------------------------------------------------------------------------


async def _collect(events) -> tuple[list[int], str]:  # noqa: ANN001
    tokens: list[int] = []
    while True:
        event = await events.get()
        if event[0] == "token":
            tokens.append(event[1])
        elif event[0] == "done":
            return tokens, event[1]
        else:
            return tokens, f"error {event[1]}: {event[2]}"


def test_worker_batches_concurrent_requests_and_matches_solo_decoding(decoder) -> None:  # noqa: ANN001
    import asyncio

    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.worker import BatchWorker

    prompts = {f"q{i}": ([10 + i, 20 + 2 * i, 30, 40 + i][: 2 + i % 3], 6 + i) for i in range(6)}
    want = {k: _alone(decoder, p, n) for k, (p, n) in prompts.items()}

    async def main() -> dict[str, list[int]]:
        worker = BatchWorker(ContinuousBatch(decoder, max_batch=8, max_len=64)).start()
        try:
            # idle: a lone request starts at once and runs alone
            alone, _ = await _collect(worker.submit("solo", [5, 6, 7], 4))
            assert alone == _alone(decoder, [5, 6, 7], 4) and set(worker.batch_sizes) == {1}
            worker.batch_sizes.clear()
            queues = {k: worker.submit(k, p, n) for k, (p, n) in prompts.items()}
            results = await asyncio.gather(*(_collect(q) for q in queues.values()))
            assert max(worker.batch_sizes) > 1  # concurrent requests shared decode steps
            return {k: toks for k, (toks, _) in zip(queues, results, strict=True)}
        finally:
            worker.drain_and_stop()

    assert asyncio.run(main()) == want


def test_worker_serves_priorities_in_order_and_frees_cancelled_slots(decoder) -> None:  # noqa: ANN001
    import asyncio

    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.scheduler import Rejected
    from variantbench.serving.worker import BatchWorker

    async def main() -> None:
        worker = BatchWorker(ContinuousBatch(decoder, max_batch=1, max_len=64), max_queue=2).start()
        try:
            finished: list[str] = []

            async def run(key: str, events) -> None:  # noqa: ANN001
                await _collect(events)
                finished.append(key)

            long = asyncio.ensure_future(run("long", worker.submit("long", [1, 2, 3], 40)))
            await asyncio.sleep(0.05)  # it is running: the others queue behind it
            low = asyncio.ensure_future(run("low", worker.submit("low", [4, 5], 3, priority=5)))
            high = asyncio.ensure_future(run("high", worker.submit("high", [6, 7], 3, priority=0)))
            with pytest.raises(Rejected) as err:  # priority 0's queue holds 2: a third is turned away
                worker.submit("more", [8], 3, priority=0), worker.submit("more2", [8], 3, priority=0)
            assert err.value.status == 429
            await asyncio.gather(long, low, high)
            assert finished == ["long", "high", "low"]
            # a cancelled request frees its slot at the next step; the next one runs
            events = worker.submit("gone", [9, 9], 50)
            await events.get()
            worker.cancel("gone")
            tokens, _ = await _collect(worker.submit("after", [3, 3], 3))
            assert len(tokens) == 3 and worker.batch.active == 0
        finally:
            worker.drain_and_stop()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_ignore_eos_runs_past_the_stop_token_beside_a_row_that_stops(decoder, kind: str) -> None:  # noqa: ANN001
    """Stop tokens are per request: one row ends at the model's stop token, the row beside it in the
    same steps (``ignore_eos``) decodes on to ``max_new`` with the very tokens it would alone."""
    import asyncio

    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.paged import PagedBatch
    from variantbench.serving.worker import BatchWorker

    prompt = [5, 9, 14, 30, 2, 8]
    full = _alone(decoder, prompt, 12)
    stop = full[3]
    end = full.index(stop) + 1
    kind_of = PagedBatch if kind == "paged" else ContinuousBatch
    # joined alone (no chunked prefill) the override holds too
    direct = kind_of(decoder, max_batch=2, max_len=64, stop_ids=(stop,))
    first, done = direct.join("x", prompt, 12, stops=frozenset())
    tokens = [first]
    while not done:
        ((_, token, done),) = direct.step()
        tokens.append(token)
    assert tokens == full

    async def main() -> list[tuple[list[int], str]]:
        worker = BatchWorker(kind_of(decoder, max_batch=4, max_len=64, stop_ids=(stop,))).start()
        try:
            both = [worker.submit("stops", prompt, 12), worker.submit("runs", prompt, 12, ignore_eos=True)]
            return await asyncio.gather(*(_collect(q) for q in both))
        finally:
            worker.drain_and_stop()

    (stopped, why), (through, why_through) = asyncio.run(main())
    assert (stopped, why) == (full[:end], "stop") and end < 12
    assert (through, why_through) == (full, "length")


def test_batch_size_adapts_to_what_a_row_more_still_buys() -> None:
    from variantbench.serving.scheduler import StepCost

    fixed = StepCost()  # a step costs 40 ms + 5 ms per row (our fp32 engine's shape here)
    assert fixed.useful_batch(32) == 32  # nothing learned yet: no limit
    for n in (1, 2, 4, 8, 16):
        fixed.observe(n, 0.040 + 0.005 * n)
    limit = fixed.useful_batch(32)
    assert 8 < limit < 32
    rate = [n / (0.040 + 0.005 * n) for n in (limit, limit + 1)]
    assert rate[1] < rate[0] * 1.02  # the next row would add under 2% tokens/s
    linear = StepCost()  # each row costs as much as a batch of one (llama.cpp before flash attention)
    for n, s in [(1, 0.0125), (2, 0.025), (4, 0.050), (8, 0.101), (16, 0.204)]:
        linear.observe(n, s)
    assert linear.useful_batch(32) == 1
    # sizes seen long ago keep counting: a thousand steps at batch 1 do not erase what batch 16 cost
    for _ in range(1000):
        linear.observe(1, 0.0125)
    assert linear.useful_batch(32) == 1 and 16 in linear.by_size


def test_batch_size_counts_what_a_request_costs_alone() -> None:
    """A prompt the batch does not share weighs against the rows: the default GGUF's costs through
    llama.cpp (a 5.1, b 5.8 ms a row and step, 3.6 ms a prompt token) batch 7 rows for decode
    tokens/s, but with 90-token prompts and 37-token answers a fifth row adds under 2% requests/s."""
    from variantbench.serving.scheduler import RequestMix, Scheduler, StepCost

    cost = StepCost()
    for n in (1, 2, 4, 8, 16):
        cost.observe(n, 0.0058 + 0.0051 * n)
    assert cost.useful_batch(32) == 7
    assert cost.useful_batch(32, prefill_s=90 * 0.0036, answer_tokens=37) == 4
    assert cost.useful_batch(32, prefill_s=0.0, answer_tokens=37) == 7  # no prompt: tokens/s
    # the scheduler's typical request: the tokens/s rule until an answer is seen, then its costs
    sched = Scheduler(max_batch=32)
    sched.cost = cost
    cost.observe_prefill_alone(90, 0.0058 + 90 * 0.0036)
    sched.mix.prompted(90)
    assert sched.useful_batch() == 7
    for _ in range(3):
        sched.mix.answered(37)
    assert sched.cost.prefill_marginal_s == pytest.approx(0.0036, rel=0.05)
    assert sched.useful_batch() == 4
    # a chunked prompt's tokens over steps, its completion in the last: 90 a request
    mix = RequestMix()
    for tokens, done in [(64, 0), (26, 1), (64, 0), (64, 0), (52, 2)]:
        mix.prompted(tokens, done)
    assert mix.prompt_tokens == pytest.approx(90, rel=0.05) and mix.answer_tokens is None  # decayed


def test_a_long_running_worker_keeps_only_its_recent_steps(decoder, monkeypatch) -> None:  # noqa: ANN001
    import asyncio

    from variantbench.serving import worker as worker_mod
    from variantbench.serving.continuous import ContinuousBatch

    monkeypatch.setattr(worker_mod, "RECENT_STEPS", 3)

    async def main() -> int:
        worker = worker_mod.BatchWorker(ContinuousBatch(decoder, max_batch=4, max_len=64)).start()
        try:
            for i in range(3):
                await _collect(worker.submit(f"r{i}", [5, 6, 7], 8))
            return len(worker.batch_sizes)
        finally:
            worker.drain_and_stop()

    assert asyncio.run(main()) == 3  # 24 decode steps ran; the record stays bounded
