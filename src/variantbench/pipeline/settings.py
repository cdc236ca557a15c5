"""What the plan means for the harness and for the judging of a run: pure translations of the plan."""

from __future__ import annotations

from variantbench.loadgen.harness import LoadSettings
from variantbench.plan import MultiStream, Plan, Server
from variantbench.report.summary import Criteria


def load_settings(plan: Plan, run_id: str, n_samples: int | None = None) -> LoadSettings:
    """The harness's settings; ``n_samples`` is the workload's size (one pass by default)."""
    n = n_samples or plan.load.tasks
    load, limits = plan.load, plan.limits
    batch = getattr(load, "max_batch_size", 8)
    if plan.quality.accuracy_only:  # every sample once, untimed: all at once, batched as the backend likes
        return LoadSettings(scenario="offline", min_queries=n, max_queries=n, warmup=0, max_batch_size=batch,
                            sample_seed=plan.seeds.workload, max_new_tokens=plan.workload.max_new_tokens,
                            run_id=run_id, drain_timeout_s=limits.drain_timeout_s)  # fmt: skip
    server = load if isinstance(load, Server) else None
    return LoadSettings(
        scenario=load.scenario,
        min_queries=limits.min_queries or n,
        max_queries=limits.max_queries,
        min_duration_s=limits.min_duration_s,
        max_duration_s=limits.max_duration_s,
        warmup=limits.warmup,
        rate_qps=server.rate_qps if server else None,
        burstiness=server.burstiness if server else 1.0,
        max_concurrency=server.max_concurrency if server else None,
        samples_per_query=load.samples_per_query if isinstance(load, MultiStream) else 1,
        max_batch_size=batch,
        schedule_seed=plan.seeds.schedule,
        sample_seed=plan.seeds.workload,
        max_new_tokens=plan.workload.max_new_tokens,
        drain_timeout_s=limits.drain_timeout_s,
        run_id=run_id,
        accuracy_share=plan.quality.accuracy_log,
    )


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
    )
