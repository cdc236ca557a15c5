"""The linear-attention student: its two forms agree, the engine decodes it as the model computes
it, and the recipe trains, records and reloads it. On the tiny random Llama (4 query heads, 2 KV)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from variantbench.backends.engine import Decoder, LinearState
from variantbench.errors import UserError
from variantbench.variants import parse_variant
from variantbench.variants.base import restore_built
from variantbench.variants.build import manifest_of, materialize
from variantbench.variants.linear_attention import HedgehogMap, LinearAttention, parallel, step

IDS = [5, 17, 33, 8, 91, 44, 12, 7, 150, 3, 66, 21]


def test_recurrent_decode_equals_the_parallel_form_on_the_same_tokens() -> None:
    torch.manual_seed(0)
    b, hkv, g, s, d, f = 2, 2, 3, 300, 16, 8
    map_q, map_k = HedgehogMap(hkv * g, d, f), HedgehogMap(hkv, d, f)
    fq = map_q(torch.randn(b, hkv * g, s, d)).view(b, hkv, g, s, 2 * f)
    fk, v = map_k(torch.randn(b, hkv, s, d)), torch.randn(b, hkv, s, d)
    out, (s_par, z_par) = parallel(fq, fk, v, chunk=64)  # 5 chunks, the state carried across
    scores = torch.einsum("bhgsf,bhtf->bhgst", fq, fk).tril()
    quadratic = torch.einsum("bhgst,bhtd->bhgsd", scores, v) / (scores.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, quadratic, rtol=1e-5, atol=1e-5)
    state = (torch.zeros(b, hkv, 2 * f, d), torch.zeros(b, hkv, 2 * f))
    steps = []
    for t in range(s):
        o, state = step(fq[:, :, :, t], fk[:, :, t], v[:, :, t], state)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 3), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], s_par, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(state[1], z_par, rtol=1e-5, atol=1e-4)
    first, mid = parallel(fq[:, :, :, :100], fk[:, :, :100], v[:, :, :100])
    rest, _ = parallel(fq[:, :, :, 100:], fk[:, :, 100:], v[:, :, 100:], mid)  # prefill, then more
    torch.testing.assert_close(torch.cat([first, rest], 3), out, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def student(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    recipe = parse_variant("linear-attn:layers=1,features=8,transfer_steps=6,steps=4,seq=32")
    return materialize(tiny_model_dir, recipe, cache=tmp_path_factory.mktemp("cache"))


def _reload(folder: Path):
    return restore_built(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), folder).eval()


def test_the_recipe_trains_records_and_reloads_the_student(student: Path, tiny_model_dir: Path) -> None:
    notes = manifest_of(student)["notes"]["linear-attn"]
    assert notes["layers"] == [1] and notes["features"] == 8
    assert notes["state_floats_per_layer"] == 2 * 16 * 16  # kv heads x 2F x head_dim
    for key in ("held_out_kl_swapped", "held_out_kl_after_transfer", "held_out_kl_after"):
        assert notes[key] > 0
    assert notes["transfer_last"] < notes["transfer_first"]  # the maps learned the softmax outputs
    curves = json.loads((student / "linear_attn_loss.json").read_text())
    assert len(curves["transfer_mse"]) == 6 and len(curves["distill_kl"]) == 4
    model = _reload(student)
    assert isinstance(model.model.layers[1].self_attn, LinearAttention)
    assert not isinstance(model.model.layers[0].self_attn, LinearAttention)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # layer 0 untouched; layer 1's maps trained
    torch.testing.assert_close(
        model.model.layers[0].mlp.down_proj.weight, base.model.layers[0].mlp.down_proj.weight
    )
    assert not torch.equal(
        model.model.layers[1].self_attn.feature_k.weight, torch.eye(16, 8).expand(2, 16, 8)
    )


def test_the_engine_decodes_the_student_as_its_parallel_form(student: Path) -> None:
    model = _reload(student)
    decoder = Decoder(model)
    assert decoder.softmax_layers == [0] and decoder.has_linear_attention
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        for _ in range(8):  # greedy by the whole-sequence (parallel) forward, no state at all
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
        reference = torch.log_softmax(model(torch.tensor([IDS])).logits[0], -1)
    assert decoder.generate([IDS], 8).token_ids[0] == ids[0, len(IDS) :].tolist()
    torch.testing.assert_close(decoder.log_probs(IDS), reference, rtol=1e-4, atol=1e-4)
    batch = [IDS, IDS[:5], IDS[3:]]  # left padding stays out of the state
    assert decoder.generate(batch, 6).token_ids == [decoder.generate([p], 6).token_ids[0] for p in batch]
    storage, states = decoder._new_cache(2, 4096)
    assert storage.shape[0] == 1 and len(states) == 1 and isinstance(states[0], LinearState)
    assert states[0].s.shape == (2, 2, 16, 16)  # no dimension grows with the context


def test_bad_linear_attention_arguments_are_one_line_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="bad parameters"):
        parse_variant("linear-attn:layers=5-2")
    with pytest.raises(UserError, match="layer 7 asked for"):
        materialize(
            tiny_model_dir, parse_variant("linear-attn:layers=7,steps=1,transfer_steps=1"), cache=tmp_path
        )
