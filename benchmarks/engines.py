"""Our engine beside llama.cpp's on the same model, precision by precision, in one run.

    python benchmarks/engines.py [--model PATH] [--pairs fp32=gguf-f32,...] [--repeats 3]

Pairs (ours = llama.cpp's): fp32 = F32, bf16 = BF16, smooth+int8:act=token = Q8_0 (8-bit weights;
ours also quantizes activations per token, llama.cpp's Q8_0 dot products quantize them per block
of 32), int4-wo = Q4_0 (torchao's int4 weight-only: a row that says so where its CPU kernel does
not run). Per engine and precision:

* decode tokens/s at batch 1 (64 new tokens after a short prompt; first token to last) and its
  share of the roofline: the memory bandwidth measured here / the weight bytes the engine reads per token (ours: less an
  embedding table the output projection does not share);
* decode tokens/s at batch 8: 8 prompts joined into the continuous batch the server uses for that
  engine (``serving/batching.batch_for``: our paged batch; llama.cpp's sequences in one
  ``llama_decode``), then the steps until every row has its 64 tokens, rows x steps / time;
* prefill tokens/s at 512 input tokens (time to the first token).

One engine is loaded at a time (as a run isolates its variants), and the engines take turns, repeat by
repeat; the median of each is kept. The CPU's flags and bandwidth are printed first. The goal (issue
42): ours within 10% of llama.cpp's at every matching precision, or the table says where not.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

PAIRS = "fp32=gguf-f32,bf16=gguf-bf16,smooth+int8:act=token=gguf-q8_0,int4-wo=gguf-q4_0"
NEW = 64


def _pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        ours, _, theirs = item.rpartition("=")
        out.append((ours, theirs))
    return out


def batch8_rate(backend: Any, prompts: list[list[int]], new: int = NEW) -> float:
    """Decode tokens/s of 8 rows in the serving batch of the backend's engine (prefill left out)."""
    from variantbench.serving.batching import batch_for

    batch = batch_for(backend, 8, 1024, prefill_chunk=512, prefix_cache_mb=0.0)
    try:
        for i, ids in enumerate(prompts[:8]):
            batch.join(i, ids, new, frozenset())  # no stop tokens: every row runs to ``new``
        rows = batch.active
        produced = 0
        t0 = time.perf_counter()
        while batch.active:
            out = batch.step()
            produced += len(out)
            for key, _token, done in out:
                if done:
                    batch.leave(key)
        seconds = time.perf_counter() - t0
    finally:
        close = getattr(batch, "close", None)
        if close:
            close()
    return produced / seconds if seconds > 0 and rows else float("nan")


def _measure(name: str, base: str, long_text: str, prompts: list[list[int]]) -> dict[str, Any]:
    from variants import prefill_rate  # benchmarks/variants.py: time to the first token of ~512

    from variantbench.analysis.diagnosis import decode_rate
    from variantbench.backends.registry import make_backend
    from variantbench.variants.spec import VariantSpec

    backend = make_backend(VariantSpec.parse(name), None, base)
    backend.status = lambda _m: None
    try:
        info = backend.load()
        decode_rate(backend, 1, new=8)  # warm
        return {"bytes": info.details.get("streamed_bytes") or info.param_bytes, "b1": decode_rate(backend, 1, new=NEW),
                "b8": batch8_rate(backend, prompts), "prefill": prefill_rate(backend, long_text)}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a row that says why, never a missing one
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"}
    finally:
        backend.close()
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--pairs", default=PAIRS, help=f"OURS=LLAMA_CPP, comma-separated (default: {PAIRS})")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # every torch call of this benchmark on the one compute thread, as a run makes them: a probe or a
    # model built on the main thread opens a second OpenMP pool, and the engine's every parallel
    # region then pays a wake-up (3x the fixed cost per token, variantbench/compute.py)
    from variantbench import compute

    compute.call(run, args)


def run(args: argparse.Namespace) -> None:

    import torch
    from transformers import AutoTokenizer

    from variantbench.analysis.ceilings import memory_bandwidth_gbs
    from variantbench.environment import cpu_flags, cpu_model
    from variantbench.models import parse_model, prepare_model
    from variantbench.workloads import build_synthetic, parse_lengths
    from variantbench.workloads.counting import tokenizer_counter

    base = str(prepare_model(parse_model(args.model), status=print))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; cpu: {cpu_model()}; "
          f"flags: {' '.join(cpu_flags())}")  # fmt: skip
    try:
        import llama_cpp

        print("llama.cpp:", llama_cpp.llama_print_system_info().decode().strip())
    except ImportError:
        print("llama-cpp-python is not installed (bash .ci/llama_cpp.sh): its rows will say so")
    bandwidth = memory_bandwidth_gbs()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s")
    long_text = (
        build_synthetic(1, 7, {"summarization": 1.0}, parse_lengths("fixed:500"), tokenizer_counter(base))
        .samples[0]
        .prompt
    )
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [list(tok(f"Story {i}: once upon a time, a robot")["input_ids"]) for i in range(8)]

    pairs = _pairs(args.pairs)
    names = [n for pair in pairs for n in pair]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):  # engines take turns, one loaded at a time
        for name in names:
            runs[name].append(_measure(name, base, long_text, prompts))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)

    def row(name: str) -> dict[str, Any]:
        ok = [m for m in runs[name] if "error" not in m]
        if not ok:
            return runs[name][0]
        return {
            "bytes": ok[0]["bytes"],
            **{k: statistics.median(m[k] for m in ok) for k in ("b1", "b8", "prefill")},
        }

    print()
    print(f"{'precision':34s} {'engine':10s} {'MB':>6} | {'b1 tok/s':>8} {'roof':>5} | {'b8 tok/s':>8} | "
          f"{'prefill@512':>11} | ours / llama.cpp (b1, b8, prefill)")  # fmt: skip
    for ours, theirs in pairs:
        a, b = row(ours), row(theirs)
        for name, m, engine in ((ours, a, "ours"), (theirs, b, "llama.cpp")):
            if "error" in m:
                print(f"{name:34s} {engine:10s} unavailable: {m['error']}")
                continue
            share = m["b1"] / (bandwidth * 1e9 / m["bytes"])
            tail = ""
            if engine == "llama.cpp" and "error" not in a:
                tail = "   " + ", ".join(f"{a[k] / m[k]:.2f}x" for k in ("b1", "b8", "prefill"))
            print(f"{name:34s} {engine:10s} {m['bytes'] / 1e6:6.0f} | {m['b1']:8.1f} {share:5.0%} | {m['b8']:8.1f} | "
                  f"{m['prefill']:11.1f} |{tail}")  # fmt: skip
    print("goal: ours within 10% of llama.cpp's (0.90x or more) at every matching precision")


if __name__ == "__main__":
    main()
