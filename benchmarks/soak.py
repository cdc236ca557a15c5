"""Soak: the mixed workload of ``priority.py`` held for half an hour; errors, memory growth, drift.

    python benchmarks/soak.py [--minutes 30] [--interactive-rate 0.25] [--batch-rate 0.08]
                              [--variant smooth+int8:act=token] [--window-min 5] [--seed 0]

One ``variantbench serve`` process on 127.0.0.1 gets both Poisson streams of ``priority.py``
(interactive priority 0, batch priority 1) for ``--minutes``; by default rates meant to keep this
machine's server about 70% busy (``priority.py`` prints the busy share of its phases, and so does
this): at batch 0.12/s it was 92% busy, the batch backlog came and went and the windows' mean
latency moved 6.9-19 s, so the default is 0.08/s: 68% busy, 576 requests, 0 errors, RSS -1.7% from
minute 5, window means 4.1-8.2 s (not stable by the rule: the seeded schedule offered 20-28 batch
requests per window, and the means follow it). Every 10 s the server's resident memory (psutil, the
process and its children) is sampled.

Goals (issue 21): zero errors; RSS growth under 5% from minute 5 to the end; per-window latency
stable by the harness's rule (``metrics.windows.stable``: every window's mean latency within 10%
of their mean), windows of ``--window-min`` minutes from minute 5 on, each window's p99 printed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import threading
import time

from priority import busy_seconds, drive, mixed_streams, percentile, rss_mb  # this folder's: the same client

from variantbench.environment import cpu_summary
from variantbench.loadgen.noop_server import free_port
from variantbench.loadgen.server_process import Running
from variantbench.metrics.windows import Window, stable
from variantbench.models import parse_model, prepare_model
from variantbench.workloads.counting import tokenizer_counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interactive-rate", type=float, default=0.25)
    ap.add_argument("--batch-rate", type=float, default=0.08)
    ap.add_argument("--interactive-lengths", default="uniform:32-128")
    ap.add_argument("--batch-lengths", default="uniform:512-2048")
    ap.add_argument("--interactive-tokens", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--variant", default="smooth+int8:act=token")
    ap.add_argument("--window-min", type=float, default=5.0, help="latency windows (minutes)")
    ap.add_argument("--warmup-min", type=float, default=5.0, help="RSS growth and windows count from here")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.minutes <= args.warmup_min:
        ap.error("--minutes must exceed --warmup-min")

    threads = args.threads or len(os.sched_getaffinity(0))
    base = str(prepare_model(parse_model(None), status=print))
    counter = tokenizer_counter(base)
    duration = args.minutes * 60
    i_times, b_times, interactive, batch = mixed_streams(args, duration, counter)
    print(cpu_summary())
    print(f"{args.variant}, {threads} threads, {args.minutes:g} minutes: interactive {len(i_times)} requests "
          f"({args.interactive_rate:g}/s), batch {len(b_times)} ({args.batch_rate:g}/s)", flush=True)  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "variantbench", "serve", "--variants", args.variant, "--threads", str(threads),
           "--max-len", "2304", "--port", str(port)]  # fmt: skip
    samples: list[tuple[float, float]] = []  # (seconds since the start, RSS MiB)
    stop = threading.Event()
    with Running(cmd, port) as srv:
        assert srv.proc is not None
        t0 = time.perf_counter()
        before = busy_seconds(srv.url, args.variant)

        def sample() -> None:
            while not stop.wait(10.0):
                samples.append((time.perf_counter() - t0, rss_mb(srv.proc.pid)))
                if len(samples) % 30 == 0:
                    print(f"  {samples[-1][0] / 60:5.1f} min: RSS {samples[-1][1]:.0f} MiB", flush=True)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        outcomes = asyncio.run(drive(srv.url, args.variant, [
            ("batch", b_times, batch, args.batch_tokens, 1),
            ("interactive", i_times, interactive, args.interactive_tokens, 0),
        ]))  # fmt: skip
        wall = time.perf_counter() - t0
        busy = (busy_seconds(srv.url, args.variant) - before) / wall
        stop.set()
        sampler.join()

    errors = [o for o in outcomes if o.status != 200]
    warm_s = args.warmup_min * 60
    after = [mb for t, mb in samples if t >= warm_s]
    growth = (after[-1] - after[0]) / after[0] if len(after) >= 2 else math.nan
    print(f"\n{len(outcomes)} requests, {len(errors)} errors, server busy {busy:.0%}")
    if errors:
        print(f"first error: HTTP {errors[0].status}: {errors[0].error}")
    print(f"RSS: {samples[0][1] if samples else math.nan:.0f} MiB at 10 s, {after[0] if after else math.nan:.0f} at "
          f"minute {args.warmup_min:g}, {after[-1] if after else math.nan:.0f} at the end, peak "
          f"{max((mb for _, mb in samples), default=math.nan):.0f}: growth {growth:+.1%} from minute "
          f"{args.warmup_min:g} (goal < 5%)")  # fmt: skip

    width = args.window_min * 60
    ws: list[Window] = []
    print(
        "\n| window (min) | interactive TTFT p99 ms | interactive latency p99 s | batch latency p99 s | mean latency s |"
    )
    print("| --- | --- | --- | --- | --- |")
    start = warm_s
    while start + width <= duration + 1e-9:
        inside = [o for o in outcomes if o.status == 200 and start <= o.sent_s < start + width and o.done_s]
        lat = sorted(o.done_s - o.sent_s for o in inside)
        it = sorted(o.ttft_s for o in inside if o.cls == "interactive" and o.ttft_s is not None)
        il = sorted(o.done_s - o.sent_s for o in inside if o.cls == "interactive")
        bl = sorted(o.done_s - o.sent_s for o in inside if o.cls == "batch")
        mean = statistics.fmean(lat) if lat else None
        ws.append(Window(len(ws), len(inside), None, percentile(lat, 0.99) * 1e3 if lat else None,
                         mean * 1e3 if mean else None, None, None))  # fmt: skip
        print(f"| {start / 60:g}-{(start + width) / 60:g} | {percentile(it, 0.99) * 1e3:.0f} | "
              f"{percentile(il, 0.99):.2f} | {percentile(bl, 0.99):.2f} | {mean or math.nan:.2f} |")  # fmt: skip
        start += width
    steady = stable(ws, last=len(ws)) if len(ws) >= 3 else None
    print(f"\nwindows stable by the harness's rule (every mean within 10% of their mean): "
          f"{'n/a (fewer than 3 windows)' if steady is None else steady}")  # fmt: skip
    ok = not errors and growth < 0.05 and steady is not False
    print(f"goal: zero errors, RSS growth < 5%, stable windows: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
