"""The executors by name (``execution.executor``), each a factory taking the plan. A new executor
is a new module and a line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from variantbench.pipeline.executors import Executor, InlineExecutor, LocalProcessExecutor


def _ray(plan: Any) -> Executor:
    from variantbench.pipeline.ray_executor import RayExecutor  # Ray only when asked for

    e = plan.execution
    return RayExecutor(address=e.address, retries=e.retries, gpus=1 if plan.model.device.startswith("cuda") else 0,
                       memory_gb=e.memory_gb, shared_cache=str(e.shared_cache) if e.shared_cache else None)  # fmt: skip


EXECUTORS: dict[str, Callable[[Any], Executor]] = {
    "local": lambda _: LocalProcessExecutor(
        # modules the child imports before the job's clocks start
        preload=(
            "torch",
            "transformers.models.auto.modeling_auto",
            "transformers.models.auto.tokenization_auto",
        )
    ),
    "inline": lambda _: InlineExecutor(),
    "ray": _ray,
}
