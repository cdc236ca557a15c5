"""The jobs a run is made of: build a variant, measure it, time its cold start.

A job is plain, picklable data with an ``id`` and a ``run(emit)`` that returns a picklable, typed
result (a build its ``Artifact``, a measurement its ``VariantResult``, a cold start ``ColdStart``):
an executor may run it in this process, in a spawned process (``executors.py``), or on another
machine, and the pipeline merges results by id. No job reads global state: everything it needs
is in its fields (the variant as a parsed ``VariantSpec``, never its name to parse again).

``emit`` receives progress events: ``("status", text)`` and ``("progress", phase, done, total)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from variantbench.faults import fault_point
from variantbench.loadgen.harness import LoadSettings
from variantbench.plan import default_of
from variantbench.report.results import PHASES, VariantResult
from variantbench.report.summary import Criteria
from variantbench.variants.spec import Artifact, VariantSpec
from variantbench.workloads.base import Workload

Emit = Callable[[tuple[Any, ...]], None]


@dataclass(frozen=True)
class BuildJob:
    """Everything the variant needs on disk, built (or found in the cache) before it is measured."""

    base_dir: str
    spec: VariantSpec
    seed: int = 0

    @property
    def id(self) -> str:
        return f"build:{self.spec.name}"

    def run(self, emit: Emit) -> Artifact:
        from variantbench.variants.spec import build_variant

        emit(("status", "building" if self.spec.needs_build else "nothing to build"))
        artifact = build_variant(
            self.base_dir, self.spec, seed=self.seed, say=lambda m: emit(("status", m)),
            progress=lambda phase, done, total: emit(("progress", phase, done, total)),
        )  # fmt: skip
        return artifact


@dataclass(frozen=True)
class Endpoint:
    """A served variant's address and options, its secrets already read from the environment."""

    url: str
    model: str | None = None
    api: str = "completions"
    timeout_s: float = 120.0
    api_key: str | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    extra_body: tuple[tuple[str, Any], ...] = ()

    def backend(self, name: str | None = None) -> Any:
        from variantbench.backends.openai_http import OpenAIBackend

        return OpenAIBackend(self.url, model=self.model, api=self.api, timeout_s=self.timeout_s, name=name,
                             api_key=self.api_key, headers=dict(self.headers), extra_body=dict(self.extra_body))  # fmt: skip


@dataclass(frozen=True)
class MeasureJob:
    """One variant, one repeat: load, warm up, run the scenario, fidelity and diagnosis; raw results."""

    variant: str  # the name in the report (the endpoint's model name for an endpoint run)
    workload: Workload
    log_path: str
    load: LoadSettings
    spec: VariantSpec | None = None  # None: an endpoint
    artifact: Artifact | None = None
    base_dir: str = ""
    device: str = default_of("model.device")
    threads: int | None = default_of("model.threads")
    cuda_graphs: bool = default_of("model.cuda_graphs")
    endpoint: Endpoint | None = None
    find_peak: bool = default_of("load.find_peak")
    criteria: Criteria = field(default_factory=Criteria)
    fidelity: Any = None  # metrics.fidelity.FidelitySpec, or None to skip logit fidelity
    # metrics.likelihood.LikelihoodSpec, or None to skip the samples' likelihood scores
    likelihood: Any = None
    lm_eval: Any = None  # metrics.lm_eval.LmEvalSpec, or None: no lm-evaluation-harness tasks
    is_standard: bool = False
    watts_per_core: float = default_of("cost.watts_per_core")
    diagnose: bool = False
    counters: str = ""  # whether perf cache counters work here (analysis.diagnosis.cache_counters)
    repeat: int = 0
    batch_rounds: int = 0  # batching-throughput measurements (batch-8 decode) after the scenario
    scrape_s: float = default_of("execution.scrape_s")  # a served variant's /metrics scrape interval; 0: off
    cold_start: bool = False  # the pipeline times a cold start after the job (listed in ``phases``)
    # where the result is saved as it grows (raw/VARIANT.REPEAT.json); None: only returned (a Ray node)
    result_path: str | None = None
    resume: VariantResult | None = None  # what a killed run saved of this variant: only the rest runs
    answered: tuple[str, ...] = ()  # sample ids a resumed variant's earlier blocks asked, in order

    @property
    def id(self) -> str:
        return f"measure:{self.variant}#{self.repeat}"

    def phases(self) -> tuple[str, ...]:
        """The phases this job's result will hold when whole (``results.PHASES``)."""
        asked = {"load": True, "scenario": True, "batch": self.batch_rounds > 0,
                 "fidelity": self.fidelity is not None, "likelihood": self.likelihood is not None,
                 "lm_eval": self.lm_eval is not None, "diagnosis": self.diagnose and self.endpoint is None,
                 "cold_start": self.cold_start}  # fmt: skip
        return tuple(p for p in PHASES if asked[p])

    def backend(self) -> Any:
        if self.endpoint is not None:
            return self.endpoint.backend(self.variant)
        from variantbench.backends.registry import make_backend

        assert self.spec is not None
        from variantbench.backends.base import CudaGraphs

        backend = make_backend(
            self.spec, self.artifact, self.base_dir, device=self.device, threads=self.threads
        )
        if isinstance(backend, CudaGraphs):
            backend.cuda_graphs = self.cuda_graphs
        return backend

    def run(self, emit: Emit) -> VariantResult:
        from variantbench.pipeline.measure import measure_variant

        return measure_variant(self, emit)

    def open(self, emit: Emit) -> Any:
        """The variant loaded and kept: a ``VariantSession`` for interleaved blocks."""
        from variantbench.pipeline.measure import VariantSession

        return VariantSession(self, emit)


@dataclass(frozen=True)
class ColdStartJob:
    """Start-to-first-token in a fresh process, the variant's files dropped from the page cache."""

    spec: VariantSpec
    artifact: Artifact
    base_dir: str
    device: str = "cpu"
    threads: int | None = None

    @property
    def id(self) -> str:
        return f"cold-start:{self.spec.name}"

    def run(self, emit: Emit) -> ColdStart:
        from variantbench.analysis.startup import cold_start

        emit(("status", "cold start in a fresh process"))
        fault_point("cold_start")
        seconds, note = cold_start(self.spec, self.artifact, self.base_dir, threads=self.threads,
                                   device=self.device)  # fmt: skip
        return ColdStart(seconds, note)


@dataclass(frozen=True)
class ColdStart:
    seconds: float | None
    note: str | None
