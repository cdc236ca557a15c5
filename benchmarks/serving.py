"""Goodput of four ways to serve the default model, driven by our harness's server scenario.

    python benchmarks/serving.py [--p99-target-s 10] [--queries 60] [--precision 0.1]
                                 [--start-rate 0.2] [--variant fp32] [--systems a,b,c,d]

Systems, each its own process on 127.0.0.1, measured one after another with the same Poisson
schedules (seeded), the same synthetic chat prompts and the same output cap:

  (a) ``variantbench serve --variants fp32 --max-batch-size 1``   our server, batching off
  (b) ``variantbench serve --variants fp32``                      our server, continuous batching (32)
  (c) ``python -m llama_cpp.server`` on the model's own GGUF      llama.cpp's server, one request at a time
  (d) ``variantbench serve --variants gguf-q4_1``                 our server on that same GGUF, batched

(b)/(a) is what batching buys on one engine; (d)/(c) is the same comparison on llama.cpp, and
(d)/(b) the engine's share. (c) and (d) run the identical Q4_1 file through the same library.

Goodput: for each system the offered Poisson rate doubles from ``--start-rate`` until a rate fails,
then is bisected until the bracket between the best pass and the lowest fail is within
``--precision`` (10% by default) of the pass, the same relative resolution for every system. A rate
*passes* when every request succeeded and the P99 end-to-end latency (issue to last token) is within
``--p99-target-s``; the system's goodput is the completed requests/s achieved at its best passing rate.
With ``--queries`` 60 per rate the P99 is the slowest request: the stated target (10 s by default) is
met by every request. Target of the issue: (b) at least 3x (a).

Every rate gets prompts of its own (no prompt repeats in a run), so the prefix cache of (a), (b)
and (d) reuses only what real traffic shares: the chat template and a task's instructions. The share
of prompt tokens it served is printed; ``--prefix-cache-mb 0`` turns it off. (c) reuses its previous
prompt's prefix (llama-cpp-python's own), which it does not count.

Beside each system: its queue-free ceiling at the P99 target, from the costs
``benchmarks/batching_ceiling.py`` measures (prefill alone, answer length, decode steps at 1-32
rows), measured in this run before any server starts, and the share of it the server reached:
(a) and (b) from the torch variant's batch at 1 row and at its best row count, (c) and (d) from our
llama.cpp batch on the same GGUF the same way ((c) is llama.cpp's own server, so its figure is
an estimate from the same library at one row). The ceilings' ratio says how much batching can pay.
The ceiling is a sustained arrival rate (``batching_ceiling.Costs.at_target``: requests arriving at
that rate forever, each within the target), so the share is given first for the arrivals'
realized rate at the best passing point (the rate the server sustained within the target; MLPerf's
server scenario reports a valid run's scheduled rate the same way) and then for completed
requests/s over the run, which also counts its drain: 60 requests at 2.6/s arrive in ~23 s and the
last of them finish ~4 s later, so done/s was 0.86 of the rate offered (fp32, 2 cores).
Target of issue 21: (b) at least 85% of its ceiling, and (b)/(a) at least 3x wherever the ceilings'
ratio is at least 3.5x.

On a GPU: ``--model DIR --device cuda`` (with ``--p99-target-s`` scaled to the device). Issue 21's
first run of the CUDA path, an H200 with 16 cores, the default model's architecture with random
weights (its answers run to max_tokens), target 2 s: prefill 21-25 ms, decode step 12-13 ms at 1
row, 17 at 8, 61-66 at 32 (launch-bound: the engine issues a few kernels per layer and one
attention call per row and layer); (a) failed at 1.0 req/s (p99 8.6 s, ceiling 1.14-1.26), (b)
passed 3.0 (p99 1.94 s) and failed 3.5: 48% of its 6.27 ceiling, and at least 3x (a).

Each point also prints the CPU the server (process and children) and this process (the load
generator, on the same cores) used per wall second: the ceilings are measured with no client
beside the model, so the client's share is compute a server here cannot have.

Also printed: the per-request overhead of our HTTP stack (starlette on uvicorn), as
(client end-to-end time of a 1-token request) - (the server's own queue wait + compute for it, from
its /metrics), and the round trip of GET /health beside the bare-ASGI no-op server's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
import importlib.util
import json
import math
import os
from pathlib import Path
import statistics
import sys
import time
import urllib.request

import batching_ceiling  # this folder's: the same measurements, made in this run
import psutil

from variantbench.backends.openai_http import OpenAIBackend
from variantbench.loadgen.harness import LoadSettings, run_scenario
from variantbench.loadgen.noop_server import ProcessServer, free_port
from variantbench.loadgen.server_process import Running
from variantbench.models import parse_model, prepare_model
from variantbench.models.source import default_gguf
from variantbench.paths import cache_root
from variantbench.trackers.server_metrics import scrape
from variantbench.workloads import build_synthetic, parse_lengths
from variantbench.workloads.counting import tokenizer_counter


@dataclass
class Point:
    rate: float
    achieved_qps: float
    p50_s: float
    p99_s: float
    errors: int
    mean_output_tokens: float
    passed: bool
    first_error: str | None = None
    scheduled_qps: float = 0.0  # the arrivals' realized rate: (n - 1) / (last scheduled - first)
    server_cores: float = math.nan  # the server's CPU seconds (process and children) per wall second
    client_cores: float = math.nan  # this process's (the load generator's) on the same cores


@dataclass
class System:
    label: str
    title: str
    command: list[str]
    model: str
    points: list[Point] = field(default_factory=list)
    startup_s: float = 0.0
    skipped: str | None = None
    cached_share: float | None = None  # prompt tokens served from the prefix cache, over the sweep

    @property
    def goodput(self) -> Point | None:
        good = [p for p in self.points if p.passed]
        return max(good, key=lambda p: p.achieved_qps) if good else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (psutil)."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(url: str, model: str, library, rate: float, queries: int, tokens: int, target_s: float,  # noqa: ANN001
            seed: int, pid: int | None = None) -> Point:  # fmt: skip
    backend = OpenAIBackend(url, model=model, api="chat", timeout_s=max(120.0, 10 * target_s))
    backend.load()
    settings = LoadSettings(scenario="server", rate_qps=rate, min_queries=queries, max_queries=queries, warmup=2,
                            max_new_tokens=tokens, schedule_seed=seed, sample_seed=seed, drain_timeout_s=600,
                            run_id=f"{model}@{rate:g}")  # fmt: skip
    # the client shares the server's cores on one machine: what each used is printed beside the point
    cpu0, mine0, wall0 = cpu_seconds(pid) if pid else math.nan, time.process_time(), time.perf_counter()
    run = run_scenario(backend, library, settings)
    wall = time.perf_counter() - wall0
    server_cores = (cpu_seconds(pid) - cpu0) / wall if pid else math.nan
    client_cores = (time.process_time() - mine0) / wall
    recs = run.records
    ok = [r for r in recs if r.status == "ok"]
    lat = sorted(r.latency_ms / 1e3 for r in recs)
    p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
    span = (max(r.completed_ns for r in recs) - min(r.issued_ns for r in recs)) / 1e9
    errors = len(recs) - len(ok)
    arrivals = (max(r.scheduled_ns for r in recs) - min(r.scheduled_ns for r in recs)) / 1e9
    return Point(rate, len(ok) / span, statistics.median(lat), p99, errors,
                 statistics.fmean(r.output_tokens for r in ok) if ok else 0.0,
                 errors == 0 and p99 <= target_s,
                 next((r.error for r in recs if r.status != "ok"), None),
                 (len(recs) - 1) / arrivals if arrivals > 0 else 0.0, server_cores, client_cores)  # fmt: skip


def sweep(system: System, url: str, libraries, args: argparse.Namespace, pid: int | None = None) -> None:  # noqa: ANN001
    """Double the rate until it fails, then bisect between the best pass and the lowest fail until
    the bracket is within ``args.precision`` of the pass (equal relative resolution for every system:
    a fixed number of bisections would leave a coarser bracket for a system whose doubling sequence
    happened to land far below its limit).

    Each rate gets its own prompts (``libraries(rate)``: a synthetic library seeded by the rate, so
    every system sees the same prompts at the same rate), and no server sees a prompt twice: its
    prefix cache may reuse the prefixes real traffic shares (the chat template, a task's
    instructions) but never a whole prompt replayed from an earlier rate."""
    rate, lo, hi = args.start_rate, None, None
    for _ in range(args.max_points):
        p = measure(
            url,
            system.model,
            libraries(rate),
            rate,
            args.queries,
            args.output_tokens,
            args.p99_target_s,
            args.seed,
            pid,
        )
        system.points.append(p)
        mark = "pass" if p.passed else "FAIL"
        print(f"  ({system.label}) {rate:7.3f} req/s offered: {p.achieved_qps:6.3f} done/s, p50 {p.p50_s:6.2f} s, "
              f"p99 {p.p99_s:6.2f} s, {p.errors} errors, {p.mean_output_tokens:.1f} tokens/answer, "
              f"CPU cores: server {p.server_cores:.2f}, client {p.client_cores:.2f}  {mark}"
              + (f" (first error: {p.first_error[:120]})" if p.first_error else ""), flush=True)  # fmt: skip
        if p.passed:
            lo = rate  # a pass only ever raises it, a fail only ever lowers hi (midpoints)
        else:
            hi = rate
        if hi is None:
            rate *= 2
        elif lo is None:
            if rate / 2 < args.start_rate / 8:
                return
            rate /= 2
        elif hi - lo > args.precision * lo:
            rate = (lo + hi) / 2
        else:
            return


def _series(url: str) -> dict[str, float]:
    """The server's /metrics, parsed by the tracker's parser (``trackers.server_metrics``)."""
    got = scrape(url, timeout_s=10)
    if "error" in got:
        raise RuntimeError(f"{got['url']}: {got['error']}")
    return got["series"]


def stack_overhead(url: str, model: str, n: int = 30) -> dict[str, float]:
    """Client e2e of 1-token requests minus the server's own queue wait + compute (from /metrics)."""

    def post() -> float:
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        return time.perf_counter() - t0

    post()
    before = _series(url)
    e2e = [post() for _ in range(n)]
    after = _series(url)
    inside = 0.0
    for name in ("variantbench_queue_wait_seconds", "variantbench_compute_seconds"):
        s0, c0 = (before.get(f'{name}_{part}{{model="{model}"}}', 0.0) for part in ("sum", "count"))
        s1, c1 = (after.get(f'{name}_{part}{{model="{model}"}}', 0.0) for part in ("sum", "count"))
        if c1 - c0 != n:
            raise RuntimeError(f"{name}: expected {n} new observations, got {c1 - c0}")
        inside += (s1 - s0) / n
    return {"e2e_ms": statistics.fmean(e2e) * 1e3, "inside_ms": inside * 1e3,
            "overhead_ms": (statistics.fmean(e2e) - inside) * 1e3}  # fmt: skip


def prefix_share(url: str, model: str) -> float | None:
    """Share of prompt tokens our server copied from its prefix cache (from its /metrics)."""
    series = _series(url)
    counts = {source: series.get(f'variantbench_prompt_tokens_total{{model="{model}",source="{source}"}}', 0.0)
              for source in ("cached", "computed")}  # fmt: skip
    total = counts["cached"] + counts["computed"]
    return counts["cached"] / total if total else None


def health_rtt_ms(url: str, n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            r.read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p99-target-s", type=float, default=10.0, help="P99 end-to-end latency target (s)")
    ap.add_argument("--queries", type=int, default=60, help="measured requests per rate")
    ap.add_argument("--start-rate", type=float, default=0.2, help="first offered rate (requests/s)")
    ap.add_argument("--max-points", type=int, default=10, help="most rates per system")
    ap.add_argument("--precision", type=float, default=0.1, help="bisect to this share of the best pass")
    ap.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--input-lengths", default="fixed:64", help="synthetic prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="a,b,c,d", help="which of a,b,c,d to run")
    ap.add_argument("--threads", type=int, default=None, help="threads per server (default: all cores)")
    ap.add_argument("--variant", default="fp32", help="the torch variant of (a) and (b)")
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0, help="our server's prefix cache (0: off)")
    ap.add_argument("--ceiling-requests", type=int, default=30, help="prompts timed for the batching ceiling")
    ap.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: the bundled GGUF)")
    ap.add_argument("--device", default="cpu", help="(a) and (b), and their ceilings: cpu or cuda[:N]")
    args = ap.parse_args()

    base = str(prepare_model(parse_model(args.model), status=print))
    wanted = args.systems.split(",")
    gguf = None  # (c) and (d) run a GGUF through llama.cpp: the bundled one, or --model's when it is one
    if args.model is None and {"c", "d"} & set(wanted):
        gguf = default_gguf(print, cache_root())
    elif args.model and args.model.endswith(".gguf"):
        gguf = Path(args.model)
    threads = args.threads or len(os.sched_getaffinity(0))
    counter, built = tokenizer_counter(base), {}

    def libraries(rate: float):  # noqa: ANN202 - the rate's own prompts (warm-up + measured, none repeated)
        key = round(rate * 1e4)
        if key not in built:
            built[key] = build_synthetic(args.queries + 2, args.seed * 10**6 + key,
                                         lengths=parse_lengths(args.input_lengths), counter=counter)  # fmt: skip
        return built[key]

    vb = [sys.executable, "-m", "variantbench", "serve", "--max-len", "1024", "--threads", str(threads),
          "--prefix-cache-mb", f"{args.prefix_cache_mb:g}", *(["--model", args.model] if args.model else [])]  # fmt: skip
    torch_vb = [*vb, "--device", args.device]
    gguf_name = gguf.name if gguf else "no GGUF"
    systems = {
        "a": System("a", f"our server, batching off ({args.variant}, batch 1)",
                    [*torch_vb, "--variants", args.variant, "--max-batch-size", "1"], args.variant),
        "b": System("b", f"our server, continuous batching ({args.variant}, up to 32)",
                    [*torch_vb, "--variants", args.variant], args.variant),
        "c": System("c", f"llama_cpp.server on {gguf_name} (one at a time)",
                    [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", "2048",
                     "--n_threads", str(threads), "--verbose", "false", "--host", "127.0.0.1",
                     # its default aborts the running request whenever a new one arrives
                     "--interrupt_requests", "false",
                     # as our llama.cpp backend and llama.cpp's own default (-fa auto): same settings
                     "--flash_attn", "true"], gguf.stem if gguf else "none"),
        "d": System("d", f"our server on {gguf_name} via llama.cpp (batched, up to 32)", [*vb, "--variants", "gguf-q4_1"], "gguf-q4_1"),
    }  # fmt: skip
    chosen = [systems[k] for k in wanted]
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    # the queue-free ceilings, from this machine's costs measured in this process (no server running),
    # once before the servers and once after: the host's speed drifts (the same code's mean prefill
    # measured 142 and 224 ms in two runs), so each ceiling is the mean of the two, both printed
    groups = {}
    if any(s.label in ("a", "b") for s in chosen):
        groups[("a", "b")] = (args.variant, args.device, "batching ceiling (benchmarks/batching_ceiling.py)")
    if gguf is not None and have_llama and any(s.label in ("c", "d") for s in chosen):
        groups[("c", "d")] = ("gguf-q4_1", "cpu", "batching ceiling of the same GGUF through llama.cpp")
    measured: dict[str, list[float]] = {}

    def measure_ceilings(when: str) -> None:
        for labels, (variant, device, what) in groups.items():
            print(f"measuring the {what}, {when}:", flush=True)
            costs = batching_ceiling.measure(variant, args.ceiling_requests, args.output_tokens, args.input_lengths,
                                             args.prefix_cache_mb, threads, args.seed, say=lambda m: print("  " + m, flush=True),
                                             model=args.model, device=device)  # fmt: skip
            pair = costs.ceilings(args.p99_target_s, args.output_tokens)
            for label, ceiling in zip(labels, pair, strict=True):
                measured.setdefault(label, []).append(ceiling)

    measure_ceilings("before the servers")
    server_extra = have_llama and importlib.util.find_spec("fastapi") is not None
    overhead: dict[str, float] | None = None
    health: dict[str, float] = {}
    print(f"P99 target {args.p99_target_s:g} s, {args.queries} requests per rate, prompts {args.input_lengths} "
          f"tokens (chat), max_tokens {args.output_tokens}, {threads} threads per server, (a)/(b) on {args.device}", flush=True)  # fmt: skip
    for s in chosen:
        if s.label in ("c", "d") and gguf is None:
            s.skipped = f"--model {args.model} is not a GGUF file"
        elif s.label in ("c", "d") and not have_llama:
            s.skipped = "llama-cpp-python is not installed (the llamacpp extra)"
        elif s.label == "c" and not server_extra:
            s.skipped = "llama_cpp.server needs llama-cpp-python[server] (fastapi, sse-starlette, ...)"
        if s.skipped:
            print(f"({s.label}) skipped: {s.skipped}")
            continue
        port = free_port()
        cmd = [*s.command, "--port", str(port)]
        print(f"({s.label}) {s.title}: starting", flush=True)
        t0 = time.monotonic()
        with Running(cmd, port) as srv:
            s.startup_s = time.monotonic() - t0
            sweep(s, srv.url, libraries, args, srv.proc.pid if srv.proc else None)
            if s.label in ("a", "b", "d"):
                s.cached_share = prefix_share(srv.url, s.model)
            if s.label == "b":
                overhead = stack_overhead(srv.url, s.model)
            if s.label in ("b", "d") and "ours" not in health:  # the same HTTP stack either way
                health["ours"] = health_rtt_ms(srv.url)
    with ProcessServer() as noop:
        health["noop"] = health_rtt_ms(noop.url)
    measure_ceilings("after the servers")
    ceilings = {label: statistics.mean(values) for label, values in measured.items()}

    print()
    print(f"Goodput at P99 end-to-end latency <= {args.p99_target_s:g} s (no errors), requests/s:")
    print("| system | goodput req/s (done) | arrivals sustained req/s | queue-free ceiling req/s (mean) | share of it "
          "(sustained / done) | at offered req/s | p50 s | p99 s | tokens/answer | rates tried |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in chosen:
        if s.skipped:
            print(f"| ({s.label}) {s.title} | skipped: {s.skipped} | | | | | | | | |")
            continue
        g = s.goodput
        tried = ", ".join(f"{p.rate:g}{'' if p.passed else '✗'}" for p in s.points)
        ceiling = ceilings.get(s.label)
        runs = measured.get(s.label, [])
        cells = f"{ceiling:.3f} ({' / '.join(f'{c:.3f}' for c in runs)} before / after)" if ceiling else "n/a"
        if g is None:
            print(f"| ({s.label}) {s.title} | 0 (no rate passed) | | {cells} | | | | | | {tried} |")
        else:
            sustained = max(p.scheduled_qps for p in s.points if p.passed)
            share = f"{sustained / ceiling:.0%} / {g.achieved_qps / ceiling:.0%}" if ceiling else "n/a"
            print(f"| ({s.label}) {s.title} | {g.achieved_qps:.3f} | {sustained:.3f} | {cells} | {share} | {g.rate:g} | "
                  f"{g.p50_s:.2f} | {g.p99_s:.2f} | {g.mean_output_tokens:.1f} | {tried} |")  # fmt: skip

    def ratio(x: str, y: str) -> str:
        a, b = systems[x], systems[y]
        if a.skipped or b.skipped or a not in chosen or b not in chosen:
            return "n/a"
        ga, gb = a.goodput, b.goodput
        if ga is None or gb is None:
            return "n/a (a system met no rate)"
        return f"{ga.achieved_qps / gb.achieved_qps:.2f}x"

    print()
    ceiling_ratio = f"{ceilings['b'] / ceilings['a']:.2f}x" if ceilings.get("a") else "n/a"
    print(f"batching on / off, torch {args.variant}   (b)/(a): {ratio('b', 'a')}   (ceilings' ratio {ceiling_ratio}; "
          "target: (b) at least 85% of its ceiling, and (b)/(a) at least 3x where the ceilings' ratio is 3.5x or more)")  # fmt: skip
    llama_ratio = f"{ceilings['d'] / ceilings['c']:.2f}x" if ceilings.get("c") else "n/a"
    print(f"our batched server / llama.cpp's server, same GGUF   (d)/(c): {ratio('d', 'c')}   (ceilings' ratio "
          f"{llama_ratio}: what batching can pay on llama.cpp here; target: (d) at least matches (c))")  # fmt: skip
    print(f"engine: llama.cpp Q4_1 / torch {args.variant}, both batched   (d)/(b): {ratio('d', 'b')}")
    for s in chosen:
        if s.cached_share is not None:
            print(f"({s.label}) prompt tokens copied from the prefix cache (prompts never repeat; shared "
                  f"template and instructions): {s.cached_share:.1%}")  # fmt: skip
    if overhead:
        print(f"per-request overhead of our stack (starlette + uvicorn/httptools, 1-token requests): "
              f"{overhead['overhead_ms']:.2f} ms = {overhead['e2e_ms']:.2f} ms end to end - "
              f"{overhead['inside_ms']:.2f} ms queue + compute")  # fmt: skip
    if health:
        print(f"GET /health round trip (median of 200): ours {health.get('ours', float('nan')):.2f} ms, "
              f"bare-ASGI no-op server {health['noop']:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
