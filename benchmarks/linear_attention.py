"""Where linear attention starts to pay: decode speed and attention memory against context length.

    python benchmarks/linear_attention.py [--variant linear-attn] [--contexts 128,512,2048,8192]
                                          [--new-tokens 32] [--repeats 2]

For each context length, the standard (fp32, softmax attention over a KV cache) and the linear-attention
student (built on first use, from the variant cache after) decode ``--new-tokens`` greedy tokens at
batch 1 after a prompt of that many tokens, interleaved and repeated (median kept). Printed per
context: decode tokens/s (after the first token, so prefill is apart), prefill seconds, and the bytes
the attention keeps per sequence: fp32's KV cache (2 x layers x KV heads x positions x head_dim x 4)
against the student's (its softmax layers' KV cache plus a fixed state per linear layer), each
measured from the tensors the engine allocates, with the ratios student / fp32. The context where
the student's decode rate passes fp32's is where linear attention starts to pay on this machine.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def _decode_rate(decoder: Any, context: int, new_tokens: int) -> tuple[float, float]:
    import torch

    ids = torch.randint(100, 20_000, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    out = decoder.generate([ids], new_tokens)
    times = out.timings[0].token_ns
    rate = (len(times) - 1) / ((times[-1] - times[0]) / 1e9)
    return rate, out.prefill_ns / 1e9


def _attention_bytes(decoder: Any, context: int) -> int:
    storage, states = decoder._new_cache(1, context)
    return storage.numel() * storage.element_size() + sum(
        s.s.numel() * s.s.element_size() + s.z.numel() * s.z.element_size() for s in states
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="linear-attn")
    parser.add_argument("--contexts", default="128,512,2048,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    from variantbench.backends.registry import make_backend
    from variantbench.environment import describe_environment
    from variantbench.models import parse_model, prepare_model
    from variantbench.variants.spec import VariantSpec

    env = describe_environment()
    print(f"CPU: {env.get('cpu_model')} ({', '.join(env.get('cpu_flags') or [])}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    base = str(prepare_model(parse_model(None), status=print))
    contexts = [int(c) for c in args.contexts.split(",")]
    decoders = {}
    for name in ("fp32", args.variant):
        backend = make_backend(VariantSpec.parse(name), None, base)
        backend.status = print
        backend.load()
        decoders[name] = backend.decoder
    student = decoders[args.variant]
    print(
        f"{args.variant}: {len(student.layers) - len(student.softmax_layers)} of {len(student.layers)} layers linear"
    )
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.repeats):
        for context in contexts:
            for name, decoder in decoders.items():
                samples.setdefault((name, context), []).append(
                    _decode_rate(decoder, context, args.new_tokens)
                )
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    print(f"\n{'context':>8} | {'fp32 tok/s':>10} {args.variant + ' tok/s':>18} {'ratio':>6} | {'fp32 prefill s':>14} "
          f"{'student prefill s':>17} | {'fp32 attn MB':>12} {'student attn MB':>15} {'ratio':>7}")  # fmt: skip
    pays = None
    for context in contexts:
        fp32_rate = statistics.median(s[0] for s in samples[("fp32", context)])
        rate = statistics.median(s[0] for s in samples[(args.variant, context)])
        fp32_prefill = statistics.median(s[1] for s in samples[("fp32", context)])
        prefill = statistics.median(s[1] for s in samples[(args.variant, context)])
        total = context + args.new_tokens
        fp32_mb = _attention_bytes(decoders["fp32"], total) / 1e6
        mb = _attention_bytes(student, total) / 1e6
        if pays is None and rate > fp32_rate:
            pays = context
        print(f"{context:8d} | {fp32_rate:10.2f} {rate:18.2f} {rate / fp32_rate:6.2f} | {fp32_prefill:14.2f} "
              f"{prefill:17.2f} | {fp32_mb:12.2f} {mb:15.3f} {mb / fp32_mb:7.4f}")  # fmt: skip
    print("\n" + (f"decode faster than fp32 from {pays} tokens of context on this machine" if pays
                  else "decode not faster than fp32 at any context tried on this machine"))  # fmt: skip


if __name__ == "__main__":
    main()
