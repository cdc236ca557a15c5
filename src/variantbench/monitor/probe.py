"""One probe: a small, fixed run against the live server, through the same pipeline as any run.

The same seeded samples every time (prompts with references), one after another (single-stream,
so a probe measures the server and not our queue), a warm-up query first; the run folder, the
report and the history row are those of an ordinary endpoint run, so a probe can be opened,
compared (``variantbench compare``) and plotted (``variantbench history --plot``) like any run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from variantbench.plan import Plan
from variantbench.plan_file import load_plan

# what a probe is when no --probe plan is given: 6 fixed samples, short answers (a few seconds on
# a CPU server; the quality score still moves when the served model's answers change)
DEFAULT_PROBE: dict[tuple[str, ...], Any] = {
    ("workload", "input_lengths"): "uniform:64-256",
    ("workload", "max_new_tokens"): 16,
    ("load", "scenario"): "single-stream",
    ("load", "tasks"): 6,
    ("limits", "warmup"): 1,
    ("quality", "fidelity"): False,
    ("analysis", "diagnose"): False,
    ("analysis", "cold_start"): False,
    ("analysis", "batch_rounds"): 0,
    ("analysis", "until_decided"): False,
}


def probe_plan(url: str, model: str | None, out: Path, probe_file: Path | None = None,
               history: Path | None = None, record_history: bool = True, api: str | None = None) -> Plan:  # fmt: skip
    """The probe's plan: ``probe_file`` (or the defaults above) aimed at the server."""
    overrides: list[tuple[tuple[str, ...], Any]] = [] if probe_file else list(DEFAULT_PROBE.items())
    overrides += [(("model", "endpoint"), url), (("model", "endpoint_model"), model), (("out",), str(out)),
                  (("output", "record_history"), record_history), (("output", "html"), False)]  # fmt: skip
    if history is not None:
        overrides.append((("output", "history"), str(history)))
    if api is not None:
        overrides.append((("model", "api"), api))
    return load_plan(probe_file, overrides)


def probe_values(report: Any) -> dict[str, float | None]:
    """The probe's four numbers (what the detectors watch), from its report."""
    run = report.runs[0] if report is not None and report.runs else None
    if run is None or run.status != "ok":
        return {"p99_ms": None, "ttft_p99_ms": None, "tokens_per_s": None, "quality": None}
    return {
        "p99_ms": run.latency_ms.p99,
        "ttft_p99_ms": run.ttft_ms.p99,
        "tokens_per_s": run.throughput.output_tokens_per_s,
        "quality": run.quality.composite,
    }
