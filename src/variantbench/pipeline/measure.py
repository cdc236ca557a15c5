"""Inside a measure job: load one built variant, warm it up, run the scenario; raw results only.

No statistics here: the job returns the query records and what the trackers saw, and the
assembly (``assemble.py``) computes every summary, in the run and again in ``variantbench report``.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
import resource
import statistics
import time
from typing import TYPE_CHECKING, Any

from variantbench.backends.base import (
    EvaluationModel,
    GenerationRequest,
    LogProbs,
    ReportsStatus,
    ScoresLikelihood,
    ScoresServed,
    ServedAt,
)
from variantbench.errors import ScoringUnavailable
from variantbench.faults import fault_point
from variantbench.loadgen.harness import LoadSettings, RunLog, run_scenario
from variantbench.records import QueryLog
from variantbench.redact import redact_url
from variantbench.report.results import (
    BatchDecode,
    BuildFacts,
    Fidelity,
    LoadFacts,
    ServerScrape,
    VariantResult,
)
from variantbench.report.schema import (
    Diagnosis,
    Likelihood,
    LmEvalReport,
    PeakTrial,
    Resources,
    SampleLikelihood,
)
from variantbench.report.summary import summarize_run

if TYPE_CHECKING:
    from variantbench.pipeline.jobs import Emit, MeasureJob


# The batching throughput: decode at batch 8, 16 new tokens, measured ``analysis.batch_rounds`` times
# per variant (in turns with the other variants when the run is interleaved). On the 2-core AVX2
# host one such measurement of the default model takes 0.6 s (int8) to 4 s (bf16, no bf16
# instructions), and three (the default) give a t-interval for the batch profile.
BATCH_SIZE = 8
BATCH_NEW = 16


def measure_variant(job: MeasureJob, emit: Emit) -> VariantResult:
    """The whole run of one variant at once (not interleaved): load, run the scenario, finish. Each
    phase's part is saved as it ends (``job.result_path``), as an interleaved run saves it at each look."""
    session = VariantSession(job, emit)
    records: list[dict[str, Any]] = []
    try:
        if "scenario" not in session.state.done:  # a resumed variant whose queries all ran: the rest only
            records = session.peak(emit) if job.find_peak else session.block(job.load, emit)
            session.checkpoint(True, emit)
        for _ in range(job.batch_rounds - session.batch_done()):
            session.batch_rate(BATCH_SIZE, BATCH_NEW, emit)
    except BaseException:
        session.close()
        raise
    result = session.finish(emit)
    result.records = records
    return result


def prompt_request(sample: Any) -> GenerationRequest:
    """A sample as the harness sends it (its chat messages, else its prompt), for one token."""
    return GenerationRequest(request_id=sample.sample_id, prompt=None if sample.messages else sample.prompt,
                             messages=sample.messages, max_new_tokens=1)  # fmt: skip


class VariantSession:
    """One loaded variant that runs blocks of a scenario on demand, then its fidelity and diagnosis.

    Interleaved execution keeps one session per variant, each in its own process, and hands them
    blocks in turn (``pipeline/interleave.py``); a plain run is one session with one block. Resources
    are tracked during blocks only, so a variant waiting while the others run is not charged the
    idle time (its CPU utilization and energy are those of its own blocks).

    ``state`` is the variant's result as it grows; it is saved to ``job.result_path`` once the
    variant has loaded, at each ``checkpoint`` (an interleaved look) and after each later phase, so
    a run killed halfway keeps what finished. A resumed job (``job.resume``: what a killed run saved)
    starts from that state and runs only what is missing.
    """

    def __init__(self, job: MeasureJob, emit: Emit) -> None:
        self.job = job
        self.backend = job.backend()
        if isinstance(self.backend, ReportsStatus):
            self.backend.status = lambda msg: emit(("status", msg))
        emit(("status", f"loading {job.variant}"))
        try:
            self.load = self.backend.load()
        except BaseException:
            self.backend.close()
            raise
        self.load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.usage: list[Any] = []  # one ResourceResult per block
        self.result: RunLog | None = None
        self.warmed = False
        self.closed = False
        self.server_samples: list[list[Any]] = []  # a served variant's /metrics over its blocks
        self.server_error: str | None = None
        self.server_histograms: dict[str, dict[str, float]] = {}  # latency buckets added in the blocks
        self.likelihood_unavailable: str | None = None  # a server that cannot score: why
        old = job.resume
        build = job.artifact
        self.state = VariantResult(
            variant=job.variant, repeat=job.repeat, status="partial", expected=list(job.phases()),
            is_standard=job.is_standard, scenario=job.load.scenario, name=self.backend.name,
            load=LoadFacts(**asdict(self.load)),
            build=None if build is None else BuildFacts(built_now=build.built_now, build_wall_s=build.build_wall_s),
        )  # fmt: skip
        if old is not None:  # what the killed run finished stays; its load is this one's
            keep = {k: getattr(old, k) for k in RESUMED}
            self.state = self.state.model_copy(update={**keep, "done": [p for p in old.done if p != "load"]})
        self.likelihood_rows: list[dict[str, Any]] = [
            r.model_dump(exclude_none=True) for r in (old.likelihood.per_sample if old and old.likelihood else [])
        ]  # fmt: skip
        self.batch_rates: list[float] = (
            list(old.batch_decode.tokens_per_s) if old and old.batch_decode else []
        )
        # sample ids the blocks asked, in order (no repeats): a resumed job's earlier blocks' first
        self.answered: list[str] = list(job.answered)
        # where the variant's time went (s): what a user reads when a run takes longer than expected
        self.phases: dict[str, float] = {"scenario": 0.0, "batch": 0.0, **(old.phases_s if old else {})}
        self.phases["load"] = round(self.load.startup_s, 3)
        self.state.mark("load")
        self._save()

    def _tracker(self) -> Any:
        from variantbench.trackers.resources import ResourceTracker

        d = self.job.device
        gpu = int(d.split(":")[1]) if d.startswith("cuda:") else (0 if d == "cuda" else None)
        return ResourceTracker(watts_per_core=self.job.watts_per_core, gpu_index=gpu)

    def block(self, settings: LoadSettings, emit: Emit) -> list[dict[str, Any]]:
        """Run one block (or the whole run) of the scenario; its records, also appended to the log."""
        scraper: Any

        def progress(phase: str, done: int, total: int) -> None:
            if phase == "warmup" and done == total and scraper is not None:
                scraper.mark()  # the server's histograms leave the warm-up out, as the records do
            emit(("progress", phase, done, total))

        if self.warmed:  # the warm-up happens once, in the session's first block
            settings = replace(settings, warmup=0)
        self.warmed = True
        tracker = self._tracker()
        with QueryLog(self.job.log_path) as log, tracker, self._scraper() as scraper:
            self.result = run_scenario(self.backend, self.job.workload, settings, log, progress=progress)
        if scraper is not None:
            from variantbench.trackers.server_metrics import add_deltas

            self.server_samples += scraper.samples
            add_deltas(self.server_histograms, scraper.histograms)
            self.server_error = self.server_error or scraper.error
        self.answered = list(dict.fromkeys([*self.answered, *(r.sample_id for r in self.result.records)]))
        self.usage.append(tracker.result)
        self.phases["scenario"] += tracker.result.wall_s
        return [r.to_json() for r in self.result.records]

    def _scraper(self) -> Any:
        """A served variant's /metrics scraped while its queries run (``None`` for a local one)."""
        from contextlib import nullcontext

        from variantbench.trackers.server_metrics import ServerScraper

        e = self.job.endpoint
        if e is None or not self.job.scrape_s:
            return nullcontext()
        headers = {**dict(e.headers), **({"Authorization": f"Bearer {e.api_key}"} if e.api_key else {})}
        return ServerScraper(e.url, self.job.scrape_s, headers)

    def peak(self, emit: Emit) -> list[dict[str, Any]]:
        tracker = self._tracker()
        with QueryLog(self.job.log_path) as log, tracker:
            self.result, trials = find_peak(self.job, self.backend, log,
                                            lambda *a: emit(("progress", *a)), emit)  # fmt: skip
        self.state.peak_search = trials
        self.usage.append(tracker.result)
        return [r.to_json() for r in self.result.records]

    def checkpoint(self, scenario_done: bool, emit: Emit) -> None:
        """The queries so far saved as the variant's partial result (an interleaved look; the end of
        a plain run's scenario)."""
        if scenario_done:
            self.state.mark("scenario")
        self._save()

    def batch_done(self) -> int:
        """Batch-throughput measurements already made (a resumed job's included)."""
        return len(self.batch_rates)

    def batch_rate(self, size: int, new: int, emit: Emit) -> float:
        """Decode tokens/s with ``size`` requests at once: the batching throughput the batch profile
        ranks by (single-stream says nothing about it). One measurement; the caller repeats it."""
        from variantbench.analysis.diagnosis import decode_rate

        emit(("status", f"batch-{size} decode"))
        start = time.perf_counter()
        rate = decode_rate(self.backend, size, new)
        self.phases["batch"] += time.perf_counter() - start
        self.batch_rates.append(round(rate, 3))
        if len(self.batch_rates) >= self.job.batch_rounds:
            self.state.mark("batch")
        self._save()
        return rate

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.close()

    def finish(self, emit: Emit) -> VariantResult:
        """Fidelity, likelihood, lm-eval and diagnosis (each saved as it ends; a resumed job's done
        ones skipped), then the backend closed; the result (records not included)."""
        job, backend, load, state = self.job, self.backend, self.load, self.state
        try:
            if job.fidelity is not None and isinstance(backend, LogProbs) and "fidelity" not in state.done:
                from variantbench.metrics.fidelity import measure

                emit(("status", "logit fidelity"))
                fault_point("fidelity")
                start = time.perf_counter()
                state.fidelity = Fidelity.model_validate(measure(backend, job.fidelity, job.is_standard))
                self.phases["fidelity"] = time.perf_counter() - start
                self._done("fidelity")
            self.likelihood(None, emit)
            if job.likelihood is not None:
                self._done("likelihood")
            if job.lm_eval is not None and "lm_eval" not in state.done:
                state.lm_eval = self._lm_eval(emit)
                self._done("lm_eval")
            if job.diagnose and job.endpoint is None and "diagnosis" not in state.done:
                from variantbench.analysis.diagnosis import diagnose_backend

                emit(("status", "diagnosis: profile and batch efficiency"))
                fault_point("diagnosis")
                start = time.perf_counter()
                try:
                    diagnosis = diagnose_backend(
                        backend,
                        load.details.get("streamed_bytes") or load.param_bytes,  # read per token
                        load.details.get("parameters"),
                        job.counters,
                        known={BATCH_SIZE: statistics.median(self.batch_rates)} if self.batch_rates else None,
                    )
                except Exception as exc:  # noqa: BLE001 - a failed diagnosis must not lose the run
                    diagnosis = {"summary": f"diagnosis failed: {type(exc).__name__}: {exc}".splitlines()[0]}
                state.diagnosis = Diagnosis(
                    **{k: v for k, v in diagnosis.items() if k in Diagnosis.model_fields}
                )
                self.phases["diagnosis"] = time.perf_counter() - start
                self._done("diagnosis")
        finally:
            self.close()
        return self.snapshot()

    def _lm_eval(self, emit: Emit) -> LmEvalReport | None:
        job, backend = self.job, self.backend
        if isinstance(backend, EvaluationModel):
            from variantbench.metrics.lm_eval import evaluate

            emit(("status", f"lm-evaluation-harness: {', '.join(job.lm_eval.tasks)}"))
            start = time.perf_counter()
            model, tokenizer = backend.evaluation_model()
            got = evaluate(model, tokenizer, job.lm_eval, device=job.device)
            del model
        elif isinstance(backend, ServedAt):
            from variantbench.metrics.lm_eval import evaluate_served

            emit(("status", f"lm-evaluation-harness on the server: {', '.join(job.lm_eval.tasks)}"))
            start = time.perf_counter()
            url, model_name, headers = backend.address()
            got = evaluate_served(url, model_name or "", job.lm_eval, headers=headers)
        else:
            return None
        self.phases["lm_eval"] = time.perf_counter() - start
        return LmEvalReport(**got)

    def _done(self, phase: str) -> None:
        self.state.mark(phase)
        self._save()

    def _save(self) -> None:
        if self.job.result_path:
            self.snapshot().write(Path(self.job.result_path))

    def likelihood(self, sample_ids: list[str] | None, emit: Emit) -> list[dict[str, Any]]:
        """Likelihood scores of the given samples (None: every sample the blocks asked) not scored yet;
        kept for the payload and returned. An interleaved run calls it at each look, the standard
        first (its distributions are what the others' KL reads), so quality joins the looks. A served
        variant's come from its server, or are not available with the server's reason (kept once)."""
        job, backend = self.job, self.backend
        served = isinstance(backend, ScoresServed)
        if (
            job.likelihood is None
            or self.likelihood_unavailable
            or not (served or isinstance(backend, ScoresLikelihood))
        ):
            return []
        from variantbench.metrics import likelihood as lk

        done = {row["sample_id"] for row in self.likelihood_rows}
        wanted = [i for i in (self.answered if sample_ids is None else sample_ids) if i not in done]
        by_id = {s.sample_id: s for s in job.workload.samples}
        samples = [by_id[i] for i in wanted if i in by_id]
        if not samples:
            return []
        emit(("status", f"likelihood scores on {len(samples)} of the workload's samples"))
        start = time.perf_counter()
        if served:
            try:
                got = lk.measure_served(backend, samples, prompt_request)
            except ScoringUnavailable as exc:
                self.likelihood_unavailable = str(exc)
                emit(("status", f"likelihood scores not available: {exc}"))
                got = []
        else:
            got = lk.measure(backend, samples, job.likelihood, job.is_standard,
                             prompt_of=lambda s: list(backend.encode(prompt_request(s))))["samples"]  # fmt: skip
        self.phases["likelihood"] = self.phases.get("likelihood", 0.0) + time.perf_counter() - start
        self.likelihood_rows += got
        return got

    def interim(self, emit: Emit) -> VariantResult:
        """The result of the blocks so far, the variant kept loaded (no fidelity, no diagnosis):
        what a search reads to stop a clearly dominated trial before the rest of its queries."""
        return self.snapshot().model_copy(update={"interim": True})

    def snapshot(self) -> VariantResult:
        """The result as it stands: the blocks' facts, resources and scores so far (a copy)."""
        from variantbench.metrics.likelihood import summarize
        from variantbench.trackers.resources import merge_results, sample_row

        job, load, state, result = self.job, self.load, self.state, self.result
        build = job.artifact
        if result is not None:
            state.run_id = str(result.settings.get("run_id", job.load.run_id))
            state.target_qps, state.seeds, state.senders = result.target_qps, result.seeds, result.senders
        elif state.run_id is None:
            state.run_id = job.load.run_id  # loaded, nothing asked yet
        if self.usage:
            res = merge_results(self.usage)
            old_rows = job.resume.resource_samples if job.resume is not None else []
            state.resource_samples = [*old_rows, *(sample_row(x) for x in res.samples)]
            state.resources = Resources(
                startup_s=load.startup_s, startup_warm_s=load.startup_s, param_bytes=load.param_bytes,
                load_peak_rss_bytes=self.load_peak, peak_rss_bytes=res.peak_rss_bytes,
                mean_rss_bytes=res.mean_rss_bytes, mean_cpu_util=res.mean_cpu_util, cpu_s=res.cpu_s,
                wall_s=res.wall_s, cores=res.cores, energy_j=res.energy_j, energy_source=res.energy_source,
                watts_per_core=res.watts_per_core, gpu=res.gpu, disk_bytes=_disk_bytes(build),
                build_s=build.build_s if build is not None else None,
                startup_cold_s=state.resources.startup_cold_s, startup_cold_note=state.resources.startup_cold_note,
            )  # fmt: skip
            if job.endpoint is not None:  # the server's memory, CPU and energy are not visible here
                state.resources = state.resources.model_copy(update=SERVED_RESOURCES)
        elif job.resume is None:
            state.resources = Resources(startup_s=load.startup_s, startup_warm_s=load.startup_s,
                                        param_bytes=load.param_bytes, load_peak_rss_bytes=self.load_peak)  # fmt: skip
        if job.endpoint is not None and job.scrape_s:
            state.server_metrics = ServerScrape(url=redact_url(job.endpoint.url), interval_s=job.scrape_s,
                                                samples=self.server_samples, error=self.server_error,
                                                latency_histograms=self.server_histograms)  # fmt: skip
        state.phases_s = {k: round(v, 3) for k, v in self.phases.items()}
        if self.batch_rates:
            state.batch_decode = BatchDecode(
                size=BATCH_SIZE, new_tokens=BATCH_NEW, tokens_per_s=self.batch_rates
            )
        if self.likelihood_rows or self.likelihood_unavailable:
            state.likelihood = Likelihood(**summarize(self.likelihood_rows), unavailable=self.likelihood_unavailable,
                                          per_sample=[SampleLikelihood(**r) for r in self.likelihood_rows])  # fmt: skip
        return state.model_copy(deep=True)


# what a resumed job takes over from the result its killed run saved (its load is measured again)
RESUMED = ("run_id", "target_qps", "seeds", "senders", "resources", "resource_samples", "peak_search",
           "fidelity", "lm_eval", "diagnosis", "server_metrics")  # fmt: skip


# a served variant's memory, CPU and energy are the server's: this process only sends and reads
SERVED_RESOURCES: dict[str, Any] = {
    "load_peak_rss_bytes": None, "peak_rss_bytes": None, "mean_rss_bytes": None, "mean_cpu_util": None,
    "cpu_s": None, "energy_j": None, "energy_source": "n/a (served: the server's resources are not visible)",
    "watts_per_core": None, "param_bytes": None,
}  # fmt: skip


def _disk_bytes(artifact: Any) -> int | None:
    """Bytes on disk of what the variant loads beyond the base folder (built folder or export)."""
    from variantbench.paths import bytes_under

    if artifact is None:
        return None
    if artifact.manifest and artifact.manifest.get("bytes_on_disk") and not artifact.engine_path:
        return int(artifact.manifest["bytes_on_disk"])
    if artifact.engine_path:
        return bytes_under(Path(artifact.engine_path))
    return None


def find_peak(job: MeasureJob, backend: Any, log: QueryLog, progress: Any, emit: Emit
              ) -> tuple[RunLog, list[PeakTrial]]:  # fmt: skip
    """Raise the server rate until the latency target fails, then bisect; keep the best passing run.

    A rate passes when every configured target passes (early stopping included) with no errors.
    Doubling from the plan's rate up (halving down if it fails at once), then bisection until the
    bracket is within 10%, at most 10 trials. Each trial's records carry the run id ``RID@RATEqps``.
    """
    lo: float | None = None
    hi: float | None = None
    rate = float(job.load.rate_qps or 1.0)
    best = last = None
    trials: list[PeakTrial] = []
    for _ in range(10):
        emit(("status", f"peak search at {rate:.3g} queries/s"))
        settings = replace(job.load, rate_qps=rate, run_id=f"{job.load.run_id}@{rate:.4g}qps")
        result = run_scenario(backend, job.workload, settings, log, progress=progress)
        summary = summarize_run(job.variant, result.records, Resources(), scenario="server",
                                criteria=replace(job.criteria, target_qps=rate))  # fmt: skip
        checks = summary.validity.checks
        passed = (
            bool(checks) and all(c.result == "PASS" for c in checks.values()) and not summary.queries.errors
        )
        trials.append(PeakTrial(rate_qps=rate, passed=passed, latency_p99_ms=summary.latency_ms.p99,
                                achieved_qps=summary.achieved_qps, reasons=summary.validity.reasons,
                                run_id=settings.run_id))  # fmt: skip
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
    assert last is not None
    return (best or last), trials
