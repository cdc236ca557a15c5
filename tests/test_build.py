"""The variant builder on a tiny random Llama with grouped-query attention (4 query heads, 2 KV)."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from variantbench.errors import UserError
from variantbench.variants import parse_variant
from variantbench.variants.base import split_chain
from variantbench.variants.build import manifest_of, materialize
from variantbench.variants.structure import keep_layers, prune_heads_to

IDS = torch.tensor([[5, 17, 33, 8, 91, 44, 12, 7, 150, 3, 66, 21]])


def _load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _zeroed(model, keep: list[list[int]]):
    """The original model with the o_proj columns of every removed query head set to zero."""
    d = model.config.head_dim
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            for h in range(model.config.num_attention_heads):
                if h not in keep[li]:
                    layer.self_attn.o_proj.weight[:, h * d : (h + 1) * d] = 0
    return model


@pytest.mark.parametrize(
    ("keep", "groups", "heads", "kv_heads"),
    [([[0, 3], [1, 2]], False, 2, 2), ([[2, 3], [0, 1]], True, 2, 1)],
)
def test_pruned_model_equals_zeroed_heads(
    tiny_model_dir: Path, tmp_path: Path, keep, groups, heads, kv_heads
) -> None:
    original = _load(tiny_model_dir)
    pruned = prune_heads_to(_load(tiny_model_dir), keep, groups)
    assert pruned.config.num_attention_heads == heads and pruned.config.num_key_value_heads == kv_heads
    assert pruned.config.head_dim == 16  # explicit, not hidden_size / heads (= 32)
    attn = pruned.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (heads * 16, 64) and attn.k_proj.weight.shape == (kv_heads * 16, 64)
    assert attn.o_proj.weight.shape == (64, heads * 16)
    removed = (4 - heads) * 16 * 64 * 2 + (2 - kv_heads) * 16 * 64 * 2  # q+o rows/cols, k+v rows
    assert (
        sum(p.numel() for p in original.parameters()) - sum(p.numel() for p in pruned.parameters())
        == removed * 2
    )
    with torch.no_grad():
        want = _zeroed(original, keep)(IDS).logits
        got = pruned(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    pruned.save_pretrained(tmp_path / "p")
    with torch.no_grad():
        torch.testing.assert_close(_load(tmp_path / "p")(IDS).logits, got)


def test_layer_drop_generates_the_same_with_and_without_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _load(build_three := tiny_model_dir)
    dropped = keep_layers(model, [1])
    assert dropped.config.num_hidden_layers == 1 and dropped.model.layers[0].self_attn.layer_idx == 0
    dropped.save_pretrained(tmp_path / "d")
    reloaded = _load(tmp_path / "d")
    cached = reloaded.generate(IDS, max_new_tokens=8, do_sample=False, use_cache=True)[0, IDS.shape[1] :]
    ids = IDS.clone()
    with torch.no_grad():
        for _ in range(8):  # greedy with a full forward each step, no cache at all
            ids = torch.cat([ids, reloaded(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert cached.tolist() == ids[0, IDS.shape[1] :].tolist()
    # the layer kept is the original's layer 1, weights untouched
    torch.testing.assert_close(
        reloaded.model.layers[0].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight
    )
    assert build_three


def test_recipes_are_cached_and_distillation_lowers_kl(tiny_model_dir: Path, tmp_path: Path) -> None:
    chain = parse_variant("drop-layers:1+distill:steps=12,lr=0.003,seq=32,batch=4")
    build, load = split_chain(chain)
    assert load == ()
    path = materialize(tiny_model_dir, build, cache=tmp_path)
    manifest = manifest_of(path)
    notes = manifest["notes"]
    assert notes["distill"]["held_out_kl_after"] < notes["distill"]["held_out_kl_before"]
    assert (path / "distill_loss.json").exists() and len(notes["drop-layers"]["kept_layers"]) == 1
    assert manifest["parameters"] < manifest["parameters_before"] and manifest["bytes_on_disk"] > 0
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert materialize(tiny_model_dir, build, cache=tmp_path) == path  # cached: not rebuilt
    assert (path / "manifest.json").stat().st_mtime_ns == stamp
    other = materialize(tiny_model_dir, split_chain(parse_variant("drop-layers:1"))[0], cache=tmp_path)
    assert other != path and not list(tmp_path.glob("variants/*.partial-*"))
    # the built variant runs through the real backend, with a load-time recipe on top
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.torch_backend import TorchBackend

    backend = TorchBackend(str(tiny_model_dir), "drop-layers:1+bf16")
    import variantbench.variants.build as b

    original = b.variants_root
    b.variants_root = lambda cache=None: original(tmp_path)
    try:
        info = backend.load()
    finally:
        b.variants_root = original
    assert info.details["built"]["key"] == other.name and info.details["weight_format"] == "bfloat16"
    assert backend.generate([GenerationRequest("r", prompt="The mayor", max_new_tokens=3)])[0].status == "ok"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("prune-heads:1.0", "prune-heads"),
        ("prune-heads", "needs a ratio"),
        ("drop-layers:0", "drop-layers"),
        ("distill:epochs=3", "distill takes"),
        ("int8+drop-layers:1", "must come before"),
        ("shrink:2", "known: "),
        ("compile:backend=tvm", "compile"),
        ("compile:fast", "compile takes"),
    ],
)
def test_bad_recipes_fail_with_one_line(spec: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle) as err:
        split_chain(parse_variant(spec))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "needle"), [("prune-heads:0.1", "between 1 and 1"), ("drop-layers:2", "keep no layer")]
)
def test_impossible_parameters_fail_before_any_work(
    tiny_model_dir: Path, tmp_path: Path, spec: str, needle: str
) -> None:
    with pytest.raises(UserError, match=needle):
        materialize(tiny_model_dir, parse_variant(spec), cache=tmp_path)
    assert not list((tmp_path / "variants").iterdir())  # no half-written entry


def test_onnx_fp32_export_matches_our_engine(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("onnxruntime_genai", reason="the onnx extra (onnxruntime-genai) is not installed")
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.ort_genai import OrtGenAIBackend
    from variantbench.backends.torch_backend import TorchBackend

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(tmp_path))
    requests = [GenerationRequest(f"r{i}", prompt=p, max_new_tokens=6) for i, p in
                enumerate(["The mayor of the town", "Read the report and answer"])]  # fmt: skip
    ours = TorchBackend(str(tiny_model_dir), "fp32")
    ours.load()
    onnx = OrtGenAIBackend(str(tiny_model_dir), "onnx-fp32")
    info = onnx.load()
    assert info.details["backend"] == "onnxruntime-genai" and info.param_bytes > 0
    assert list(tmp_path.glob("variants/onnx-*/manifest.json"))  # exported once, into the cache
    want, got = ours.generate(requests), onnx.generate(requests)
    for a, b in zip(want, got, strict=True):
        assert b.status == "ok", b.error
        assert b.output_tokens == a.output_tokens and b.text == a.text  # same greedy tokens, other engine
        assert len(b.token_ns) == b.output_tokens and b.first_token_ns <= b.end_ns
    # logit fidelity works the same way on both engines: the same distributions, within float error
    from variantbench.metrics.fidelity import FidelitySpec, measure

    spec = FidelitySpec(ctx=64, chunks=2, cache_dir=str(tmp_path / "fid"), model_key=str(tiny_model_dir))
    standard = measure(ours, spec, is_standard=True)
    other = measure(onnx, spec, is_standard=False)
    assert other["tokens_scored"] == standard["tokens_scored"] == 62
    assert other["perplexity"] == pytest.approx(standard["perplexity"], rel=1e-3)
    assert other["kl_mean"] < 1e-3 and other["top1_agreement"] > 0.95
    with pytest.raises(UserError, match="ends the chain"):
        split_chain(parse_variant("onnx-int4+int8"))
    # the export is listed among the built variants
    listing = subprocess.run([sys.executable, "-m", "variantbench", "variants"], capture_output=True, text=True,
                             check=False, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert listing.returncode == 0, listing.stderr[-1000:]
    assert "built (1):" in listing.stdout and "onnx-fp32" in listing.stdout


def test_weight_only_int8_and_a_clear_int4_answer(tiny_model_dir: Path) -> None:
    pytest.importorskip("torchao", reason="the torchao extra is not installed")
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.torch_backend import TorchBackend

    request = [GenerationRequest("r", prompt="The mayor of the town", max_new_tokens=4)]
    fp32, wo = TorchBackend(str(tiny_model_dir), "fp32"), TorchBackend(str(tiny_model_dir), "int8-wo")
    fp32_info, wo_info = fp32.load(), wo.load()
    assert wo_info.details["weight_format"] == "int8 weight-only (torchao)"
    assert wo_info.param_bytes < 0.5 * fp32_info.param_bytes  # int8 payload + scales (untied tiny model)
    want, got = fp32.generate(request)[0], wo.generate(request)[0]
    assert got.status == "ok" and got.text.split()[:1] == want.text.split()[:1]
    int4 = TorchBackend(str(tiny_model_dir), "int4-wo")
    try:
        int4.load()
    except UserError as exc:  # no kernel on this machine: the reason is named, on one line
        assert "int4-wo" in str(exc) and "kernel" in str(exc) and "\n" not in str(exc)
    else:
        assert int4.generate(request)[0].status == "ok"


def test_compiled_decode_step_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    # aot_eager: TorchDynamo capture + AOTAutograd functionalization (the in-place KV-cache writes),
    # without Inductor's C++ code generation, which takes minutes on 2 cores (benchmarks/ use it)
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.torch_backend import TorchBackend

    requests = [
        GenerationRequest("a", prompt="The mayor of the town", max_new_tokens=6),
        GenerationRequest("b", prompt="A letter from a resident who", max_new_tokens=9),
    ]
    eager, compiled = (
        TorchBackend(str(tiny_model_dir), "fp32"),
        TorchBackend(str(tiny_model_dir), "compile:backend=aot_eager"),
    )
    eager.load()
    info = compiled.load().details
    assert info["compile"] == {"backend": "aot_eager"} and info["compile_s"] > 0
    assert compiled._decoder.compiled
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for batch in (requests[:1], requests, requests * 2):  # batch 1, a padded batch of 2, and of 4
        want = [r.text for r in eager.generate(batch)]
        assert [r.text for r in compiled.generate(batch)] == want
    assert counters["stats"]["unique_graphs"] == graphs  # loading compiled every graph a run needs


@pytest.mark.slow  # 31 s of Inductor's code generation; the compiled step's tokens are proved with aot_eager above
def test_the_default_compile_variant_loads_and_decodes_batches(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor itself (the variant's default), once: its lowering of the packed multi-row matmul
    wants frozen weights, and failed the load with an AssertionError until that op ran outside
    the graph. ~30 s here from a cold code cache."""
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.torch_backend import TorchBackend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    requests = [
        GenerationRequest("a", prompt="The mayor of the town", max_new_tokens=6),
        GenerationRequest("b", prompt="A letter from a resident who", max_new_tokens=9),
    ]
    eager, compiled = TorchBackend(str(tiny_model_dir), "fp32"), TorchBackend(str(tiny_model_dir), "compile")
    eager.load()
    assert compiled.load().details["compile"] == {"backend": "inductor"}
    for batch in (requests[:1], requests):
        assert [r.text for r in compiled.generate(batch)] == [r.text for r in eager.generate(batch)]
    assert compiled.compact_weights() == 0  # a compiled step keeps its split-K copy
