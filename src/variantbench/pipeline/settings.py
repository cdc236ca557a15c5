"""What the plan means for the harness and for the judging of a run: pure translations of the plan."""

from __future__ import annotations

from variantbench.loadgen.harness import LoadSettings
from variantbench.plan import Plan
from variantbench.report.summary import Criteria

# the plan's scenario settings that are not knobs of the harness (they shape the workload or the search)
_NOT_HARNESS = {"scenario", "tasks", "find_peak"}


def load_settings(plan: Plan, run_id: str, n_samples: int | None = None) -> LoadSettings:
    """The harness's settings; ``n_samples`` is the workload's size (one pass by default).

    The plan's scenario model carries exactly its own knobs, named as the harness names them, so
    they pass through without a ladder over scenarios.
    """
    n = n_samples or plan.load.tasks
    limits = plan.limits
    common = dict(sample_seed=plan.seeds.workload, max_new_tokens=plan.workload.max_new_tokens, run_id=run_id,
                  drain_timeout_s=limits.drain_timeout_s)  # fmt: skip
    if plan.quality.accuracy_only:  # every sample once, untimed: all at once, batched as the backend likes
        batch = plan.load.model_dump().get("max_batch_size", LoadSettings.max_batch_size)
        return LoadSettings(scenario="offline", min_queries=n, max_queries=n, warmup=0, max_batch_size=batch,
                            **common)  # fmt: skip
    knobs = plan.load.model_dump(exclude=_NOT_HARNESS)
    if "senders" in knobs:
        # served variants on --executor ray: sender actors on the cluster's nodes (default one a node)
        on_ray = plan.served and plan.execution.executor == "ray"
        knobs["senders"] = (
            (knobs["senders"] or (0 if on_ray else default_senders(plan))) if plan.served else 1
        )
        knobs.update(ray_senders=on_ray, ray_address=plan.execution.address if on_ray else None)
    return LoadSettings(
        scenario=plan.load.scenario,
        **knobs,
        min_queries=limits.min_queries or n,
        max_queries=limits.max_queries,
        min_duration_s=limits.min_duration_s,
        max_duration_s=limits.max_duration_s,
        warmup=limits.warmup,
        schedule_seed=plan.seeds.schedule,
        accuracy_share=plan.quality.accuracy_log,
        **common,
    )


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def default_senders(plan: Plan) -> int:
    """One sender process per core for a remote server; half the cores for one on this machine,
    which needs the rest (on 2 cores, two senders beside a local server measured a p99 dispatch lag
    of 4.5 ms at 100 requests/s, one sender 0.9 ms)."""
    from urllib.parse import urlparse

    from variantbench.environment import usable_cores

    cores = usable_cores()
    urls = [plan.model.endpoint] if plan.model.endpoint else [plan.endpoints[v].url for v in plan.variants]
    local = all(urlparse(u).hostname in LOOPBACK for u in urls if u)
    return max(1, cores // 2) if local else max(1, cores)


def criteria_for(
    plan: Plan, seeds: dict[str, int] | None = None, target_qps: float | None = None
) -> Criteria:
    t = plan.targets
    return Criteria(
        percentile=t.percentile,
        latency_target_ms=t.latency_ms,
        ttft_target_ms=t.ttft_ms,
        tpot_target_ms=t.tpot_ms,
        min_queries=plan.min_queries,
        min_duration_s=plan.limits.min_duration_s,
        window=t.window,
        seeds={"workload": plan.seeds.workload, **(seeds or {})},
        target_qps=target_qps if target_qps is not None else getattr(plan.load, "rate_qps", None),
        goodput_slo_ms=dict(t.goodput_ms),
        percentile_metrics=plan.output.percentile_metrics,
        metric_percentiles=plan.output.metric_percentiles,
    )
