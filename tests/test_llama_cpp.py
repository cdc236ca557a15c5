"""llama.cpp variants: our GGUF export, llama_model_quantize, and the llama-cpp-python backend.

Skipped when llama-cpp-python is not installed (``bash .ci/llama_cpp.sh`` installs it in about 3
minutes); ``.ci/run`` installs it and sets VARIANTBENCH_REQUIRE_LLAMA_CPP=1, so in CI a missing
engine fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import re
import shutil

import pytest

from variantbench.backends.base import GenerationRequest
from variantbench.errors import UserError

if os.environ.get("VARIANTBENCH_REQUIRE_LLAMA_CPP"):
    import llama_cpp  # noqa: F401 - CI: a missing engine is a failure, not a skip
else:
    pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: bash .ci/llama_cpp.sh (about 3 minutes)"
    )

PROMPTS = ["The mayor of the town", "Read the report and answer"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vb-cache")


def _requests(n: int = 6) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", prompt=p, max_new_tokens=n) for i, p in enumerate(PROMPTS)]


def test_f32_export_runs_the_same_model_as_torch(tiny_model_dir: Path, cache: Path, monkeypatch) -> None:
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.backends.torch_backend import TorchBackend
    from variantbench.metrics.fidelity import FidelitySpec, measure

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    ours, gguf = TorchBackend(str(tiny_model_dir), "fp32"), LlamaCppBackend(str(tiny_model_dir), "gguf-f32")
    ours.load()
    info = gguf.load()
    assert info.details["gguf_file_type"] == 0 and info.details["backend"] == "llama.cpp"
    for a, b in zip(ours.generate(_requests()), gguf.generate(_requests()), strict=True):
        assert b.status == "ok", b.error
        assert (b.text, b.output_tokens, b.input_tokens) == (a.text, a.output_tokens, a.input_tokens)
    # the same distributions at every position: the query/key row permutation and the head size are right
    spec = FidelitySpec(ctx=64, chunks=2, cache_dir=str(cache / "fid"), model_key=str(tiny_model_dir))
    standard, other = measure(ours, spec, is_standard=True), measure(gguf, spec, is_standard=False)
    assert other["perplexity"] == pytest.approx(standard["perplexity"], rel=1e-3)
    assert other["kl_mean"] < 1e-3 and other["top1_agreement"] > 0.95
    gguf.close()


def test_every_request_starts_from_an_empty_context(tiny_model_dir: Path, cache: Path, monkeypatch) -> None:
    from variantbench.backends.llama_cpp import LlamaCppBackend

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    backend = LlamaCppBackend(str(tiny_model_dir), "gguf-f32")
    backend.load()
    # it stops where llama.cpp's own server does: every end-of-generation token, not the EOS alone
    tok = backend.tokenizer
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")} <= set(backend.stop_ids)
    same = [GenerationRequest(f"s{i}", prompt=PROMPTS[0], max_new_tokens=5) for i in range(3)]
    results = backend.generate(same)
    assert len({r.text for r in results}) == 1
    for r in results:
        # the whole prompt is evaluated every time (no KV-cache reuse across requests), and the
        # perf counters hold this request alone (they were reset): prompt + each token but the last
        assert r.engine_timings["prompt_tokens"] == r.input_tokens
        assert r.engine_timings["eval_tokens"] == r.output_tokens - 1
        # our clock and llama.cpp's agree: TTFT covers the prompt evaluation
        ttft_ms = (r.first_token_ns - r.start_ns) / 1e6
        assert ttft_ms >= r.engine_timings["prompt_eval_ms"] * 0.95
    too_long = backend.generate([GenerationRequest("x", prompt="word " * 3000, max_new_tokens=4)])[0]
    assert too_long.status == "error" and "exceeds the context" in too_long.error
    backend.close()


def test_quantized_files_come_from_the_f32_export(tiny_model_dir: Path, cache: Path, monkeypatch) -> None:
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.variants.gguf import gguf_file_type

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    q8 = LlamaCppBackend(str(tiny_model_dir), "gguf-q8_0")
    info = q8.load()
    path = Path(info.details["gguf"])
    assert gguf_file_type(path) == 7
    manifest = json.loads((path.parent / "manifest.json").read_text())
    f32 = Path(manifest["from"])
    assert gguf_file_type(f32) == 0 and path.stat().st_size < 0.5 * f32.stat().st_size
    assert all(r.status == "ok" and r.output_tokens > 0 for r in q8.generate(_requests()))
    q8.close()
    # cached: a second load builds nothing
    again = LlamaCppBackend(str(tiny_model_dir), "gguf-q8_0")
    assert again.load().details["gguf"] == str(path)
    again.close()


def test_a_base_converted_from_gguf_runs_its_own_file(tiny_model_dir: Path, cache: Path, tmp_path: Path,
                                                      monkeypatch) -> None:  # fmt: skip
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.variants.gguf import write_gguf

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    shipped = tmp_path / "shipped-f16.gguf"
    write_gguf(tiny_model_dir, shipped, f16=True)
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "variantbench-model.json").write_text(json.dumps({"source": str(shipped), "format": "gguf"}))
    backend = LlamaCppBackend(str(base), "gguf-f16")
    assert backend.load().details["gguf"] == str(shipped)  # run as shipped, not re-made
    assert backend.generate(_requests(3))[0].status == "ok"
    backend.close()


def test_gguf_recipes_end_the_chain_and_need_llama_architecture(tmp_path: Path) -> None:
    from variantbench.variants import parse_variant
    from variantbench.variants.base import split_chain
    from variantbench.variants.gguf import write_gguf

    with pytest.raises(UserError, match="ends the chain"):
        split_chain(parse_variant("gguf-q4_0+int8"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UserError, match="Llama-architecture"):
        write_gguf(tmp_path, tmp_path / "out.gguf")


def test_build_command_exports_engine_variants(tiny_model_dir: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "VARIANTBENCH_CACHE": str(tmp_path), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "variantbench", "build", "gguf-q4_0", "--model", str(tiny_model_dir)],
                          capture_output=True, text=True, env=env, check=False, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert re.search(r"gguf-q4_0: [0-9.]+ MB, built in \d+ s -> ", proc.stderr), proc.stderr[-1500:]
    listing = subprocess.run([sys.executable, "-m", "variantbench", "variants"], capture_output=True, text=True,
                             env=env, check=False, timeout=120)  # fmt: skip
    assert (
        "gguf-q4_0" in listing.stdout and "gguf-f32" in listing.stdout
    )  # the quantized file and its f32 source


def test_continuous_batching_on_llama_cpp_decodes_as_if_alone(
    tiny_model_dir: Path, cache: Path, monkeypatch
) -> None:
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.serving.batching import batch_for
    from variantbench.serving.continuous import NoRoom

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    backend = LlamaCppBackend(str(tiny_model_dir), "gguf-f32")
    backend.load()
    from variantbench.backends.base import encode_request

    tok = backend.tokenizer
    texts = {f"p{i}": text for i, text in enumerate(PROMPTS + ["The river", "A mill"])}
    prompts = {key: encode_request(tok, GenerationRequest(key, prompt=text)) for key, text in texts.items()}
    # each alone, through the engine's own generate loop
    want = {key: backend.generate([GenerationRequest(key, prompt=text, max_new_tokens=9)])[0].text
            for key, text in texts.items()}  # fmt: skip
    batch = batch_for(backend, max_batch=3, max_len=64)
    got: dict[str, list[int]] = {}
    pending = list(prompts)
    sizes = []
    while pending or batch.active:
        if pending and batch.active < batch.max_batch:  # joins between steps, up to 3 at once
            key = pending.pop(0)
            got[key] = [batch.join(key, prompts[key], 9, stops=frozenset())[0]]  # ignore_eos: all 9
        sizes.append(batch.active)
        for key, token, done in batch.step():
            got[key].append(token)
            if done:
                batch.leave(key)
    assert max(sizes) == 3
    for key, tokens in got.items():
        assert len(tokens) == 9
        stop = next((i for i, t in enumerate(tokens) if t in backend._stop_ids), len(tokens))
        text = tok.decode(tokens[:stop], skip_special_tokens=True).strip()
        assert text == want[key], key
    batch.stop_ids = frozenset(range(batch.n_vocab))  # the model's stop tokens end it at once
    assert batch.join("s", prompts["p0"], 9)[1]
    batch.leave("s")
    small = batch_for(backend, max_batch=2, max_len=64)
    small.kv_tokens = 40  # two 20-token reservations fill it
    small.join("a", list(range(3, 13)), 10)
    small.join("b", list(range(3, 13)), 10)
    with pytest.raises(NoRoom):
        small.leave("b") or small.join("c", list(range(3, 33)), 10)
    small.close()
    batch.close()
    backend.close()


def test_llama_cpp_cache_is_held_within_the_kv_budget(tiny_model_dir: Path, cache: Path, monkeypatch) -> None:
    """``--kv-cache-gb`` caps llama.cpp's cache as it caps the torch pool: fewer cells (requests beyond
    them wait), one line when not even one ``max_len`` request fits, and /metrics' gauge reads it whole."""
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.serving.batching import KvMemory, batch_for
    from variantbench.serving.continuous import NoRoom

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    backend = LlamaCppBackend(str(tiny_model_dir), "gguf-f32")
    backend.load()
    meta = backend.llm.metadata
    arch = meta["general.architecture"]
    heads, kv_heads = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.attention.head_count_kv"])
    width = kv_heads * int(meta[f"{arch}.embedding_length"]) // heads
    per_token = int(meta[f"{arch}.block_count"]) * width * 2 * 2  # K and V, f16 cells
    whole = batch_for(backend, max_batch=4, max_len=64)
    assert isinstance(whole, KvMemory) and whole.bytes_per_token == per_token
    assert (
        whole.kv_tokens == 4 * 64 and whole.kv_resident_bytes == 256 * per_token and whole.capped_by is None
    )
    whole.close()
    capped = batch_for(backend, max_batch=4, max_len=64, kv_cache_gb=100 * per_token / 2**30)
    assert capped.kv_tokens == 100 and "capped by --kv-cache-gb" in capped.describe()
    capped.join("a", list(range(3, 23)), 40, stops=frozenset())  # 60 of the 100 cells reserved
    with pytest.raises(NoRoom):
        capped.join("b", list(range(30, 50)), 40)  # waits: the worker keeps it queued
    capped.leave("a")
    capped.join("b", list(range(30, 50)), 40)  # room again
    capped.close()
    with pytest.raises(UserError, match="less than one request of --max-len 64"):
        batch_for(backend, max_batch=4, max_len=64, kv_cache_gb=30 * per_token / 2**30)
    backend.close()


def test_llama_cpp_batch_prefills_in_chunks_beside_the_rows_and_reuses_prefixes(
    tiny_model_dir: Path, cache: Path, monkeypatch
) -> None:
    """Prompts begun while others decode ride in the same llama_decode (a plan may pause the rows),
    a prompt that shares a finished or running one's prefix computes only the rest, and every answer
    is the one the engine gives the prompt alone."""
    from variantbench.backends.base import encode_request
    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.serving.batching import batch_for
    from variantbench.serving.scheduler import StepPlan

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    backend = LlamaCppBackend(str(tiny_model_dir), "gguf-f32")
    backend.load()
    tok = backend.tokenizer
    stem = "Read the report of the mayor of the town and answer the question that follows it"
    texts = {"a": stem + ": who won?", "b": "The river", "c": stem + ": when?", "d": stem + ": when? Why?"}
    prompts = {k: encode_request(tok, GenerationRequest(k, prompt=t)) for k, t in texts.items()}
    want = {
        k: backend.generate([GenerationRequest(k, prompt=t, max_new_tokens=8)])[0].text
        for k, t in texts.items()
    }
    batch = batch_for(backend, max_batch=4, max_len=128, prefill_chunk=8, prefix_cache_mb=1)
    batch.stop_ids = frozenset()
    got: dict[str, list[int]] = {}
    shapes = []

    def run(plan: StepPlan | None = None) -> None:
        for key, token, done in batch.step(plan):
            got.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
        shapes.append((batch.last_rows, batch.last_prompt_tokens))

    batch.begin("a", prompts["a"], 8)
    while "a" not in got:
        run()
    assert all(tokens <= 8 for _, tokens in shapes)  # chunks of prefill_chunk
    computed = batch.prompt_tokens["computed"]
    batch.begin("b", prompts["b"], 8)
    run()  # a decodes beside b's prompt in one call
    assert shapes[-1][0] == 1 and shapes[-1][1] > 0
    batch.begin("c", prompts["c"], 8)  # shares a's prompt while a runs
    pending = {p.key: p.left for p in batch.pending_prefills()}
    assert pending["c"] < len(prompts["c"]) - 10
    run(StepPlan(prefill=[("c", 2)], decode=False))  # the rows pause for c's chunk
    assert shapes[-1] == (0, 2)
    while batch.active:
        run()
    assert batch.prompt_tokens["cached"] > 10
    batch.begin("d", prompts["d"], 8)  # c has finished: its kept keys/values are taken over
    shared = next(
        i for i, (x, y) in enumerate(zip(prompts["c"] + [-1], prompts["d"], strict=False)) if x != y
    )
    assert (
        shared > 10 and {p.key: p.left for p in batch.pending_prefills()}["d"] == len(prompts["d"]) - shared
    )
    while batch.active:
        run()
    assert batch.prompt_tokens["computed"] - computed < sum(len(prompts[k]) for k in "bcd") - 20
    for key, tokens in got.items():
        assert len(tokens) == 8
        stop = next((i for i, t in enumerate(tokens) if t in backend._stop_ids), len(tokens))
        assert tok.decode(tokens[:stop], skip_special_tokens=True).strip() == want[key], key
    off = batch_for(backend, max_batch=2, max_len=128, prefix_cache_mb=0)
    off.join("a", prompts["a"], 2)
    off.leave("a")
    off.join("c", prompts["c"], 2)
    assert off.prompt_tokens["cached"] == 0
    off.close()
    batch.close()
    backend.close()


def test_a_gguf_variant_is_served_with_the_engines_greedy_text(
    tiny_model_dir: Path, cache: Path, monkeypatch
) -> None:
    """The whole serving path on llama.cpp (warm-up, chunked prefill, prefix reuse, HTTP), as
    ``variantbench serve --variants gguf-f32`` runs it: concurrent clients get what the engine
    gives each prompt alone, and /metrics counts the prompt tokens the kept prefixes served."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from variantbench.backends.llama_cpp import LlamaCppBackend
    from variantbench.loadgen.noop_server import ThreadServer
    from variantbench.serving.app import make_app
    from variantbench.serving.host import ServeOptions, serve_model

    monkeypatch.setenv("VARIANTBENCH_CACHE", str(cache))
    backend = LlamaCppBackend(str(tiny_model_dir), "gguf-f32", threads=2)
    backend.load()
    stem = "Read the report of the mayor of the town and answer: "
    prompts = [stem + q for q in ("who won?", "when?", "where is the mill?", "why?")]
    chats = [({"role": "user", "content": p},) for p in prompts]
    want = [backend.generate([GenerationRequest(str(i), messages=m, max_new_tokens=6)])[0].text
            for i, m in enumerate(chats)]  # fmt: skip
    models = {"gguf-f32": serve_model("gguf-f32", backend, ServeOptions(max_len=256, prefill_chunk=8))}
    try:
        with ThreadServer(app=make_app(models)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:

            def ask(messages: tuple) -> str:
                body = {"model": "gguf-f32", "messages": list(messages), "max_tokens": 6, "temperature": 0}
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"].strip()

            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(ask, chats))
            assert got == want
            assert ask(chats[0]) == want[0]  # again, from its kept prefix
            metrics = client.get("/metrics").text
            cached = re.search(
                r'variantbench_prompt_tokens_total\{model="gguf-f32",source="cached"\} (\S+)', metrics
            )
            assert cached and float(cached.group(1)) >= len(prompts[0]) // 2
    finally:
        for m in models.values():
            m.worker.drain_and_stop()
        backend.close()
