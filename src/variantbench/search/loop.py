"""``variantbench search``: which variants should exist? A multi-objective search over recipe chains.

The seeds end on "neural architecture search automates generation of efficient specialized
models": after "which of these variants?" comes "which variant should exist?". Each trial is a
recipe chain drawn from the space (``space.py``) by Optuna (NSGA-II by default; TPE or random on
request), built and briefly measured by the plan's executor exactly as ``variantbench run`` would
(the same jobs, the same assembly), and scored on the chosen objectives (``objectives.py``). Optuna
keeps the search's own log, an append-only journal file in the output folder, so a search stopped
at any point goes on from its last finished trial when run again with the same arguments.

Early stop: a trial's queries are measured in two blocks; after the first (half by default) its
interim values are compared with every finished trial's, and a trial that some finished trial
beats by a clear margin (10% by default) in every objective is stopped there, recorded as pruned
with its interim values. Optuna's pruners are single-objective, so the rule is ours. It needs a
resident executor (local processes, inline) and objectives known part-way (not ``kl``); otherwise
every trial runs whole, and the search says so.

On a concurrent executor (Ray: a node per job), trials run as many at once as the cluster has
nodes, each asked of the sampler before any of the batch is told (Optuna's ask-and-tell).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
import hashlib
import json
import math
from pathlib import Path
import threading
import time
from typing import Any
import warnings

from rich.console import Console

from variantbench.errors import UserError
from variantbench.extras import require
from variantbench.pipeline.executors import Concurrent, JobFailed, Resident
from variantbench.pipeline.interleave import pass_size
from variantbench.pipeline.run import (
    Display,
    RunContext,
    build_or_error,
    one_repeat,
    prepare,
    result_name,
    run_progress,
    safe_name,
)
from variantbench.plan import Plan
from variantbench.records import QueryRecord
from variantbench.report.results import VariantResult, failed
from variantbench.report.schema import Report, RunReport
from variantbench.search.objectives import Objective, beaten_by, dominates
from variantbench.search.space import SearchSpace
from variantbench.variants.spec import VariantSpec

STUDY = "variantbench-search"
MAX_REPEATS = 50  # draws in a row of chains tried before: the sampler has run out of the space
SAMPLERS = ("nsga2", "tpe", "random")


@dataclass(frozen=True)
class SearchSettings:
    """The search as it runs, built from the plan's ``search`` section (``from_plan``): the space
    file read and the objectives parsed; no default of its own."""

    space: SearchSpace
    objectives: list[Objective]
    budget: int  # trials in all, over every session of a resumed search
    sampler: str
    seed: int
    population: int | None  # NSGA-II's generation size (None: about a third of the budget, 4-20)
    prune_margin: float  # a trial beaten by this share in every objective stops early; 0: never
    fresh: bool  # start over even where the folder holds a search
    first_share: float = 0.5  # of a trial's queries measured before that check (a constant, not a setting)

    @classmethod
    def from_plan(cls, plan: Plan) -> SearchSettings:
        from variantbench.search.objectives import parse_objectives
        from variantbench.search.space import load_space

        s = plan.search
        if s.space is None:
            raise UserError("search needs a space: --space SPACE.yaml (search.space)")
        return cls(space=load_space(s.space), objectives=parse_objectives(s.objectives), budget=s.budget,
                   sampler=s.sampler, seed=s.seed, population=s.population, prune_margin=s.prune_margin,
                   fresh=s.fresh)  # fmt: skip


@dataclass
class Trial:
    number: int
    variant: str
    state: str  # "measured" | "pruned" | "failed" | "repeat" (a variant measured before: its values)
    values: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    front: bool = False
    seconds: float = 0.0


@dataclass
class Outcome:
    out: Path
    objectives: list[Objective]
    trials: list[Trial]
    reference: Trial | None  # the plan's standard, measured first
    report: Report
    notes: list[str]

    @property
    def front(self) -> list[Trial]:
        """The front's members: the standard first where it is on it, then the trials."""
        ref = [self.reference] if self.reference is not None and self.reference.front else []
        return ref + [t for t in self.trials if t.front]


def search_plan(plan: Plan, objectives: list[Objective]) -> Plan:
    """The plan each trial is measured under: the standard alone to start, one block of the plan's
    queries (no looks, no cold start, no diagnosis, no history), the batch rounds only for the
    batch objective and logit fidelity only for ``kl``."""
    names = {o.name for o in objectives}
    a = plan.analysis.model_copy(update={
        "repeats": 1, "until_decided": False, "cold_start": False, "diagnose": False,
        "batch_rounds": plan.analysis.batch_rounds if "batch_tokens_per_s" in names else 0,
    })  # fmt: skip
    return plan.model_copy(update={
        "variants": (plan.standard_variant,), "analysis": a,
        "limits": plan.limits.model_copy(update={"min_duration_s": 0.0}),
        "quality": plan.quality.model_copy(update={"fidelity": "kl" in names}),
        "output": plan.output.model_copy(update={"record_history": False}),
        "execution": plan.execution.model_copy(update={"interleave": False}),
    })  # fmt: skip


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _identity(plan: Plan, s: SearchSettings) -> dict[str, Any]:
    """What must match for a folder's search to be resumed."""
    measured = plan.model_dump(
        mode="json", exclude={"out", "execution", "search", "serve", "router", "monitor"}
    )
    return {"space": s.space.digest(), "objectives": [o.name for o in s.objectives], "plan": _digest(measured),
            "sampler": s.sampler, "seed": s.seed}  # fmt: skip


def _sampler(s: SearchSettings) -> Any:
    import optuna

    if s.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=s.seed)
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    population = s.population or max(4, min(20, s.budget // 3))
    return optuna.samplers.NSGAIISampler(population_size=population, seed=s.seed)


def _open_study(out: Path, s: SearchSettings, resume: bool) -> Any:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal = out / "search.journal"
    if not resume:
        journal.unlink(missing_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.create_study(study_name=STUDY, storage=storage, sampler=_sampler(s), load_if_exists=True,
                                directions=[o.direction for o in s.objectives])  # fmt: skip
    with warnings.catch_warnings():  # "experimental" since Optuna 3.2, and still the way to name them
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([o.name for o in s.objectives])
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # a trial the last session was measuring when it stopped: failed (said so), its budget spent
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    return study


def run_search(plan: Plan, console: Console) -> Outcome:
    """Run (or resume) the plan's search; the folder keeps every trial as it finishes."""
    require("search", "variantbench search")
    s = SearchSettings.from_plan(plan)
    if plan.served:
        raise UserError(
            "search builds variants of a local model: served variants (endpoints) cannot be searched"
        )
    if s.budget < 1:
        raise UserError("--budget must be at least 1 trial")
    if s.sampler not in SAMPLERS:
        raise UserError(f"--sampler {s.sampler!r}: one of {', '.join(SAMPLERS)}")
    user_plan, plan = plan, search_plan(plan, s.objectives)
    out = plan.out
    identity = _identity(plan, s)
    meta_path = out / "search.json"
    resume = False
    if not s.fresh and (out / "search.journal").exists() and meta_path.exists():
        try:
            before = json.loads(meta_path.read_text(encoding="utf-8")).get("identity")
        except (OSError, ValueError):
            before = None
        if before != identity:
            changed = [k for k in identity if (before or {}).get(k) != identity[k]]
            raise UserError(
                f"{out} holds a search with another {', '.join(changed) or 'setup'}: --fresh starts it over, "
                "or choose another --out"
            )
        resume = True
    ctx = prepare(plan, console, keep=resume)
    study = _open_study(out, s, resume)
    off = _early_stop_off(ctx, s)
    searcher = _Searcher(
        ctx, s, study, identity, console, [off] if off else [], user_plan, staged=off is None
    )
    return searcher.run(resume)


def _early_stop_off(ctx: RunContext, s: SearchSettings) -> str | None:
    """Why a trial cannot stop early here (None: it can)."""
    late = [o.name for o in s.objectives if not o.interim]
    if not s.prune_margin:
        return "early stop off (--prune-margin 0): every trial measured whole"
    if late:
        return f"early stop off: {', '.join(late)} is known only at a trial's end"
    if not isinstance(ctx.executor, Resident) or isinstance(ctx.executor, Concurrent):
        return "early stop off: the executor runs each trial as one job (it keeps no session between blocks)"
    return None


class _Searcher:
    def __init__(self, ctx: RunContext, s: SearchSettings, study: Any, identity: dict[str, Any], console: Console,
                 notes: list[str], user_plan: Plan, staged: bool) -> None:  # fmt: skip
        self.ctx, self.s, self.study, self.identity, self.console, self.notes = (
            ctx,
            s,
            study,
            identity,
            console,
            notes,
        )
        self.user_plan = user_plan
        self.lock = threading.Lock()
        self.inflight: dict[str, threading.Event] = {}  # chains being measured now (trials at once)
        self.staged = staged  # two blocks and the early stop between them
        self.report: Report = ctx.header
        self.standard = ctx.header.standard or ctx.plan.standard_variant

    # ---- the loop -------------------------------------------------------------------------------

    def run(self, resume: bool) -> Outcome:
        """Trials until ``budget`` chains have been tried (built and measured, stopped early or
        failed). A chain drawn again costs nothing and does not count: the sampler is told its
        first trial's outcome. A sampler that draws nothing new ``MAX_REPEATS`` times in a row has
        run out of the space, and the search ends there."""
        import optuna

        ctx = self.ctx
        done = [t for t in self.study.get_trials(deepcopy=False)
                if t.state.is_finished() and t.user_attrs.get("state") != "repeat"]  # fmt: skip
        left = self.s.budget - len(done)
        for raw in ctx.raws:  # trials measured by earlier sessions stay in the report
            if raw.variant not in ctx.order:
                ctx.order.append(raw.variant)
        if resume:
            self.console.print(f"[dim]resuming the search in {ctx.plan.out}: {len(done)} trial(s) finished, "
                               f"{max(left, 0)} to go[/dim]")  # fmt: skip
        for note in self.notes:
            self.console.print(f"[dim]{note}[/dim]")
        at_once = ctx.executor.capacity() if isinstance(ctx.executor, Concurrent) else 1
        repeats = 0
        with run_progress(self.console) as progress:
            if not any(r.variant == self.standard for r in ctx.raws):
                self._measure_whole(self.standard, progress)  # the reference every quality ratio needs
            self.report = ctx.assemble()
            while left > 0 and repeats < MAX_REPEATS:
                batch = [self.study.ask() for _ in range(min(left, max(1, at_once)))]
                if len(batch) == 1:
                    new = [self._trial(batch[0], progress)]
                else:
                    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                        new = [f.result() for f in [pool.submit(self._trial, t, progress) for t in batch]]
                left -= sum(new)
                repeats = 0 if any(new) else repeats + len(new)
                self._write()
        if repeats >= MAX_REPEATS:
            self.notes.append(f"stopped after {MAX_REPEATS} draws in a row of chains tried before: the sampler "
                              "has run out of the space (a larger space, or another --sampler, goes further)")  # fmt: skip
            self.console.print(f"[yellow]{self.notes[-1]}[/yellow]")
        self._write()
        states = {t.state for t in self.study.get_trials(deepcopy=False)}
        assert optuna.trial.TrialState.RUNNING not in states
        return self._outcome()

    def _trial(self, trial: Any, progress: Any) -> bool:
        """One drawn trial, told to the study; False where its chain was tried before (no new run)."""
        import optuna

        started = time.perf_counter()
        try:
            name = self.s.space.suggest(trial)
        except UserError as exc:
            trial.set_user_attr("note", str(exc))
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return True
        trial.set_user_attr("variant", name)
        with self.lock:
            running = self.inflight.get(name)
            if running is None:
                self.inflight[name] = threading.Event()
        if running is not None:  # the same chain drawn twice in one batch: wait for the first
            running.wait()
        with self.lock:
            earlier = self._earlier(name)
        if earlier is not None or name == self.standard:  # tried before: its outcome again, no new run
            trial.set_user_attr("state", "repeat")
            if earlier is None:  # the standard, measured first as the reference
                trial.set_user_attr("note", "the standard (measured first)")
                values = self._read(self.report.run(self.standard)) if self.report.run(self.standard) else {}
                if len(values) == len(self.s.objectives):
                    self.study.tell(trial, [values[o.name] for o in self.s.objectives])
                else:
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                trial.set_user_attr("note", f"as trial {earlier.number}")
                if earlier.state == optuna.trial.TrialState.COMPLETE:
                    self.study.tell(trial, list(earlier.values))
                else:
                    self.study.tell(trial, state=earlier.state)
            if running is None:
                self.inflight.pop(name).set()
            return False
        try:
            state, values, note = self._measure(name, progress)
            trial.set_user_attr("state", state)
            trial.set_user_attr("seconds", round(time.perf_counter() - started, 1))
            if note:
                trial.set_user_attr("note", note)
            if values is not None:
                trial.set_user_attr("values", values)
            if state == "measured" and values is not None:
                self.study.tell(trial, [values[o.name] for o in self.s.objectives])
            elif state == "pruned":
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        finally:
            with self.lock:
                self.inflight.pop(name).set()
        return True

    def _earlier(self, name: str) -> Any:
        """The first finished trial of the same chain (measured, stopped early or failed), if any."""
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("variant") == name and t.state.is_finished() and "state" in t.user_attrs:
                return t
        return None

    # ---- one trial's measurement ----------------------------------------------------------------

    def _measure(self, name: str, progress: Any) -> tuple[str, dict[str, float] | None, str]:
        """("measured" | "pruned" | "failed", objective values, a note)."""
        ctx = self.ctx
        try:
            spec = VariantSpec.parse(name)
        except UserError as exc:
            return "failed", None, str(exc)
        with self.lock:
            ctx.specs[name] = spec
            if name not in ctx.order:
                ctx.order.append(name)
        if self.staged:
            return self._measure_staged(name, progress)
        return self._measure_whole(name, progress)

    def _measure_whole(self, name: str, progress: Any) -> tuple[str, dict[str, float] | None, str]:
        display = Display(progress, name)
        artifact, error = build_or_error(self.ctx, name, display)
        result, records = one_repeat(self.ctx, name, 0, artifact, error, display, time.perf_counter())
        return self._kept(name, result, records, display)

    def _measure_staged(self, name: str, progress: Any) -> tuple[str, dict[str, float] | None, str]:
        from variantbench.pipeline.assemble import summarize_payload

        ctx = self.ctx
        display = Display(progress, name)
        artifact, error = build_or_error(ctx, name, display)
        if error is not None:
            return self._kept(name, failed(name, 0, error), [], display)
        job = ctx.job(name, 0, artifact)
        total = pass_size(job.load)
        first = max(1, min(total - 1, math.ceil(total * self.s.first_share))) if total > 1 else total
        blocks = [(0, first), (first, total - first)] if total > first else [(0, total)]
        records: list[QueryRecord] = []
        assert isinstance(ctx.executor, Resident)
        try:
            session = ctx.executor.open(job, display)
        except JobFailed as exc:
            return self._kept(name, failed(name, 0, str(exc)), [], display)
        try:
            for index, (start, n) in enumerate(blocks):
                settings = replace(job.load, first_query=start, min_queries=n, max_queries=n, min_duration_s=0.0,
                                   max_duration_s=None, block=index)  # fmt: skip
                got = session.call("block", settings, on_event=display)
                records += [QueryRecord.from_json(r) for r in got]
                if index == 0 and len(blocks) > 1:
                    interim = session.call("interim", on_event=display)
                    with self.lock:
                        run = summarize_payload(
                            interim, records, ctx.plan, self._standard_run(), ctx.header.ceilings
                        )
                        beaten_by = self._clearly_beaten(run)
                    if beaten_by is not None:
                        values = self._read(run)
                        display.finish(f"pruned after {n} of {total} queries (beaten by {beaten_by})")
                        self._keep_pruned(name, interim, records)
                        return (
                            "pruned",
                            values,
                            f"after {n} of {total} queries, clearly beaten by {beaten_by}",
                        )
            for _ in range(job.batch_rounds):
                from variantbench.pipeline.measure import BATCH_NEW, BATCH_SIZE

                session.call("batch_rate", BATCH_SIZE, BATCH_NEW, on_event=display)
            result = session.call("finish", on_event=display)
        except JobFailed as exc:
            result = failed(name, 0, str(exc))
            records = []
        finally:
            session.close()
        return self._kept(name, result, records, display)

    def _kept(self, name: str, result: VariantResult, records: list[QueryRecord], display: Display
              ) -> tuple[str, dict[str, float] | None, str]:  # fmt: skip
        """The trial's result in the run folder (raw/, the log, report.*) and its objective values."""
        ctx = self.ctx
        with self.lock:
            ctx.records.extend(records)
            ctx.keep(result)
            self.report = ctx.assemble()
            run = self.report.run(name)
        if result.status == "failed" or run is None or run.status != "ok":
            display.finish("[red]failed[/red]")
            return "failed", None, str(result.error or (run.error if run else "no result"))
        values = self._read(run)
        missing = [o.name for o in self.s.objectives if values.get(o.name) is None]
        if missing:
            display.finish("[yellow]measured, not scored[/yellow]")
            return (
                "failed",
                None,
                f"no {', '.join(missing)} in its report (scored samples? a quality reference?)",
            )
        display.finish("done")
        return "measured", values, ""

    def _keep_pruned(self, name: str, interim: VariantResult, records: list[QueryRecord]) -> None:
        """A pruned trial's interim result, apart from the report's runs (its queries are in the log):
        moved from raw/, where its session saved it as it went, to pruned/."""
        folder = self.ctx.plan.out / "pruned"
        folder.mkdir(exist_ok=True)
        (self.ctx.raw_dir / result_name(name, 0)).unlink(missing_ok=True)
        interim.status = "partial"
        interim.write(folder / f"{safe_name(name)}.json")

    def _standard_run(self) -> tuple[RunReport, list[QueryRecord]] | None:
        run = self.report.run(self.standard)
        if run is None or run.status != "ok":
            return None
        return run, [r for r in self.ctx.records if r.variant == self.standard]

    def _read(self, run: RunReport) -> dict[str, float]:
        return {o.name: v for o in self.s.objectives if (v := o.value(run)) is not None}

    def _clearly_beaten(self, run: RunReport) -> str | None:
        """The finished trial (or the standard) that beats ``run`` by the margin in every objective."""
        others = {r.variant: self._read(r) for r in self.report.runs if r.status == "ok"}
        return beaten_by(self._read(run), others, self.s.objectives, self.s.prune_margin)

    # ---- what the folder keeps ------------------------------------------------------------------

    def _outcome(self) -> Outcome:
        import optuna

        trials = []
        for t in self.study.get_trials(deepcopy=False):
            values = t.user_attrs.get("values") or {}
            if t.state == optuna.trial.TrialState.COMPLETE:
                values = dict(zip((o.name for o in self.s.objectives), t.values, strict=True))
            state = t.user_attrs.get("state") or ("failed" if t.state.is_finished() else "running")
            note = t.user_attrs.get("note", "")
            if t.state == optuna.trial.TrialState.FAIL and "state" not in t.user_attrs and not note:
                note = "interrupted: the search stopped during this trial"
            trials.append(Trial(number=t.number, variant=t.user_attrs.get("variant", "-"), state=state, values=values,
                                params=dict(t.params), note=note,
                                seconds=float(t.user_attrs.get("seconds") or 0.0)))  # fmt: skip
        std_run = self.report.run(self.standard)
        reference = None
        if std_run is not None and std_run.status == "ok":
            reference = Trial(number=-1, variant=self.standard, state="reference", values=self._read(std_run))
        self._mark_front(trials, reference)
        return Outcome(out=self.ctx.plan.out, objectives=self.s.objectives, trials=trials, reference=reference,
                       report=self.report, notes=self.notes)  # fmt: skip

    def _mark_front(self, trials: list[Trial], reference: Trial | None) -> None:
        """Optuna's Pareto front (``best_trials``) less the chains drawn again and any trial the
        standard itself dominates (a variant worse than not changing the model in every objective is
        not worth deploying); the standard is on the front where no front trial dominates it."""
        names = [o.name for o in self.s.objectives]
        best = {t.number for t in self.study.best_trials}
        ref = (
            [reference.values[n] for n in names]
            if reference and len(reference.values) == len(names)
            else None
        )
        for t in trials:
            t.front = t.number in best and t.state == "measured"
            if t.front and ref is not None:
                t.front = not dominates(ref, [t.values[n] for n in names], self.s.objectives)
        if ref is not None and reference is not None:
            reference.front = not any(dominates([t.values[n] for n in names], ref, self.s.objectives)
                                      for t in trials if t.front)  # fmt: skip

    def _write(self) -> None:
        """search.json, front.yaml and search.html: after every batch of trials, so a stop loses none."""
        from variantbench.search.page import write_search_page

        outcome = self._outcome()
        out = self.ctx.plan.out
        data = {
            "identity": self.identity,
            "objectives": [
                {"name": o.name, "direction": o.direction, "label": o.label} for o in self.s.objectives
            ],
            "space": self.s.space.model_dump(mode="json"),
            "budget": self.s.budget,
            "notes": self.notes,
            "reference": None if outcome.reference is None else outcome.reference.__dict__,
            "trials": [t.__dict__ for t in outcome.trials],
            "front": [t.variant for t in outcome.front],
        }
        tmp = out / "search.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
        tmp.replace(out / "search.json")
        front_plan = front_yaml(outcome, self.user_plan)
        (out / "front.yaml").write_text(front_plan, encoding="utf-8")
        write_search_page(outcome, out / "search.html", front_plan)


def front_yaml(outcome: Outcome, plan: Plan) -> str:
    """The front as a plan: the search's own (model, workload, load) with the standard and the front
    as its variants, to compare them properly (interleaved, until decided) with ``variantbench run``."""
    from variantbench.plan_file import dump_plan

    names = list(dict.fromkeys(t.variant for t in outcome.front))
    std = plan.standard_variant
    lines = ["# The Pareto front of the search in this folder, as a plan: compare them properly with",
             f"#   variantbench run {outcome.out / 'front.yaml'}",
             f"# objectives: {', '.join(f'{o.name} ({o.direction})' for o in outcome.objectives)}"]  # fmt: skip
    for t in outcome.front:
        shown = ", ".join(f"{o.name} {o.shown(t.values.get(o.name))}" for o in outcome.objectives)
        lines.append(f"#   {t.variant}: {shown}")
    variants = [std, *(n for n in names if n != std)]
    front_plan = plan.model_copy(update={"variants": tuple(variants), "out": outcome.out / "front-run"})
    return "\n".join(lines) + "\n" + dump_plan(front_plan)
