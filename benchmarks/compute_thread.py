"""What one compute thread buys: the model loaded on one thread and stepped on another, or both on one.

    python benchmarks/compute_thread.py [--variants fp32,smooth+int8:act=token] [--repeats 3]

torch's OpenMP (libgomp) keeps a pool of worker threads for every thread that opened a parallel
region, and throttles their spinning when the pools outnumber the CPUs (``variantbench.compute``).
Each arm runs in a fresh process (no pool carried over), alternating, ``--repeats`` times:

  two threads  the old way: the backend loaded on the main thread, the paged batch stepped on a
               worker thread (as ``serve`` and the harness's executor did)
  one thread   the way now: load and steps both on ``variantbench.compute``'s thread

Per arm: the paged batch's decode step with one row (median of 60), a 110-token prompt step alone
(median of 8), and the worker threads' CPU share during the decode steps (a pool that sleeps
between regions shows as less than 100% on its worker). Prints the CPU's capabilities, and the
ratio two threads / one thread with the spread over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from variantbench.environment import cpu_summary

ARM = r"""
import json, os, statistics, sys, threading, time
import torch
from variantbench.backends.registry import make_backend
from variantbench.backends.torch_backend import TorchBackend
from variantbench.models import parse_model, prepare_model
from variantbench.serving.paged import PagedBatch
from variantbench.variants.spec import VariantSpec

arm, variant = sys.argv[1], sys.argv[2]
torch.set_num_threads(len(os.sched_getaffinity(0)))
base = str(prepare_model(parse_model(None)))
backend = make_backend(VariantSpec.parse(variant), None, base)
raw = arm == "two"  # the undecorated methods: run on whichever thread calls them
if raw:
    TorchBackend.load.__wrapped__(backend)
    batch = PagedBatch.__new__(PagedBatch)
    PagedBatch.__init__.__wrapped__(batch, backend.decoder, max_batch=8, max_len=1024, stop_ids=())
    step, join, leave = (getattr(PagedBatch, n).__wrapped__ for n in ("step", "join", "leave"))
else:
    backend.load()
    batch = PagedBatch(backend.decoder, max_batch=8, max_len=1024, stop_ids=())
    step, join, leave = PagedBatch.step, PagedBatch.join, PagedBatch.leave

def ticks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out[tid] = int(f[11]) + int(f[12])
    return out

out = {}
def work():
    prompt = [1000 + (7 * i) % 5000 for i in range(110)]
    times = []
    for i in range(9):
        t0 = time.perf_counter(); join(batch, ("p", i), prompt, 4); times.append(time.perf_counter() - t0)
        leave(batch, ("p", i))
    out["prefill_ms"] = statistics.median(times[1:]) * 1e3
    join(batch, "row", prompt[:100], 900)
    for _ in range(10):
        step(batch)
    t0, c0, times = time.perf_counter(), ticks(), []
    for _ in range(60):
        s0 = time.perf_counter(); step(batch); times.append(time.perf_counter() - s0)
    wall, c1 = time.perf_counter() - t0, ticks()
    busy = sorted(((c1[k] - c0.get(k, 0)) / (wall * os.sysconf("SC_CLK_TCK")) for k in c1), reverse=True)
    out["decode_ms"] = statistics.median(times) * 1e3
    out["busiest_threads_cpu"] = [round(b, 2) for b in busy[:3]]
worker = threading.Thread(target=work); worker.start(); worker.join()
print(json.dumps(out))
"""


def run_arm(arm: str, variant: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ARM, arm, variant], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{arm} thread(s), {variant}: failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fp32,smooth+int8:act=token")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(cpu_summary())
    for variant in args.variants.split(","):
        runs: dict[str, list[dict]] = {"two": [], "one": []}
        for r in range(args.repeats):
            for arm in ("two", "one") if r % 2 == 0 else ("one", "two"):
                runs[arm].append(run_arm(arm, variant))
                m = runs[arm][-1]
                print(f"  {variant:24s} {arm} thread(s): decode {m['decode_ms']:6.1f} ms, prompt {m['prefill_ms']:6.1f} ms, "
                      f"busiest threads' CPU {m['busiest_threads_cpu']}", flush=True)  # fmt: skip
        for what in ("decode_ms", "prefill_ms"):
            ratios = [a[what] / b[what] for a, b in zip(runs["two"], runs["one"], strict=True)]
            print(f"{variant}: {what[:-3]} two threads / one thread = {statistics.median(ratios):.2f}x "
                  f"(repeats {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
