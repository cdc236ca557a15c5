"""Do our client's TTFT and ITL agree with the server's own histograms? (issue 19: within 10% at p50)

    python benchmarks/server_agreement.py [--variant fp32] [--rate 0.5] [--num-prompts 40]
                                          [--input-lengths uniform:64-256] [--max-new-tokens 32]

Starts ``variantbench serve`` on the default model in its own process on 127.0.0.1, then measures
it as a served variant with ``variantbench run --variants name=URL#variant`` in the server scenario
(Poisson arrivals). The run scrapes the server's ``/metrics`` after its warm-up and after its
block; the report's ``server_latency`` holds the server's TTFT and ITL percentiles (read off its
histograms, whose buckets are 10% apart) beside the client's. Printed: both p50s and their ratio
for TTFT and ITL, and whether each is within the 10% target.

Where the time goes between the two: the client's clock starts before it sends and stops when a
chunk with text is parsed; the server's starts when the request is received and stops when the
token reaches its event loop to be written. A token that decodes to no text of its own (part of a
multi-byte character) is streamed with the next one, so the client can see it one token late.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="fp32", help="the variant the server hosts")
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-lengths", default="uniform:64-256")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--target", type=float, default=0.10, help="allowed relative difference at p50")
    args = ap.parse_args()

    from variantbench.environment import describe_environment

    env = describe_environment(torch_details=False)
    print(f"CPU: {env['cpu_model']}, {env['cpu_logical_cores']} logical cores, flags "
          f"{', '.join(env['cpu_flags']) or 'none of note'}")  # fmt: skip
    from serving import Running  # benchmarks/serving.py: a server process, ready when /v1/models answers

    from variantbench.loadgen.noop_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    serve = [sys.executable, "-m", "variantbench", "serve", "--variants", args.variant, "--port", str(port)]
    with Running(serve, port, timeout_s=600):
        print(f"server: variantbench serve --variants {args.variant} on {url}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            cmd = [sys.executable, "-m", "variantbench", "run", "--variants", f"served={url}#{args.variant}",
                   "--request-rate", f"{args.rate:g}", "--num-prompts", str(args.num_prompts),
                   "--input-lengths", args.input_lengths, "--max-new-tokens", str(args.max_new_tokens),
                   "--no-history", "--out", str(out)]  # fmt: skip
            print("client: " + " ".join(cmd[1:]), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"the run failed: {proc.stderr.strip().splitlines()[-1:]}")
            run = json.loads((out / "report.json").read_text())["runs"][0]
    view = run.get("server_latency")
    if not view:
        sys.exit("the run kept no server histograms (was /metrics readable?)")
    print(f"\n{'':6} {'client p50 ms':>14} {'server p50 ms':>14} {'client/server':>14} {'n (server)':>11}")
    ok = True
    for kind, client in (("ttft", run["ttft_ms"]["p50"]), ("itl", run["itl_ms"]["p50"])):
        entry = view[f"{kind}_ms"]
        ratio = view["client_over_server_p50"][kind]
        within = abs(ratio - 1) <= args.target
        ok &= within
        print(f"{kind.upper():6} {client:14.2f} {entry['p50']:14.2f} {ratio:14.3f} {entry['count']:11d}"
              f"   {'within' if within else 'NOT within'} {args.target:.0%}")  # fmt: skip
    print(
        f"\nserver p90/p99 ms: TTFT {view['ttft_ms']['p90']}/{view['ttft_ms']['p99']}, "
        f"ITL {view['itl_ms']['p90']}/{view['itl_ms']['p99']}; client TTFT p99 {run['ttft_ms']['p99']:.2f}, "
        f"ITL p90/p99 {run['itl_ms']['p90']:.2f}/{run['itl_ms']['p99']:.2f}"
    )
    print("target met" if ok else "target NOT met")


if __name__ == "__main__":
    main()
