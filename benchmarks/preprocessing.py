"""CPU preprocessing beside the model: the share of a request's time that tokenizing, chat templating
and detokenizing take, encoded inline on the model's thread against encoded ahead on a CPU thread.

    python benchmarks/preprocessing.py [--requests 6] [--tokens 2000] [--repeats 3] [--device cpu]

A burst of long requests (about 2,048 prompt tokens each, 8 output tokens) is handed at once to the
runner (``ThreadedSUT``, one request per ``generate``), as an offline batch or a queue of a busy server:
while the model prefills request i, the next requests wait. Inline, each is encoded when its turn
comes; ahead, a CPU thread encodes them as they arrive. Printed per mode (medians over interleaved
repeats): encode and detokenize ms per request, their share of the burst's time (the time a request
costs the runner), the share the model's thread waited for, and the burst's wall time, with the
ratio ahead / inline.
The share depends on how fast the model is: on a CPU, prefill of 2,048 tokens takes seconds and any
encoding is a sliver; on an accelerator the prefill is milliseconds, the size of the encoding itself.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any


def burst(backend: Any, requests: list[Any], ahead: bool) -> dict[str, float]:
    from variantbench.loadgen.sut import Pending, ThreadedSUT
    from variantbench.records import QueryRecord

    done = threading.Event()
    finished: list[tuple[Pending, Any, int]] = []

    def on_complete(pendings: list[Pending], results: list[Any]) -> None:
        now = time.perf_counter_ns()
        finished.extend((p, r, now) for p, r in zip(pendings, results, strict=True))
        if len(finished) == len(requests):
            done.set()

    start = time.perf_counter_ns()
    pendings = [
        Pending(
            QueryRecord(
                run_id="b",
                variant="v",
                scenario="offline",
                index=i,
                sample_id=str(i),
                task="summarization",
                status="ok",
                error=None,
                scheduled_ns=start,
                issued_ns=start,
                first_token_ns=None,
                completed_ns=0,
                input_tokens=0,
                output_tokens=0,
            ),
            r,
        )  # fmt: skip
        for i, r in enumerate(requests)
    ]
    sut = ThreadedSUT(backend, 1, on_complete, preprocess=ahead)
    sut.submit(pendings)
    done.wait()
    wall = (time.perf_counter_ns() - start) / 1e6
    sut.close()
    bad = [r.error for _, r, _ in finished if r.status != "ok"]
    if bad:
        raise RuntimeError(bad[0])
    work = [r.cpu_work for _, r, _ in finished]
    encode = sum(w["encode_ms"] for w in work)
    waited = sum(w["encode_waited_ms"] for w in work)
    detok = sum(w["detokenize_ms"] for w in work)
    n = len(work)
    return {"encode_ms": encode / n, "detokenize_ms": detok / n, "share": (encode + detok) / wall,
            "critical_share": (waited + detok) / wall, "wall_ms": wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt words of synthetic text (~tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.registry import make_backend
    from variantbench.environment import describe_environment
    from variantbench.models import parse_model, prepare_model
    from variantbench.variants.spec import VariantSpec
    from variantbench.workloads import build_synthetic, parse_lengths
    from variantbench.workloads.counting import tokenizer_counter

    env = describe_environment()
    print(f"CPU: {env.get('cpu_model')} ({', '.join(env.get('cpu_flags') or [])}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}")  # fmt: skip
    base = str(prepare_model(parse_model(None), status=print))
    library = build_synthetic(args.requests, 11, {"summarization": 1.0}, parse_lengths(f"fixed:{args.tokens}"),
                              tokenizer_counter(base))  # fmt: skip
    backend = make_backend(VariantSpec.parse("fp32"), None, base)
    backend.device = args.device
    backend.load()
    requests = [
        GenerationRequest(f"r{i}", prompt=s.prompt, max_new_tokens=8) for i, s in enumerate(library.samples)
    ]
    lengths = [len(backend.encode(r)) for r in requests]
    print(f"{len(requests)} requests of {min(lengths)}-{max(lengths)} prompt tokens, 8 output tokens each")
    burst(backend, requests[:2], True)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"inline": [], "ahead": []}
    for _ in range(args.repeats):
        for mode in ("inline", "ahead"):
            runs[mode].append(burst(backend, requests, mode == "ahead"))
    backend.close()
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(
        f"\n{'mode':8} {'encode ms':>10} {'detok ms':>9} {'share %':>8} {'on model path %':>16} {'burst wall ms':>14}"
    )
    for mode, m in medians.items():
        print(f"{mode:8} {m['encode_ms']:10.2f} {m['detokenize_ms']:9.3f} {m['share'] * 100:8.3f} "
              f"{m['critical_share'] * 100:16.3f} {m['wall_ms']:14.0f}")  # fmt: skip
    print(f"\nahead / inline: on-path share {medians['ahead']['critical_share'] / medians['inline']['critical_share']:.3f}, "
          f"burst wall time {medians['ahead']['wall_ms'] / medians['inline']['wall_ms']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
