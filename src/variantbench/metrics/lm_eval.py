"""Standard evaluation tasks through lm-evaluation-harness, beside our own quality scores.

``quality.lm_eval: {tasks: [...], limit: N, include_path: DIR}`` runs lm-eval's own harness on each
local variant, in the variant's process: its ``hf`` model class (``HFLM``) over the variant as we
built it (the model reloaded from the variant's folder with its load-time recipes applied, so an
int8 variant is evaluated with its int8 modules), greedy and batch size 1 on the variant's device.
Tasks come from lm-eval's registry (``hellaswag``, ``arc_easy``, ``gsm8k``: their datasets need the
dataset hub) or from ``include_path``, a folder of task YAML files: lm-eval's custom tasks, which
can read a local JSONL file (``dataset_path: json`` with ``data_files``), the form our tests use on
machines with no dataset hub. Each task's metrics come back with lm-eval's standard errors, and
with each document's scores (``log_samples``), so the report pairs them with the standard's by
document like every other quality score (``quality_compare.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LmEvalSpec:
    """Picklable: the plan's ``quality.lm_eval`` for a measure job."""

    tasks: tuple[str, ...]
    limit: int | None = None
    include_path: str | None = None
    num_fewshot: int | None = None


PER_DOC_METRICS = ("acc", "acc_norm", "exact_match", "f1")


def evaluate(model: Any, tokenizer: Any, spec: LmEvalSpec, device: str = "cpu") -> dict[str, Any]:
    """lm-eval's scores of one loaded model: {"tasks": {task: {metric: value, metric_stderr: se}},
    "docs": {task: [{"doc_id", metric: value}, ...]}, "version"}."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from variantbench.errors import UserError

    lm = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=1)
    manager = TaskManager(include_path=spec.include_path) if spec.include_path else TaskManager()
    unknown = [t for t in spec.tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"lm-eval does not know the task(s) {', '.join(unknown)}"
                        + (f" (nor does {spec.include_path})" if spec.include_path else ""))  # fmt: skip
    result = simple_evaluate(model=lm, tasks=list(spec.tasks), task_manager=manager, limit=spec.limit,
                             num_fewshot=spec.num_fewshot, log_samples=True, gen_kwargs=None,
                             write_out=False, bootstrap_iters=1000)  # fmt: skip
    tasks: dict[str, dict[str, float | None]] = {}
    for task, metrics in (result or {}).get("results", {}).items():
        scores: dict[str, float | None] = {}
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if isinstance(value, (int, float)) and name not in ("sample_len",):
                scores[name] = None if value != value else float(value)  # NaN (one document's stderr) -> None
        tasks[task] = scores
    docs = {
        task: [
            {"doc_id": int(s["doc_id"]), **{m: float(s[m]) for m in PER_DOC_METRICS if m in s}}
            for s in samples
        ]
        for task, samples in (result or {}).get("samples", {}).items()
    }
    return {"tasks": tasks, "docs": docs, "version": lm_eval.__version__}
