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

A served variant is evaluated through lm-eval's own ``local-completions`` model against its server:
log-likelihoods from ``echo`` + ``logprobs`` on ``/v1/completions`` over token ids, the tokenizer
the server's (vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, which our server also
answers, ``serving/scoring.py``), one request at a time. A server without those endpoints is
reported as not available, with lm-eval's reason, and the rest of the run stands.
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
    """lm-eval's scores of one loaded model (its ``hf`` model class)."""
    from lm_eval.models.huggingface import HFLM

    return _run(HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=1), spec)


def evaluate_served(base_url: str, model: str, spec: LmEvalSpec, headers: dict[str, str] | None = None,
                    timeout_s: float = 120.0) -> dict[str, Any]:  # fmt: skip
    """lm-eval's scores of a served model (its ``local-completions`` model over the server's own
    tokenizer endpoints), or ``{"unavailable": why}`` where the server cannot be evaluated so."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    headers = dict(headers or {})
    bearer = headers.get("Authorization", "")
    try:
        # the tokenizer endpoints get the key (lm-eval's remote tokenizer sends no other header)
        lm = LocalCompletionsAPI(base_url=f"{base_url.rstrip('/')}/v1/completions", model=model,
                                 tokenizer_backend="remote", tokenized_requests=True, num_concurrent=1,
                                 max_retries=1, timeout=int(timeout_s), header=headers or None,
                                 auth_token=bearer.removeprefix("Bearer ") or None)  # fmt: skip
        return _run(lm, spec)
    except (RuntimeError, ValueError, KeyError, TypeError, OSError) as exc:
        import lm_eval

        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return {"tasks": {}, "docs": {}, "version": lm_eval.__version__, "unavailable": reason}


def _run(lm: Any, spec: LmEvalSpec) -> dict[str, Any]:
    """lm-eval's scores of one lm-eval model: {"tasks": {task: {metric: value, metric_stderr: se}},
    "docs": {task: [{"doc_id", metric: value}, ...]}, "version"}."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from variantbench.errors import UserError

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
