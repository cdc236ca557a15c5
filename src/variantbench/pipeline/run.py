"""Run a plan: prepare once, then build, measure and time each variant as jobs on an executor.

The parent prepares what every job shares (the base model, the workload, the machine's ceilings),
turns the plan into jobs, hands them to the plan's executor and keeps every result: each measure
job's raw result goes to ``raw/VARIANT.REPEAT.json`` and its queries are already in
``queries.jsonl`` (appended as they complete), and the report is assembled again from them after
every variant, so a run that fails halfway keeps all that was measured.

Order: variant by variant, the standard first (the others are compared with its answers), each
built before it is measured, so ``startup_s`` never contains a build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
import datetime as dt
import json
from pathlib import Path
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from variantbench import __version__
from variantbench.errors import UserError
from variantbench.extras import require
from variantbench.paths import cache_root
from variantbench.pipeline.assemble import assemble
from variantbench.pipeline.executors import EXECUTORS, Executor, InlineExecutor, JobFailed
from variantbench.pipeline.jobs import BuildJob, ColdStartJob, Endpoint, MeasureJob
from variantbench.pipeline.settings import criteria_for, load_settings
from variantbench.plan import Plan
from variantbench.plan_file import write_plan
from variantbench.records import QueryRecord, read_log
from variantbench.report.schema import Report
from variantbench.variants.spec import Artifact, VariantSpec, plain_artifact
from variantbench.workloads.base import Workload


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".variantbench-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"output folder is not writable: {out} ({exc.strerror or exc})") from None


def parse_variants(plan: Plan) -> dict[str, VariantSpec]:
    """Every variant of the plan parsed once; an unknown kind or a bad chain is one line, before anything runs."""
    if plan.model.endpoint:
        return {}
    return {name: VariantSpec.parse(name) for name in plan.ordered_variants()}


def check_device(plan: Plan) -> None:
    if plan.model.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"model.device {plan.model.device}: torch sees no CUDA device on this machine")


class _Display:
    """Rich progress for one variant at a time, fed by job events."""

    def __init__(self, progress: Progress, variant: str) -> None:
        self.progress = progress
        self.variant = variant
        self.task = progress.add_task(f"{variant}: starting", total=None)

    def __call__(self, event: tuple[Any, ...]) -> None:
        if event[0] == "status":
            self.progress.update(self.task, description=f"{self.variant}: {event[1]}")
        elif event[0] == "progress":
            _, phase, done, total = event
            self.progress.update(
                self.task, description=f"{self.variant}: {phase}", completed=done, total=total
            )

    def finish(self, text: str) -> None:
        self.progress.update(self.task, description=f"{self.variant}: {text}")


def execute(plan: Plan, console: Console | None = None) -> Report:
    """Run the plan; return the report (also written to ``plan.out / report.json``)."""
    from variantbench.environment import describe_environment
    from variantbench.models import ModelSpec, parse_model, prepare_model

    console = console or Console(stderr=True)
    out = plan.out
    check_writable(out)
    if not plan.model.endpoint:
        require("local", "a local model (model.source)")
        spec = parse_model(plan.model.source)  # a bad path fails here, before anything slow
    specs = parse_variants(plan)
    check_device(plan)
    # a bad workload file or fidelity text stops the run before any model is converted or loaded
    checked = _load_file(plan, console) if plan.workload.file else None
    if plan.quality.fidelity_text is not None and not plan.quality.fidelity_text.is_file():
        raise UserError(f"fidelity text not found: {plan.quality.fidelity_text}")
    endpoint = None
    if plan.model.endpoint:
        from variantbench.backends.openai_http import OpenAIBackend

        m = plan.model
        probe = OpenAIBackend(m.endpoint, model=m.endpoint_model, api=m.api, timeout_s=m.request_timeout_s)
        probe.load()  # unreachable or garbage: one clear line, before any measurement
        spec = ModelSpec(kind="endpoint", path=m.endpoint, name=probe.model or "endpoint")
        endpoint = Endpoint(m.endpoint, model=spec.name, api=m.api, timeout_s=m.request_timeout_s)
        base_dir = ""
    else:
        say = lambda msg: console.print(f"[dim]{msg}[/dim]", soft_wrap=True)  # noqa: E731
        base_dir = str(prepare_model(spec, status=say))
    write_plan(plan, out / "plan.yaml")
    library = build_workload(
        plan, base_dir, say=lambda msg: console.print(f"[dim]{msg}[/dim]"), checked=checked
    )
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    header = Report(
        tool_version=__version__,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        model={"name": spec.name, "kind": spec.kind, "source": spec.path, "hf_dir": base_dir or None},
        standard=spec.name if endpoint else plan.standard_variant,
        plan=plan.model_dump(mode="json"),
        workload=library.describe(),
        environment=describe_environment(torch_details=endpoint is None),
    )
    log_path = out / "queries.jsonl"
    log_path.write_text("")  # the folder holds one run: a fresh log
    raw_dir = out / "raw"
    raw_dir.mkdir(exist_ok=True)
    for old in raw_dir.glob("*.json"):
        old.unlink()
    order = [spec.name] if endpoint else list(plan.ordered_variants())
    fidelity = None
    if plan.quality.fidelity and not endpoint:
        from variantbench.metrics.fidelity import FidelitySpec

        text = plan.quality.fidelity_text
        fidelity = FidelitySpec(text_path=str(text) if text else None, cache_dir=str(cache_root() / "fidelity"),
                                model_key=base_dir)  # fmt: skip
    analyze = endpoint is None and plan.is_timed  # an untimed pass has no speed to explain
    counters = ""
    if plan.analysis.diagnose and analyze:
        from variantbench.analysis.ceilings import probe as probe_ceilings
        from variantbench.analysis.diagnosis import cache_counters

        console.print("[dim]probing the machine's ceilings (matmul GFLOP/s, memory GB/s)[/dim]")
        device = plan.model.device if plan.model.device.startswith("cuda") else "cpu"
        header.ceilings = probe_ceilings(device)
        counters = cache_counters()
        header.ceilings["cache_counters"] = counters
    header.write(out / "report.json")
    # an endpoint is measured from this process: nothing is loaded here
    executor: Executor = InlineExecutor() if endpoint else EXECUTORS[plan.execution.executor]()
    raws: list[dict[str, Any]] = []
    records: list[QueryRecord] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)  # fmt: skip
    with progress:
        for variant in order:
            display = _Display(progress, variant)
            started = time.perf_counter()
            vspec = specs.get(variant)
            artifact: Artifact | None = None
            build_error = None
            if vspec is not None:
                try:
                    artifact = _build(executor, base_dir, vspec, plan.model.build_seed, display)
                except JobFailed as exc:
                    build_error = f"build failed: {exc}"
            for repeat in range(plan.analysis.repeats):
                rid = run_id if plan.analysis.repeats == 1 else f"{run_id}#{repeat}"
                raw_path = raw_dir / f"{_safe(variant)}.{repeat}.json"
                job = MeasureJob(
                    variant=variant, workload=library, log_path=str(log_path),
                    load=load_settings(plan, rid, len(library)), spec=vspec, artifact=artifact, base_dir=base_dir,
                    device=plan.model.device, threads=plan.model.threads, endpoint=endpoint,
                    find_peak=bool(getattr(plan.load, "find_peak", False)) and plan.is_timed,
                    criteria=criteria_for(plan), fidelity=fidelity if repeat == 0 else None,
                    is_standard=variant == header.standard, watts_per_core=plan.cost.watts_per_core,
                    diagnose=plan.analysis.diagnose and analyze and repeat == 0, counters=counters, repeat=repeat,
                )  # fmt: skip
                try:
                    if build_error:
                        raise JobFailed(build_error)
                    payload = executor.run(job, display)
                    records.extend(QueryRecord.from_json(r) for r in payload.pop("records"))
                    if plan.analysis.cold_start and analyze and repeat == 0 and vspec is not None:
                        assert artifact is not None
                        cold = ColdStartJob(vspec, artifact, base_dir, plan.model.device, plan.model.threads)
                        payload["resources"].update(cold.run(display))  # its own fresh process already
                    payload["wall_s"] = round(time.perf_counter() - started, 3)
                    display.finish("done")
                except Exception as exc:  # noqa: BLE001 - a failed variant is data, the run goes on
                    payload = {"variant": variant, "repeat": repeat, "status": "failed", "error": str(exc)}
                    display.finish("[red]failed[/red]")
                _write_json(raw_path, payload)
                raws.append(payload)
            report = assemble(header, plan, raws, records, order=order)
            report.write(out / "report.json")
            run = report.run(variant)
            if run is not None and run.status == "ok":
                display.finish(f"done ({run.validity.verdict})")
    write_outputs(report, out)  # the last variant's assembly is the whole report
    return report


def _build(executor: Executor, base_dir: str, spec: VariantSpec, seed: int, display: _Display) -> Artifact:
    """The variant's artifact: built by a job (its own process on the local executor) when it needs one."""
    if not spec.needs_build:
        return plain_artifact(base_dir)
    result = executor.run(BuildJob(base_dir, spec, seed), display)
    return result["artifact"]


def write_outputs(report: Report, out: Path) -> None:
    """report.json, report.md and the MLPerf-style summaries: every file rendered from the report."""
    from variantbench.report.markdown import render
    from variantbench.report.mlperf import run_summary

    report.write(out / "report.json")
    for run in report.runs:
        if run.status == "ok":
            (out / f"mlperf_log_summary.{_safe(run.variant)}.txt").write_text(run_summary(report, run))
    tmp = out / "report.md.tmp"
    tmp.write_text(render(report), encoding="utf-8")
    tmp.replace(out / "report.md")


def rebuild_report(folder: Path) -> Report:
    """report.json and report.md recomputed from the query log and raw/*.json alone."""
    report_path, log_path, raw_dir = folder / "report.json", folder / "queries.jsonl", folder / "raw"
    for needed in (report_path, log_path, raw_dir):
        if not needed.exists():
            raise UserError(f"{folder} is not a complete run folder: {needed.name} is missing")
    try:
        old = Report.read(report_path)
        plan = Plan.model_validate(old.plan)
        raws = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(raw_dir.glob("*.json"))]
        records = read_log(log_path)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read the run in {folder}: {str(exc).splitlines()[0]}") from None
    order = [r.variant for r in old.runs] or None
    report = assemble(old, plan, raws, records, order=order)
    write_outputs(report, folder)
    return report


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _load_file(plan: Plan, console: Console) -> Workload:
    from variantbench.workloads.files import load_workload_file

    assert plan.workload.file is not None
    return load_workload_file(
        plan.workload.file,
        skip_bad=plan.workload.skip_bad_lines,
        warn=lambda msg: console.print(f"[yellow]{msg}[/yellow]", highlight=False, soft_wrap=True),
    )


def build_workload(
    plan: Plan, model_dir: str, say: Callable[[str], None], checked: Workload | None = None
) -> Workload:
    """The plan's workload, lengths counted with the model's tokenizer when there is one."""
    from variantbench.workloads import TASKS, build_synthetic, parse_lengths, parse_mix
    from variantbench.workloads.counting import tokenizer_counter

    w = plan.workload
    tokenizer_dir = plan.model.tokenizer or model_dir or None
    counter = None
    if tokenizer_dir:
        try:
            counter = tokenizer_counter(tokenizer_dir)
        except Exception as exc:  # noqa: BLE001 - any loader failure is a bad tokenizer
            raise UserError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}".splitlines()[0]) from None
    if checked is not None:
        if counter is None:
            return checked
        samples = tuple(replace(s, input_tokens=counter(s.prompt)) for s in checked.samples)
        return replace(checked, samples=samples, info={**checked.info, "counted_with": tokenizer_dir})
    say(f"building the synthetic workload: {plan.load.tasks} samples, {w.input_lengths} input tokens")
    return build_synthetic(
        plan.load.tasks,
        plan.seeds.workload,
        mix=parse_mix(w.mix, TASKS) if w.mix else None,
        lengths=parse_lengths(w.input_lengths),
        counter=counter,
        counted_with=tokenizer_dir,
    )
