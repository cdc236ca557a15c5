"""Is the verdict stable? The default comparison plan run K times in a row on this machine.

    python benchmarks/decision_stability.py [--runs 5] [--plan plans/default.yaml] [--set k=v ...]

Each run is a fresh ``variantbench run`` process (the same command a user types), its report read
back. Printed: the CPU's capabilities, each run's wall time (target: at most 10 minutes; the default
run's own target is 5), and, across the runs:

* per deployment profile: the variant recommended in each run and how many runs agree with the
  majority (target: at least 4 of 5 for every profile; a tie is an answer too, and the variant
  the tie-break picks is the recommendation);
* per pair of variants: the state of each comparison (faster, slower, tied, undecided) and its
  agreement with the majority; per variant: the A/B verdict against the standard;
* the quality half: per variant, the state of its quality gate (meets, fails, undecided or tied, from
  the paired intervals of ``metrics/quality_compare.py``) in each run and its agreement (target: at
  least 4 of 5); a seeded simulation of two identical variants whose answers differ by noise,
  never called worse on quality (target: 20 of 20); and whether a planted drop (plain ``int8``,
  KL about 0.9 on the default model) is called worse (``fails``) within the default budget.

Exits non-zero when a profile or a quality gate misses the agreement target, the simulation calls
an identical variant worse, or a run fails.
"""

from __future__ import annotations

import argparse
from collections import Counter
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

ROOT = Path(__file__).resolve().parents[1]


def _majority(answers: list[str]) -> tuple[str, int]:
    value, count = Counter(answers).most_common(1)[0]
    return value, count


def identical_variants_called_worse(draws: int = 20, samples: int = 8, floor: float = 0.99) -> int:
    """Two variants with the same quality whose answers score differently by chance: each sample's
    true quality drawn from Beta(2, 5), each side's observed score that plus N(0, 0.1), clipped to
    [0, 1]; the gate (the paired differences' BCa interval, read as a ratio of the standard's mean,
    against the strictest floor, the
    cloud profile's 99%) must never say ``fails``."""
    import numpy as np

    from variantbench.metrics.quality_compare import paired_mean_ratio, ratio_state

    worse = 0
    for seed in range(draws):
        rng = np.random.default_rng(seed)
        truth = rng.beta(2, 5, samples)
        a = np.clip(truth + rng.normal(0, 0.1, samples), 0, 1)
        b = np.clip(truth + rng.normal(0, 0.1, samples), 0, 1)
        _, low, high = paired_mean_ratio(a, b, seed=seed)
        worse += ratio_state(low, high, floor) == "fails"
    return worse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--plan", default=str(ROOT / "plans" / "default.yaml"))
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument(
        "--agree", type=int, default=None, help="runs that must agree (default: K - 1, at least 1)"
    )
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = ap.parse_args()
    need = args.agree if args.agree is not None else max(1, args.runs - 1)

    from variantbench.environment import describe_environment

    env = describe_environment(torch_details=True)
    print(f"CPU: {env.get('cpu_model')}, {env.get('cpu_logical_cores')} logical cores, flags "
          f"{', '.join(env.get('cpu_flags') or []) or 'none of note'}; torch {env.get('torch')} "
          f"({env.get('cpu_capability')})")  # fmt: skip
    base = Path(args.out or tempfile.mkdtemp(prefix="decision-stability-"))
    reports, walls = [], []
    for i in range(args.runs):
        out = base / f"run-{i}"
        cmd = [sys.executable, "-m", "variantbench", "run", args.plan, "--set", f"out={out}"]
        for kv in args.sets:
            cmd += ["--set", kv]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
        wall = time.perf_counter() - t0
        walls.append(wall)
        if done.returncode != 0:
            print(f"run {i}: FAILED after {wall:.0f} s: {done.stderr.strip().splitlines()[-1:]}")
            return 1
        report = json.loads((out / "report.json").read_text())
        reports.append(report)
        recs = {p: r.get("variant") or "none" for p, r in report["recommendations"].items()}
        print(f"run {i}: {wall:.0f} s ({wall / 600:.2f} of the 10-minute budget, {wall / 300:.2f} of the default "
              f"run's 5); {', '.join(f'{p}: {v}' for p, v in recs.items())}", flush=True)  # fmt: skip

    ok = True
    print(f"\nrecommendations over {args.runs} runs (target: {need} of {args.runs} agree)")
    for profile in reports[0]["recommendations"]:
        answers = [r["recommendations"][profile].get("variant") or "none" for r in reports]
        ties = [",".join(r["recommendations"][profile].get("tied") or []) or "-" for r in reports]
        value, count = _majority(answers)
        ok &= count >= need
        print(
            f"  {profile:8s} {count}/{args.runs} agree on {value:10s} runs: {' '.join(answers)}   tied: {' '.join(ties)}"
        )
    print("\ncomparisons (state of a vs b in each run)")
    keys = [(c["a"], c["b"], c["metric"]) for c in reports[0]["comparisons"]]
    for a, b, metric in keys:
        states = [next((c["state"] for c in r["comparisons"] if (c["a"], c["b"], c["metric"]) == (a, b, metric)),
                       "missing") for r in reports]  # fmt: skip
        value, count = _majority(states)
        print(f"  {a} vs {b} ({metric}): {count}/{args.runs} agree on {value}; {' '.join(states)}")
    print("\nA/B verdicts against the standard")
    for run in reports[0]["runs"]:
        if not run.get("ab_vs_standard"):
            continue
        verdicts = [next((x["ab_vs_standard"]["verdict"] for x in r["runs"]
                          if x["variant"] == run["variant"] and x.get("ab_vs_standard")), "missing")
                    for r in reports]  # fmt: skip
        value, count = _majority(verdicts)
        print(f"  {run['variant']}: {count}/{args.runs} agree on {value!r}")
    print("\nquality gates against the standard (state of each variant's gate in each run)")
    for run in reports[0]["runs"]:
        if run["variant"] == reports[0]["standard"]:
            continue
        states = [next(((x.get("quality_vs_standard") or {}).get("state") or "none" for x in r["runs"]
                        if x["variant"] == run["variant"]), "missing") for r in reports]  # fmt: skip
        value, count = _majority(states)
        ok &= count >= need
        print(f"  {run['variant']}: {count}/{args.runs} agree on {value}; {' '.join(states)}")
        if run["variant"] == "int8":
            print(f"  planted drop (int8) called worse (fails) in {states.count('fails')}/{args.runs} runs")
    false_calls = identical_variants_called_worse()
    ok &= false_calls == 0
    print(
        f"  two identical variants (seeded simulation, 20 draws of 8 samples): called worse {false_calls}/20, "
        f"not worse {20 - false_calls}/20"
    )
    slowest = max(walls)
    print(f"\nwall per run: min {min(walls):.0f} s, max {slowest:.0f} s (budget 600 s: {slowest / 600:.2f})")
    print(
        f"decision stability target ({need}/{args.runs} per profile): {'MET' if ok else 'MISSED'}; runs in {base}"
    )
    return 0 if ok and slowest <= 600 else 1


if __name__ == "__main__":
    sys.exit(main())
