"""Putting variants behind the server: load each, give it an executor, calibrate the router, run uvicorn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
import json
import os
import time
from typing import Any

from variantbench.errors import UserError
from variantbench.plan import ServePlan, default_of
from variantbench.serving.app import ServedModel
from variantbench.serving.batching import ChunkedPrefill
from variantbench.serving.guard import LOOPBACK, Access, parse_keys
from variantbench.serving.requests import Limits
from variantbench.serving.scheduler import QueuePolicy
from variantbench.serving.worker import BatchWorker


def parse_queue_policy(text: str) -> tuple[int, QueuePolicy]:
    """``LEVEL:max_queue=N,timeout_ms=T,on_timeout=reject|delay,ttft_slo_ms=S,shed_late=true|false`` (any subset after the colon)."""
    level, sep, rest = text.partition(":")
    try:
        prio = int(level)
    except ValueError:
        raise UserError(
            f"--queue-policy {text!r}: starts with a priority level (an integer) and a colon"
        ) from None
    if not sep:
        raise UserError(
            f"--queue-policy {text!r}: expected LEVEL:max_queue=N,timeout_ms=T,on_timeout=reject|delay,ttft_slo_ms=S,shed_late=true|false"
        )
    policy = QueuePolicy()
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, _, value = item.partition("=")
        try:
            if key == "max_queue":
                policy.max_queue = int(value)
                if policy.max_queue < 1:
                    raise ValueError
            elif key == "timeout_ms":
                policy.timeout_ms = float(value)
                if policy.timeout_ms <= 0:
                    raise ValueError
            elif key == "ttft_slo_ms":
                policy.ttft_slo_ms = float(value)
                if policy.ttft_slo_ms <= 0:
                    raise ValueError
            elif key == "shed_late":
                if value not in ("true", "false"):
                    raise ValueError
                policy.shed_late = value == "true"
            elif key == "on_timeout":
                if value not in ("reject", "delay"):
                    raise ValueError
                policy.on_timeout = value
            else:
                raise UserError(
                    f"--queue-policy {text!r}: unknown key {key!r} (max_queue, timeout_ms, on_timeout, ttft_slo_ms, shed_late)"
                )
        except ValueError:
            raise UserError(f"--queue-policy {text!r}: bad value for {key}: {value!r}") from None
    return prio, policy


WEIGHT_LAYOUTS = ("packed", "packed+split")


@dataclass(frozen=True)
class ServeOptions:
    """What a served variant's batch and queues take, built from the plan's ``serve`` section
    (``from_plan``); its defaults are the plan's. ``aging_ms`` is the scheduler's own constant."""

    max_batch_size: int = default_of("serve.max_batch_size")
    max_wait_ms: float = default_of("serve.max_wait_ms")
    max_queue: int = default_of("serve.max_queue")
    queue_timeout_ms: float | None = default_of("serve.queue_timeout_ms")
    max_len: int = default_of("serve.max_len")
    aging_ms: float = 1000.0
    prefill_chunk: int = default_of(
        "serve.prefill_chunk"
    )  # prompt tokens per step, prefilled beside the decode rows
    # keys/values of prompt prefixes kept for reuse (llama.cpp: finished prompts kept); 0: off
    prefix_cache_mb: float = default_of("serve.prefix_cache_mb")
    policies: dict[int, QueuePolicy] = field(default_factory=dict)  # per priority level
    # level 0's first-token objective unless its own policy sets one (None: none); the seeds' promise
    ttft_slo_ms: float | None = default_of("serve.ttft_slo_ms")
    kv_cache: str = default_of("serve.kv_cache")  # torch engine: paged | contiguous
    kv_cache_gb: float | None = default_of("serve.kv_cache_gb")  # None: 80% of the memory available at start
    # torch engine, fp32 on CPU: "packed" keeps one copy of each layer's weights (idle RSS ~0.7x
    # less); "packed+split" adds the plain row-major copy, whose one-row product decodes one row
    # faster (~10% measured with the split-K copy it replaced)
    weight_layout: str = default_of("serve.weight_layout")
    priority_levels: int = default_of("serve.priority_levels")  # a request's priority: 0 .. levels-1
    max_queue_total: int = default_of("serve.max_queue_total")  # waiting in all levels together

    @classmethod
    def from_plan(cls, s: ServePlan) -> ServeOptions:
        return cls(max_batch_size=s.max_batch_size, max_wait_ms=s.max_wait_ms, max_queue=s.max_queue,
                   queue_timeout_ms=s.queue_timeout_ms, max_len=s.max_len, prefill_chunk=s.prefill_chunk,
                   prefix_cache_mb=s.prefix_cache_mb, policies=dict(parse_queue_policy(p) for p in s.queue_policy),
                   ttft_slo_ms=s.ttft_slo_ms or None, kv_cache=s.kv_cache, kv_cache_gb=s.kv_cache_gb,
                   weight_layout=s.weight_layout, priority_levels=s.priority_levels,
                   max_queue_total=s.max_queue_total)  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise UserError(f"--max-batch-size must be at least 1, got {self.max_batch_size}")
        if self.max_wait_ms < 0:
            raise UserError(f"--max-wait-ms must be at least 0, got {self.max_wait_ms}")
        if self.max_queue < 1:
            raise UserError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.queue_timeout_ms is not None and self.queue_timeout_ms <= 0:
            raise UserError(f"--queue-timeout-ms must be positive, got {self.queue_timeout_ms}")
        if self.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.prefix_cache_mb < 0:
            raise UserError(f"--prefix-cache-mb must be at least 0, got {self.prefix_cache_mb}")
        if self.max_len < 8:
            raise UserError(f"--max-len must be at least 8, got {self.max_len}")
        if self.kv_cache not in ("paged", "contiguous"):
            raise UserError(f"--kv-cache must be paged or contiguous, got {self.kv_cache!r}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise UserError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb:g}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise UserError(
                f"--weight-layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {self.weight_layout!r}"
            )
        if not 1 <= self.priority_levels <= 16:
            raise UserError(f"--priority-levels must be between 1 and 16, got {self.priority_levels}")
        outside = sorted(level for level in self.policies if not 0 <= level < self.priority_levels)
        if outside:
            raise UserError(f"--queue-policy for level {outside[0]}: the levels are 0 to {self.priority_levels - 1} "
                            "(--priority-levels)")  # fmt: skip
        if self.max_queue_total < 1:
            raise UserError(f"--max-queue-total must be at least 1, got {self.max_queue_total}")
        if self.ttft_slo_ms is not None and self.ttft_slo_ms <= 0:
            raise UserError(
                f"--ttft-slo-ms must be positive (0 on the command line: none), got {self.ttft_slo_ms}"
            )

    def level_policies(self) -> dict[int, QueuePolicy]:
        """The per-level policies, level 0 given the default first-token objective if it sets none."""
        out = dict(self.policies)
        if self.ttft_slo_ms is not None:
            zero = out.get(0) or QueuePolicy(max_queue=self.max_queue, timeout_ms=self.queue_timeout_ms)
            if zero.ttft_slo_ms is None:
                out[0] = replace(zero, ttft_slo_ms=self.ttft_slo_ms)
        return out


def serve_model(name: str, backend: Any, options: ServeOptions) -> ServedModel:
    """A loaded backend behind its own executor (not started: the app's lifespan starts it)."""
    from variantbench.backends.base import CompactsWeights
    from variantbench.serving.batching import batch_for

    if options.weight_layout == "packed" and isinstance(backend, CompactsWeights):
        backend.compact_weights()
    batch = batch_for(backend, options.max_batch_size, options.max_len, prefill_chunk=options.prefill_chunk,
                      prefix_cache_mb=options.prefix_cache_mb, kv_cache=options.kv_cache,
                      kv_cache_gb=options.kv_cache_gb)  # fmt: skip
    worker = BatchWorker(batch, max_queue=options.max_queue, aging_ms=options.aging_ms,
                         queue_timeout_ms=options.queue_timeout_ms, max_wait_ms=options.max_wait_ms,
                         policies=options.level_policies(), name=name, max_total=options.max_queue_total)  # fmt: skip
    worker.warm_up()  # the step-cost model fitted before the first request; not in the step log
    trace = os.environ.get("VARIANTBENCH_STEP_LOG")
    if trace:  # every step as a JSON line (end time on the monotonic clock): where a latency went
        worker.step_listeners.append(_step_log(trace, name, worker))
    return ServedModel(name, backend, backend.tokenizer, worker, dict(backend.info()))


def _step_log(path: str, name: str, worker: BatchWorker) -> Callable[[int, float, int], None]:
    """Each step: its decode rows and prompt tokens, then what the batch holds (``active``: rows and
    prompts being prefilled) and what waits in the queue, by priority level."""
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the server's life

    def log(rows: int, seconds: float, prompt_tokens: int) -> None:
        prefilling: dict[int, int] = {}
        for p in worker.batch.pending_prefills() if isinstance(worker.batch, ChunkedPrefill) else []:
            prefilling[p.priority] = prefilling.get(p.priority, 0) + 1
        out.write(json.dumps({"model": name, "end_s": round(time.monotonic(), 4), "seconds": round(seconds, 4),
                              "rows": rows, "prompt_tokens": prompt_tokens, "active": worker.batch.active,
                              "prefilling": prefilling, "queued": worker.scheduler.queued_by_level()}) + "\n")  # fmt: skip

    return log


def load_models(model_dir: str, variants: Sequence[str], options: ServeOptions, device: str = "cpu",
                threads: int | None = None, say: Callable[[str], None] = lambda _m: None) -> dict[str, ServedModel]:  # fmt: skip
    from variantbench.backends.base import ReportsStatus
    from variantbench.backends.registry import make_backend
    from variantbench.variants.spec import VariantSpec

    models: dict[str, ServedModel] = {}
    try:
        for name in variants:
            # no artifact: the backend builds the variant (if it must) before its startup clock starts
            backend = make_backend(VariantSpec.parse(name), None, model_dir, device=device, threads=threads)
            if isinstance(backend, ReportsStatus):
                backend.status = say
            say(f"loading {name}")
            info = backend.load()
            models[name] = serve_model(name, backend, options)
            batch = models[name].worker.batch
            memory = batch.describe()
            say(f"{name}: ready in {info.startup_s:.1f} s (batches of up to {batch.max_batch} x {batch.max_len} tokens"
                f"{', ' + memory if memory else ''})")  # fmt: skip
    except BaseException:
        close_models(models)
        raise
    return models


def close_models(models: dict[str, ServedModel]) -> None:
    for m in models.values():
        close = getattr(m.worker.batch, "close", None)
        if close:
            close()
        m.backend.close()


def build_router(models: dict[str, ServedModel], light: str, standard: str, share: float, prompts: Sequence[Any],
                 name: str = "tiered", say: Callable[[str], None] = lambda _m: None) -> Any:  # fmt: skip
    """Calibrate the tiered router's threshold on ``prompts`` (samples) with the light variant."""
    from variantbench.backends.base import GenerationRequest, encode_request
    from variantbench.serving.router import TieredRouter, calibrate, prompt_features

    for role, v in (("light", light), ("standard", standard)):
        if v not in models:
            raise UserError(
                f"router {role} variant {v!r} is not among the served variants: {', '.join(models)}"
            )
    if name in models:
        raise UserError(f"router name {name!r} is also a variant's name")
    lm = models[light]
    log_probs = getattr(lm.backend, "token_log_probs", None)
    if log_probs is None:
        raise UserError(f"router light variant {light!r} cannot score prompts (no token log-probabilities)")
    say(f"calibrating the router on {len(prompts)} prompts for a standard share of {share:g}")
    feats = []
    for s in prompts:
        ids = encode_request(
            lm.tokenizer, GenerationRequest(s.sample_id, prompt=s.prompt, messages=s.messages)
        )
        feats.append(prompt_features(log_probs, ids))
    try:
        cal = calibrate(feats, share)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return TieredRouter(light, standard, log_probs, cal, name=name)


def run_server(app: Any, host: str, port: int, header_timeout_s: float = default_of("serve.header_timeout_s"),
               keep_alive_s: float = default_of("serve.keep_alive_s")) -> None:  # fmt: skip
    """uvicorn until Ctrl-C, or until a worker stops for good: then a ``UserError`` (exit 1) says why."""
    import uvicorn

    server = uvicorn.Server(server_config(app, host, port, header_timeout_s, keep_alive_s))
    workers = [m.worker for m in app.state.server.models.values()]
    for worker in workers:
        worker.on_fatal.append(lambda _why: setattr(server, "should_exit", True))
    server.run()
    failed = [w.fatal for w in workers if w.fatal]
    if failed:
        raise UserError(f"the server stopped: {failed[0]}")


def server_config(app: Any, host: str, port: int, header_timeout_s: float = default_of("serve.header_timeout_s"),
                  keep_alive_s: float = default_of("serve.keep_alive_s"), log_level: str = "warning") -> Any:  # fmt: skip
    """uvicorn's configuration: httptools with a deadline on each request's headers (``protocol.py``)."""
    import uvicorn

    from variantbench.serving.protocol import with_header_timeout

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=with_header_timeout(header_timeout_s), lifespan="on", backlog=4096,
                          timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=30)  # fmt: skip


def serve_limits(s: ServePlan) -> Limits:
    return Limits(max_len=s.max_len, max_body_bytes=int(s.max_body_mb * (1 << 20)), max_prompt_bytes=s.max_prompt_bytes,
                  max_stop=s.max_stop, max_stop_chars=s.max_stop_chars, max_messages=s.max_messages,
                  priority_levels=s.priority_levels)  # fmt: skip


def serve_access(s: ServePlan, environ: dict[str, str]) -> Access:
    """Who may call the server; binding beyond loopback with no key is refused unless asked for."""
    keys = parse_keys(s.api_key, environ)
    if not keys and s.host not in LOOPBACK and not s.allow_unauthenticated:
        raise UserError(f"binding {s.host} without an API key would let anyone on the network use it: set "
                        "--api-key (or VARIANTBENCH_API_KEY), or --allow-unauthenticated")  # fmt: skip
    return Access.for_server(s.host, keys, s.allowed_hosts, public_paths=s.public_paths,
                             max_body_bytes=serve_limits(s).max_body_bytes, body_timeout_s=s.body_timeout_s)  # fmt: skip


def calibration_samples(model_dir: str, n: int, seed: int, input_lengths: str) -> list:
    """Synthetic prompts for the router's calibration (and ``route``'s held-out half), counted in tokens."""
    from variantbench.workloads import build_synthetic, parse_lengths
    from variantbench.workloads.counting import tokenizer_counter

    try:
        lengths = parse_lengths(input_lengths)
    except ValueError as exc:
        raise UserError(f"--input-lengths: {exc}") from None
    workload = build_synthetic(
        n, seed, lengths=lengths, counter=tokenizer_counter(model_dir), counted_with=model_dir
    )
    return list(workload.samples)


def router_pair(router: str) -> tuple[str, str]:
    """``"int8,fp32"`` -> ("int8", "fp32"): the light and the standard variant of the tiered router."""
    light, sep, standard = router.partition(",")
    if not sep or not light.strip() or not standard.strip():
        raise UserError(f"--router takes LIGHT,STANDARD (e.g. int8,fp32), got {router!r}")
    return light.strip(), standard.strip()
