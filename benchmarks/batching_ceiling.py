"""How much batching can buy on this machine: the ceiling of continuous batching over batch 1, from
measured costs, for the workload of ``benchmarks/serving.py``.

    python benchmarks/batching_ceiling.py [--variant fp32] [--p99-target-s 10] [--requests 30]

Measures, in this process, on the variant's own continuous batch (the one ``variantbench serve``
runs, with its prefix cache warmed on a few other prompts of the workload):
  P      the compute of one request's prefill, alone (mean over ``--requests`` prompts never seen);
  T      the mean answer length under greedy decoding with ``max_tokens`` = ``--output-tokens``;
  s(r)   the time of one decode step with r rows, r = 1, 2, 4, ..., 32.

and derives from them, with no queueing (so every figure is an upper bound on what a server
achieves, not a measurement of one):
  capacity(r) = 1 / (P + T * s(r) / r)   requests/s when every step runs r rows;
  capacity(r) / capacity(1)              the most that batching at r rows can buy over batch 1;
  at the P99 target: a rate lam spends lam * P of every second on prefill, so a step of r rows
  takes s(r) / (1 - lam * P) of wall time, and the longest answer (``--output-tokens`` tokens)
  needs ``--output-tokens`` such steps. The largest lam meeting both that latency and capacity(r)
  is the ceiling of a batched server at the target; batch 1's is the same with r = 1.

Each ceiling bounds one server's goodput; their ratio does not bound the measured (b)/(a) of
``serving.py``, because queueing costs batch 1 a larger share of its ceiling. So the last line
states what a ratio target needs instead: (b) can reach ``--ratio`` times (a) only where (a)'s
goodput is below (b)'s ceiling / ``--ratio``.

Prefill is compute-bound (every prompt token multiplies every weight) and costs the same in both
servers, so it bounds what batching can buy: capacity(inf) / capacity(1) = (P + T * s(1)) / P.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import os
import statistics
import time

import torch

from variantbench.backends.base import GenerationRequest, encode_request
from variantbench.backends.registry import make_backend
from variantbench.models import parse_model, prepare_model
from variantbench.serving.batching import batch_for
from variantbench.variants.spec import VariantSpec
from variantbench.workloads import build_synthetic, parse_lengths
from variantbench.workloads.counting import tokenizer_counter

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # fine enough that the best ceiling is not missed


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class Costs:
    """What one variant's continuous batch costs here: prefill alone, answer length, decode steps."""

    prefill_s: float  # P: one request's prefill, alone (mean)
    answer: float  # T: mean answer length (tokens)
    steps: dict[int, float]  # s(r): decode step seconds at r rows

    def capacity(self, rows: int) -> float:
        """Requests/s when every step runs ``rows`` rows (no queueing)."""
        return 1 / (self.prefill_s + self.answer * self.steps[rows] / rows)

    def at_target(self, rows: int, target_s: float, longest: int) -> float:
        """The largest rate meeting both capacity(rows) and the latency target: a rate lam spends
        lam * P of every second on prefill, so a step of r rows takes s(r) / (1 - lam * P) of wall
        time, and the longest answer needs ``longest`` such steps."""
        decode = longest * self.steps[rows]
        return max(0.0, min(self.capacity(rows), (1 - decode / target_s) / self.prefill_s))

    def ceilings(self, target_s: float, longest: int) -> tuple[float, float]:
        """(batch 1's ceiling, the best batched ceiling) at the target, requests/s."""
        return self.at_target(1, target_s, longest), max(
            self.at_target(r, target_s, longest) for r in ROWS[1:]
        )


def measure(variant: str, requests: int = 30, output_tokens: int = 64, input_lengths: str = "fixed:64",
            prefix_cache_mb: float = 256.0, threads: int | None = None, seed: int = 0,
            say=print, model: str | None = None, device: str = "cpu") -> Costs:  # noqa: ANN001  # fmt: skip
    """P, T and s(r) on the variant's own continuous batch (the one ``variantbench serve`` runs, its
    prefix cache warmed on a few other prompts of the workload), in this process."""
    if not 1 <= requests <= max(ROWS):
        raise ValueError(f"requests must be within 1..{max(ROWS)}")
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    base = str(prepare_model(parse_model(model), status=say))
    warm = 4
    library = build_synthetic(warm + requests + max(ROWS), seed,
                              lengths=parse_lengths(input_lengths), counter=tokenizer_counter(base))  # fmt: skip
    backend = make_backend(VariantSpec.parse(variant), None, base, device=device, threads=threads)
    backend.load()
    try:
        reqs = [
            GenerationRequest(s.sample_id, s.prompt, messages=s.messages, max_new_tokens=output_tokens)
            for s in library.samples
        ]
        prompts = [encode_request(backend.tokenizer, r) for r in reqs]  # a torch or a llama.cpp variant
        batch = batch_for(backend, max(ROWS), 1024, prefix_cache_mb=prefix_cache_mb)
        if not hasattr(batch, "join"):
            raise SystemExit(f"{variant}: its serving batch cannot prefill alone; use a torch variant")
        say(f"{variant} on {device}, {threads} threads, prompts {input_lengths} tokens (chat), "
            f"max_tokens {output_tokens}")  # fmt: skip

        # P: prefill alone, the prefix cache warmed on prompts of the same workload
        for i in range(warm):
            batch.join(("warm", i), prompts[i], output_tokens)
            batch.leave(("warm", i))
        counts = dict(getattr(batch, "prompt_tokens", {}))
        timed = prompts[warm : warm + requests]
        prefill = []
        for i, ids in enumerate(timed):
            prefill.append(_timed(lambda ids=ids, i=i: batch.join(("p", i), ids, output_tokens)))
            batch.leave(("p", i))
        p_s = statistics.mean(prefill)
        tokens = ""
        if counts:
            computed = (batch.prompt_tokens["computed"] - counts["computed"]) / len(timed)
            cached = (batch.prompt_tokens["cached"] - counts["cached"]) / len(timed)
            tokens = f" ({computed:.1f} prompt tokens computed + {cached:.1f} from the prefix cache)"
        say(
            f"P  prefill alone: {p_s * 1e3:.0f} ms per request, median {statistics.median(prefill) * 1e3:.0f} ms{tokens}"
        )

        # T: the answers' lengths, all the timed prompts decoded together to their end
        emitted: dict[object, int] = {}
        for i, ids in enumerate(timed):
            _, done = batch.join(("t", i), ids, output_tokens)
            emitted[("t", i)] = 1
            if done:
                batch.leave(("t", i))
        while batch.active:
            for key, _token, done in batch.step():
                emitted[key] += 1
                if done:
                    batch.leave(key)
        answer = statistics.mean(emitted.values())
        say(f"T  answer length: {answer:.1f} tokens on average, {max(emitted.values())} at most")

        # s(r): decode steps with r rows, the write index where a served request's sits
        steps: dict[int, float] = {}
        fresh = prompts[warm + requests :]
        batch.stop_ids = frozenset()  # every row decodes through the timing (a finished row would not)
        for rows in ROWS:
            for i in range(rows):
                batch.join(("s", i), fresh[i], 400)
            for _ in range(80):
                batch.step()
            steps[rows] = statistics.median(_timed(batch.step) for _ in range(12))
            step = steps[rows]
            say(f"s({rows:2d}) decode step: {step * 1e3:6.1f} ms = {step / rows * 1e3:5.1f} ms per token "
                f"({batch.live_tokens / rows:.0f} cached positions per row)")  # fmt: skip
            for i in range(rows):
                batch.leave(("s", i))
    finally:
        backend.close()
    return Costs(p_s, answer, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variant", default="fp32", help="a variant of the default model: torch engine or gguf-*"
    )
    ap.add_argument("--p99-target-s", type=float, default=10.0, help="latency target (s), as serving.py's")
    ap.add_argument("--requests", type=int, default=30, help="prompts timed for prefill and answer length")
    ap.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--input-lengths", default="fixed:64", help="synthetic prompt tokens")
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0, help="as the server's (0: off)")
    ap.add_argument("--threads", type=int, default=None, help="default: all cores")
    ap.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: the bundled model)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=3.0, help="goodput ratio target of (b) over (a)")
    args = ap.parse_args()
    if not 1 <= args.requests <= max(ROWS):
        ap.error(f"--requests must be within 1..{max(ROWS)}")
    costs = measure(args.variant, args.requests, args.output_tokens, args.input_lengths, args.prefix_cache_mb,
                    args.threads, args.seed, say=lambda m: print(m, flush=True), model=args.model,
                    device=args.device)  # fmt: skip
    target, longest = args.p99_target_s, args.output_tokens
    p_s, answer, steps = costs.prefill_s, costs.answer, costs.steps
    one, one_at = costs.capacity(1), costs.at_target(1, target, longest)
    print(
        f"\nbatch 1: {p_s + answer * steps[1]:.2f} s of compute per request, capacity {one:.3f} req/s, "
        f"{one_at:.3f} req/s at the target (longest answer's decode alone {longest * steps[1]:.1f} s)"
    )
    print(
        "| rows | capacity req/s | x batch 1 | longest answer's decode s | at the target req/s | x batch 1 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in ROWS[1:]:
        cap, at = costs.capacity(rows), costs.at_target(rows, target, longest)
        print(
            f"| {rows} | {cap:.3f} | {cap / one:.2f} | {longest * steps[rows]:.1f} | {at:.3f} | {at / one_at:.2f} |"
        )
    best = costs.ceilings(target, longest)[1]
    free = (p_s + answer * steps[1]) / p_s
    print(f"\nceilings over batch 1's (no queueing): {free:.2f}x if decode were free, {best / one_at:.2f}x at a "
          f"P99 of {target:g} s")  # fmt: skip
    print(f"batched ceiling at the target: {best:.3f} req/s, so (b) >= {args.ratio:g}x (a) needs (a)'s goodput "
          f"below {best / args.ratio:.3f} req/s ({best / args.ratio / one_at:.0%} of batch 1's ceiling)")  # fmt: skip


if __name__ == "__main__":
    main()
