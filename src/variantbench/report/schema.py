"""report.json: one versioned schema. Renderers read it; nothing is generated at run time.

Units are in the field names. ``queries.completed`` counts queries that completed successfully;
``queries.errors`` those that completed as errors; ``issued = completed + errors``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1.5"  # 1.5: typed batch_throughput, execution, comparisons, recommendations; incomplete


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LatencyDist(_Model):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None


class Tail(_Model):
    p50: float | None = None
    p99: float | None = None


class Throughput(_Model):
    qps: float | None = None
    output_tokens_per_s: float | None = None


class Speed(_Model):
    """Prefill (input tokens / TTFT) and decode (tokens after the first / their time) apart."""

    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


class Quality(_Model):
    """Against the references (see metrics/quality.py), plus logit fidelity against the standard."""

    scored: int = 0  # answers with a reference that were scored
    bleu: float | None = None  # sacrebleu corpus BLEU, 0-100
    rouge1: float | None = None  # mean F-measure, 0-1
    rouge2: float | None = None
    rougeL: float | None = None  # noqa: N815 - the metric's own name
    exact_match: float | None = None  # QA, SQuAD normalization, 0-1
    f1: float | None = None  # QA token F1, 0-1
    accuracy: float | None = None  # classification, 0-1 (by ``accuracy_by``)
    # "label likelihood": the most likely label given the prompt (lm-eval's way, where measured);
    # "generated label": the first label word of the generated answer
    accuracy_by: str | None = None
    accuracy_generated: float | None = None  # the generated label's accuracy, kept beside
    composite: float | None = None  # 0.5 * BLEU/100 + 0.5 * ROUGE-L, 0-1
    perplexity: float | None = None  # of the held-out fidelity text
    kl_mean: float | None = None  # KL(standard || variant) per scored token, nats
    kl_p99: float | None = None
    top1_agreement: float | None = None  # share of positions whose argmax is the standard's


class QualityComparisonReport(_Model):
    """One paired quality comparison with the standard (``metrics/quality_compare.py``)."""

    metric: str
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float = 0.95
    pairs: int = 0
    floor: float | None = None
    state: str | None = None  # "meets" | "fails" | "undecided" | "tied"; None: evidence only
    more_samples: int | None = None
    damage: float | None = None  # fidelity: the KL above which the variant fails (floor: the tie level)


class QualityVsStandard(_Model):
    """MLPerf-style gates against the standard variant on the same samples."""

    standard: str
    agreement_rougeL: float | None = None  # noqa: N815 - ROUGE-L of this variant's answers vs the standard's
    identical: float | None = None  # share of answers identical to the standard's
    ratio: float | None = None  # composite quality / the standard's
    length_ratio: float | None = None  # mean output tokens / the standard's, same samples
    quality_threshold: float = 0.99
    length_tolerance: float = 0.10
    gate: str = "n/a"  # "PASS" | "FAIL" | "UNDECIDED" | "n/a" (the standard itself, or nothing to compare)
    reasons: list[str] = Field(default_factory=list)
    # paired intervals by sample: the deciding one's state is the gate's (see metrics/quality_compare.py)
    state: str | None = None  # "meets" | "fails" | "undecided" | "tied" | None (too few paired samples)
    decided_by: str | None = None
    comparisons: list[QualityComparisonReport] = Field(default_factory=list)


class SampleLikelihood(_Model):
    """One sample's likelihood scores (``metrics/likelihood.py``): paired with the standard's by sample."""

    sample_id: str
    task: str = ""
    ref_logprob: float | None = None  # log p(reference tokens | prompt), summed
    ref_tokens: int | None = None
    ref_logprob_per_token: float | None = None
    choice_logprobs: dict[str, float] = Field(default_factory=dict)
    choice: str | None = None  # the most likely choice
    acc: float | None = None  # 1.0 when the most likely choice is the reference
    acc_norm: float | None = None  # the same, log-probabilities per byte of the choice (lm-eval's acc_norm)
    kl: float | None = None  # KL(standard || this variant), mean over the sample's scored positions
    top1: float | None = None  # share of those positions where its most likely token is the standard's


class Likelihood(_Model):
    """Means over the workload's samples, and each sample's scores."""

    samples: int = 0
    ref_logprob_per_token: float | None = None
    ref_perplexity: float | None = None
    choice_accuracy: float | None = None
    choice_accuracy_norm: float | None = None
    choice_samples: int = 0
    kl_mean: float | None = None  # on the samples' own positions (the held-out text's is quality.kl_mean)
    top1_agreement: float | None = None
    per_sample: list[SampleLikelihood] = Field(default_factory=list)
    unavailable: str | None = None  # a served variant whose server cannot score text: why


class LmEvalReport(_Model):
    """lm-evaluation-harness's scores of a variant (``metrics/lm_eval.py``): per task its metrics and
    their standard errors (``acc``, ``acc_stderr``, ...), and each document's scores for pairing."""

    version: str | None = None
    tasks: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    docs: dict[str, list[dict[str, float]]] = Field(default_factory=dict)
    unavailable: str | None = None  # a served variant whose server lm-eval cannot evaluate: why


class TaskReport(_Model):
    """One task type of a mixed workload: its latency, its per-query decode rate, its quality."""

    queries: int = 0
    latency_ms: Tail = Field(default_factory=Tail)
    ttft_ms: Tail = Field(default_factory=Tail)
    input_tokens: Tail = Field(default_factory=Tail)
    output_tokens_per_s: float | None = None  # output tokens / the time of those queries
    quality: Quality = Field(default_factory=Quality)


class GpuResources(_Model):
    """NVML's (or nvidia-smi's) samples over the measured blocks (trackers/gpu.py)."""

    util: float | None = None  # mean percent of time a kernel ran
    mem_bw_util: float | None = None  # mean percent of time device memory was read or written
    mem_bytes: int | None = None  # peak used
    sm_clock_mhz: float | None = None  # mean
    power_w: float | None = None  # mean
    energy_j: float | None = None
    energy_from: str | None = None  # "counter" | "power integrated"
    samples: int | None = None


class Resources(_Model):
    startup_s: float | None = None  # load to ready (first token possible), in a warm process
    startup_warm_s: float | None = None  # the same, named as the cost/decision sections read it
    startup_cold_s: float | None = (
        None  # fresh process start to first token, model files out of the page cache
    )
    startup_cold_note: str | None = None  # how "cold" was arranged, or why it could not be
    build_s: float | None = None  # building the variant (structural steps, export), before any startup
    peak_rss_bytes: int | None = None  # while serving: warm-up and measured queries
    mean_rss_bytes: float | None = None
    load_peak_rss_bytes: int | None = None  # high-water mark of the process up to ready
    param_bytes: int | None = None  # weights in memory
    disk_bytes: int | None = None  # the variant's files on disk (built folder, ONNX or GGUF)
    mean_cpu_util: float | None = None  # CPU seconds / (wall seconds x usable cores), 0-1
    cpu_s: float | None = None
    wall_s: float | None = None
    cores: int | None = None
    energy_j: float | None = None
    energy_source: str | None = None  # "rapl" | "estimate" (+ "+nvml" with a GPU)
    watts_per_core: float | None = None  # the estimate's assumption, when energy is an estimate
    gpu: GpuResources | None = None


class Ratio(_Model):
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Spread(_Model):
    """One number measured in several repeated runs: its mean and 95% t-interval."""

    n: int = 0
    mean: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class AcrossRepeats(_Model):
    """--repeats: this variant's ratios to the standard's run of the same index, across the runs."""

    latency_p50_ratio: Spread = Field(default_factory=Spread)
    throughput_ratio: Spread = Field(default_factory=Spread)


class AB(_Model):
    """This variant against the standard: paired per sample where both answered the same samples."""

    standard: str
    paired: bool = False  # True: per-sample pairs (Wilcoxon, BCa); False: unpaired (Mann-Whitney)
    pairs: int = 0
    test: str = "mann-whitney"  # "wilcoxon" | "mann-whitney"
    # the verdict's effect: paired, the geometric mean of per-sample latency ratios; else the median ratio
    latency_ratio: Ratio = Field(default_factory=Ratio)
    ttft_ratio: Ratio = Field(default_factory=Ratio)  # paired geometric mean of per-sample TTFT ratios
    latency_p50_ratio: Ratio = Field(default_factory=Ratio)  # variant / standard: < 1 is faster
    latency_p99_ratio: Ratio = Field(default_factory=Ratio)
    throughput_ratio: Ratio = Field(
        default_factory=Ratio
    )  # output tokens/s, variant / standard: > 1 is faster
    p_value: float | None = None  # two-sided: Wilcoxon signed-rank on the pairs, else Mann-Whitney U
    verdict: str = "no significant difference"  # "faster" | "slower" | "no significant difference"
    summary: str = ""
    across_repeats: AcrossRepeats | None = None  # --repeats: mean and 95% CI of each run's ratios


class Cost(_Model):
    """Derived from the run and the cost model (plan.cost); every input is kept to check by hand."""

    per_million_output_tokens: float | None = None
    tokens_per_joule: float | None = None
    efficiency: float | None = None
    efficiency_units: str = ""
    inputs: dict[str, Any] = Field(default_factory=dict)
    # 95% intervals carried over from the throughput's (cost ~ 1/throughput, efficiency ~ throughput^2)
    per_million_output_tokens_ci: list[float] | None = None
    efficiency_ci: list[float] | None = None


class Diagnosis(_Model):
    """Where a variant's time goes (operator families), against the machine's measured ceilings."""

    op_share: dict[str, float] = Field(default_factory=dict)  # decode step: share of profiled time
    op_ms: dict[str, float] = Field(default_factory=dict)  # decode step: ms per step by family
    prefill_op_share: dict[str, float] = Field(default_factory=dict)
    prefill_op_ms: dict[str, float] = Field(default_factory=dict)  # one prefill of the profiled prompt
    decode_step_ms: float | None = None
    top_ops: list[dict[str, Any]] = Field(default_factory=list)  # decode: the operators taking most time
    achieved_gflops: float | None = None  # decode at batch 1: 2 x parameters x tokens/s
    achieved_gbps: float | None = None  # decode at batch 1: weight bytes read per token x tokens/s
    ceiling_gflops: float | None = None
    ceiling_gbps: float | None = None
    batch_tokens_per_s: dict[str, float] = Field(default_factory=dict)  # "1", "8", "32"
    cache_misses: str | None = None  # perf counters, or why they were unavailable
    gpu_idle_share: float | None = None  # CUDA: decode span with no kernel running (analysis/kernel_gaps.py)
    gpu_kernels_per_step: float | None = None
    decode_mode: str | None = None  # CUDA: "cuda-graphs" or "eager"
    profiler: str | None = None
    summary: str = ""


class LagDist(_Model):
    p50: float | None = None
    p99: float | None = None
    max: float | None = None


class TargetCheck(_Model):
    """One latency target judged by MLPerf's early-stopping rule (``loadgen/validity.py``)."""

    target_ms: float
    percentile: float
    observed_ms: float | None = None
    over_target: int = 0
    queries: int = 0
    early_stopping_estimate_ms: float | None = None
    result: str = "FAIL"  # "PASS" | "FAIL"


class Validity(_Model):
    verdict: str = "VALID"  # "VALID" | "INVALID"
    reasons: list[str] = Field(default_factory=list)
    recommendations: list[str] = Field(default_factory=list)
    checks: dict[str, TargetCheck] = Field(default_factory=dict)  # per target (latency, ttft, tpot)


class WindowReport(_Model):
    index: int
    queries: int
    p50_latency_ms: float | None = None
    p99_latency_ms: float | None = None
    mean_latency_ms: float | None = None
    qps: float | None = None
    output_tokens_per_s: float | None = None
    mean_rss_bytes: float | None = None  # resource samples within the window's span
    mean_cpu_util: float | None = None


class Outliers(_Model):
    """3-sigma rejection on per-query latency and on window throughput; percentiles are never trimmed."""

    removed: int = 0
    trimmed_mean_latency_ms: float | None = None
    raw_mean_latency_ms: float | None = None
    windows_removed: int = 0
    trimmed_output_tokens_per_s: float | None = None


class PeakTrial(_Model):
    """One rate a find-peak search tried."""

    rate_qps: float
    passed: bool
    latency_p99_ms: float | None = None
    achieved_qps: float | None = None
    reasons: list[str] = Field(default_factory=list)
    run_id: str = ""


class PeakSearch(_Model):
    """``--find-peak``: the highest server rate whose latency targets passed, and every trial."""

    peak_qps: float | None = None
    trials: list[PeakTrial] = Field(default_factory=list)


class Goodput(_Model):
    """vLLM's definition: completed requests meeting every SLO, per second of the run."""

    slo_ms: dict[str, float] = Field(default_factory=dict)  # ttft / tpot / e2el -> ms
    requests_per_s: float | None = None
    met: int = 0
    share: float | None = None  # of the issued requests


class BatchThroughput(_Model):
    """Decode tokens/s at ``batch`` requests at once, measured several times (interleaved): the mean,
    its 95% t-interval and every value."""

    batch: int
    new_tokens: int
    values: list[float] = Field(default_factory=list)
    tokens_per_s: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Incomplete(_Model):
    """A variant whose result is not whole: the run stopped while it was measured (killed), or only
    its queries in the log are left. Its latency and throughput are those of the queries it answered."""

    status: str  # "partial" | "log-only"
    why: str
    missing: list[str] = Field(default_factory=list)  # phases asked of it that did not finish
    done: list[str] = Field(default_factory=list)


class Queries(_Model):
    issued: int = 0
    completed: int = 0
    errors: int = 0


class RepeatRow(_Model):
    """--repeats: one run's key numbers."""

    repeat: int
    status: str
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    output_tokens_per_s: float | None = None


class RunReport(_Model):
    variant: str
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None
    scenario: str = "single-stream"
    seeds: dict[str, int] = Field(default_factory=dict)
    weight_format: str | None = None
    backend: dict[str, Any] = Field(default_factory=dict)
    duration_s: float | None = None
    latency_ms: LatencyDist = Field(default_factory=LatencyDist)  # = from scheduled time
    latency_from_scheduled_ms: LatencyDist = Field(default_factory=LatencyDist)
    latency_from_issue_ms: LatencyDist = Field(default_factory=LatencyDist)
    dispatch_lag_ms: LagDist = Field(default_factory=LagDist)
    # server scenario over HTTP with sender processes: each one's queries and dispatch lag
    senders: list[dict[str, Any]] = Field(default_factory=list)
    late_share: float | None = None  # share of queries issued more than 1 ms after their scheduled time
    target_qps: float | None = None  # server
    achieved_qps: float | None = None  # server: issued queries / issue span
    validity: Validity = Field(default_factory=Validity)
    windows: list[WindowReport] = Field(default_factory=list)
    stable: bool | None = None  # last 3 windows' mean latencies within 10%
    outliers: Outliers = Field(default_factory=Outliers)
    peak: PeakSearch | None = None
    engine_timings: dict[str, float | None] | None = None  # the engine's own clock, summed (llama.cpp)
    cpu_work: dict[str, float] | None = None  # tokenizing, templating, detokenizing (see summary.cpu_work)
    ttft_ms: Tail = Field(default_factory=Tail)
    tpot_ms: Tail = Field(default_factory=Tail)
    itl_ms: LatencyDist = Field(default_factory=LatencyDist)  # every gap between consecutive tokens
    # vLLM's --percentile-metrics x --metric-percentiles: {"ttft": {"50": ms, "99": ms}, ...}; e2el from issue
    percentiles: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    # a served variant: the server's own TTFT/ITL histograms over the run's blocks (percentiles in ms,
    # bucket-interpolated as Prometheus does) and the client's p50 over the server's
    server_latency: dict[str, Any] | None = None
    goodput: Goodput | None = None
    throughput: Throughput = Field(default_factory=Throughput)
    speed: Speed = Field(default_factory=Speed)
    quality: Quality = Field(default_factory=Quality)
    quality_vs_standard: QualityVsStandard | None = None
    likelihood: Likelihood | None = None  # None: not measured (served variants, or quality.likelihood off)
    lm_eval: LmEvalReport | None = None  # quality.lm_eval's tasks, where asked for
    per_task: dict[str, TaskReport] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    cost: Cost | None = None
    ab_vs_standard: AB | None = None
    diagnosis: Diagnosis | None = None
    repeats: list[RepeatRow] = Field(default_factory=list)  # --repeats: each run's key numbers
    # decode tokens/s at batch 8, measured several times (interleaved): mean, 95% t-interval, values
    batch_throughput: BatchThroughput | None = None
    incomplete: Incomplete | None = None  # None: every phase asked of it finished
    queries: Queries = Field(default_factory=Queries)
    input_tokens: Tail = Field(default_factory=Tail)
    output_tokens: Tail = Field(default_factory=Tail)


class Recommendation(_Model):
    """One deployment profile's choice (``analysis/recommend.py``): the variant, why, and why not the others."""

    variant: str | None = None  # None: no measured variant meets every constraint
    reasons: dict[str, str] = Field(default_factory=dict)  # variant -> why it is chosen, or fails
    undecided_quality: list[str] = Field(default_factory=list)  # kept out: quality not yet decided
    eligible: list[str] = Field(default_factory=list)
    tied: list[str] = Field(default_factory=list)
    ranked_by: str = ""
    constraints: dict[str, Any] = Field(default_factory=dict)  # open: the profile's own constraints
    description: str = ""
    summary: str = ""


class PairComparison(_Model):
    """``a`` against ``b`` on one metric, paired by sample (``metrics/sequential.py``): the ratio
    a/b with its interval at the run's confidence, and where it lies against the tie band."""

    a: str
    b: str
    metric: str  # "throughput" (output tokens/s, paired per sample) | "batch throughput"
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float
    pairs: int = 0
    state: str  # "faster" | "slower" | "tied" | "undecided", a relative to b
    more_samples: int | None = None  # undecided: pairs in all likely needed to decide


class Look(_Model):
    """One look of an interleaved run at its data: how far it was, at what confidence, what was open."""

    look: int
    queries_per_variant: int
    confidence: float
    undecided: list[str] = Field(default_factory=list)


class Rounds(_Model):
    """One repeat of an interleaved run: its rounds, its looks and why it stopped."""

    repeat: int
    rounds: int
    looks: list[Look] = Field(default_factory=list)
    stopped: str = ""


class Execution(_Model):
    """How the variants shared the machine: in turns (interleaved) or not and why not, where."""

    interleaved: bool = False
    why_not: str | None = None
    executor: str | None = None
    nodes: int | None = None  # a concurrent executor's nodes (Ray), each variant on one
    run_id: str | None = None  # the records' run id (a resumed run keeps it)
    repeats: list[Rounds] = Field(default_factory=list)


class Report(_Model):
    schema_version: str = SCHEMA_VERSION
    tool_version: str
    created_utc: str
    model: dict[str, Any]
    standard: str
    plan: dict[str, Any]
    workload: dict[str, Any]
    environment: dict[str, Any]
    runs: list[RunReport] = Field(default_factory=list)
    ceilings: dict[str, Any] = Field(default_factory=dict)  # measured matmul GFLOP/s and memory GB/s
    recommendations: dict[str, Recommendation] = Field(default_factory=dict)  # by profile
    # how the variants were run: interleaved or not (and why not), rounds, looks, why it stopped
    execution: Execution = Field(default_factory=Execution)
    # every pair of variants on paired throughput: faster, slower, tied or undecided, with intervals
    comparisons: list[PairComparison] = Field(default_factory=list)
    # tasks whose scores carry no information: every variant scored every sample the same
    uninformative_tasks: dict[str, str] = Field(default_factory=dict)
    # planned variants with neither a query nor a result: the run stopped (or failed) before them
    not_started: list[str] = Field(default_factory=list)

    def stopped(self) -> list[str]:
        """One line per variant the run did not finish: what it measured, what it lacks and why."""
        lines = []
        for run in self.runs:
            if run.incomplete is not None:
                missing = ", ".join(run.incomplete.missing) or "nothing asked of it"
                lines.append(f"{run.variant}: {run.queries.issued} queries measured; {run.incomplete.why}; "
                             f"missing: {missing}")  # fmt: skip
            elif run.status != "ok":
                lines.append(f"{run.variant}: failed: {run.error or 'no error recorded'}")
        lines += [f"{v}: never started (the run stopped before it)" for v in self.not_started]
        return lines

    def run(self, variant: str) -> RunReport | None:
        return next((r for r in self.runs if r.variant == variant), None)

    @property
    def scenario(self) -> str:
        """The scenario the variants were measured in (an accuracy-only pass reads as offline)."""
        measured = next((r.scenario for r in self.runs if r.status == "ok"), None)
        return measured or (self.plan.get("load") or {}).get("scenario") or "single-stream"

    def write(self, path: Path) -> None:
        """Atomic write: a crash mid-write never leaves a truncated report."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> Report:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))
