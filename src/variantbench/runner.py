"""Run a plan: prepare the base model once, then measure each variant in its own process.

Each variant runs in a fresh spawned process so that its memory, startup and threads are its own
and a crash in one variant cannot take the others down. The worker appends every completed query
to the query log as it goes and sends progress and its raw results back; the parent computes the
summaries and rewrites report.json after every variant, so a run that fails halfway keeps all that
was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
import datetime as dt
import multiprocessing as mp
from pathlib import Path
import queue as queue_mod
import resource
import time
import traceback
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from variantbench import __version__
from variantbench.config import RunPlan
from variantbench.errors import UserError
from variantbench.loadgen.harness import LoadSettings
from variantbench.loadgen.records import QueryLog, QueryRecord
from variantbench.paths import cache_root
from variantbench.report.mlperf import run_summary
from variantbench.report.schema import PeakSearch, Report, Resources, RunReport
from variantbench.report.summary import Criteria, compare_to_standard, summarize_run
from variantbench.workloads.base import Workload

Emit = Callable[[tuple[Any, ...]], None]


@dataclass(frozen=True)
class VariantJob:
    """Everything a worker needs; plain data so it pickles into the spawned process."""

    model_dir: str
    variant: str
    device: str
    threads: int | None
    workload: Workload
    log_path: str
    load: LoadSettings
    endpoint: str | None = None
    endpoint_model: str | None = None
    api: str = "completions"
    request_timeout: float = 120.0
    find_peak: bool = False
    criteria: Criteria | None = None
    fidelity: Any = None  # FidelitySpec, or None to skip logit fidelity
    is_standard: bool = False

    def backend(self) -> Any:
        if self.endpoint:
            from variantbench.backends.openai_http import OpenAIBackend

            return OpenAIBackend(self.endpoint, model=self.endpoint_model, api=self.api,
                                 timeout_s=self.request_timeout)  # fmt: skip
        return make_backend(self.model_dir, self.variant, device=self.device, threads=self.threads)


def make_backend(model_dir: str, variant: str, device: str = "cpu", threads: int | None = None) -> Any:
    """The in-process backend a variant runs on: the engine recipe's own (onnx-*, gguf-*), else ours."""
    import importlib

    from variantbench.variants import parse_variant
    from variantbench.variants.base import engine_of

    engine = engine_of(parse_variant(variant))
    if engine is not None:
        if device != "cpu":
            raise UserError(f"{variant}: {engine.kind} variants run on the CPU here")
        module, _, cls = type(engine).engine_backend.partition(":")
        return getattr(importlib.import_module(module), cls)(model_dir, variant, threads=threads)
    from variantbench.backends.torch_backend import TorchBackend

    return TorchBackend(model_dir, variant, device=device, threads=threads)


def run_variant(job: VariantJob, emit: Emit) -> dict[str, Any]:
    """Load one variant, warm it up, run the scenario; return raw results (no statistics)."""
    from variantbench.loadgen.harness import run_scenario
    from variantbench.trackers.memory import RssTracker

    library = job.workload
    backend = job.backend()
    if hasattr(backend, "status"):
        backend.status = lambda msg: emit(("status", msg))
    emit(("status", f"loading {job.variant}"))
    try:
        load = backend.load()
        load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def progress(phase: str, done: int, total: int) -> None:
            emit(("progress", phase, done, total))

        trials: list[dict[str, Any]] = []
        with QueryLog(job.log_path) as log, RssTracker() as rss:
            if job.find_peak:
                result, trials = _find_peak(job, backend, library, log, progress, emit)
            else:
                result = run_scenario(backend, library, job.load, log, progress=progress)
        fidelity = None
        if job.fidelity is not None and hasattr(backend, "token_log_probs"):
            from variantbench.metrics.fidelity import measure

            emit(("status", "logit fidelity"))
            fidelity = measure(backend, job.fidelity, job.is_standard)
    finally:
        backend.close()
    return {
        "name": backend.name,
        "peak_search": trials,
        "load_settings": {"rate_qps": result.target_qps},
        "records": [r.to_json() for r in result.records],
        "seeds": result.seeds,
        "fidelity": fidelity,
        "load": asdict(load),
        "resources": {
            "startup_s": load.startup_s,
            "param_bytes": load.param_bytes,
            "load_peak_rss_bytes": load_peak,
            "peak_rss_bytes": rss.result.peak_rss_bytes,
            "mean_rss_bytes": rss.result.mean_rss_bytes,
        },
    }


def _find_peak(
    job: VariantJob, backend: Any, library: Any, log: QueryLog, progress: Any, emit: Emit
) -> tuple[Any, list]:
    """Raise the server rate until the latency target fails, then bisect; keep the best passing run.

    A rate passes when every configured target passes (early stopping included) with no errors.
    Doubling from ``--rate`` up (halving down if it fails at once), then bisection until the
    bracket is within 10%, at most 10 trials.
    """
    from dataclasses import replace

    from variantbench.loadgen.harness import run_scenario

    criteria = job.criteria or Criteria()
    lo: float | None = None
    hi: float | None = None
    rate = float(job.load.rate_qps or 1.0)
    best = last = None
    trials: list[dict[str, Any]] = []
    for _ in range(10):
        emit(("status", f"peak search at {rate:.3g} queries/s"))
        settings = replace(job.load, rate_qps=rate, run_id=f"{job.load.run_id}@{rate:.4g}qps")
        result = run_scenario(backend, library, settings, log, progress=progress)
        summary = summarize_run(
            job.variant, result.records, Resources(), scenario="server", criteria=criteria
        )
        checks = summary.validity.checks
        passed = (
            bool(checks)
            and all(c["result"] == "PASS" for c in checks.values())
            and not summary.queries.errors
        )
        trials.append({"rate_qps": rate, "passed": passed, "latency_p99_ms": summary.latency_ms.p99,
                       "achieved_qps": summary.achieved_qps, "reasons": summary.validity.reasons})  # fmt: skip
        last = result
        if passed:
            lo, best = rate, result
        else:
            hi = rate
        if lo is not None and hi is not None:
            if (hi - lo) / hi < 0.10:
                break
            rate = (lo + hi) / 2
        elif lo is not None:
            rate *= 2
        else:
            rate /= 2
    return (best or last), trials


def _worker(job: VariantJob, channel: Any) -> None:
    try:
        payload = run_variant(job, channel.put)
        channel.put(("done", payload))
    except UserError as exc:
        channel.put(("failed", str(exc)))
    except BaseException as exc:  # report, never hang the parent
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        channel.put(("failed", last))


def criteria_for(plan: RunPlan, seeds: dict[str, int] | None = None) -> Criteria:
    return Criteria(
        percentile=plan.latency_percentile,
        latency_target_ms=plan.latency_target_ms,
        ttft_target_ms=plan.ttft_target_ms,
        tpot_target_ms=plan.tpot_target_ms,
        min_queries=plan.min_queries or plan.tasks,
        min_duration_s=plan.min_duration,
        window=plan.window,
        seeds={"workload": plan.seed, **(seeds or {})},
        target_qps=plan.rate,
    )


def _summarize(
    job: VariantJob, payload: dict[str, Any], plan: RunPlan
) -> tuple[RunReport, list[QueryRecord]]:
    records = [QueryRecord.from_json(r) for r in payload["records"]]
    fidelity = payload.get("fidelity") or {}
    criteria = replace(criteria_for(plan, payload["seeds"]), target_qps=payload["load_settings"]["rate_qps"])
    run = summarize_run(
        payload.get("name") or job.variant,
        records,
        Resources(**payload["resources"]),
        backend=payload["load"].get("details", {}),
        scenario=job.load.scenario,
        criteria=criteria,
        fidelity={k: fidelity.get(k) for k in ("perplexity", "kl_mean", "kl_p99", "top1_agreement")},
    )
    if payload.get("peak_search"):
        passing = [t["rate_qps"] for t in payload["peak_search"] if t["passed"]]
        run.peak = PeakSearch(peak_qps=max(passing) if passing else None, trials=payload["peak_search"])
    return run, records


def load_settings(plan: RunPlan, run_id: str, n_samples: int | None = None) -> LoadSettings:
    """The harness's settings; ``n_samples`` is the workload's size (one pass by default)."""
    n = n_samples or plan.tasks
    if plan.accuracy_only:  # every sample once, untimed: all at once, batched as the backend likes
        return LoadSettings(scenario="offline", min_queries=n, max_queries=n, warmup=0,
                            max_batch_size=plan.max_batch_size, sample_seed=plan.seed,
                            max_new_tokens=plan.max_new_tokens, run_id=run_id)  # fmt: skip
    return LoadSettings(
        scenario=plan.scenario,
        min_queries=plan.min_queries or n,
        max_queries=plan.max_queries,
        min_duration_s=plan.min_duration,
        max_duration_s=plan.max_duration,
        warmup=plan.warmup,
        rate_qps=plan.rate,
        burstiness=plan.burstiness,
        max_concurrency=plan.max_concurrency,
        samples_per_query=plan.samples_per_query,
        max_batch_size=plan.max_batch_size,
        schedule_seed=plan.schedule_seed,
        sample_seed=plan.seed,
        max_new_tokens=plan.max_new_tokens,
        run_id=run_id,
        accuracy_share=plan.accuracy_log,
    )


class _Display:
    """Rich progress for one variant at a time, fed by worker events."""

    def __init__(self, progress: Progress, variant: str) -> None:
        self.progress = progress
        self.variant = variant
        self.task = progress.add_task(f"{variant}: starting", total=None)

    def __call__(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "status":
            self.progress.update(self.task, description=f"{self.variant}: {event[1]}")
        elif kind == "progress":
            _, phase, done, total = event
            self.progress.update(
                self.task, description=f"{self.variant}: {phase}", completed=done, total=total
            )


def _run_isolated(job: VariantJob, display: _Display) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(job, channel), name=f"variantbench-{job.variant}")
    proc.start()
    try:
        while True:
            try:
                event = channel.get(timeout=0.2)
            except queue_mod.Empty:
                if not proc.is_alive():
                    # one last look: the result may have landed just before the exit
                    try:
                        event = channel.get(timeout=1.0)
                    except queue_mod.Empty:
                        raise RuntimeError(
                            f"worker for {job.variant} exited with code {proc.exitcode}"
                        ) from None
                else:
                    continue
            if event[0] == "done":
                return event[1]
            if event[0] == "failed":
                raise RuntimeError(event[1])
            display(event)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _run_inline(job: VariantJob, display: _Display) -> dict[str, Any]:
    try:
        return run_variant(job, display)
    except UserError as exc:
        raise RuntimeError(str(exc)) from exc


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".variantbench-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"output folder is not writable: {out} ({exc.strerror or exc})") from None


def execute(plan: RunPlan, console: Console | None = None) -> Report:
    """Run the plan; return the report (also written to ``plan.out / report.json``)."""
    from variantbench.environment import describe_environment
    from variantbench.models import ModelSpec, parse_model, prepare_model

    console = console or Console(stderr=True)
    check_writable(plan.out)
    # a bad workload file or fidelity text stops the run before any model is converted or loaded
    checked = _load_file(plan, console) if plan.workload else None
    if plan.fidelity_text is not None and not plan.fidelity_text.is_file():
        raise UserError(f"fidelity text not found: {plan.fidelity_text}")
    if plan.endpoint:
        from variantbench.backends.openai_http import OpenAIBackend

        probe = OpenAIBackend(
            plan.endpoint, model=plan.endpoint_model, api=plan.api, timeout_s=plan.request_timeout
        )
        probe.load()  # unreachable or garbage: one clear line, before any measurement
        spec = ModelSpec(kind="endpoint", path=plan.endpoint, name=probe.model or "endpoint")
        model_dir = ""
    else:
        spec = parse_model(plan.model)
        model_dir = str(
            prepare_model(spec, status=lambda msg: console.print(f"[dim]{msg}[/dim]", soft_wrap=True))
        )
    library = build_workload(
        plan, model_dir, say=lambda msg: console.print(f"[dim]{msg}[/dim]"), checked=checked
    )
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    report = Report(
        tool_version=__version__,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        model={"name": spec.name, "kind": spec.kind, "source": spec.path, "hf_dir": model_dir or None},
        standard=spec.name if plan.endpoint else plan.standard,
        plan=plan.model_dump(mode="json"),
        workload=library.describe(),
        environment=describe_environment(),
    )
    log_path = plan.out / "queries.jsonl"
    log_path.write_text("")  # the folder holds one run: a fresh log
    report_path = plan.out / "report.json"
    report.write(report_path)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    # the standard runs first: the others are compared with its answers and its distributions
    order = (
        (spec.name,) if plan.endpoint else (plan.standard, *(v for v in plan.variants if v != plan.standard))
    )
    fidelity = None
    if plan.fidelity and not plan.endpoint:
        from variantbench.metrics.fidelity import FidelitySpec

        fidelity = FidelitySpec(
            text_path=str(plan.fidelity_text) if plan.fidelity_text else None,
            cache_dir=str(cache_root() / "fidelity"),
            model_key=model_dir,
        )
    standard_records: list[QueryRecord] | None = None
    with progress:
        for variant in order:
            job = VariantJob(
                model_dir=model_dir,
                variant=variant,
                device=plan.device,
                threads=plan.threads,
                workload=library,
                log_path=str(log_path),
                load=load_settings(plan, run_id, len(library)),
                endpoint=plan.endpoint,
                endpoint_model=spec.name if plan.endpoint else None,
                api=plan.api,
                request_timeout=plan.request_timeout,
                find_peak=plan.find_peak,
                criteria=criteria_for(plan),
                fidelity=fidelity,
                is_standard=variant == report.standard,
            )
            display = _Display(progress, variant)
            started = time.perf_counter()
            try:
                # an endpoint run loads nothing here: measuring it from this process is enough
                isolated = plan.isolate and not plan.endpoint
                payload = (_run_isolated if isolated else _run_inline)(job, display)
                run, records = _summarize(job, payload, plan)
                standard_run = report.run(report.standard)
                if variant == report.standard:
                    standard_records = records
                    run.quality_vs_standard = compare_to_standard(run, records, run, records)
                elif standard_run is not None and standard_run.status == "ok" and standard_records:
                    run.quality_vs_standard = compare_to_standard(
                        run, records, standard_run, standard_records,
                        threshold=plan.quality_threshold / 100, length_tolerance=plan.length_tolerance / 100,
                    )  # fmt: skip
                (plan.out / f"mlperf_log_summary.{_safe(variant)}.txt").write_text(run_summary(report, run))
                progress.update(display.task, description=f"{variant}: done ({run.validity.verdict})")
            except Exception as exc:
                run = RunReport(variant=variant, status="failed", error=str(exc))
                progress.update(display.task, description=f"[red]{variant}: failed[/red]")
            run.backend.setdefault("wall_s", round(time.perf_counter() - started, 3))
            report.runs.append(run)
            report.write(report_path)
    return report


def _load_file(plan: RunPlan, console: Console) -> Workload:
    from variantbench.workloads.files import load_workload_file

    assert plan.workload is not None
    return load_workload_file(
        plan.workload,
        skip_bad=plan.skip_bad_lines,
        warn=lambda msg: console.print(f"[yellow]{msg}[/yellow]", highlight=False, soft_wrap=True),
    )


def build_workload(
    plan: RunPlan, model_dir: str, say: Callable[[str], None], checked: Workload | None = None
) -> Workload:
    """The plan's workload, lengths counted with the model's tokenizer when there is one."""
    from variantbench.workloads import TASKS, build_synthetic, parse_lengths, parse_mix
    from variantbench.workloads.base import tokenizer_counter

    tokenizer_dir = plan.tokenizer or model_dir or None
    counter = None
    if tokenizer_dir:
        try:
            counter = tokenizer_counter(tokenizer_dir)
        except Exception as exc:  # noqa: BLE001 - any loader failure is a bad --tokenizer
            raise UserError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}".splitlines()[0]) from None
    if checked is not None:
        if counter is None:
            return checked
        samples = tuple(replace(s, input_tokens=counter(s.prompt)) for s in checked.samples)
        return replace(checked, samples=samples, info={**checked.info, "counted_with": tokenizer_dir})
    say(f"building the synthetic workload: {plan.tasks} samples, {plan.input_lengths} input tokens")
    return build_synthetic(
        plan.tasks,
        plan.seed,
        mix=parse_mix(plan.mix, TASKS) if plan.mix else None,
        lengths=parse_lengths(plan.input_lengths),
        counter=counter,
        counted_with=tokenizer_dir,
    )
