"""The performance paradox table: every variant recipe on the default model, measured in one run.

    python benchmarks/variants.py [--variants fp32,bf16,...] [--repeats 3]

Per variant: bytes of weights in memory, decode tokens/s at batch 1 and at batch 8
(64 new tokens after a 32-token prompt), prefill tokens/s at 512 input tokens, each also as a
ratio to fp32 measured in the same run (interleaved repeats; the median is kept). Built recipes
(prune, drop layers, distill) come from the variant cache and are built on first use. A recipe
with no working kernel or backend here gets a row that says why, never a missing row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

DEFAULT = "fp32,bf16,int8,prune-heads:0.3,drop-layers:15,drop-layers:15+distill"


def _decode_rate(decoder: Any, batch: int, prompt: int = 32, new: int = 64) -> float:
    prompts = [[(7 * i + 13 * b) % 1000 + 100 for i in range(prompt)] for b in range(batch)]
    out = decoder.generate(prompts, new)
    decode_s = (out.timings[0].end_ns - out.timings[0].token_ns[0]) / 1e9
    return batch * (len(out.token_ids[0]) - 1) / decode_s


def _prefill_rate(decoder: Any, length: int = 512) -> float:
    prompt = [(11 * i) % 1000 + 100 for i in range(length)]
    out = decoder.generate([prompt], 1)
    return length / (out.prefill_ns / 1e9)


def measure(variants: list[str], repeats: int) -> dict[str, dict[str, Any]]:
    from variantbench.backends.torch_backend import TorchBackend
    from variantbench.models import parse_model, prepare_model

    base = str(prepare_model(parse_model(None), status=print))
    rows: dict[str, dict[str, Any]] = {}
    loaded: dict[str, Any] = {}
    for name in variants:
        backend = TorchBackend(base, name)
        backend.status = print
        started = time.perf_counter()
        try:
            info = backend.load()
        except Exception as exc:  # noqa: BLE001 - a row that says why
            rows[name] = {"error": str(exc).splitlines()[0]}
            continue
        built = info.details.get("built") or {}
        rows[name] = {"bytes": info.param_bytes, "load_s": time.perf_counter() - started, "built": built,
                      "samples": {"b1": [], "b8": [], "prefill": []}}  # fmt: skip
        loaded[name] = backend
    for r in range(repeats):  # interleaved, so drift on a noisy host hits every variant alike
        for name, backend in loaded.items():
            dec = backend._decoder
            s = rows[name]["samples"]
            s["b1"].append(_decode_rate(dec, 1))
            s["b8"].append(_decode_rate(dec, 8))
            s["prefill"].append(_prefill_rate(dec))
        print(f"repeat {r + 1}/{repeats} done", flush=True)
    for name, backend in loaded.items():
        s = rows[name].pop("samples")
        rows[name].update({k: statistics.median(v) for k, v in s.items()})
        backend.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
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
        notes = (rows[name].get("built") or {}).get("notes") or {}
        if "distill" in notes:
            d = notes["distill"]
            print(
                f"{name}: distillation held-out KL to fp32 {d['held_out_kl_before']:.3f} -> {d['held_out_kl_after']:.3f}"
            )


if __name__ == "__main__":
    main()
