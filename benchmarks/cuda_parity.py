"""Does the torch engine's served batch decode the same tokens on a GPU as on the CPU?

    python benchmarks/cuda_parity.py [--model DIR] [--variant fp32] [--tokens 24]

Loads the variant twice, on ``--devices`` (cpu,cuda by default), runs three chat prompts through
the paged continuous batch that ``variantbench serve`` runs (prefill with the prefix cache, then
decode steps of three rows), greedy, and compares the tokens. Prints each device's step time too.
fp32 on both sides: CUDA's matmuls do not use TF32 unless asked (torch's default), so greedy
tokens should agree unless two logits tie within rounding.

Measured on an H200 (issue 21, the first run of the CUDA path) by this script's precursor, the same
steps in a one-off file (this file itself has run only on the CPU, ``--devices cpu,cpu``), the
default model's architecture with random weights: 72 of 72 tokens equal; 23 steps of 3 rows in
484 ms on CUDA, 1,026 ms on 16 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from variantbench.backends.base import GenerationRequest
from variantbench.backends.registry import make_backend
from variantbench.models import parse_model, prepare_model
from variantbench.serving.batching import batch_for
from variantbench.variants.spec import VariantSpec

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain continuous batching in one sentence. " * 8)  # fmt: skip


def decode(base: str, variant: str, device: str, tokens: int) -> tuple[dict[int, list[int]], float, int]:
    backend = make_backend(VariantSpec.parse(variant), None, base, device=device)
    backend.load()
    try:
        reqs = [GenerationRequest(f"r{i}", messages=({"role": "user", "content": t},), max_new_tokens=tokens)
                for i, t in enumerate(PROMPTS)]  # fmt: skip
        batch = batch_for(backend, len(reqs) + 1, 512, prefix_cache_mb=64)
        out: dict[int, list[int]] = {}
        t0, steps = time.perf_counter(), 0
        for i, r in enumerate(reqs):
            first, done = batch.join(i, backend.encode(r), tokens)
            out[i] = [first]
            if done:
                batch.leave(i)
        while batch.active:
            for key, token, done in batch.step():
                out[key].append(token)
                if done:
                    batch.leave(key)
            steps += 1
        return out, time.perf_counter() - t0, steps
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: the bundled model)")
    ap.add_argument("--variant", default="fp32")
    ap.add_argument("--devices", default="cpu,cuda", help="the two devices compared")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    devices = args.devices.split(",")
    if len(devices) != 2:
        ap.error("--devices takes two devices, e.g. cpu,cuda")
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device here: nothing to compare (try --devices cpu,cpu)")
    base = str(prepare_model(parse_model(args.model), status=print))
    print(
        f"torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "")
    )
    runs = {}
    for device in devices:
        out, seconds, steps = decode(base, args.variant, device, args.tokens)
        runs[device] = out
        print(
            f"{device}: {len(out)} rows, {steps} decode steps + prefills in {seconds * 1e3:.0f} ms; row 0: {out[0][:12]}"
        )
    a, b = (runs[d] for d in devices)
    equal = sum(x == y for k in a for x, y in zip(a[k], b[k], strict=False))
    total = sum(len(v) for v in a.values())
    agree = [
        next((j for j, (x, y) in enumerate(zip(a[k], b[k], strict=False)) if x != y), len(a[k])) for k in a
    ]
    print(
        f"{devices[0]} vs {devices[1]}: {equal}/{total} greedy tokens equal; equal before the first difference, per row: {agree}"
    )
    sys.exit(0 if equal == total else 1)


if __name__ == "__main__":
    main()
