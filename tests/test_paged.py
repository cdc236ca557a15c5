"""The paged KV cache: blocks from a pool, memory handed back, prefixes shared, the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from variantbench.serving.kv_pool import BlockPool, PoolFull, block_size, runs


@pytest.fixture(scope="module")
def decoder(tiny_model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import Decoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return Decoder(model)


def test_blocks_are_whole_pages_per_head_and_runs_group_consecutive_ids() -> None:
    assert block_size(64, 4) == 16 and block_size(64, 2) == 32 and block_size(128, 4) == 16
    assert runs([4, 5, 6, 9, 10, 2]) == [(4, 3), (9, 2), (2, 1)]


def test_the_pool_gives_consecutive_blocks_first_fit_and_merges_what_comes_back() -> None:
    pool = BlockPool(layers=2, kv_heads=1, head_dim=64, blocks=10, dtype=torch.float32)
    a, b, c = pool.allocate(3), pool.allocate(4), pool.allocate(2)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5, 6], [7, 8])
    pool.release(b)
    assert pool.allocate(5) == [3, 4, 5, 6, 9]  # no run of 5 is free: the fewest runs, longest first
    pool.release(a)
    pool.release(c)
    pool.retain([4])  # a second holder (the prefix cache): the block stays when the row lets go
    pool.release([3, 4, 5, 6, 9])
    assert pool.free_blocks == 9 and pool.refs[4] == 1
    with pytest.raises(PoolFull):
        pool.allocate(10)
    pool.release([4])
    assert pool.allocate(10) == list(range(10))


def test_written_blocks_are_resident_and_handed_back_when_freed() -> None:
    proc = psutil.Process()
    before = proc.memory_info().rss
    # 256 MiB reserved: 8 layers x 2 x 4 heads x 4096 blocks x 16 positions x 64 x 4 bytes
    pool = BlockPool(layers=8, kv_heads=4, head_dim=64, blocks=4096, dtype=torch.float32)
    assert proc.memory_info().rss - before < 32 * 2**20  # reserved, not resident
    blocks = pool.allocate(2048)
    for b in blocks:
        pool.data[:, :, :, b * 16 : (b + 1) * 16] = 1.0
    pool.written(blocks)
    assert pool.committed_bytes == 2048 * pool.bytes_per_block
    grown = proc.memory_info().rss - before
    assert grown > 100 * 2**20
    pool.release(blocks)
    assert pool.committed_bytes == 0
    assert proc.memory_info().rss - before < grown - 100 * 2**20
    assert float(pool.data[0, 0, 0, 0, 0]) == 0.0  # handed back: the kernel's zero page


def test_requests_joining_and_leaving_decode_as_if_alone(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.paged import PagedBatch

    prompts = {
        "a": ([5, 9, 14, 30, 2, 8], 12),
        "b": ([40, 41, 42], 5),
        "c": (list(range(60, 100)), 9),
        "d": ([7, 7, 7, 7], 6),
    }
    want = {k: decoder.generate([p], n).token_ids[0] for k, (p, n) in prompts.items()}
    batch = PagedBatch(decoder, max_batch=4, max_len=80)
    got: dict[str, list[int]] = {}
    pending = ["a", "b", None, "c", None, None, "d"]
    while pending or batch.active:
        if pending:
            key = pending.pop(0)
            if key is not None:
                first, _ = batch.join(key, *prompts[key])
                got[key] = [first]
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)
    assert got == want
    assert batch.pool.free_blocks == batch.pool.blocks and batch.pool.committed_bytes == 0


@pytest.mark.parametrize("share", [True, False])
def test_chunked_prefill_paused_rows_and_a_shared_prefix_decode_as_if_alone(decoder, share: bool) -> None:  # noqa: ANN001
    from variantbench.serving.paged import PagedBatch
    from variantbench.serving.scheduler import StepPlan

    batch = PagedBatch(
        decoder, max_batch=4, max_len=256, prefill_chunk=10, prefix_cache_mb=1, share_prefixes=share
    )
    shared = [100 + i % 250 for i in range(2 * batch.block)]  # two blocks that two prompts share
    prompts = {"a": (shared + [5, 6, 7], 10), "b": (shared + [9, 8], 8), "c": (list(range(200, 237)), 7)}
    want = {k: decoder.generate([p], n).token_ids[0] for k, (p, n) in prompts.items()}
    got: dict[str, list[int]] = {}
    batch.begin("a", *prompts["a"])
    while "a" not in got:  # prefilled in chunks of 10 tokens
        for key, token, _ in batch.step():
            got.setdefault(key, []).append(token)
    batch.begin("b", *prompts["b"])
    assert batch.prompt_tokens["cached"] == 2 * batch.block  # b borrows a's two prompt blocks
    b_row = batch.rows[-1]
    if share:  # borrowed: the same blocks, held by a, b and the cache
        assert b_row.blocks[:2] == batch.rows[0].blocks[:2] and batch.pool.refs[b_row.blocks[0]] == 3
    else:  # copied into b's own run
        assert (
            not set(b_row.blocks) & set(batch.rows[0].blocks)
            and batch.pool.refs[batch.rows[0].blocks[0]] == 2
        )
    batch.begin("c", *prompts["c"], priority=0)
    rows_before = [len(t) for t in got.values()]
    out = batch.step(StepPlan([("c", 37)], decode=False))  # c alone; a pauses
    assert [k for k, _, _ in out] == ["c"] and [len(t) for t in got.values()] == rows_before
    got["c"] = [out[0][1]]
    while batch.active:
        for key, token, done in batch.step():
            got.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
    assert got == want
    # the prefix cache still holds its blocks; clearing it returns every block
    assert batch.pool.free_blocks < batch.pool.blocks
    batch.prefix.clear()
    assert batch.pool.free_blocks == batch.pool.blocks


def test_a_request_the_pool_cannot_hold_waits_for_room(decoder) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import NoRoom
    from variantbench.serving.paged import PagedBatch

    probe = PagedBatch(decoder, max_batch=2, max_len=64)
    block = probe.block
    batch = PagedBatch(decoder, max_batch=2, max_len=3 * block, pool_tokens=block)  # 1 + 2 blocks
    assert batch.pool.blocks == 3
    batch.begin("a", [3 + i % 390 for i in range(2 * block)], block)  # its prompt and answer: 3 blocks
    with pytest.raises(NoRoom):
        batch.begin("b", [5, 6, 7], 4)
    batch.leave("a")
    batch.begin("b", [5, 6, 7], 4)


def test_a_pool_larger_than_the_machine_is_reserved_and_commits_only_what_is_written() -> None:
    # a 1.7B model's worst case outgrew this machine: the reservation itself used to be refused
    machine = psutil.virtual_memory().total + psutil.swap_memory().total
    blocks = (2 * machine) // (8 * 2 * 4 * 16 * 64 * 4) + 1
    pool = BlockPool(layers=8, kv_heads=4, head_dim=64, blocks=blocks, dtype=torch.float32)
    assert pool.reserved_bytes > 2 * machine
    before = psutil.Process().memory_info().rss
    last = pool.allocate(blocks)[-1:]
    pool.data[:, :, :, last[0] * 16 :] = 1.0
    pool.written(last)
    assert psutil.Process().memory_info().rss - before < 16 * 2**20
    pool.release(last)


def test_the_cache_holds_the_worst_case_within_its_memory_budget(decoder) -> None:  # noqa: ANN001
    from variantbench.errors import UserError
    from variantbench.serving.continuous import ContinuousBatch, NoRoom
    from variantbench.serving.paged import PagedBatch

    whole = PagedBatch(decoder, max_batch=4, max_len=64)
    per_token = whole.pool.bytes_per_block // whole.block
    assert whole.capped_by is None and whole.pool.blocks * whole.block >= 4 * 64
    # room for 2.5 requests of max_len: the pool is cut to it, and a third long request waits
    capped = PagedBatch(decoder, max_batch=4, max_len=64, kv_budget=(160 * per_token, "a test's budget"))
    assert capped.capped_by == "a test's budget" and "capped by a test's budget" in capped.describe()
    assert capped.pool.blocks * capped.block < 4 * 64
    for key in ("a", "b"):
        capped.begin(key, [3 + i % 390 for i in range(40)], 24)
    with pytest.raises(NoRoom):
        capped.begin("c", [3 + i % 390 for i in range(40)], 24)
    capped.leave("a")
    capped.begin("c", [3 + i % 390 for i in range(40)], 24)
    with pytest.raises(UserError, match="less than one request of --max-len 64"):
        PagedBatch(decoder, max_batch=4, max_len=64, kv_budget=(32 * per_token, "--kv-cache-gb 0.001"))
    with pytest.raises(UserError, match="contiguous KV cache needs"):
        ContinuousBatch(decoder, max_batch=4, max_len=64, kv_budget=(100 * per_token, "a test's budget"))


def test_the_prefix_caches_blocks_give_way_to_a_request(decoder) -> None:  # noqa: ANN001
    """The cache keeps its blocks in the requests' pool: once a request needs them, the least recently
    used go (a batch of one whose cache held 8 of its 17 blocks otherwise never started a request)."""
    from variantbench.serving.paged import PagedBatch

    probe = PagedBatch(decoder, max_batch=1, max_len=64)
    block = probe.block
    batch = PagedBatch(decoder, max_batch=1, max_len=4 * block, pool_tokens=3 * block, prefix_cache_mb=1)
    assert batch.pool.blocks == 4
    old = [3 + i % 390 for i in range(2 * block + 1)]
    batch.join("old", old, 2)
    while batch.active:
        for key, _, done in batch.step():
            if done:
                batch.leave(key)
    assert len(batch.prefix) == 2 and batch.pool.free_blocks == 2  # its two prompt blocks stay cached
    fresh = [5 + i % 380 for i in range(3 * block)]
    batch.begin("fresh", fresh, block)  # 4 blocks: the cached ones are let go
    assert len(batch.prefix) == 0 and batch.pool.free_blocks == 0
