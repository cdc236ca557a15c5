"""Our harness against guidellm, both driving the same no-op OpenAI server, at rising Poisson rates.

    python benchmarks/harness_vs_peers.py [--seconds 4] [--rates 100,200,400,...]

guidellm is installed into its own virtual environment under the variantbench cache on first use
(``pip install guidellm==VERSION``); its synthetic prompts use the default model's tokenizer from our
cache, so nothing is fetched from a model hub. The no-op server runs in its own process on
127.0.0.1 and streams 8 tokens per request, so what is measured is each load generator.

Judged the same way for both, from each tool's own per-request send times: a rate is *sustained*
when the achieved send rate is within 1% of the target and no request failed. Ours is also held to
its stricter selftest rule (p99 dispatch lag under 1 ms), printed beside it.
Target from the issue: at least 3x guidellm's highest sustained rate.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import venv

GUIDELLM_VERSION = "0.8.1"


def guidellm_bin(cache: Path) -> Path:
    env_dir = cache / "peers" / f"guidellm-{GUIDELLM_VERSION}"
    exe = env_dir / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing guidellm {GUIDELLM_VERSION} into {env_dir} (once)", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        subprocess.run(
            [str(env_dir / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"], check=True
        )
    return exe


def _achieved(send_times: list[float]) -> float | None:
    times = sorted(send_times)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def run_guidellm(
    exe: Path, url: str, rate: float, seconds: float, tokenizer: Path
) -> tuple[float | None, int, int]:
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
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=seconds * 10 + 120)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"guidellm failed at {rate}/s: {tail[0]}")
        data = json.loads(out.read_text())
    bench = data["benchmarks"][0]["requests"]
    ok = bench.get("successful") or []
    errored = bench.get("errored") or []
    # "incomplete" are requests still in flight when guidellm's duration limit cut the run: not failures
    cut = bench.get("incomplete") or []
    sends = [
        r["info"]["timings"]["request_start"]
        for r in ok + errored + cut
        if r["info"]["timings"].get("request_start")
    ]
    return _achieved(sends), len(ok), len(errored)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rates", default="100,200,400,600,800,1200,1600,2400,3200")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    from variantbench.loadgen.noop_server import ProcessServer
    from variantbench.models import parse_model, prepare_model
    from variantbench.paths import cache_root
    from variantbench.selftest import http_rate

    tokenizer = prepare_model(parse_model(None), status=print)
    exe = guidellm_bin(cache_root())
    best = {"ours": None, "ours_strict": None, "guidellm": None}
    failures = {"ours": 0, "guidellm": 0}
    print(
        f"{'rate/s':>8} | {'ours achieved':>13} {'err':>4} {'lag p99 ms':>10} | {'guidellm achieved':>17} {'err':>4}"
    )
    with ProcessServer(tokens=8) as server:
        for rate in rates:
            row = f"{rate:8.0f} |"
            if failures["ours"] < 2:
                ours = http_rate(server.url, rate, args.seconds)
                ok = (
                    ours.achieved_qps is not None
                    and abs(ours.achieved_qps - rate) <= 0.01 * rate
                    and not ours.errors
                )
                failures["ours"] = 0 if ok else failures["ours"] + 1
                best["ours"] = rate if ok else best["ours"]
                best["ours_strict"] = rate if ours.sustained else best["ours_strict"]
                row += f" {ours.achieved_qps or 0:13.1f} {ours.errors:4d} {ours.lag_p99_ms or 0:10.3f} |"
            else:
                row += f" {'(stopped)':>13} {'':4} {'':10} |"
            if failures["guidellm"] < 2:
                try:
                    achieved, _n_ok, n_bad = run_guidellm(exe, server.url, rate, args.seconds, tokenizer)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    achieved, _n_ok, n_bad = None, 0, -1
                    print(f"   {exc}", file=sys.stderr)
                ok = achieved is not None and abs(achieved - rate) <= 0.01 * rate and n_bad == 0
                failures["guidellm"] = 0 if ok else failures["guidellm"] + 1
                best["guidellm"] = rate if ok else best["guidellm"]
                row += f" {achieved or 0:17.1f} {n_bad:4d}"
            else:
                row += f" {'(stopped)':>17}"
            print(row, flush=True)
            if failures["ours"] >= 2 and failures["guidellm"] >= 2:
                break
    print()
    print(
        f"highest sustained rate (achieved within 1%, no errors): ours {best['ours']}, guidellm {best['guidellm']}"
    )
    print(f"ours under the stricter selftest rule (also p99 dispatch lag < 1 ms): {best['ours_strict']}")
    if best["ours"] and best["guidellm"]:
        print(f"ratio ours / guidellm: {best['ours'] / best['guidellm']:.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
