"""Scale-out on Ray: overhead and correctness on this machine, and the speed-up to expect on N.

    python benchmarks/scale_out.py [--variants fp32,bf16,int8] [--tasks 4] [--jobs 8] [--model PATH]

1. Scheduling overhead per job: the same job (a build of a variant with nothing to build, about a
   millisecond of work) run ``--jobs`` times by each executor: inline (this process), local (a
   spawned process a job) and Ray (a task on a local one-node cluster). What a job costs beyond
   its own work is the executor's share.
2. Correctness: the same plan of k variants run on the default executor (a spawned process a job),
   on Ray, and on the default executor again (in that order, so a drift of the machine shows in the
   two local runs). Both give every job a fresh process; an inline run would not (its later
   variants ran in a process the earlier ones had warmed, and int8 read 30% faster there). Per variant: output tokens/s, latency p50,
   composite quality, weights in memory, and whether the greedy answers are identical. A timed
   number on Ray must lie within the run-to-run noise of the mean of the two local runs (the noise:
   their largest relative difference over every timed number); quality and bytes must be equal.
3. The speed-up on N machines, from the Ray run's own job times: each variant is a chain of jobs
   (build, measure, cold start) that must run on one node in order; on N nodes the chains run at
   once (longest first onto the least loaded node), each job paying the measured Ray overhead. On
   this 2-core machine Ray runs one job at a time (two nodes here would share the cores, and the
   measurements would disturb each other): what it shows is overhead and correctness, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

METRICS = {  # name -> (path in a run of report.json, format)
    "tokens/s": (("throughput", "output_tokens_per_s"), "{:.2f}"),
    "latency p50 ms": (("latency_ms", "p50"), "{:.1f}"),
    "quality": (("quality", "composite"), "{:.4f}"),
    "weights MB": (("resources", "param_bytes"), "{:.1f}"),
}


def _get(run: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        run = (run or {}).get(key)
    return run  # type: ignore[return-value]


def per_job_overhead(jobs: int, base_dir: str) -> dict[str, float]:
    """Seconds per job of each executor, for a job with about a millisecond of work of its own."""
    from variantbench.pipeline.executors import InlineExecutor, LocalProcessExecutor
    from variantbench.pipeline.jobs import BuildJob
    from variantbench.pipeline.ray_executor import RayExecutor
    from variantbench.variants.spec import VariantSpec

    job = BuildJob(base_dir, VariantSpec.parse("fp32"))
    out = {}
    for name, make in (("inline", InlineExecutor), ("local process", LocalProcessExecutor),
                       ("ray task", lambda: RayExecutor(None))):  # fmt: skip
        executor = make()
        executor.run(job, lambda e: None)  # the first: Ray starts its workers, a cache warms
        start = time.perf_counter()
        for _ in range(jobs if name != "local process" else max(2, jobs // 4)):
            executor.run(job, lambda e: None)
        out[name] = (time.perf_counter() - start) / (jobs if name != "local process" else max(2, jobs // 4))
    import ray

    ray.shutdown()
    return out


def run_plan(out: Path, variants: str, tasks: int, model: str | None, *extra: str) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "variantbench", "run", "--variants", variants, "--tasks", str(tasks),
           "--max-new-tokens", "16", "--input-lengths", "uniform:64-256", "--no-until-decided", "--no-diagnose",
           "--no-fidelity", "--no-history", "--no-interleave", "--out", str(out), *extra]  # fmt: skip
    if model:
        cmd += ["--model", model]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[3:])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "report.json").read_text()), wall


def outputs(out: Path) -> dict[tuple[str, str], str]:
    rows = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    return {(r["variant"], r["sample_id"]): r["output"] for r in rows}


def chains(out: Path) -> dict[str, float]:
    """Each variant's chain of jobs on its node, in seconds (build + measure + cold start)."""
    times = {}
    for raw in sorted((out / "raw").glob("*.json")):
        data = json.loads(raw.read_text())
        times[data["variant"]] = float(data.get("wall_s") or 0.0)
    return times


def expected_speedup(chain_s: dict[str, float], per_job_s: float, jobs_per_chain: int, nodes: int) -> float:
    """Serial time over the time on ``nodes`` nodes: the chains placed longest first onto the least
    loaded node, each job paying the executor's overhead."""
    serial = sum(chain_s.values())
    loads = [0.0] * nodes
    for t in sorted(chain_s.values(), reverse=True):
        loads[loads.index(min(loads))] += t + per_job_s * jobs_per_chain
    return serial / max(loads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="fp32,bf16,int8")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=8, help="no-op jobs per executor for the overhead")
    ap.add_argument(
        "--model", default=None, help="a model folder or GGUF (default: the bundled default model)"
    )
    args = ap.parse_args()

    from variantbench.environment import describe_environment
    from variantbench.models import parse_model, prepare_model

    env = describe_environment(torch_details=False)
    print(f"CPU: {env['cpu_model']}, {env['cpu_logical_cores']} logical cores, flags "
          f"{', '.join(env['cpu_flags']) or 'none of note'}")  # fmt: skip
    base_dir = str(prepare_model(parse_model(args.model) if args.model else parse_model(None)))

    print(f"\n1. per-job overhead ({args.jobs} jobs of about 1 ms of work each)")
    overhead = per_job_overhead(args.jobs, base_dir)
    for name, seconds in overhead.items():
        print(f"   {name:14} {seconds * 1000:10.1f} ms a job")

    print(
        f"\n2. the same plan ({args.variants}, {args.tasks} tasks) on the local executor, on Ray (one node), "
        "on the local executor again"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folders = {
            "local 1": Path(tmp) / "local1",
            "ray": Path(tmp) / "ray",
            "local 2": Path(tmp) / "local2",
        }
        reports, walls = {}, {}
        for name, folder in folders.items():
            extra = ("--executor", "ray") if name == "ray" else ()  # the default: a spawned process a job
            reports[name], walls[name] = run_plan(folder, args.variants, args.tasks, args.model, *extra)
            print(f"   {name:9} wall {walls[name]:7.1f} s", flush=True)
        runs = {name: {r["variant"]: r for r in rep["runs"]} for name, rep in reports.items()}
        same = outputs(folders["ray"]) == outputs(folders["local 1"]) == outputs(folders["local 2"])
        chain_s = chains(folders["ray"])
    agree_all = True
    # the run-to-run noise of a timed number: the largest relative difference between the two local
    # runs over every timed metric of every variant (two runs per metric alone give a band too narrow
    # to mean anything: one metric's pair can agree to 2% while another's differ by 20%)
    timed = ("tokens/s", "latency p50 ms")
    pairs = [(_get(runs["local 1"].get(v, {}), METRICS[m][0]), _get(runs["local 2"].get(v, {}), METRICS[m][0]))
             for v in args.variants.split(",") for m in timed]  # fmt: skip
    noise = max((abs(a - b) / ((a + b) / 2) for a, b in pairs if a and b), default=0.0)
    print(f"\n   run-to-run noise of the timed numbers (largest local 1 / local 2 difference): {noise:.1%}")
    print(
        f"   {'variant':10} {'metric':15} {'local 1':>10} {'ray':>10} {'local 2':>10}  ray vs the local mean"
    )
    for variant in args.variants.split(","):
        for metric, (path, fmt) in METRICS.items():
            a, r, b = (_get(runs[n].get(variant, {}), path) for n in ("local 1", "ray", "local 2"))
            if None in (a, r, b):
                print(f"   {variant:10} {metric:15} (missing)")
                agree_all = False
                continue
            scale = 1e6 if metric == "weights MB" else 1
            mean = (a + b) / 2
            off = abs(r - mean) / max(abs(mean), 1e-12)
            ok = off <= noise if metric in timed else r == a == b  # quality and bytes: the same, exactly
            agree_all &= ok
            cells = " ".join(f"{fmt.format(v / scale):>10}" for v in (a, r, b))
            print(
                f"   {variant:10} {metric:15} {cells}  {off:6.1%} {'within the noise' if ok else 'OUTSIDE'}"
            )
    print(f"   greedy answers identical in all three runs: {'yes' if same else 'NO'}")
    print(f"   every number within the noise: {'yes' if agree_all else 'NO'}")

    print("\n3. expected speed-up on N nodes, from the Ray run's chains (build + measure + cold start)")
    for variant, seconds in chain_s.items():
        print(f"   {variant:10} chain {seconds:7.1f} s")
    jobs_per_chain = 3
    for n in (1, 2, 3, 4, 8):
        s = expected_speedup(chain_s, overhead["ray task"], jobs_per_chain, n)
        print(f"   {n} node(s): {s:4.2f}x")
    longest = max(chain_s.values()) if chain_s else 0.0
    print(f"   limit: the longest chain ({longest:.1f} s of {sum(chain_s.values()):.1f} s serial): past "
          f"{len(chain_s)} nodes (one a variant) nothing more runs at once; the driver's own work (the "
          f"model and workload prepared once, the report assembled after each variant) is serial too")  # fmt: skip


if __name__ == "__main__":
    main()
