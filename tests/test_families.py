"""Every registered family against transformers' own forward, on a tiny random model of its config.

What each family file claims (norms, q/k norms, biases, fused projections, multipliers, soft-caps,
sliding windows, RoPE variants, experts) is proven here: logits on prefill and on 32 decode steps
within ``TOLERANCE`` of transformers' (fp32), greedy tokens equal, and the same tokens from the two
serving batches with rows of different lengths joining, prefilling in chunks and leaving.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from variantbench.backends.engine import Decoder
from variantbench.families import family_for, registered_types
from variantbench.models.tiny import TINY, tiny_config, tiny_model

TOLERANCE = 1e-4  # max |logit difference| in fp32; measured 1e-6 to 6e-6 (tests print each)
VOCAB = 400
STEPS = 32
FAMILIES = sorted(TINY)
# prompts longer than the tiny configs' 6-position windows, of four lengths
PROMPTS = {"a": (list(range(3, 17)), 12), "b": ([40, 41, 42, 7, 8], 9), "c": [list(range(60, 100)), 10],
           "d": ([7, 300, 7, 250, 7, 9, 11, 13, 5], 14)}  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest):  # noqa: ANN201 - (transformers model, our decoder)
    model = tiny_model(tiny_config(request.param, VOCAB), seed=3)
    return request.param, model, Decoder(model)


def test_every_registered_family_has_a_tiny_config_and_the_tiny_configs_name_registered_families() -> None:
    names = {family_for(tiny_config(name, VOCAB)).name for name in TINY}
    assert names == set(TINY)
    assert {family_for(tiny_config(name, VOCAB)).model_types[0] for name in TINY} == set(registered_types())


def _hf_greedy(model, prompt: list[int], n: int):  # noqa: ANN001, ANN202
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.logits]


def _our_step_logits(
    dec: Decoder, prompt: list[int], forced: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill logits at every position, then one decode step per forced token (teacher forcing:
    transformers' tokens are fed, so a difference cannot cascade), each step's logits."""
    return dec.teacher_forced_logits(prompt, forced)


def test_prefill_and_decode_logits_and_greedy_tokens_match_transformers(pair) -> None:  # noqa: ANN001
    name, model, dec = pair
    prompt = PROMPTS["a"][0]
    want_tokens, want_logits = _hf_greedy(model, prompt, STEPS)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0]
    prefill, steps = _our_step_logits(dec, prompt, want_tokens)
    prefill_diff = (prefill - reference).abs().max().item()
    decode_diff = max((a - b).abs().max().item() for a, b in zip(steps, want_logits, strict=True))
    print(f"{name}: prefill max |dlogit| {prefill_diff:.2e}, decode {decode_diff:.2e}")
    assert prefill_diff < TOLERANCE and decode_diff < TOLERANCE
    assert dec.generate([prompt], STEPS).token_ids[0] == want_tokens
    # left-padded batch of three lengths: masks and windows per row
    batch = [PROMPTS[k][0] for k in ("a", "b", "d")]
    assert dec.generate(batch, STEPS).token_ids == [_hf_greedy(model, p, STEPS)[0] for p in batch]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_serving_batches_decode_every_family_as_transformers_alone(pair, kind: str) -> None:  # noqa: ANN001
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.paged import PagedBatch

    _, model, dec = pair
    want = {k: _hf_greedy(model, p, n)[0] for k, (p, n) in PROMPTS.items()}
    cls = ContinuousBatch if kind == "contiguous" else PagedBatch
    batch = cls(dec, max_batch=4, max_len=96, prefill_chunk=7)
    got: dict[str, list[int]] = {}
    first, _ = batch.join("a", *PROMPTS["a"])  # prefilled alone
    got["a"] = [first]
    arrivals = [None, "b", None, "c", None, None, "d"]  # the rest prefill in chunks beside decode rows
    steps = 0
    while arrivals or batch.active:
        if arrivals and (key := arrivals.pop(0)) is not None:
            batch.begin(key, *PROMPTS[key])
        for key, token, done in batch.step():
            got.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
        steps += 1
        assert steps < 200
    assert got == want


def test_a_misdescribed_family_fails_parity() -> None:
    """The checks above can fail: the same model read without its window or soft-caps differs."""
    for name, change in (("mistral", {"sliding_every_layer": False}), ("gemma2", {"attn_softcap_key": None}),
                         ("qwen3", {"qk_norm": None}), ("granite", {"residual_scale_key": None})):  # fmt: skip
        model = tiny_model(tiny_config(name, VOCAB), seed=3)
        prompt = PROMPTS["a"][0]
        with torch.no_grad():
            reference = model(torch.tensor([prompt])).logits[0]
        wrong = Decoder(model, dataclasses.replace(family_for(model.config), **change))
        prefill, _ = _our_step_logits(wrong, prompt, [1])
        assert (prefill - reference).abs().max().item() > 100 * TOLERANCE, (name, change)


ROPE_VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 2048),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}, 64),
    # the two whose frequencies depend on the forward's length: decode runs past the original 16 positions
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, 16),
    "longrope": ({"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                  "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.1 * i for i in range(8)]}, 2048),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(ROPE_VARIANTS))
def test_rope_variants_match_transformers_past_the_original_context(kind: str) -> None:
    params, positions = ROPE_VARIANTS[kind]
    model = tiny_model(
        tiny_config("llama", VOCAB, rope_parameters=params, max_position_embeddings=positions), seed=3
    )
    prompt = PROMPTS["a"][0]  # 14 tokens; 32 more pass 16 positions
    want_tokens, want_logits = _hf_greedy(model, prompt, STEPS)
    dec = Decoder(model)
    prefill, steps = _our_step_logits(dec, prompt, want_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(steps, want_logits, strict=True)) < TOLERANCE
    assert Decoder(model).generate([prompt], STEPS).token_ids[0] == want_tokens
