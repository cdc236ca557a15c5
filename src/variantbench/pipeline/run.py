"""Run a plan: prepare once, then build, measure and time each variant as jobs on an executor.

The parent prepares what every job shares (the base model, the workload, the machine's ceilings),
turns the plan into jobs, hands them to the plan's executor and keeps every result: each measure
job's raw result goes to ``raw/VARIANT.REPEAT.json`` and its queries are already in
``queries.jsonl`` (appended as they complete), and the report is assembled again from them after
every variant, so a run that fails halfway keeps all that was measured.

Order: every variant is built before any is measured, so ``startup_s`` never contains a build.
Then, by default, the variants are measured interleaved (``pipeline/interleave.py``: all loaded at
once, each in its own process, in turns), so a drift of the machine lands on all of them; one
after the other, the standard first, under ``--no-interleave``, under find-peak (each variant's
rate searched alone) and for an endpoint. The report says which (``report.execution``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
import datetime as dt
import json
from pathlib import Path
import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from variantbench import __version__
from variantbench.errors import UserError
from variantbench.extras import require
from variantbench.paths import cache_root
from variantbench.pipeline.assemble import assemble
from variantbench.pipeline.executors import (
    Concurrent,
    Executor,
    InlineExecutor,
    JobFailed,
    Resident,
)
from variantbench.pipeline.jobs import BuildJob, ColdStartJob, Endpoint, MeasureJob
from variantbench.pipeline.registry import EXECUTORS
from variantbench.pipeline.settings import criteria_for, load_settings
from variantbench.plan import Plan
from variantbench.plan_file import write_plan
from variantbench.records import QueryRecord, read_log
from variantbench.redact import redact_plan, redact_url, redacted_keys
from variantbench.report.results import VariantResult, failed, read_result
from variantbench.report.schema import Execution, Report, Rounds
from variantbench.variants.spec import Artifact, VariantSpec, plain_artifact
from variantbench.workloads.base import Workload


def claim_folder(plan: Plan, say: Callable[[str], None]) -> None:
    """A fresh run writes into an empty folder: one that holds anything is refused in one line, or
    with ``output.overwrite`` moved aside to ``OUT.N`` (never deleted), the history's rows of the
    run it holds following it. ``--resume`` and a resumed search keep the folder instead."""
    out = plan.out
    if not out.is_dir() or not any(out.iterdir()):
        return
    n = 1
    while Path(f"{out}.{n}").exists():
        n += 1
    aside = Path(f"{out}.{n}")
    if not plan.output.overwrite:
        held = "a run" if (out / "report.json").exists() or (out / "queries.jsonl").exists() else "files"
        raise UserError(f"{out} already holds {held}: --overwrite moves it aside to {aside}, "
                        f"--resume {out} continues it, or --out names another folder")  # fmt: skip
    try:
        out.rename(aside)
    except OSError as exc:
        raise UserError(f"cannot move {out} aside to {aside}: {exc.strerror or exc}") from None
    moved = 0
    if plan.output.record_history:
        from variantbench.history import History

        try:
            with History(plan.output.history) as history:
                moved = history.relocate(out, aside)
        except Exception as exc:  # noqa: BLE001 - a history that cannot be written costs the run nothing
            say(f"the history still points at {out}: {exc}".splitlines()[0])
    say(
        f"moved the run that was in {out} aside to {aside}"
        + (f" ({moved} history rows follow it)" if moved else "")
    )


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".variantbench-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"output folder is not writable: {out} ({exc.strerror or exc})") from None


def served_endpoints(plan: Plan) -> dict[str, Endpoint]:
    """The served variants by name, each server asked for its models (``/v1/models``): unreachable,
    garbage or a missing API key is one line here, before anything is measured. ``model.endpoint``
    (one server) names its variant after the served model."""
    import os

    from variantbench.backends.openai_http import OpenAIBackend

    m = plan.model
    eos = (("ignore_eos", True),) if plan.workload.ignore_eos else ()
    if m.endpoint:
        probe = OpenAIBackend(m.endpoint, model=m.endpoint_model, api=m.api, timeout_s=m.request_timeout_s)
        probe.load()
        name = probe.model or "endpoint"
        return {
            name: Endpoint(m.endpoint, model=name, api=m.api, timeout_s=m.request_timeout_s, extra_body=eos)
        }
    out: dict[str, Endpoint] = {}
    for name in plan.ordered_variants():
        e = plan.endpoints.get(name)
        if e is None:
            continue
        key = None
        if e.api_key_env:
            key = os.environ.get(e.api_key_env)
            if not key:
                raise UserError(
                    f"endpoints.{name}.api_key_env: the environment variable {e.api_key_env} is not set"
                )
        headers = []
        for header, value in e.headers.items():
            if value.startswith("$"):
                if value[1:] not in os.environ:
                    raise UserError(
                        f"endpoints.{name}.headers.{header}: the environment variable {value[1:]} is not set"
                    )
                value = os.environ[value[1:]]
            headers.append((header, value))
        endpoint = Endpoint(e.url, model=e.model, api=e.api, timeout_s=e.timeout_s, api_key=key,
                            headers=tuple(headers), extra_body=(*eos, *e.extra_body.items()))  # fmt: skip
        probe = endpoint.backend(name)
        probe.load()
        out[name] = replace(endpoint, model=probe.model)
    return out


def parse_variants(plan: Plan) -> dict[str, VariantSpec]:
    """Every variant of the plan parsed once; an unknown kind or a bad chain is one line, before anything runs."""
    if plan.served:
        return {}
    return {name: VariantSpec.parse(name) for name in plan.ordered_variants()}


def check_device(plan: Plan, specs: dict[str, VariantSpec]) -> None:
    """The plan's device on this machine, and every variant's recipes runnable there (one line each
    way, before anything is built), unless the jobs run elsewhere (Ray checks its cluster's)."""
    if plan.model.device.startswith("cuda") and plan.execution.executor != "ray":
        from variantbench.device_probe import device_info
        from variantbench.devices import check_variant

        device = device_info(plan.model.device)
        for name, spec in specs.items():
            check_variant(name, spec.recipes, device)


class Display:
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


def execute(plan: Plan, console: Console | None = None, resume: bool = False) -> Report:
    """Run the plan; return the report (also written to ``plan.out / report.json``). ``resume``: the
    folder holds a run that was killed or failed; what it measured is kept and only the rest runs."""
    console = console or Console(stderr=True)
    ctx = prepare(plan, console, keep=resume, resume=resume)
    with run_progress(console) as progress:
        if ctx.interleave:
            report = _measure_interleaved(ctx, progress, console)
        elif ctx.at_once:
            report = _measure_at_once(ctx, progress)
        else:
            report = _measure_one_by_one(ctx, progress)
    finish(ctx, report, console)
    return report


def run_progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)  # fmt: skip


def finish(ctx: RunContext, report: Report, console: Console) -> None:
    """The last assembly: every file, from the log as `variantbench report DIR` reads it (the log's
    order); then the run's rows in the history."""
    plan = ctx.plan
    write_outputs(report, plan.out, read_log(ctx.log_path), ctx.raws, csv=plan.output.csv)
    if plan.output.record_history:
        _record_history(plan, report, ctx.records, ctx.base_dir, console)


def resume_run(folder: Path, console: Console | None = None) -> Report:
    """``variantbench run --resume DIR``: the run in ``folder`` continued from its plan.yaml, its query
    log and its partial results. Whole variants are skipped; an interleaved variant goes on from the
    first round it had not answered (the same samples, the same schedule, the same looks); a phase
    that finished (fidelity, batch rounds, diagnosis, cold start) is not run again."""
    from variantbench.plan_file import load_plan

    for needed in ("plan.yaml", "queries.jsonl", "report.json"):
        if not (folder / needed).is_file():
            raise UserError(f"{folder} is not a run folder to resume: {needed} is missing")
    plan = load_plan(folder / "plan.yaml").model_copy(update={"out": folder})
    if hidden := redacted_keys(plan.model_dump(mode="json")):
        raise UserError(f"{folder / 'plan.yaml'}: {hidden[0]} was given literally and is not written to disk; "
                        "give it as $NAME (an environment variable) to resume")  # fmt: skip
    return execute(plan, console, resume=True)


def earlier_run_id(out: Path, raws: list[VariantResult], records: list[QueryRecord]) -> str:
    """The run id of the run a resume continues: its queries and results carry it."""
    try:
        rid = Report.read(out / "report.json").execution.run_id
    except (OSError, ValueError):
        rid = None
    ids = [r.run_id for r in raws if r.run_id] + [r.run_id for r in records]
    rid = rid or (ids[0].split("@")[0].split("#")[0] if ids else None)
    if rid is None:
        raise UserError(f"nothing was measured in {out}: there is nothing to resume (run it again)")
    return str(rid)


def set_aside(ctx: RunContext, say: Callable[[str], None]) -> None:
    """Queries a resumed run asks again (a block the kill cut short; a one-by-one variant's unfinished
    scenario), moved from the log to ``queries.unfinished.jsonl``: kept, not counted twice."""
    from variantbench.pipeline.interleave import unfinished_blocks
    from variantbench.records import QueryLog

    aside: list[QueryRecord] = []
    for (variant, repeat), old in ctx.resumed.items():
        mine = [r for r in ctx.records if r.run_id == old.run_id and r.variant in (variant, old.name)]
        if ctx.interleave:
            aside += unfinished_blocks(mine, ctx.job(variant, repeat, None).load, ctx.plan.execution.block_s)
        elif "scenario" not in old.done:
            aside += mine
    if not aside:
        return
    gone = {id(r) for r in aside}
    ctx.records = [r for r in ctx.records if id(r) not in gone]
    with QueryLog(ctx.plan.out / "queries.unfinished.jsonl") as log:
        for r in aside:
            log.append(r)
    tmp = ctx.log_path.with_name(ctx.log_path.name + ".tmp")
    tmp.write_text(
        "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in ctx.records), encoding="utf-8"
    )
    tmp.replace(ctx.log_path)
    say(f"{len(aside)} queries of unfinished blocks set aside in queries.unfinished.jsonl: asked again")


def prepare(plan: Plan, console: Console, keep: bool = False, resume: bool = False) -> RunContext:
    """Everything the plan's jobs share, checked and made once: the base model, the workload, the
    machine's ceilings, the executor and how the variants will be measured; ``report.json``'s header
    written. Bad input fails here, before anything is measured. ``keep``: the folder's query log and
    raw results are kept and loaded (a search resumed), not started afresh."""
    from variantbench.environment import describe_environment
    from variantbench.models import ModelSpec, parse_model, prepare_model
    from variantbench.variants.support import check_support

    out = plan.out
    if not keep:
        claim_folder(plan, say=lambda msg: console.print(f"[dim]{msg}[/dim]", soft_wrap=True))
    check_writable(out)
    if not plan.served:
        require("local", "a local model (model.source)")
        spec = parse_model(plan.model.source)  # a bad path fails here, before anything slow
    specs = parse_variants(plan)
    check_device(plan, specs)
    if plan.execution.executor == "ray":  # jobs on its nodes, or (served variants) its sender actors
        from variantbench.ray_cluster import preflight

        preflight(plan.execution.address)
        if plan.execution.shared_cache:  # the base model prepared here where every node reads it too
            import os

            os.environ["VARIANTBENCH_CACHE"] = str(plan.execution.shared_cache)
    # a bad workload file or fidelity text stops the run before any model is converted or loaded
    checked = _load_file(plan, console) if plan.workload.file else None
    if plan.quality.fidelity_text is not None and not plan.quality.fidelity_text.is_file():
        raise UserError(f"fidelity text not found: {plan.quality.fidelity_text}")
    endpoints = served_endpoints(plan)  # every server probed: unreachable is one line, before any measurement
    if endpoints:
        models = list(dict.fromkeys(e.model or "endpoint" for e in endpoints.values()))
        urls = ", ".join(dict.fromkeys(redact_url(e.url) for e in endpoints.values()))
        spec = ModelSpec(kind="endpoint", path=urls, name=" / ".join(models))
        base_dir = ""
    else:
        say = lambda msg: console.print(f"[dim]{msg}[/dim]", soft_wrap=True)  # noqa: E731
        base_dir = str(prepare_model(spec, status=say))
        for name, variant in specs.items():  # a recipe the model's family cannot take: one line, now
            check_support(variant.recipes, base_dir, name)
    write_plan(plan, out / "plan.yaml")
    library = build_workload(plan, base_dir, say=lambda msg: console.print(f"[dim]{msg}[/dim]"), checked=checked,
                             passes=1 if endpoints else None)  # fmt: skip
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    if resume:
        earlier = read_results(out / "raw") if (out / "raw").is_dir() else []
        run_id = earlier_run_id(out, earlier, read_log(out / "queries.jsonl"))
    header = Report(
        tool_version=__version__,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        model={"name": spec.name, "kind": spec.kind, "source": spec.path, "hf_dir": base_dir or None},
        standard=next(iter(endpoints)) if plan.model.endpoint else plan.standard_variant,
        plan=redact_plan(plan.model_dump(mode="json")),
        workload=library.describe(),
        environment=describe_environment(torch_details=not endpoints),
    )
    log_path = out / "queries.jsonl"
    raw_dir = out / "raw"
    raw_dir.mkdir(exist_ok=True)
    kept_raws: list[VariantResult] = []
    kept_records: list[QueryRecord] = []
    if keep:  # a resumed search or run: what earlier sessions measured stays and is counted
        kept_raws = read_results(raw_dir)
        kept_records = read_log(log_path) if log_path.exists() else []
        log_path.touch()
    else:
        log_path.write_text("")  # the folder holds one run: a fresh log
        for old in raw_dir.glob("*.json"):
            old.unlink()
    order = list(endpoints) if plan.model.endpoint else list(plan.ordered_variants())
    fidelity = None
    if plan.quality.fidelity and not endpoints:
        from variantbench.metrics.fidelity import FidelitySpec

        text = plan.quality.fidelity_text
        fidelity = FidelitySpec(text_path=str(text) if text else None, cache_dir=str(cache_root() / "fidelity"),
                                model_key=base_dir)  # fmt: skip
    likelihood = None
    if plan.quality.likelihood:  # a served variant's from its server (echo + logprobs), where it can
        from variantbench.metrics.likelihood import LikelihoodSpec

        likelihood = LikelihoodSpec(cache_dir=str(cache_root() / "likelihood"), model_key=base_dir)
    lm_eval = None
    if plan.quality.lm_eval is not None and plan.quality.lm_eval.tasks:  # a served variant's on its server
        from variantbench.metrics.lm_eval import LmEvalSpec

        le = plan.quality.lm_eval
        lm_eval = LmEvalSpec(tasks=tuple(le.tasks), limit=le.limit, num_fewshot=le.num_fewshot,
                             include_path=str(le.include_path) if le.include_path else None)  # fmt: skip
    analyze = not endpoints and plan.is_timed  # an untimed pass has no speed to explain; a server no weights
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
    executor: Executor = InlineExecutor() if endpoints else EXECUTORS[plan.execution.executor](plan)
    find_peak = bool(getattr(plan.load, "find_peak", False)) and plan.is_timed
    nodes = executor.capacity() if isinstance(executor, Concurrent) else 0
    at_once = nodes > 1 and len(order) > 1
    interleave = (plan.execution.interleave and not endpoints and len(order) > 1 and not find_peak
                  and isinstance(executor, Resident) and not at_once)  # fmt: skip
    header.execution = Execution(
        interleaved=interleave,
        why_not=None if interleave or len(order) < 2 else
        ("each variant measured at once on a node of its own" if at_once else
         "one node of the cluster: the variants one after another" if nodes == 1 else
         "find-peak searches each variant's rate alone" if find_peak else
         "served variants are measured one after another" if endpoints else "execution.interleave is off"),
        executor=plan.execution.executor if not endpoints else "inline",
        run_id=run_id,
        nodes=nodes or None,
    )  # fmt: skip
    ctx = RunContext(plan=plan, header=header, order=order, specs=specs, base_dir=base_dir, library=library,
                     log_path=log_path, raw_dir=raw_dir, run_id=run_id, executor=executor, endpoints=endpoints,
                     fidelity=fidelity, likelihood=likelihood, lm_eval=lm_eval, analyze=analyze, counters=counters, find_peak=find_peak,
                     interleave=interleave, at_once=at_once, raws=kept_raws, records=kept_records)  # fmt: skip
    if resume:
        kept_raws += from_log_alone(kept_records, kept_raws, plan)
        ctx.resumed = {(r.variant, r.repeat): r.model_copy(update={"done": [] if r.status == "log-only" else r.done})
                       for r in kept_raws if r.status in ("partial", "log-only")}  # fmt: skip
        ctx.raws = [r for r in kept_raws if r.status != "failed"]  # a failed variant is measured again
        set_aside(ctx, say=lambda msg: console.print(f"[dim]{msg}[/dim]"))
        whole = sorted({r.variant for r in ctx.raws if r.status == "ok"})
        console.print(f"[dim]resuming {out}: " + (f"{', '.join(whole)} whole, " if whole else "")
                      + (f"{len(ctx.resumed)} to finish" if ctx.resumed else "nothing left half-done") + "[/dim]")  # fmt: skip
    return ctx


def _record_history(
    plan: Plan, report: Report, records: list[QueryRecord], base_dir: str, console: Console
) -> None:
    """The run's rows in the results history; a history that cannot be written costs the run nothing."""
    from variantbench.history import History

    try:
        with History(plan.output.history) as history:
            weights = [f for pattern in ("*.safetensors", "*.bin", "*.gguf", "config.json")
                       for f in Path(base_dir).glob(pattern)] if base_dir else []  # fmt: skip
            ids = history.record(report, plan.out, records, history.file_hash(weights))
        console.print(f"[dim]recorded in the history {history.path} (ids {', '.join(map(str, ids))})[/dim]")
    except (UserError, OSError) as exc:
        console.print(f"[yellow]not recorded in the history: {exc}[/yellow]", soft_wrap=True)


@dataclass
class RunContext:
    """What every way of measuring needs from the prepared run."""

    plan: Plan
    header: Report
    order: list[str]
    specs: dict[str, VariantSpec]
    base_dir: str
    library: Workload
    log_path: Path
    raw_dir: Path
    run_id: str
    executor: Executor
    endpoints: dict[str, Endpoint]  # served variants by name ({} for local ones)
    fidelity: Any
    likelihood: Any
    lm_eval: Any
    analyze: bool
    counters: str
    find_peak: bool
    interleave: bool = False  # measured in turns (pipeline/interleave.py)
    at_once: bool = False  # each variant at once on a node of its own (a Concurrent executor)
    raws: list[VariantResult] = field(default_factory=list)
    records: list[QueryRecord] = field(default_factory=list)
    # a resumed run: what its killed run saved, by (variant, repeat), and its run id
    resumed: dict[tuple[str, int], VariantResult] = field(default_factory=dict)

    def job(self, variant: str, repeat: int, artifact: Artifact | None) -> MeasureJob:
        plan = self.plan
        rid = self.run_id if plan.analysis.repeats == 1 else f"{self.run_id}#{repeat}"
        old = self.resumed.get((variant, repeat))
        answered = tuple(dict.fromkeys(r.sample_id for r in self.records if old is not None
                                       and r.run_id == old.run_id and r.variant in (variant, old.name)))  # fmt: skip
        return MeasureJob(
            variant=variant, workload=self.library, log_path=str(self.log_path),
            load=load_settings(plan, rid, self.library.pass_size or len(self.library)), spec=self.specs.get(variant), artifact=artifact,
            base_dir=self.base_dir, device=plan.model.device, threads=plan.model.threads, cuda_graphs=plan.model.cuda_graphs, endpoint=self.endpoints.get(variant),
            find_peak=self.find_peak, criteria=criteria_for(plan), fidelity=self.fidelity if repeat == 0 else None,
            likelihood=self.likelihood if repeat == 0 else None, lm_eval=self.lm_eval if repeat == 0 else None,
            is_standard=variant == self.header.standard, watts_per_core=plan.cost.watts_per_core,
            diagnose=plan.analysis.diagnose and self.analyze and repeat == 0, counters=self.counters, repeat=repeat,
            batch_rounds=plan.analysis.batch_rounds if self.analyze else 0, scrape_s=plan.execution.scrape_s,
            cold_start=self.cold_starts(variant, artifact) and repeat == 0,
            result_path=str(self.raw_dir / result_name(variant, repeat)), resume=old, answered=answered,
        )  # fmt: skip

    def whole(self, variant: str, repeat: int) -> bool:
        """This variant-repeat's result is whole already (a resumed run skips it)."""
        return any(r.variant == variant and r.repeat == repeat and r.status == "ok" for r in self.raws)

    def cold_starts(self, variant: str, artifact: Artifact | None) -> bool:
        return bool(self.plan.analysis.cold_start and self.analyze and variant in self.specs and artifact)

    def cold_start(
        self, variant: str, artifact: Artifact | None, result: VariantResult, display: Any,
        via: Executor | None = None,
    ) -> None:  # fmt: skip
        """The variant's cold start, here (the job starts its own fresh process) or ``via`` an
        executor that runs jobs elsewhere (a Ray node, on hardware like the one measured); saved."""
        vspec = self.specs.get(variant)
        if "cold_start" in result.expected and "cold_start" not in result.done and vspec and artifact:
            cold = ColdStartJob(
                vspec, artifact, self.base_dir, self.plan.model.device, self.plan.model.threads
            )
            start = time.perf_counter()
            got = via.run(cold, display) if via is not None else cold.run(display)
            result.resources.startup_cold_s, result.resources.startup_cold_note = got.seconds, got.note
            result.phases_s["cold_start"] = round(time.perf_counter() - start, 3)
            result.mark("cold_start")
            result.write(self.raw_dir / result_name(variant, result.repeat))

    def keep(self, result: VariantResult) -> None:
        """One variant-repeat's result written whole and kept (a failure too: it is data)."""
        if result.status == "partial":
            result.status = "ok"
        result.write(self.raw_dir / result_name(result.variant, result.repeat))
        self.raws = [r for r in self.raws if (r.variant, r.repeat) != (result.variant, result.repeat)]
        self.raws.append(result)

    def assemble(self) -> Report:
        """The report so far: a run stopped here (even by SIGKILL) leaves report.json, .md and .csv, and
        ``variantbench report DIR`` draws the page. The page itself waits for the end: drawing it
        after every variant cost 0.6-0.9 s each, a minute over the test suite's many small runs."""
        report = assemble(self.header, self.plan, self.raws, self.records, order=self.order)
        write_outputs(report, self.plan.out, self.records, self.raws, html=False)
        return report


def one_repeat(
    ctx: RunContext, variant: str, repeat: int, artifact: Artifact | None, build_error: str | None,
    display: Display, started: float,
) -> tuple[VariantResult, list[QueryRecord]]:  # fmt: skip
    """One variant-repeat measured (the first also timed from cold): its result and records,
    or a failure's result and none."""
    try:
        if build_error:
            raise JobFailed(build_error)
        result: VariantResult = ctx.executor.run(ctx.job(variant, repeat, artifact), display)
        records = [QueryRecord.from_json(r) for r in result.records or []]
        result.records = None
        if repeat == 0:  # on the executor's hardware where its jobs run elsewhere (Ray)
            elsewhere = ctx.executor if isinstance(ctx.executor, Concurrent) else None
            ctx.cold_start(variant, artifact, result, display, via=elsewhere)
        result.wall_s = round(time.perf_counter() - started, 3)
        display.finish("done")
        return result, records
    except Exception as exc:  # noqa: BLE001 - a failed variant is data, the run goes on
        display.finish("[red]failed[/red]")
        return failed(variant, repeat, str(exc)), []


def _measure_one_by_one(ctx: RunContext, progress: Progress) -> Report:
    """Variant after variant, each in one block (``--no-interleave``, find-peak, an endpoint)."""
    report = ctx.header
    for variant in ctx.order:
        display = Display(progress, variant)
        started = time.perf_counter()
        artifact, build_error = build_or_error(ctx, variant, display)
        for repeat in range(ctx.plan.analysis.repeats):
            if ctx.whole(variant, repeat):
                continue
            result, records = one_repeat(ctx, variant, repeat, artifact, build_error, display, started)
            ctx.records.extend(records)
            ctx.keep(result)
        report = ctx.assemble()
        run = report.run(variant)
        if run is not None and run.status == "ok":
            display.finish(f"done ({run.validity.verdict})")
    return report


def _measure_at_once(ctx: RunContext, progress: Progress) -> Report:
    """Every variant at once, each in a thread of this process driving its jobs (build, measure,
    cold start) on the executor, which gives each job hardware of its own (Ray: a node)."""
    from concurrent.futures import ThreadPoolExecutor

    assert isinstance(ctx.executor, Concurrent)
    lock = threading.Lock()

    def one(variant: str) -> None:
        display = Display(progress, variant)
        started = time.perf_counter()
        artifact, build_error = build_or_error(ctx, variant, display)
        for repeat in range(ctx.plan.analysis.repeats):
            if ctx.whole(variant, repeat):
                continue
            result, records = one_repeat(ctx, variant, repeat, artifact, build_error, display, started)
            with lock:
                ctx.records.extend(records)
                ctx.keep(result)
                ctx.assemble()

    with ThreadPoolExecutor(max_workers=min(len(ctx.order), ctx.executor.capacity())) as pool:
        for future in [pool.submit(one, v) for v in ctx.order]:
            future.result()
    return ctx.assemble()


def _measure_interleaved(ctx: RunContext, progress: Progress, console: Console) -> Report:
    """Every variant built, then loaded at once and measured in turns (``pipeline/interleave.py``)."""
    from variantbench.pipeline.interleave import run_interleaved

    displays = {v: Display(progress, v) for v in ctx.order}
    built: dict[str, Artifact | None] = {}
    errors: dict[str, str] = {}
    for variant in ctx.order:
        built[variant], error = build_or_error(ctx, variant, displays[variant])
        if error:
            errors[variant] = error
    report = ctx.header
    executor = ctx.executor
    assert isinstance(executor, Resident)
    for repeat in range(ctx.plan.analysis.repeats):
        jobs = {
            v: ctx.job(v, repeat, built[v]) for v in ctx.order if v not in errors and not ctx.whole(v, repeat)
        }
        if not jobs and not errors:
            continue  # a resumed run: this repeat was whole
        kept = {v: [r for r in ctx.records if r.run_id == j.load.run_id and r.variant == v]
                for v, j in jobs.items() if j.resume is not None}  # fmt: skip
        started = time.perf_counter()
        outcome = run_interleaved(executor, jobs, ctx.plan, on_event=lambda v: displays[v],
                                  say=lambda m: console.print(f"[dim]{m}[/dim]"), kept=kept)  # fmt: skip
        wall = round(time.perf_counter() - started, 3)
        for variant in ctx.order:
            if variant not in jobs and variant not in errors:
                continue
            ctx.records.extend(
                outcome.records.get(variant, [])[len(kept.get(variant, [])) :]
            )  # after the kept
            error = errors.get(variant) or outcome.failures.get(variant)
            if error:
                result = failed(variant, repeat, error)
                displays[variant].finish("[red]failed[/red]")
            else:
                result = outcome.results[variant]
                if repeat == 0:
                    ctx.cold_start(variant, built[variant], result, displays[variant])
                result.wall_s = wall
                displays[variant].finish("done")
            ctx.keep(result)
        ctx.header.execution.repeats.append(
            Rounds(repeat=repeat, rounds=outcome.rounds, looks=outcome.looks, stopped=outcome.stopped)
        )
        report = ctx.assemble()
    return report


def build_or_error(ctx: RunContext, variant: str, display: Display) -> tuple[Artifact | None, str | None]:
    vspec = ctx.specs.get(variant)
    if vspec is None:
        return None, None
    try:
        return _build(ctx.executor, ctx.base_dir, vspec, ctx.plan.model.build_seed, display), None
    except JobFailed as exc:
        return None, f"build failed: {exc}"


def _build(executor: Executor, base_dir: str, spec: VariantSpec, seed: int, display: Display) -> Artifact:
    """The variant's artifact: built by a job (its own process on the local executor) when it needs one."""
    if not spec.needs_build:
        return plain_artifact(base_dir)
    artifact: Artifact = executor.run(BuildJob(base_dir, spec, seed), display)
    return artifact


def write_outputs(
    report: Report,
    out: Path,
    records: list[QueryRecord],
    raws: list[VariantResult],
    csv: bool = False,
    html: bool = True,
) -> None:
    """report.json, report.md, report.html, report.csv and the MLPerf-style summaries: every file
    rendered from the report, the query log and the raw payloads; queries.csv too with ``csv``."""
    from variantbench.report.html import write_html
    from variantbench.report.markdown import render
    from variantbench.report.mlperf import run_summary
    from variantbench.report.tables import write_queries_csv, write_report_csv

    report.write(out / "report.json")
    write_report_csv(report, out / "report.csv")
    if csv:
        write_queries_csv(records, out / "queries.csv")
    for run in report.runs:
        if run.status == "ok":
            (out / f"mlperf_log_summary.{safe_name(run.variant)}.txt").write_text(run_summary(report, run))
    tmp = out / "report.md.tmp"
    tmp.write_text(render(report), encoding="utf-8")
    tmp.replace(out / "report.md")
    if html and report.plan.get("output", {}).get("html", True):
        write_html(report, records, raws, out / "report.html")
    if report.plan.get("output", {}).get("vllm_result"):
        from variantbench.report.vllm_result import write_vllm_results

        write_vllm_results(report, records, raws, out)


def rebuild_report(folder: Path) -> Report:
    """report.json, .md and .html recomputed from the query log and raw/ alone. A run that was killed
    or failed halfway rebuilds too: every variant with a measured query is in it (from its partial
    result, or from the log alone), and what it lacks is named (``RunReport.incomplete``)."""
    report_path, log_path, raw_dir = folder / "report.json", folder / "queries.jsonl", folder / "raw"
    for needed in (report_path, log_path):
        if not needed.exists():
            raise UserError(f"{folder} is not a complete run folder: {needed.name} is missing")
    try:
        old = Report.read(report_path)
        plan = Plan.model_validate(old.plan)
        raws = read_results(raw_dir) if raw_dir.is_dir() else []
        records = read_log(log_path)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read the run in {folder}: {str(exc).splitlines()[0]}") from None
    raws += from_log_alone(records, raws, plan)
    planned = [r.variant for r in old.runs] or list(plan.ordered_variants())
    order = [v for v in planned if any(r.variant == v for r in raws)]
    order += [v for v in dict.fromkeys(r.variant for r in raws) if v not in order]
    report = assemble(old, plan, raws, records, order=order)
    report.not_started = [v for v in plan.ordered_variants() if v not in order and not plan.served]
    write_outputs(report, folder, records, raws, csv=plan.output.csv)
    return report


def from_log_alone(records: list[QueryRecord], raws: list[VariantResult], plan: Plan) -> list[VariantResult]:
    """A result for each variant-repeat whose queries are in the log but whose result file is not
    (written by a version that saved results only at the end): its queries are its measurement."""
    known = {(r.run_id, name) for r in raws for name in (r.variant, r.name)}
    found: dict[tuple[str, str], QueryRecord] = {}
    for rec in records:
        if (rec.run_id, rec.variant) not in known:
            found.setdefault((rec.run_id, rec.variant), rec)
    out = []
    for (run_id, variant), first in found.items():
        if "@" in run_id:  # a find-peak trial: only the best one is summarized, by its result
            continue
        repeat = int(run_id.rsplit("#", 1)[1]) if "#" in run_id else 0
        out.append(VariantResult(variant=variant, repeat=repeat, status="log-only", run_id=run_id,
                                 scenario=first.scenario, is_standard=variant == plan.standard_variant,
                                 done=["scenario"], expected=list(planned_phases(plan))))  # fmt: skip
    return out


def planned_phases(plan: Plan) -> tuple[str, ...]:
    """The phases a local variant's result holds when whole, by the plan alone."""
    from variantbench.report.results import PHASES

    a, q = plan.analysis, plan.quality
    timed = plan.is_timed and not plan.served
    asked = {"load": True, "scenario": True, "batch": timed and a.batch_rounds > 0,
             "fidelity": q.fidelity and not plan.served, "likelihood": q.likelihood,
             "lm_eval": bool(q.lm_eval and q.lm_eval.tasks), "diagnosis": timed and a.diagnose,
             "cold_start": timed and a.cold_start}  # fmt: skip
    return tuple(p for p in PHASES if asked[p])


def result_name(variant: str, repeat: int) -> str:
    return f"{safe_name(variant)}.{repeat}.json"


def read_results(raw_dir: Path) -> list[VariantResult]:
    """Every result in ``raw/`` (any version, through ``migrate``)."""
    return [read_result(f) for f in sorted(raw_dir.glob("*.json"))]


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _load_file(plan: Plan, console: Console) -> Workload:
    from variantbench.workloads.files import load_workload_file

    assert plan.workload.file is not None
    return load_workload_file(
        plan.workload.file,
        skip_bad=plan.workload.skip_bad_lines,
        warn=lambda msg: console.print(f"[yellow]{msg}[/yellow]", highlight=False, soft_wrap=True),
    )


def workload_passes(plan: Plan) -> int:
    """Passes the synthetic workload is built with: one per look under ``until_decided``, so each
    look brings samples not yet answered (a quality interval narrows only on new samples: greedy
    decoding answers a repeated sample the same way); one where ``limits.min_queries`` sets a pass."""
    a = plan.analysis
    return a.looks if a.until_decided and plan.is_timed and plan.limits.min_queries is None else 1


def build_workload(plan: Plan, model_dir: str, say: Callable[[str], None], checked: Workload | None = None,
                   passes: int | None = None) -> Workload:  # fmt: skip
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
    passes = passes or workload_passes(plan)
    say(
        f"building the synthetic workload: {plan.load.tasks} samples"
        + (f" a pass, {passes} passes (one a look)" if passes > 1 else "")
        + f", {w.input_lengths} input tokens"
    )
    return build_synthetic(
        plan.load.tasks,
        plan.seeds.workload,
        mix=parse_mix(w.mix, TASKS) if w.mix else None,
        lengths=parse_lengths(w.input_lengths),
        counter=counter,
        counted_with=tokenizer_dir,
        passes=passes,
    )
