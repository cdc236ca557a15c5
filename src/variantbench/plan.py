"""The plan of a run: one frozen pydantic model, the only place where a default lives.

A plan is read from YAML (``variantbench run PLAN.yaml``), changed by ``--set key.path=value`` and by
the CLI's everyday flags (each a shortcut for one key path, ``cli_args.py``), and written back fully
resolved as ``OUT/plan.yaml``, so ``variantbench run OUT/plan.yaml`` replays the run: the same
samples, the same sample order and arrival schedule, the same settings.

Pure: validation imports no measuring code, writes no environment, probes no device and touches
no network (the import contracts in ``pyproject.toml`` hold it to that). What needs the machine
(does the model folder exist, is there a GPU, are the variant names known) is checked by the
pipeline before anything is measured.

The load pattern is a tagged union on ``load.scenario``: each scenario carries its own knobs, so a
``rate_qps`` on a single-stream run is an error naming the key instead of a silently ignored value.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from variantbench.analysis.profiles import PROFILES, Profile
from variantbench.errors import UserError

# the best of each kind (issue 42): the float baseline, half its bytes, and the int8 that keeps its
# quality. Plain int8 (one scale per activation tensor) collapsed on the default model: KL 0.92-0.95
# nats and 66% of fp32's composite in the README's default run; smooth+int8:act=token (SmoothQuant
# migration, per-token activation scales) kept 98.3% of it on 48 samples, KL 0.033
DEFAULT_VARIANTS = ("fp32", "bf16", "smooth+int8:act=token")


def default_of(path: str) -> Any:
    """The plan's default at a key path (``"limits.warmup"``; ``"load.KEY"``: the first scenario that
    has it): what a struct below the plan (``LoadSettings``, ``Criteria``, ``MeasureJob``,
    ``ServeOptions``) takes as its own default, so every default is declared once, here."""
    section, _, key = path.partition(".")
    if section == "load":
        model = next(t for t in SCENARIO_TYPES.values() if key in t.model_fields)
    else:
        annotation = Plan.model_fields[section].annotation
        model = annotation if key else Plan
        key = key or section
    field = model.model_fields[key]
    return field.default_factory() if field.default_factory is not None else field.default


def names_of(value: Any, split: bool = True) -> Any:
    """A list setting from a flag or ``--set`` (a string: comma-separated where ``split``) or YAML."""
    if isinstance(value, str):
        value = value.split(",") if split else [value]
    if isinstance(value, list | tuple):
        value = tuple(str(v).strip() for v in value if v is not None and str(v).strip())
    return value


def each_once(value: tuple[str, ...], empty: str) -> tuple[str, ...]:
    """Variant names: at least one (``empty`` says so otherwise), none twice."""
    if not value:
        raise ValueError(empty)
    dupes = sorted({v for v in value if value.count(v) > 1})
    if dupes:
        raise ValueError(f"variant listed twice: {', '.join(dupes)}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelPlan(_Section):
    source: str | None = Field(None, description="Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")  # fmt: skip
    endpoint: str | None = Field(
        None, description="measure a running OpenAI-compatible server at this URL instead"
    )
    endpoint_model: str | None = Field(None, description="model name at the endpoint (default: its first)")
    api: Literal["completions", "chat"] = Field(
        "completions", description="endpoint API: completions or chat"
    )
    request_timeout_s: float = Field(120.0, gt=0, description="per-request timeout for an endpoint (s)")
    tokenizer: str | None = Field(
        None, description="tokenizer folder that counts input lengths for endpoint runs"
    )
    device: str = Field("cpu", description="cpu or cuda[:N]")
    threads: PositiveInt | None = Field(None, description="torch threads (default: torch's own choice)")
    cuda_graphs: bool = Field(
        True, description="on CUDA, replay decode steps from CUDA graphs (off: eager; the report says which)"
    )
    build_seed: int = Field(0, description="seed of the calibration and distillation text of built variants")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        from variantbench.devices import parse_device

        try:
            parse_device(value)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return value


class WorkloadPlan(_Section):
    file: Path | None = Field(None, description="JSONL prompts, SQuAD JSON/JSONL or CNN/DailyMail CSV/JSONL instead of synthetic")  # fmt: skip
    skip_bad_lines: bool = Field(
        False, description="run a workload file on its good records only, reporting the bad"
    )
    mix: str | None = Field(
        None, description="synthetic task mix, e.g. qa=0.4,summarization=0.3,generation=0.3"
    )
    input_lengths: str = Field("uniform:128-1024", description="synthetic input tokens: uniform:LOW-HIGH | normal:MEAN,STD[,LOW-HIGH] | fixed:N")  # fmt: skip
    max_new_tokens: PositiveInt | None = Field(None, description="override the tasks' output token caps")

    ignore_eos: bool = Field(False, description="served models: answers run to max_new_tokens past the end-of-text token (vLLM's --ignore-eos; sent as ignore_eos in the request body)")  # fmt: skip

    @field_validator("mix")
    @classmethod
    def _mix(cls, value: str | None) -> str | None:
        if value is not None:
            from variantbench.workloads.base import TASKS
            from variantbench.workloads.lengths import parse_mix

            parse_mix(value, TASKS)
        return value

    @field_validator("input_lengths")
    @classmethod
    def _lengths(cls, value: str) -> str:
        from variantbench.workloads.lengths import parse_lengths

        parse_lengths(value)
        return value

    @model_validator(mode="after")
    def _file_or_mix(self) -> WorkloadPlan:
        if self.file is not None and self.mix is not None:
            raise ValueError("mix shapes the synthetic workload; a workload file brings its own tasks")
        return self


class _Scenario(_Section):
    tasks: PositiveInt = Field(8, description="measured queries per variant: the synthetic workload's size, one pass over it")  # fmt: skip


class SingleStream(_Scenario):
    """The next query is issued when the last completes."""

    scenario: Literal["single-stream"] = "single-stream"


class MultiStream(_Scenario):
    """Each query is ``samples_per_query`` samples issued together; its latency is the slowest's."""

    scenario: Literal["multi-stream"] = "multi-stream"
    samples_per_query: PositiveInt = Field(4, description="multi-stream: samples per query")
    max_batch_size: PositiveInt = Field(
        8, description="most waiting requests handed to an in-process model at once"
    )


class Server(_Scenario):
    """Arrivals on a seeded schedule (Poisson, or gamma gaps), latency from the scheduled time."""

    scenario: Literal["server"] = "server"
    rate_qps: float = Field(..., gt=0, description="server: target queries/s")
    burstiness: float = Field(1.0, gt=0, description="server: gamma shape of the arrival gaps; 1.0 = Poisson")
    max_concurrency: PositiveInt | None = Field(None, description="server: cap on outstanding queries")
    max_batch_size: PositiveInt = Field(
        8, description="most waiting requests handed to an in-process model at once"
    )
    find_peak: bool = Field(False, description="server: raise the rate until a target fails, then bisect")
    senders: PositiveInt | None = Field(None, description="server, served models: sender processes splitting the schedule, each with its own event loop (default: the cores)")  # fmt: skip


class Offline(_Scenario):
    """Every sample issued at once; the system batches as it likes."""

    scenario: Literal["offline"] = "offline"
    max_batch_size: PositiveInt = Field(
        8, description="most waiting requests handed to an in-process model at once"
    )


LoadPlan = Annotated[SingleStream | MultiStream | Server | Offline, Field(discriminator="scenario")]
SCENARIO_TYPES: dict[str, type[_Scenario]] = {
    "single-stream": SingleStream, "multi-stream": MultiStream, "server": Server, "offline": Offline,
}  # fmt: skip
SCENARIOS = tuple(SCENARIO_TYPES)


class LimitsPlan(_Section):
    warmup: int = Field(1, ge=0, description="warm-up queries per variant (not counted)")
    min_queries: PositiveInt | None = Field(
        None, description="run at least this many queries (default: the workload's size)"
    )
    max_queries: PositiveInt | None = Field(None, description="stop after this many queries")
    min_duration_s: float = Field(0.0, ge=0, description="run at least this many seconds")
    max_duration_s: float | None = Field(None, gt=0, description="stop issuing after this many seconds")
    drain_timeout_s: float = Field(
        600.0, gt=0, description="after the last issue, how long outstanding queries may take"
    )

    @model_validator(mode="after")
    def _ordered(self) -> LimitsPlan:
        if (
            self.max_queries is not None
            and self.min_queries is not None
            and self.max_queries < self.min_queries
        ):
            raise ValueError("max_queries is below min_queries")
        if self.max_duration_s is not None and self.max_duration_s < self.min_duration_s:
            raise ValueError("max_duration_s is below min_duration_s")
        return self


GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


class TargetsPlan(_Section):
    latency_ms: float | None = Field(None, gt=0, description="PASS/FAIL latency target (ms)")
    ttft_ms: float | None = Field(None, gt=0, description="PASS/FAIL time-to-first-token target (ms)")
    tpot_ms: float | None = Field(None, gt=0, description="PASS/FAIL time-per-output-token target (ms)")
    percentile: float = Field(99.0, gt=0, lt=100, description="percentile the targets apply to, in (0,100)")
    window: PositiveInt = Field(50, description="queries per metrics window")
    goodput_ms: dict[str, float] = Field(default_factory=dict, description="goodput SLOs per request (vLLM's --goodput): ttft, tpot, e2el in ms; goodput is the requests per second meeting all of them (default: the targets above)")  # fmt: skip

    @field_validator("goodput_ms", mode="before")
    @classmethod
    def _goodput(cls, value: Any) -> Any:
        if isinstance(value, str):  # "ttft:500 tpot:50" or "ttft=500,tpot=50" from a flag
            pairs = [p for p in re.split(r"[\s,]+", value.strip()) if p]
            try:
                value = {k: float(v) for k, v in (re.split(r"[:=]", p, maxsplit=1) for p in pairs)}
            except ValueError:
                raise ValueError(
                    f"goodput SLOs are NAME:MS pairs (ttft:500 tpot:50 e2el:2000), got {value!r}"
                ) from None
        if isinstance(value, dict):
            bad = sorted(set(value) - set(GOODPUT_METRICS))
            if bad:
                raise ValueError(
                    f"unknown goodput metric {', '.join(bad)}; known: {', '.join(GOODPUT_METRICS)}"
                )
            if any(float(v) <= 0 for v in value.values()):
                raise ValueError("goodput SLOs must be positive (ms)")
        return value


class SeedsPlan(_Section):
    workload: int = Field(0, description="seed of the synthetic workload and of the sample order")
    schedule: int = Field(0, description="seed of the arrival schedule")


class LmEvalPlan(_Section):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks: hub tasks (hellaswag, arc_easy, gsm8k) where the dataset hub "
        "is reachable, or tasks defined in include_path",
    )
    limit: PositiveInt | None = Field(None, description="documents per task (default: all)")
    include_path: Path | None = Field(
        None, description="a folder of lm-eval task YAML files (custom tasks, e.g. over a local JSONL file)"
    )
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples (default: the task's own)")


class QualityPlan(_Section):
    threshold: float = Field(99.0, gt=0, le=100, description="gate: quality at least this % of the standard's (99 or 99.9)")  # fmt: skip
    length_tolerance: float = Field(10.0, ge=0, le=100, description="gate: mean output length within this ±% of the standard's")  # fmt: skip
    accuracy_log: float = Field(1.0, gt=0, le=1, description="share of timed queries whose output is kept and scored, (0,1]")  # fmt: skip
    accuracy_only: bool = Field(False, description="score every sample once, untimed (no speed figures)")
    fidelity: bool = Field(
        True, description="logit fidelity: perplexity, KL and top-1 agreement vs the standard"
    )
    fidelity_text: Path | None = Field(None, description="held-out text for logit fidelity (default: pydoc_data.topics)")  # fmt: skip
    lm_eval: LmEvalPlan | None = Field(
        None,
        description="standard evaluation tasks through lm-evaluation-harness beside ours (local variants)",
    )
    likelihood: bool = Field(
        True,
        description="likelihood scores on the workload's samples: the reference's log-likelihood, choices by "
        "log-probability, KL and top-1 agreement on the samples' own positions (local variants)",
    )


class AnalysisPlan(_Section):
    repeats: PositiveInt = Field(1, description="run each variant N times: mean and 95% CI across runs")
    diagnose: bool = Field(
        True, description="profile each variant (operator families, batch 1/8/32, ceilings)"
    )
    cold_start: bool = Field(True, description="time a fresh process to its first token, model files out of the page cache")  # fmt: skip
    batch_rounds: int = Field(3, ge=0, le=20, description="batch-8 decode measurements per variant, for the batch profile (0: none)")  # fmt: skip
    until_decided: bool = Field(True, description="keep measuring in rounds until every comparison the recommendation ranks by is decided, or the looks run out")  # fmt: skip
    decide_within_s: float | None = Field(90.0, gt=0, description="until_decided: no further pass once the rounds have run this long (s, all variants)")  # fmt: skip
    tie_band: float = Field(
        3.0, ge=0, lt=50, description="%: two variants within this of each other are tied"
    )
    looks: PositiveInt = Field(
        3, le=20, description="most looks at the data under until_decided (each at alpha/looks)"
    )
    alpha: float = Field(
        0.05, gt=0, lt=0.5, description="error rate of the whole comparison (Bonferroni-split over looks)"
    )


class CostPlan(_Section):
    per_hour: float = Field(0.10, ge=0, description="hardware cost per device-hour")
    devices: PositiveInt = Field(1, description="devices the hardware cost is paid for")
    currency: str = Field("USD", description="currency of the cost figures")
    energy_price_kwh: float = Field(0.15, ge=0, description="energy price per kWh")
    watts_per_core: float = Field(10.0, gt=0, description="energy estimate per busy core where RAPL/NVML cannot be read")  # fmt: skip


class DecisionPlan(_Section):
    profile: str | None = Field(
        None, description=f"the deployment profile to recommend for: {' | '.join(PROFILES)}"
    )
    need_p99_ms: float | None = Field(None, gt=0, description="constraint: P99 latency at most this")
    need_memory_mb: float | None = Field(None, gt=0, description="constraint: peak memory at most this")
    need_quality: float | None = Field(None, gt=0, le=100, description="constraint: quality at least this % of the standard's")  # fmt: skip
    need_qps: float | None = Field(None, gt=0, description="constraint: at least this many queries/s")
    need_build_s: float | None = Field(None, ge=0, description="constraint: build time at most this")
    need_no_gpu: bool = Field(False, description="constraint: must run without a GPU")
    mix_backends: bool = Field(
        False,
        description="recommend variants measured on another backend than the standard's (the transformers "
        "fallback beside our engine, llama.cpp, ONNX Runtime): each is a different system under test",
    )

    @field_validator("profile")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value is not None and value not in PROFILES:
            raise ValueError(f"unknown deployment profile {value!r}; known: {', '.join(PROFILES)}")
        return value

    def custom_profile(self) -> Profile | None:
        """The profile given by the need_* constraints, or None when none was given."""
        if not any((self.need_p99_ms, self.need_memory_mb, self.need_quality, self.need_qps,
                    self.need_build_s is not None, self.need_no_gpu)):  # fmt: skip
            return None
        return Profile(
            name="custom",
            description="the constraints given in the plan (need_*)",
            p99_latency_ms=self.need_p99_ms,
            memory_budget_bytes=int(self.need_memory_mb * 1e6) if self.need_memory_mb else None,
            gpu=not self.need_no_gpu,
            quality_floor=self.need_quality / 100 if self.need_quality else None,
            build_budget_s=self.need_build_s,
            min_qps=self.need_qps,
        )

    def profiles(self) -> dict[str, Profile]:
        custom = self.custom_profile()
        return {**PROFILES, **({"custom": custom} if custom is not None else {})}


class ExecutionPlan(_Section):
    executor: Literal["local", "inline", "ray"] = Field("local", description="local: each job in its own process; inline: in this process; ray: each job a Ray task, one per node, the variants at once")  # fmt: skip
    address: str | None = Field(None, description="ray: the cluster's address (default: RAY_ADDRESS, else a local cluster of this machine)")  # fmt: skip
    retries: int = Field(1, ge=0, le=5, description="ray: times a job is run again when its worker or node dies")  # fmt: skip
    memory_gb: float | None = Field(None, gt=0, description="ray: memory each job reserves on its node (Ray's memory resource; default: none reserved)")  # fmt: skip
    shared_cache: Path | None = Field(None, description="ray: the variant cache as every node sees it (a shared filesystem path), set as VARIANTBENCH_CACHE in every job")  # fmt: skip
    interleave: bool = Field(True, description="load every variant at once and alternate between them in rounds, so drift lands on all alike")  # fmt: skip
    block_s: float = Field(
        10.0, gt=0, description="server scenario, interleaved: seconds of arrivals per block"
    )
    scrape_s: float = Field(1.0, ge=0, description="served variants: scrape the server's Prometheus /metrics every this many seconds while measuring (0: off)")  # fmt: skip


class OutputPlan(_Section):
    csv: bool = Field(False, description="also write queries.csv (report.csv is always written)")
    history: Path | None = Field(None, description="the results history (SQLite) this run is recorded in (default: <cache>/history.db)")  # fmt: skip
    record_history: bool = Field(True, description="record this run in the history (--no-history: do not)")
    overwrite: bool = Field(False, description="an existing run in the out folder is moved aside to OUT.N (never deleted; its history rows follow it) before this run")  # fmt: skip
    percentile_metrics: tuple[str, ...] = Field(PERCENTILE_METRICS, description="metrics whose percentiles every run reports: ttft, tpot, itl, e2el (vLLM's --percentile-metrics)")  # fmt: skip
    metric_percentiles: tuple[float, ...] = Field((50.0, 90.0, 99.0), description="the percentiles reported for them (vLLM's --metric-percentiles)")  # fmt: skip
    html: bool = Field(True, description="write report.html (plotly charts, about 5 MB); the monitor's probes skip it")  # fmt: skip
    vllm_result: bool = Field(False, description="also write vllm_result.VARIANT.json with vllm bench serve's field names (--save-result)")  # fmt: skip

    @field_validator("percentile_metrics", "metric_percentiles", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        return tuple(p for p in re.split(r"[\s,]+", value.strip()) if p) if isinstance(value, str) else value

    @field_validator("percentile_metrics")
    @classmethod
    def _metrics(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in value if m not in PERCENTILE_METRICS]
        if bad:
            raise ValueError(f"unknown metric {', '.join(bad)}; known: {', '.join(PERCENTILE_METRICS)}")
        return value

    @field_validator("metric_percentiles")
    @classmethod
    def _percentiles(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(not 0 < p <= 100 for p in value):
            raise ValueError("percentiles lie in (0, 100]")
        return value


ENDPOINT_VARIANT = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)=(?P<url>https?://[^#\s]+)(?:#(?P<model>.+))?$")


class EndpointPlan(_Section):
    """A served model measured as a variant: ``name=URL#model`` on the command line, or in full here."""

    url: str = Field(description="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    model: str | None = Field(None, description="the served model's name (default: the server's first)")
    api: Literal["completions", "chat"] = Field("completions", description="completions or chat")
    api_key_env: str | None = Field(None, description="environment variable holding the API key (sent as a Bearer token; the key itself never enters plan.yaml)")  # fmt: skip
    headers: dict[str, str] = Field(default_factory=dict, description="extra HTTP headers; a value '$NAME' is read from the environment at run time")  # fmt: skip
    extra_body: dict[str, Any] = Field(default_factory=dict, description="fields merged into every request body (e.g. top_k, ignore_eos)")  # fmt: skip
    timeout_s: float = Field(120.0, gt=0, description="per-request timeout (s)")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"an endpoint must be an http(s) URL, got {value!r}")
        return value


class ServePlan(_Section):
    """``variantbench serve``: the variants it serves, where, and how it batches and queues them."""

    variants: tuple[str, ...] = Field(("fp32", "int8"), description="variants to serve (the request's model field)")  # fmt: skip
    host: str = Field("127.0.0.1", description="interface to bind; other than 127.0.0.1 only when you mean it")  # fmt: skip
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    max_batch_size: PositiveInt = Field(32, description="most requests decoding together per variant")
    max_wait_ms: float = Field(10.0, ge=0, description="longest a decode step is held open for an expected newcomer (adaptive)")  # fmt: skip
    max_queue: PositiveInt = Field(256, description="waiting requests per priority level before 429")
    queue_timeout_ms: float | None = Field(None, gt=0, description="longest wait in the queue before 503 (default: none)")  # fmt: skip
    max_len: PositiveInt = Field(2048, description="context per request (prompt + output tokens)")
    prefill_chunk: PositiveInt = Field(256, description="prompt tokens per step, prefilled beside the decode rows")  # fmt: skip
    prefix_cache_mb: float = Field(256.0, ge=0, description="MiB of prompt-prefix keys/values kept for reuse (llama.cpp: finished prompts kept; 0: off)")  # fmt: skip
    queue_policy: tuple[str, ...] = Field((), description="per priority level: LEVEL:max_queue=N,timeout_ms=T,on_timeout=reject|delay,ttft_slo_ms=S,shed_late=true|false")  # fmt: skip
    ttft_slo_ms: float = Field(500.0, ge=0, description="priority 0's first-token objective (ms): less urgent prefill yields to it; 0: none")  # fmt: skip
    kv_cache: Literal["paged", "contiguous"] = Field("paged", description="torch engine: paged (blocks from a pool, memory as used) or contiguous")  # fmt: skip
    kv_cache_gb: float | None = Field(None, gt=0, description="GiB the KV cache may hold (default: 80% of the memory available once the weights are loaded)")  # fmt: skip
    weight_layout: Literal["packed", "packed+split"] = Field("packed", description="torch engine, fp32 on CPU: packed (one copy of the weights) or packed+split (the plain copy too: one row decodes faster, +0.8x the weights)")  # fmt: skip
    # who may call it (issue 41): a key on every endpoint but the public ones, and only the names it is
    # reached by, so a web page the user visits can neither post to it nor read it (DNS rebinding)
    priority_levels: int = Field(3, ge=1, le=16, description="priority levels a request may ask for: 0 (most urgent) to N-1; any other is refused with 400")  # fmt: skip
    max_queue_total: PositiveInt = Field(512, description="waiting requests in all levels together before 429")  # fmt: skip
    api_key: str | None = Field("$VARIANTBENCH_API_KEY", description="the key(s) a client must send as 'Authorization: Bearer KEY', comma-separated; $NAME reads them from that environment variable (unset or empty: no key)")  # fmt: skip
    allow_unauthenticated: bool = Field(False, description="serve without a key on an address other than loopback")  # fmt: skip
    public_paths: tuple[str, ...] = Field(("/health", "/metrics"), description="paths answered without the key")  # fmt: skip
    allowed_hosts: tuple[str, ...] = Field((), description="Host header names accepted besides the bound address and localhost ('*': any)")  # fmt: skip
    # limits: a request larger or slower than these is refused (4xx), not buffered or waited for
    max_body_mb: float = Field(4.0, gt=0, description="largest request body (MiB): 413 above it, read no further")  # fmt: skip
    max_prompt_bytes: PositiveInt | None = Field(None, description="largest prompt in UTF-8 bytes, checked before tokenizing (default: 32 per token of max_len)")  # fmt: skip
    max_stop: PositiveInt = Field(4, description="most 'stop' strings in a request")
    max_stop_chars: PositiveInt = Field(256, description="longest 'stop' string (characters)")
    max_messages: PositiveInt = Field(1024, description="most chat messages in a request")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this (the connection is closed)")  # fmt: skip
    body_timeout_s: float = Field(30.0, gt=0, description="a request's body must arrive within this after its headers (408)")  # fmt: skip
    keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")  # fmt: skip
    max_request_s: float = Field(600.0, gt=0, description="a request's longest lifetime, queue to last token: past it, it ends with 504 (or an error event in its stream)")  # fmt: skip

    @field_validator("variants", "queue_policy", "public_paths", "allowed_hosts", mode="before")
    @classmethod
    def _listed(cls, value: Any, info: Any) -> Any:
        # variants "fp32,int8" from a flag; a queue policy is one string (its own commas inside)
        return names_of(value, split=info.field_name != "queue_policy")

    @field_validator("variants")
    @classmethod
    def _some_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return each_once(value, "empty: at least one variant to serve")


class RouterPlan(_Section):
    """The tiered router (``serve --router``, ``route``): a light and a standard variant, the share of
    requests the standard should take, and the synthetic prompts it is calibrated on."""

    tiers: str | None = Field(None, description="LIGHT,STANDARD variants, e.g. int8,fp32 (serve: none unless set; route: int8,fp32)")  # fmt: skip
    name: str = Field("tiered", description="the model name that reaches the router")
    standard_share: float = Field(0.2, ge=0, le=1, description="target share of requests to the standard")
    calibration_prompts: PositiveInt = Field(32, description="serve: synthetic prompts to calibrate on")
    input_lengths: str = Field("uniform:128-2048", description="serve: calibration prompts' input tokens (as workload.input_lengths)")  # fmt: skip
    seed: int = Field(0, description="seed of the calibration prompts (route: and of the held-out split)")
    # route: half the samples calibrate, half are held out and answered by both variants
    tasks: int = Field(40, ge=4, description="route: synthetic samples (half calibrate, half are held out)")
    route_input_lengths: str = Field("uniform:128-1024", description="route: the samples' input tokens")


class MonitorPlan(_Section):
    """``variantbench monitor``: a small probe run against a live server every ``every_s`` seconds."""

    url: str | None = Field(None, description="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    model: str | None = Field(None, description="the served model's name (default: the server's first)")
    every_s: float = Field(60.0, gt=0, description="seconds from one probe's start to the next's")
    probes: PositiveInt | None = Field(
        None, description="stop after this many probes (default: until Ctrl-C)"
    )
    probe: Path | None = Field(None, description="a plan file for the probe (default: 6 fixed samples, 16 tokens)")  # fmt: skip
    out: Path = Field(Path("variantbench-monitor"), description="monitor.jsonl and the probes' run folders")
    threshold: str = Field("p99_ms=20%,ttft_p99_ms=20%,tokens_per_s=15%,quality=2%", description="the smallest shift to alert on, per metric: p99_ms, ttft_p99_ms, tokens_per_s (relative), quality (absolute drop, points of 100)")  # fmt: skip
    baseline: int = Field(5, ge=2, description="probes that set the baseline level before any alert")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve the monitor's own /metrics on 127.0.0.1:PORT")  # fmt: skip
    api: Literal["completions", "chat"] | None = Field(None, description="completions or chat (default: the probe plan's)")  # fmt: skip


class SearchPlan(_Section):
    """``variantbench search``: the recipe space, the objectives and the budget of trials."""

    space: Path | None = Field(None, description="the search space: recipe steps and finishes (YAML)")
    objectives: str = Field("quality,tokens_per_s,peak_rss", description="what to optimize, comma-separated: quality, kl, tokens_per_s, latency_p90, ttft_p50, peak_rss, weights, batch_tokens_per_s")  # fmt: skip
    budget: PositiveInt = Field(12, description="trials in all (a resumed search counts the earlier ones)")
    sampler: Literal["nsga2", "tpe", "random"] = Field("nsga2", description="nsga2 (Optuna's NSGA-II), tpe or random")  # fmt: skip
    seed: int = Field(0, description="the sampler's seed")
    population: PositiveInt | None = Field(None, description="NSGA-II's generation size (default: budget/3, 4-20)")  # fmt: skip
    prune_margin: float = Field(0.10, ge=0, lt=1, description="stop a trial that a finished one beats by this share in every objective after its first half (0: never)")  # fmt: skip
    fresh: bool = Field(False, description="start over where the folder holds a search (default: resume it)")


class Plan(_Section):
    """Everything a run needs, every default spelled out. ``Plan()`` is the default comparison."""

    out: Path = Field(Path("variantbench-out"), description="output folder for plan.yaml, queries.jsonl and the reports")  # fmt: skip
    model: ModelPlan = ModelPlan()
    variants: tuple[str, ...] = Field(
        DEFAULT_VARIANTS, description="variant recipe chains; see 'variantbench variants'"
    )
    standard: str | None = Field(
        None, description="the baseline variant (default: fp32 if listed, else the first)"
    )
    workload: WorkloadPlan = WorkloadPlan()
    load: LoadPlan = SingleStream()
    limits: LimitsPlan = LimitsPlan()
    targets: TargetsPlan = TargetsPlan()
    seeds: SeedsPlan = SeedsPlan()
    quality: QualityPlan = QualityPlan()
    analysis: AnalysisPlan = AnalysisPlan()
    cost: CostPlan = CostPlan()
    decision: DecisionPlan = DecisionPlan()
    execution: ExecutionPlan = ExecutionPlan()
    output: OutputPlan = OutputPlan()
    endpoints: dict[str, EndpointPlan] = Field(default_factory=dict, description="served variants by name: url, model, api, api_key_env, headers, extra_body (variants NAME=URL#MODEL land here)")  # fmt: skip
    # the other commands' own settings: each reads its section (and model, cost, output where it shares them)
    serve: ServePlan = ServePlan()
    router: RouterPlan = RouterPlan()
    monitor: MonitorPlan = MonitorPlan()
    search: SearchPlan = SearchPlan()

    @model_validator(mode="before")
    @classmethod
    def _served_variants(cls, data: Any) -> Any:
        """``name=URL#model`` in the variants becomes ``name`` plus ``endpoints[name]`` (a plan file's
        entry for that name keeps its other keys: key, headers, body)."""
        if not isinstance(data, dict) or data.get("variants") is None:
            return data
        variants = cls._split(data["variants"])
        if not isinstance(variants, tuple):
            return data
        endpoints = dict(data.get("endpoints") or {})
        names = []
        for v in variants:
            m = ENDPOINT_VARIANT.match(v)
            if m is None:
                names.append(v)
                continue
            given = {k: x for k, x in (("url", m["url"]), ("model", m["model"])) if x}
            endpoints[m["name"]] = {**dict(endpoints.get(m["name"]) or {}), **given}
            names.append(m["name"])
        return {**data, "variants": tuple(names), **({"endpoints": endpoints} if endpoints else {})}

    @field_validator("variants", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return names_of(value)  # "fp32,int8" from a flag or --set

    @field_validator("variants")
    @classmethod
    def _variants(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return each_once(value, "at least one variant is required")

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.standard is not None and self.standard not in self.variants:
            raise ValueError(f"standard {self.standard!r} is not among the variants")
        served = [v for v in self.variants if v in self.endpoints]
        if served and len(served) != len(self.variants):
            local = [v for v in self.variants if v not in self.endpoints]
            raise ValueError(f"{', '.join(served)} {'is' if len(served) == 1 else 'are'} served (NAME=URL) and "
                             f"{', '.join(local)} local: a run compares served variants or local ones, not both")  # fmt: skip
        if self.workload.ignore_eos and not self.served:
            raise ValueError(
                "workload.ignore_eos applies to served models (an endpoint): a local variant stops at its end of text"
            )
        if served and self.model.endpoint:
            raise ValueError(
                "model.endpoint measures one server; with served variants (NAME=URL) leave it unset"
            )
        if isinstance(self.load, Server) and self.load.find_peak:
            if not self.targets.latency_ms:
                raise ValueError("load.find_peak needs targets.latency_ms (the target the peak must meet)")
            if self.quality.accuracy_only:
                raise ValueError(
                    "quality.accuracy_only scores every sample once, untimed: it has no peak to find"
                )
        if self.limits.max_queries is not None and self.limits.max_queries < self.min_queries:
            raise ValueError("limits.max_queries is below the minimum number of queries")
        return self

    # ---- what follows from the plan -------------------------------------------------------------

    @property
    def standard_variant(self) -> str:
        if self.standard is not None:
            return self.standard
        return "fp32" if "fp32" in self.variants else self.variants[0]

    @property
    def min_queries(self) -> int:
        return self.limits.min_queries or self.load.tasks

    @property
    def served(self) -> bool:
        """The variants are served models (endpoints), measured over HTTP."""
        return bool(self.model.endpoint) or any(v in self.endpoints for v in self.variants)

    @property
    def is_timed(self) -> bool:
        return not self.quality.accuracy_only

    @property
    def scenario(self) -> str:
        return "offline" if self.quality.accuracy_only else self.load.scenario

    def ordered_variants(self) -> tuple[str, ...]:
        """The standard first: the others are compared with its answers and its distributions."""
        std = self.standard_variant
        return (std, *(v for v in self.variants if v != std))
