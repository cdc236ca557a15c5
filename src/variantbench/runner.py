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
    watts_per_core: float = 10.0
    diagnose: bool = False
    counters: str = ""  # whether perf cache counters work here (analysis.diagnosis.cache_counters)
    repeat: int = 0

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
    from variantbench.trackers.resources import ResourceTracker

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
        gpu = (
            int(job.device.split(":")[1])
            if job.device.startswith("cuda:")
            else (0 if job.device == "cuda" else None)
        )
        tracker = ResourceTracker(watts_per_core=job.watts_per_core, gpu_index=gpu)
        with QueryLog(job.log_path) as log, tracker:
            if job.find_peak:
                result, trials = _find_peak(job, backend, library, log, progress, emit)
            else:
                result = run_scenario(backend, library, job.load, log, progress=progress)
        fidelity = None
        if job.fidelity is not None and hasattr(backend, "token_log_probs"):
            from variantbench.metrics.fidelity import measure

            emit(("status", "logit fidelity"))
            fidelity = measure(backend, job.fidelity, job.is_standard)
        diagnosis = None
        if job.diagnose and not job.endpoint:
            from variantbench.analysis.diagnosis import diagnose_backend

            emit(("status", "diagnosis: profile and batch efficiency"))
            try:
                diagnosis = diagnose_backend(
                    backend, load.param_bytes, load.details.get("parameters"), job.counters
                )
            except Exception as exc:  # noqa: BLE001 - a failed diagnosis must not lose the run
                diagnosis = {"summary": f"diagnosis failed: {type(exc).__name__}: {exc}".splitlines()[0]}
    finally:
        backend.close()
    res = tracker.result
    return {
        "variant": job.variant,
        "is_standard": job.is_standard,
        "repeat": job.repeat,
        "run_id": job.load.run_id,
        "scenario": job.load.scenario,
        "diagnosis": diagnosis,
        "resource_samples": [[x.t_ns, x.rss_bytes, round(x.cpu_s, 4)] for x in res.samples],
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
            "peak_rss_bytes": res.peak_rss_bytes,
            "mean_rss_bytes": res.mean_rss_bytes,
            "mean_cpu_util": res.mean_cpu_util,
            "cpu_s": res.cpu_s,
            "wall_s": res.wall_s,
            "cores": res.cores,
            "energy_j": res.energy_j,
            "energy_source": res.energy_source,
            "watts_per_core": res.watts_per_core,
            "gpu": res.gpu,
            "startup_warm_s": load.startup_s,
            "disk_bytes": _disk_bytes(load.details),
        },
    }


def _disk_bytes(details: dict[str, Any]) -> int | None:
    """Bytes on disk of what the variant loads beyond the base folder (built folder or export)."""
    built = details.get("built") or {}
    if built.get("bytes_on_disk"):
        return int(built["bytes_on_disk"])
    for key in ("gguf", "onnx_dir"):
        if details.get(key):
            path = Path(details[key])
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
            return sum(f.stat().st_size for f in files)
    return None


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


def _quiet_libraries() -> None:
    """Keep library chatter off the user's console: torchao's missing-CUDA-kernel notices and torch's
    pytree deprecation lines are logged at WARNING on every import and say nothing about the run."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(job: VariantJob, channel: Any) -> None:
    _quiet_libraries()
    try:
        if not job.endpoint:  # a warm process: libraries loaded, so startup_warm_s is the model's own
            import torch  # noqa: F401
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

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


def summarize_payload(
    payload: dict[str, Any],
    records: list[QueryRecord],
    plan: RunPlan,
    standard: tuple[RunReport, list[QueryRecord]] | None = None,
    ceilings: dict[str, Any] | None = None,
) -> RunReport:
    """One variant's run from its raw results and its query records: summary, resources, cost, A/B.

    Pure function of the saved data (``raw/*.json`` and the query log), so ``variantbench report``
    recomputes exactly what the run wrote.
    """
    from variantbench.analysis.cost import derive
    from variantbench.metrics.windows import windows as make_windows
    from variantbench.report.schema import AB, Cost, Diagnosis
    from variantbench.trackers.resources import ResourceSample, window_resources

    fidelity = payload.get("fidelity") or {}
    criteria = replace(criteria_for(plan, payload["seeds"]), target_qps=payload["load_settings"]["rate_qps"])
    raw = dict(payload["resources"])
    raw.setdefault("startup_warm_s", raw.get("startup_s"))
    run = summarize_run(
        payload.get("name") or payload["variant"],
        records,
        Resources(**raw),
        backend=payload["load"].get("details", {}),
        scenario=payload.get("scenario", plan.scenario),
        criteria=criteria,
        fidelity={k: fidelity.get(k) for k in ("perplexity", "kl_mean", "kl_p99", "top1_agreement")},
    )
    if payload.get("peak_search"):
        passing = [t["rate_qps"] for t in payload["peak_search"] if t["passed"]]
        run.peak = PeakSearch(peak_qps=max(passing) if passing else None, trials=payload["peak_search"])
    samples = [ResourceSample(t, rss, cpu) for t, rss, cpu in payload.get("resource_samples") or []]
    if samples and run.windows:
        spans = [(w.start_ns, w.end_ns) for w in make_windows(records, criteria.window)]
        for w, extra in zip(
            run.windows, window_resources(samples, spans, raw.get("cores") or 1), strict=True
        ):
            w.mean_rss_bytes, w.mean_cpu_util = extra["mean_rss_bytes"], extra["mean_cpu_util"]
    ok_tokens = sum(r.output_tokens for r in records if r.status == "ok")
    run.cost = Cost(**derive(plan.cost_model(), duration_s=run.duration_s, output_tokens=ok_tokens,
                             energy_j=raw.get("energy_j"), tracked_wall_s=raw.get("wall_s"),
                             quality=run.quality.composite))  # fmt: skip
    if payload.get("is_standard"):
        run.quality_vs_standard = compare_to_standard(run, records, run, records)
    elif standard is not None:
        std_run, std_records = standard
        if std_run.variant == run.variant:
            run.quality_vs_standard = compare_to_standard(run, records, run, records)
        elif std_run.status == "ok":
            run.quality_vs_standard = compare_to_standard(
                run, records, std_run, std_records,
                threshold=plan.quality_threshold / 100, length_tolerance=plan.length_tolerance / 100,
            )  # fmt: skip
            run.ab_vs_standard = AB(**ab_compare(run.variant, records, std_run.variant, std_records))
    diag = payload.get("diagnosis")
    if diag:
        run.diagnosis = Diagnosis(
            **{k: v for k, v in diag.items() if k in Diagnosis.model_fields},
            ceiling_gflops=(ceilings or {}).get("matmul_gflops"),
            ceiling_gbps=(ceilings or {}).get("memory_gbps"),
        )
    return run


def ab_compare(variant: str, records: list[QueryRecord], standard: str, std_records: list[QueryRecord],
               seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Ratios with bootstrap intervals and a Mann-Whitney test, per query, variant over standard."""
    from variantbench.metrics import significance as sig

    def lat(rs: list[QueryRecord]) -> list[float]:
        return [r.latency_from_scheduled_ms for r in rs if r.status == "ok"]

    a, b = lat(records), lat(std_records)
    p50 = sig.bootstrap_ratio(a, b, 50, seed=seed)
    p99 = sig.bootstrap_ratio(a, b, 99, seed=seed + 1)
    ok_a = [r for r in records if r.status == "ok"]
    ok_b = [r for r in std_records if r.status == "ok"]
    tput = sig.bootstrap_rate_ratio([r.output_tokens for r in ok_a], [r.latency_ms for r in ok_a],
                                    [r.output_tokens for r in ok_b], [r.latency_ms for r in ok_b],
                                    seed=seed + 2)  # fmt: skip
    p = sig.mann_whitney(a, b)
    word = sig.verdict(p50, p)
    return {
        "standard": standard,
        "latency_p50_ratio": p50,
        "latency_p99_ratio": p99,
        "throughput_ratio": tput,
        "p_value": p,
        "verdict": word,
        "summary": sig.describe(variant, standard, p50, tput, p, word),
    }


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
    ceilings: dict[str, Any] = {}
    counters = ""
    analyze = not plan.endpoint and not plan.accuracy_only  # an untimed pass has no speed to explain
    if plan.diagnose and analyze:
        from variantbench.analysis.ceilings import probe
        from variantbench.analysis.diagnosis import cache_counters

        console.print("[dim]probing the machine's ceilings (matmul GFLOP/s, memory GB/s)[/dim]")
        ceilings = probe(plan.device if plan.device.startswith("cuda") else "cpu")
        counters = cache_counters()
        ceilings["cache_counters"] = counters
        report.ceilings = ceilings
    raw_dir = plan.out / "raw"
    raw_dir.mkdir(exist_ok=True)
    for old in raw_dir.glob("*.json"):
        old.unlink()
    standard: tuple[RunReport, list[QueryRecord]] | None = None
    standard_repeats: list[RunReport] = []
    with progress:
        for variant in order:
            display = _Display(progress, variant)
            started = time.perf_counter()
            repeats: list[RunReport] = []
            for repeat in range(plan.repeats):
                rid = run_id if plan.repeats == 1 else f"{run_id}#{repeat}"
                job = VariantJob(
                    model_dir=model_dir,
                    variant=variant,
                    device=plan.device,
                    threads=plan.threads,
                    workload=library,
                    log_path=str(log_path),
                    load=load_settings(plan, rid, len(library)),
                    endpoint=plan.endpoint,
                    endpoint_model=spec.name if plan.endpoint else None,
                    api=plan.api,
                    request_timeout=plan.request_timeout,
                    find_peak=plan.find_peak,
                    criteria=criteria_for(plan),
                    fidelity=fidelity if repeat == 0 else None,
                    is_standard=variant == report.standard,
                    watts_per_core=plan.watts_per_core,
                    diagnose=plan.diagnose and analyze and repeat == 0,
                    counters=counters,
                    repeat=repeat,
                )
                raw_path = raw_dir / f"{_safe(variant)}.{repeat}.json"
                try:
                    # an endpoint run loads nothing here: measuring it from this process is enough
                    isolated = plan.isolate and not plan.endpoint
                    payload = (_run_isolated if isolated else _run_inline)(job, display)
                    records = [QueryRecord.from_json(r) for r in payload.pop("records")]
                    if plan.cold_start and analyze and repeat == 0:
                        from variantbench.analysis.startup import cold_start

                        display(("status", "cold start in a fresh process"))
                        cold_s, note = cold_start(model_dir, variant, payload["load"].get("details", {}),
                                                  threads=plan.threads, device=plan.device)  # fmt: skip
                        payload["resources"].update(startup_cold_s=cold_s, startup_cold_note=note)
                    _write_json(raw_path, payload)
                    run = summarize_payload(payload, records, plan, standard, ceilings)
                    if repeat == 0 and variant == report.standard and run.status == "ok":
                        standard = (run, records)
                    progress.update(display.task, description=f"{variant}: done ({run.validity.verdict})")
                except Exception as exc:
                    _write_json(raw_path, {"variant": variant, "repeat": repeat, "status": "failed",
                                           "error": str(exc)})  # fmt: skip
                    run = RunReport(variant=variant, status="failed", error=str(exc))
                    progress.update(display.task, description=f"[red]{variant}: failed[/red]")
                repeats.append(run)
            run = combine_repeats(repeats, standard_repeats)
            if variant == report.standard:
                standard_repeats = repeats
            if run.status == "ok":
                (plan.out / f"mlperf_log_summary.{_safe(variant)}.txt").write_text(run_summary(report, run))
            run.backend.setdefault("wall_s", round(time.perf_counter() - started, 3))
            report.runs.append(run)
            report.write(report_path)
    finalize(report, plan)
    report.write(report_path)
    write_markdown(report, plan.out / "report.md")
    return report


def rebuild_report(folder: Path) -> Report:
    """report.json and report.md recomputed from the query log and raw/*.json alone."""
    import json

    from variantbench.loadgen.records import read_log

    report_path, log_path, raw_dir = folder / "report.json", folder / "queries.jsonl", folder / "raw"
    for needed in (report_path, log_path, raw_dir):
        if not needed.exists():
            raise UserError(f"{folder} is not a complete run folder: {needed.name} is missing")
    try:
        old = Report.read(report_path)
        plan = RunPlan(**old.plan)
        raws = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(raw_dir.glob("*.json"))]
        records = read_log(log_path)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read the run in {folder}: {str(exc).splitlines()[0]}") from None
    by_run: dict[str, list[QueryRecord]] = {}
    for rec in records:
        by_run.setdefault(rec.run_id, []).append(rec)
    order = [r.variant for r in old.runs] or list(dict.fromkeys(raw["variant"] for raw in raws))
    report = old.model_copy(update={"runs": [], "recommendations": {}})
    standard: tuple[RunReport, list[QueryRecord]] | None = None
    standard_repeats: list[RunReport] = []
    for variant in order:
        repeats: list[RunReport] = []
        for raw in sorted((r for r in raws if r["variant"] == variant), key=lambda r: r.get("repeat", 0)):
            if raw.get("status") == "failed":
                repeats.append(RunReport(variant=variant, status="failed", error=raw.get("error")))
                continue
            recs = [r for r in by_run.get(raw["run_id"], []) if r.variant in (variant, raw.get("name"))]
            run = summarize_payload(raw, recs, plan, standard, old.ceilings)
            if raw.get("repeat", 0) == 0 and variant == report.standard:
                standard = (run, recs)
            repeats.append(run)
        if not repeats:
            continue
        run = combine_repeats(repeats, standard_repeats)
        if variant == report.standard:
            standard_repeats = repeats
        previous = old.run(variant)
        if previous is not None and "wall_s" in previous.backend:
            run.backend.setdefault("wall_s", previous.backend["wall_s"])
        report.runs.append(run)
    finalize(report, plan)
    report.write(report_path)
    write_markdown(report, folder / "report.md")
    return report


def _write_json(path: Path, data: dict[str, Any]) -> None:
    import json

    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)


def combine_repeats(repeats: list[RunReport], standard_repeats: list[RunReport]) -> RunReport:
    """The first run is the report's row; with --repeats, each run's key numbers and, against the
    standard's run of the same index, the mean and 95% CI of the ratios across runs."""
    from variantbench.metrics.significance import across_runs

    main = repeats[0]
    if len(repeats) < 2:
        return main
    main.repeats = [
        {
            "repeat": i,
            "status": r.status,
            "latency_p50_ms": r.latency_ms.p50,
            "latency_p99_ms": r.latency_ms.p99,
            "output_tokens_per_s": r.throughput.output_tokens_per_s,
        }  # fmt: skip
        for i, r in enumerate(repeats)
    ]
    if main.ab_vs_standard is not None and standard_repeats:
        p50, tput = [], []
        for mine, theirs in zip(repeats, standard_repeats, strict=False):
            if mine.status == theirs.status == "ok" and mine.latency_ms.p50 and theirs.latency_ms.p50:
                p50.append(mine.latency_ms.p50 / theirs.latency_ms.p50)
                if mine.throughput.output_tokens_per_s and theirs.throughput.output_tokens_per_s:
                    tput.append(mine.throughput.output_tokens_per_s / theirs.throughput.output_tokens_per_s)
        main.ab_vs_standard.across_repeats = {
            "latency_p50_ratio": across_runs(p50),
            "throughput_ratio": across_runs(tput),
        }
    return main


def finalize(report: Report, plan: RunPlan) -> None:
    """What needs every run: each diagnosis explained against the standard's, the recommendations."""
    from variantbench.analysis.diagnosis import explain
    from variantbench.analysis.recommend import PROFILES, recommend

    std = report.run(report.standard)
    for run in report.runs:
        if run.diagnosis is None or std is None or std.diagnosis is None or run.status != "ok":
            continue
        if run.diagnosis.summary.startswith("diagnosis failed"):
            continue
        if run.variant == std.variant:
            run.diagnosis.summary = f"{run.variant}: the standard (baseline of the comparison)"
            continue

        def ratio(mine: float | None, theirs: float | None) -> float | None:
            return mine / theirs if mine and theirs else None

        run.diagnosis.summary = explain(
            run.variant, run.diagnosis.model_dump(), std.variant, std.diagnosis.model_dump(),
            ratio(run.speed.decode_tokens_per_s, std.speed.decode_tokens_per_s),
            ratio(run.speed.prefill_tokens_per_s, std.speed.prefill_tokens_per_s),
        )  # fmt: skip
    scenarios = dict(PROFILES)
    custom = plan.custom_scenario()
    if custom is not None:
        scenarios["custom"] = custom
    report.recommendations = {
        name: recommend(report.runs, report.standard, s) for name, s in scenarios.items()
    }


def write_markdown(report: Report, path: Path) -> None:
    from variantbench.report.markdown import render

    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(report), encoding="utf-8")
    tmp.replace(path)


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
