"""Our harness against guidellm and ``vllm bench serve``, all driving the same no-op OpenAI server,
at rising Poisson rates.

    python benchmarks/harness_vs_peers.py [--seconds 4] [--rates 100,200,400,...] [--lag-ms 1,5,10]
                                          [--tools ours,guidellm,vllm]

Each peer is installed into its own virtual environment under the variantbench cache on first use.
guidellm: ``pip install guidellm==VERSION``. vLLM: PyPI has only its CUDA build, which pins
torch==2.14.0 with flashinfer and CUTLASS (several GB; vLLM's CPU wheels are published outside
PyPI, which this machine cannot reach). Its benchmark client needs none of that, so the venv sees
this environment's packages (our CPU torch among them), takes ``vllm==VERSION --no-deps``, and adds
the few pure-Python packages its CLI imports (VLLM_CLIENT_DEPS). Both peers' synthetic prompts use
the default model's tokenizer from our cache, so nothing is fetched from a model hub. The no-op
server runs in its own process on 127.0.0.1, pinned to the last core with every tool on the others
(as ``variantbench selftest`` does), and streams 8 tokens per request, so what is measured is each
load generator.

Both tools are judged by one rule, from each tool's own per-request records: a rate is *sustained*
when the achieved send rate is within 1% of the rate of the tool's own schedule (guidellm does not
rescale its Poisson draw, so over a few seconds its schedule may be 10% off the nominal rate; that
is not held against it), no request failed, and the p99 dispatch lag (send time minus scheduled
time: our ``issued - scheduled``, guidellm's ``request_start - targeted_start``, vLLM's
``start_times`` against the schedule ``peer_vllm_driver.py`` records beside its draw) is under the
bound. The bound of the selftest is 1 ms; looser ones are printed beside it so that a ratio exists
when a tool never meets 1 ms. Target from the issue: at least 5x guidellm's highest sustained rate.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import venv

GUIDELLM_VERSION = "0.8.1"
VLLM_VERSION = "0.34.0"
# what ``vllm bench serve`` imports beyond this environment (found by running it until it started)
VLLM_CLIENT_DEPS = [
    "pyzmq", "cachetools", "blake3", "py-cpuinfo", "msgspec", "cbor2", "pybase64", "ijson",
    "setproctitle", "cloudpickle", "partial-json-parser", "einops", "aiohttp", "orjson>=3.11.6",
    "prometheus-fastapi-instrumentator", "fastapi[standard]", "tiktoken", "sentencepiece",
    "watchfiles", "python-json-logger", "pillow", "openai-harmony", "llguidance", "xgrammar",
]  # fmt: skip
HERE = Path(__file__).resolve().parent


@dataclass
class Step:
    """One tool at one rate, in the common terms of the rule."""

    scheduled_qps: float | None
    achieved_qps: float | None
    errors: int
    lag_p50_ms: float | None
    lag_p99_ms: float | None

    def sustained(self, lag_bound_ms: float) -> bool:
        return (
            self.scheduled_qps is not None
            and self.achieved_qps is not None
            and abs(self.achieved_qps - self.scheduled_qps) <= 0.01 * self.scheduled_qps
            and self.errors == 0
            and self.lag_p99_ms is not None
            and self.lag_p99_ms < lag_bound_ms
        )


def guidellm_bin(cache: Path) -> Path:
    env_dir = cache / "peers" / f"guidellm-{GUIDELLM_VERSION}"
    exe = env_dir / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing guidellm {GUIDELLM_VERSION} into {env_dir} (once)", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        pip = [str(env_dir / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"]
        proc = subprocess.run(pip, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"could not install guidellm: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return exe


def vllm_python(cache: Path) -> Path:
    env_dir = cache / "peers" / f"vllm-{VLLM_VERSION}"
    exe = env_dir / "bin" / "python"
    if not (env_dir / "ok").exists():
        print(f"installing vllm {VLLM_VERSION}'s benchmark client into {env_dir} (once)", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True, system_site_packages=True).create(env_dir)
        pip = [str(env_dir / "bin" / "pip"), "install", "-q", "-c", str(HERE.parent / "constraints.txt")]
        for args in ([f"vllm=={VLLM_VERSION}", "--no-deps"], VLLM_CLIENT_DEPS):
            proc = subprocess.run([*pip, *args], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(
                    f"could not install vllm's client: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
                )
        (env_dir / "ok").write_text(VLLM_VERSION)
    return exe


def rate_of(times: list[float]) -> float | None:
    """Events per second over the span of the times (n events span n-1 gaps)."""
    times = sorted(times)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def run_guidellm(exe: Path, url: str, rate: float, seconds: float, tokenizer: Path) -> Step:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "guidellm.json"
        cmd = [
            str(exe), "run",
            "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=poisson,rate={rate}",
            "--constraint", f"kind=max_duration,seconds={seconds}",
            "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}",
            "--disable-console",
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=seconds * 10 + 120, check=False
        )
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"guidellm failed at {rate}/s: {tail[0]}")
        data = json.loads(out.read_text())
    from variantbench.metrics.latency import percentile

    requests = data["benchmarks"][0]["requests"]
    errored = requests.get("errored") or []
    # "incomplete" are requests still in flight when guidellm's duration limit cut the run: not failures
    timings = [
        r["info"]["timings"]
        for r in (requests.get("successful") or []) + errored + (requests.get("incomplete") or [])
    ]
    sent = [t for t in timings if t.get("request_start") and t.get("targeted_start")]
    lags = [(t["request_start"] - t["targeted_start"]) * 1e3 for t in sent]
    return Step(
        scheduled_qps=rate_of([t["targeted_start"] for t in sent]),
        achieved_qps=rate_of([t["request_start"] for t in sent]),
        errors=len(errored),
        lag_p50_ms=percentile(lags, 50),
        lag_p99_ms=percentile(lags, 99),
    )


def run_vllm(python: Path, url: str, rate: float, seconds: float, tokenizer: Path) -> Step:
    n = max(50, int(rate * seconds))
    with tempfile.TemporaryDirectory() as tmp:
        schedule = Path(tmp) / "schedule.json"
        cmd = [
            str(python), str(HERE / "peer_vllm_driver.py"), str(schedule), "--",
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "noop",
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "16",
            "--random-output-len", "8", "--num-prompts", str(n), "--request-rate", str(rate), "--seed", "0",
            "--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", "result.json",
            "--disable-tqdm",
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=seconds * 10 + 180, check=False
        )
        result_path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result_path.exists() or not schedule.exists():
            lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if "Error" in ln]
            raise RuntimeError(f"vllm bench serve failed at {rate}/s: {(lines or ['no output'])[-1]}")
        data = json.loads(result_path.read_text())
        scheduled = json.loads(schedule.read_text())["scheduled_perf"]
    from variantbench.metrics.latency import percentile

    # outputs are in request order, as the schedule is; start_times are perf_counter at the send
    sent = [(s, t) for s, t in zip(data["start_times"], scheduled, strict=True) if s]
    lags = [(s - t) * 1e3 for s, t in sent]
    return Step(
        scheduled_qps=rate_of([t for _, t in sent]),
        achieved_qps=rate_of([s for s, _ in sent]),
        errors=int(data.get("failed") or 0),
        lag_p50_ms=percentile(lags, 50),
        lag_p99_ms=percentile(lags, 99),
    )


def run_ours(url: str, rate: float, seconds: float, senders: int) -> Step:
    from variantbench.selftest import http_rate

    r = http_rate(url, rate, seconds, senders=senders)
    # our schedule is rescaled so that its realized rate is the target exactly
    return Step(rate, r.achieved_qps, r.errors, r.lag_p50_ms, r.lag_p99_ms)


def _cell(step: Step | None) -> str:
    if step is None:
        return f"{'(stopped)':>33}"
    return (
        f"{step.achieved_qps or 0:8.1f}/{step.scheduled_qps or 0:<7.1f} {step.errors:4d} "
        f"{step.lag_p50_ms or 0:6.2f} {step.lag_p99_ms or 0:7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rates", default="100,200,400,600,800,1200,1600,2400,3200")
    parser.add_argument(
        "--lag-ms", default="1,5,10", help="p99 dispatch-lag bounds to judge by, comma-separated"
    )
    parser.add_argument("--tools", default="ours,guidellm,vllm", help="which load generators to run")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    bounds = [float(b) for b in args.lag_ms.split(",")]
    loosest = max(bounds)

    from variantbench.environment import describe_environment, usable_cores
    from variantbench.loadgen.noop_server import ProcessServer
    from variantbench.models import parse_model, prepare_model
    from variantbench.paths import cache_root
    from variantbench.selftest import pin_apart

    tools = tuple(t.strip() for t in args.tools.split(",") if t.strip())
    if unknown := set(tools) - {"ours", "guidellm", "vllm"}:
        sys.exit(f"unknown tool(s): {', '.join(sorted(unknown))}")
    tokenizer = prepare_model(parse_model(None), status=print)
    peers = {}
    if "guidellm" in tools:
        peers["guidellm"] = guidellm_bin(cache_root())
    if "vllm" in tools:
        peers["vllm"] = vllm_python(cache_root())
    env = describe_environment(torch_details=False)
    print(f"CPU: {env['cpu_model']}, {env['cpu_logical_cores']} logical cores, flags "
          f"{', '.join(env['cpu_flags']) or 'none of note'}")  # fmt: skip
    steps: dict[str, list[tuple[float, Step]]] = {t: [] for t in tools}
    failures = dict.fromkeys(tools, 0)
    head = f"{'achieved/scheduled':>16} {'err':>4} {'lag50':>6} {'lag99':>7}"
    print(f"{'rate/s':>8} | " + " | ".join(f"{t:>8} {head}" for t in tools) + "   (lag in ms)")
    with ProcessServer(tokens=8) as server:
        print(pin_apart(server.proc.pid))
        senders = usable_cores()
        for rate in rates:
            row = f"{rate:8.0f} |"
            for tool in tools:
                step = None
                if failures[tool] < 2:  # a tool stops after two rates in a row fail the loosest rule
                    try:
                        if tool == "ours":
                            step = run_ours(server.url, rate, args.seconds, senders)
                        elif tool == "guidellm":
                            step = run_guidellm(peers[tool], server.url, rate, args.seconds, tokenizer)
                        else:
                            step = run_vllm(peers[tool], server.url, rate, args.seconds, tokenizer)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(f"   {exc}", file=sys.stderr)
                        step = Step(None, None, -1, None, None)
                    steps[tool].append((rate, step))
                    failures[tool] = 0 if step.sustained(loosest) else failures[tool] + 1
                row += f" {'':>8} {_cell(step)} |"
            print(row.rstrip("|"), flush=True)
            if all(f >= 2 for f in failures.values()):
                break
    print()
    for bound in bounds:
        best = {t: max((r for r, s in steps[t] if s.sustained(bound)), default=None) for t in tools}
        line = f"highest sustained rate (p99 dispatch lag < {bound:g} ms): " + ", ".join(
            f"{t} {best[t]}" for t in tools
        )
        for peer in (t for t in tools if t != "ours" and "ours" in tools):
            if best["ours"] and best[peer]:
                target = " (target >= 5x)" if peer == "guidellm" else ""
                line += f"; ours / {peer} {best['ours'] / best[peer]:.2f}x{target}"
            elif best["ours"]:
                line += f"; {peer} sustains none of the rates tried"
        print(line)


if __name__ == "__main__":
    main()
