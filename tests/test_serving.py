"""Serving: continuous batching gives the same greedy tokens as decoding each request alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def decoder(tiny_model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from variantbench.backends.engine import LlamaDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return LlamaDecoder(model)


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
