"""The performance paradox table: every variant recipe on the default model, measured in one run.

    python benchmarks/variants.py [--variants fp32,bf16,...] [--repeats 3]

Per variant: bytes of weights in memory, decode tokens/s at batch 1 and at batch 8
(64 new tokens after a short chat prompt; the ONNX Runtime GenAI and llama.cpp backends serve a
batch one request at a time, the PyTorch engine batches), prefill tokens/s at 512 input tokens, each also as a
ratio to fp32 measured in the same run (interleaved repeats; the median is kept). Built recipes
(prune, drop layers, distill) come from the variant cache and are built on first use. A recipe
with no working kernel or backend here gets a row that says why, never a missing row.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from variantbench.analysis.diagnosis import decode_rate

DEFAULT = (
    "fp32,bf16,int8,int8:act=token,smooth+int8:act=token,smooth+keep-fp32:8+int8:act=token,"
    "smooth+qat-int8+int8:act=token,int8-wo,prune-heads:0.3,drop-layers:15,drop-layers:15+distill,"
    "compile,onnx-int4,onnx-int8,onnx-fp32"
)
GGUF = "gguf-f32,gguf-q8_0,gguf-q4_1,gguf-q4_0"  # added when llama-cpp-python is installed


def prefill_rate(backend: Any, text: str) -> float:
    """Input tokens over the time to the first token, for a prompt of about 512 tokens."""
    from variantbench.backends.base import GenerationRequest

    r = backend.generate([GenerationRequest("p", prompt=text, max_new_tokens=1)])[0]
    if r.status != "ok":
        raise RuntimeError(r.error)
    return r.input_tokens / ((r.first_token_ns - r.start_ns) / 1e9)


def measure(variants: list[str], repeats: int) -> dict[str, dict[str, Any]]:
    from variantbench.backends.registry import make_backend
    from variantbench.models import parse_model, prepare_model
    from variantbench.variants.spec import VariantSpec
    from variantbench.workloads import build_synthetic, parse_lengths
    from variantbench.workloads.counting import tokenizer_counter

    base = str(prepare_model(parse_model(None), status=print))
    # one document of ~512 tokens (the chat template adds a few)
    long_text = (
        build_synthetic(1, 7, {"summarization": 1.0}, parse_lengths("fixed:500"), tokenizer_counter(base))
        .samples[0]
        .prompt
    )
    # One variant loaded at a time, as a run isolates them: with four loaded in one process, fp32
    # decoded at 16.4 tokens/s against 25.5 alone (benchmarks/decode.py). Each is loaded again for
    # every repeat (builds are cached; a compiled variant compiles again), the repeats interleaved
    # so drift on a noisy host hits every variant alike; load and compile times are the first's.
    rows: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        for name in variants:
            if "error" in rows.get(name, {}):
                continue
            backend = make_backend(VariantSpec.parse(name), None, base)
            backend.status = print
            started = time.perf_counter()
            try:
                info = backend.load()
            except Exception as exc:  # noqa: BLE001 - a row that says why
                rows[name] = {"error": str(exc).splitlines()[0]}
                backend.close()
                continue
            if name not in rows:
                rows[name] = {"bytes": info.param_bytes, "load_s": time.perf_counter() - started,
                              "built": info.details.get("built") or {}, "compile_s": info.details.get("compile_s"),
                              "samples": {"b1": [], "b8": [], "prefill": []}}  # fmt: skip
            s = rows[name]["samples"]
            s["b1"].append(decode_rate(backend, 1))
            s["b8"].append(decode_rate(backend, 8))
            s["prefill"].append(prefill_rate(backend, long_text))
            backend.close()
            gc.collect()
        print(f"repeat {r + 1}/{repeats} done", flush=True)
    for row in rows.values():
        if "samples" in row:
            s = row.pop("samples")
            row.update({k: statistics.median(v) for k, v in s.items()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", default=None, help=f"default: {DEFAULT} (+ {GGUF} with llama-cpp-python)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chosen = args.variants
    if chosen is None:
        import importlib.util

        chosen = DEFAULT + ("," + GGUF if importlib.util.find_spec("llama_cpp") else "")
    variants = [v.strip() for v in chosen.split(",") if v.strip()]
    if "fp32" not in variants:
        variants.insert(0, "fp32")
    rows = measure(variants, args.repeats)
    base = rows.get("fp32", {})

    def ratio(name: str, key: str) -> str:
        v, b = rows[name].get(key), base.get(key)
        return f"{v:8.1f} {v / b:5.2f}x" if v and b else f"{'-':>14}"

    print()
    print(
        f"{'variant':34s} {'MB':>7} {'ratio':>6} | {'decode b1 tok/s':>15} | {'decode b8 tok/s':>15} | {'prefill@512 tok/s':>17}"
    )
    for name in variants:
        row = rows[name]
        if "error" in row:
            print(f"{name:34s} unavailable: {row['error']}")
            continue
        mb = row["bytes"] / 1e6
        size_ratio = row["bytes"] / base["bytes"] if base.get("bytes") else float("nan")
        print(f"{name:34s} {mb:7.1f} {size_ratio:5.2f}x | {ratio(name, 'b1'):>15} | {ratio(name, 'b8'):>15} | "
              f"{ratio(name, 'prefill'):>17}")  # fmt: skip
    for name in variants:
        if rows[name].get("compile_s") is not None:
            print(
                f"{name}: torch.compile took {rows[name]['compile_s']:.1f} s while loading (not in any rate above)"
            )
        notes = (rows[name].get("built") or {}).get("notes") or {}
        if "distill" in notes:
            d = notes["distill"]
            print(
                f"{name}: distillation held-out KL to fp32 {d['held_out_kl_before']:.3f} -> {d['held_out_kl_after']:.3f}"
            )


if __name__ == "__main__":
    main()
