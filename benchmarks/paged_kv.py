"""The paged KV cache against the contiguous one: decode speed, idle memory, memory under load.

    python benchmarks/paged_kv.py [--variant fp32] [--repeats 8] [--steps 8] [--max-batch 32]
                                  [--max-len 2304] [--threads N] [--weight-layout packed]
                                  [--model DIR] [--idle-caches paged,contiguous]

In one process, on one loaded variant of the default model (or ``--model``'s), both batches ``variantbench serve`` can
run (``--kv-cache paged`` and ``contiguous``), each sized for ``--max-batch`` rows of ``--max-len``:

  speed    decode steps with the same rows in both (equal lengths, and one long row among short
           ones), in alternating bursts of ``--steps`` steps, ``--repeats`` bursts each: tokens/s,
           paged / contiguous per burst pair (median, min-max);
  idle     the process's RSS once ``serve``'s own ``serve_model`` has put the variant behind an
           executor with each batch (weights in the layout ``serve`` keeps, the warm-up steps run),
           against the weights' bytes, whole and less the runtime's RSS: the same process before
           any weight is loaded, with the server's modules and the tokenizer loaded and the model's
           classes imported (``runtime_rss``; itself more than 1.5x an int8 variant's weights);
  load     requests of 64-2,048 tokens joining and leaving at random for ``--load-steps`` steps:
           the paged pool's committed bytes against live tokens x bytes per token, sampled every
           step (goal: within 10%), and the RSS it ends at.

Goals (issue 21): RSS at idle at most 1.5x the weights; KV memory under load within 10% of live
tokens x bytes per token; decode speed within 5% of the contiguous cache.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

import psutil
import torch

from variantbench.backends.base import CompactsWeights
from variantbench.backends.registry import make_backend
from variantbench.environment import cpu_summary
from variantbench.models import parse_model, prepare_model
from variantbench.serving.continuous import ContinuousBatch
from variantbench.serving.host import ServeOptions, serve_model
from variantbench.serving.paged import PagedBatch
from variantbench.variants.spec import VariantSpec


def rss() -> int:
    return psutil.Process().memory_info().rss


def runtime_rss(model_dir: str) -> int:
    """RSS with everything a load brings except the weights: the interpreter, torch, our modules,
    and what loading the tokenizer and the model's classes imports (transformers pulls in
    accelerate, sympy and torch.distributed there: ~75 MiB), and the server's own modules (the
    app, uvicorn). The model is built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    import uvicorn  # noqa: F401

    import variantbench.serving.app  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    del model, tokenizer
    gc.collect()
    return rss()


def timed_steps(batch, steps: int) -> float:  # noqa: ANN001
    """Seconds per decode step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="fp32")
    ap.add_argument("--repeats", type=int, default=8, help="alternating bursts per batch and shape")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per burst")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2304)
    ap.add_argument("--load-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="idle,speed,load", help="which measurements, comma-separated")
    ap.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: the bundled model)")
    ap.add_argument("--idle-caches", default="paged,contiguous",
                    help="the batches whose idle RSS is measured (a contiguous cache is written whole)")  # fmt: skip
    ap.add_argument(
        "--weight-layout",
        default="packed",
        choices=["packed", "packed+split"],
        help="as 'serve --weight-layout' (packed: one copy of each layer's weights)",
    )
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    parts = set(args.parts.split(","))
    torch.set_num_threads(threads)
    print(cpu_summary())
    base = str(prepare_model(parse_model(args.model), status=print))
    backend = make_backend(VariantSpec.parse(args.variant), None, base, threads=threads)
    runtime = runtime_rss(base)
    weights = backend.load().param_bytes
    loaded = rss()
    freed = (
        backend.compact_weights()
        if args.weight_layout == "packed" and isinstance(backend, CompactsWeights)
        else 0
    )
    dec = backend.decoder
    gc.collect()
    before = rss()
    rng = random.Random(args.seed)
    print(f"{args.variant}, {threads} threads; weights {weights / 2**20:.0f} MiB; RSS with no weights (the runtime) "
          f"{runtime / 2**20:.0f} MiB, loaded {loaded / 2**20:.0f} MiB, served layout {args.weight_layout!r} "
          f"{before / 2**20:.0f} MiB ({freed / 2**20:.0f} MiB of weight copies freed)")  # fmt: skip

    # idle: each batch alone in the process, put behind an executor as ``serve`` does (warm-up
    # included: its multi-row steps make the vocabulary head's packed copy, see ``_DenseT``)
    idle = {}
    for name in args.idle_caches.split(",") if "idle" in parts else ():
        gc.collect()
        r0 = rss()
        options = ServeOptions(max_batch_size=args.max_batch, max_len=args.max_len, kv_cache=name,
                               weight_layout=args.weight_layout)  # fmt: skip
        served = serve_model(args.variant, backend, options)
        gc.collect()
        idle[name] = rss()
        print(f"idle {name}: RSS {idle[name] / 2**20:.0f} MiB (+{(idle[name] - r0) / 2**20:.0f} MiB for the batch "
              f"and the warm-up; {served.worker.batch.describe()}), {idle[name] / weights:.2f}x the weights; "
              f"less the runtime's {runtime / 2**20:.0f} MiB: {(idle[name] - runtime) / weights:.2f}x (goal: 1.5x)")  # fmt: skip
        if isinstance(served.worker.batch, PagedBatch):
            served.worker.batch.close()  # its prefix cache's blocks back to the pool
        del served
        gc.collect()
    if idle:
        head = dec.lm_head  # a _DenseT for fp32 weights
        both = getattr(head, "packed", None) is not None and getattr(head, "weight", None) is not None
        extra = head.weight.numel() * head.weight.element_size() if both else 0
        print(f"of which the vocabulary head's second layout: {extra / 2**20:.0f} MiB ({extra / weights:.2f}x the weights; "
              f"tied embeddings are looked up in its plain copy, decode steps of 2+ rows run on the packed one)")  # fmt: skip

    if "speed" in parts:
        # speed: both batches alive, in turns
        batches = {name: kind(dec, max_batch=args.max_batch, max_len=args.max_len, prefix_cache_mb=0)
                   for name, kind in (("paged", PagedBatch), ("contiguous", ContinuousBatch))}  # fmt: skip
        shapes = {"8 rows x 256": [256] * 8, "8 rows x 1024": [1024] * 8, "16 rows x 512": [512] * 16,
                  "1 x 2000 + 7 x 150": [2000] + [150] * 7, "1 row x 1024": [1024]}  # fmt: skip
        print("\n| rows | paged tokens/s | contiguous tokens/s | paged / contiguous (min-max) |")
        print("| --- | --- | --- | --- |")
        with torch.inference_mode():
            for label, lengths in shapes.items():
                prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in lengths]
                for batch in batches.values():  # the same rows in both, decoded in alternating bursts
                    for i, p in enumerate(prompts):
                        batch.join(("r", i), p, args.steps * args.repeats + 8)
                    for _ in range(2):
                        batch.step()
                rates: dict[str, list[float]] = {name: [] for name in batches}
                for _ in range(args.repeats):
                    for name, batch in batches.items():
                        rates[name].append(len(lengths) / timed_steps(batch, args.steps))
                for batch in batches.values():
                    for i in range(len(prompts)):
                        batch.leave(("r", i))
                ratios = [p / c for p, c in zip(rates["paged"], rates["contiguous"], strict=True)]
                print(f"| {label} | {statistics.median(rates['paged']):.1f} | {statistics.median(rates['contiguous']):.1f} | "
                      f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)  # fmt: skip
        del batches, batch
        gc.collect()

    if "load" in parts:
        # load: requests of mixed lengths joining and leaving; committed memory against live tokens
        r0 = rss()
        paged = PagedBatch(dec, max_batch=args.max_batch, max_len=args.max_len, prefix_cache_mb=0)
        per_token = paged.pool.bytes_per_block // paged.block
        ratios, live_max = [], 0
        serial = 0
        with torch.inference_mode():
            for _ in range(args.load_steps):
                while paged.active < 12:
                    n = rng.randrange(64, 2048)
                    serial += 1
                    paged.begin(serial, [rng.randrange(1000, 20000) for _ in range(n)], rng.randrange(8, 128))
                for key, _, done in paged.step():
                    if done:
                        paged.leave(key)
                live = paged.live_tokens
                live_max = max(live_max, live)
                if live:
                    ratios.append(paged.pool.committed_bytes / (live * per_token))
        print(f"\nunder load ({args.load_steps} steps, 12 requests of 64-2,048 prompt tokens at a time, up to "
              f"{live_max} live tokens): committed KV / (live tokens x {per_token} bytes) median "
              f"{statistics.median(ratios):.3f}, max {max(ratios):.3f} (goal: within 1.10); RSS {rss() / 2**20:.0f} MiB, {(rss() - r0) / 2**20:+.0f} MiB over the batch's start, "
              f"{paged.pool.committed_bytes / 2**20:.0f} MiB committed in the pool")  # fmt: skip


if __name__ == "__main__":
    main()
