"""Likelihood scores of one variant on the workload's own samples, as lm-evaluation-harness scores.

Generated text is a noisy witness of a variant's quality: a variant whose distributions differ from
the standard's by a KL of 0.03 nats answers differently often enough that ROUGE on 8 samples moved
88-134% of the standard's across reruns (issue 39). The model's probabilities of known text are a
low-noise, continuous signal, computed here in one forward per sample (``token_log_probs``) of the
prompt (through the model's chat template, as the harness sends it) followed by a continuation:

* reference log-likelihood: the summed and per-token log-probability of the reference answer;
* choices (samples with ``choices``, the classification task): log p(choice | prompt) for each (a
  label's lower-case and capitalized forms together: a chat model answers "Positive" as often as
  "positive"), accuracy (the most likely is the reference) and normalized accuracy (by the choice's
  length in bytes, lm-eval's ``acc_norm``);
* fidelity on the sample's own positions: KL(standard || variant) and top-1 agreement at the
  positions the answer is scored on (the last prompt token and the reference's tokens). The
  standard keeps, per position, its ``TOP_K`` most likely tokens' log-probabilities and the rest's
  mass; the KL between those coarse distributions is a lower bound of the full KL (the data
  processing inequality), exact when the standard's mass lies in its top tokens, and costs 2 KB a
  position to keep instead of a vocabulary's worth (192 KB for SmolLM2's 49,152 tokens in float32).

The standard runs first and leaves its part in a cache file keyed by the model, the samples and the
token ids; the others read it in their own processes (as ``fidelity.py`` does for the held-out text).

A served variant (``measure_served``) gets the reference's and the choices' log-likelihoods from its
server (``echo`` + ``logprobs``, ``backends/openai_http.py``): the same numbers, with no fidelity (a
server returns the scored token's log-probability, not the distribution a KL needs). A server that
cannot score is reported as not available, with its reason, and the gate reads the other scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import hashlib
import math
from pathlib import Path
from typing import Any

from variantbench.compute import on_compute
from variantbench.errors import SampleNotScored

TOP_K = 256
MAX_CONTINUATION = 64  # reference tokens scored per sample (the answer's start carries its content)


@dataclass(frozen=True)
class LikelihoodSpec:
    """Picklable: where the standard's distributions are kept, and whose model they are."""

    cache_dir: str = ""
    model_key: str = ""

    def cache_file(self, key: str) -> Path:
        digest = hashlib.sha256(f"{self.model_key}|{TOP_K}|{key}".encode()).hexdigest()[:20]
        return Path(self.cache_dir) / f"standard-sample-topk-{digest}.pt"


def choices_of(sample: Any) -> tuple[str, ...]:
    """The answer choices of a sample scored by likelihood (classification: its labels), or ()."""
    from variantbench.metrics.quality import LABELS

    return tuple(LABELS) if sample.task == "classification" else ()


def _continuation(backend: Any, text: str) -> list[int]:
    return list(backend.tokenize(text))[:MAX_CONTINUATION]


def _sum_logprob(lp: Any, ids: list[int], start: int) -> float:
    """Sum of log p(ids[i] | ...) where row ``start + i`` of ``lp`` predicts ids[i]."""
    return float(sum(lp[start + i, t].item() for i, t in enumerate(ids)))


def _choice_scores(sample: Any, out: dict[str, Any], logprob: Callable[[str], float]) -> None:
    """Accuracy and normalized accuracy by the choices' log-likelihoods (a label's lower-case and
    capitalized forms together: a chat model answers "Positive" as often as "positive")."""
    choices = choices_of(sample)
    if not choices:
        return
    scores = [_logsumexp([logprob(form) for form in dict.fromkeys((c, c.capitalize()))]) for c in choices]
    norm = [v / max(1, len(c.encode())) for v, c in zip(scores, choices, strict=True)]
    target = sample.reference.strip().lower()
    pick = choices[max(range(len(scores)), key=scores.__getitem__)]
    pick_norm = choices[max(range(len(norm)), key=norm.__getitem__)]
    out.update(choice_logprobs=dict(zip(choices, scores, strict=True)), choice=pick,
               acc=float(pick.lower() == target), acc_norm=float(pick_norm.lower() == target))  # fmt: skip


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _reference(out: dict[str, Any], logprobs: Sequence[float]) -> None:
    if logprobs:
        total = float(sum(logprobs))
        out.update(ref_logprob=total, ref_tokens=len(logprobs), ref_logprob_per_token=total / len(logprobs))


def score_sample(backend: Any, sample: Any, prompt: list[int]) -> tuple[dict[str, Any], Any]:
    """One sample's likelihood scores and the log-probs [positions, vocab] at its scored positions;
    ``prompt``: the sample's token ids as the harness sends them (the caller encodes the request)."""
    out: dict[str, Any] = {"sample_id": sample.sample_id, "task": sample.task}
    ref = _continuation(backend, sample.reference) if sample.reference else []
    lp = backend.token_log_probs(prompt + ref) if ref else backend.token_log_probs(prompt)
    start = len(prompt) - 1  # the row that predicts the first continuation token
    _reference(out, [float(lp[start + i, t]) for i, t in enumerate(ref)])

    forwards = [(ref, lp)]  # continuations run after the prompt, and their log-probs

    def logprob(text: str) -> float:
        """A choice's log-probability, read off a forward already run where one covers it (every
        token but its last fed after the prompt): a one-token label is read off the reference's
        rows. Classification took five prompt forwards a sample (the reference, two labels in two
        cases each), each a whole prefill (35.5 s of fp32's 8 default samples on a 2-core AVX2
        host, 203 s for bf16); one now."""
        ids = _continuation(backend, text)
        for cont, rows in forwards:
            if len(cont) >= len(ids) - 1 and cont[: len(ids) - 1] == ids[:-1]:
                return _sum_logprob(rows, ids, start)
        rows = backend.token_log_probs(prompt + ids)
        forwards.append((ids, rows))
        return _sum_logprob(rows, ids, start)

    _choice_scores(sample, out, logprob)
    return out, lp[start : start + max(1, len(ref))].float()


def measure_served(
    backend: Any, samples: Sequence[Any], request_of: Callable[[Any], Any]
) -> list[dict[str, Any]]:
    """Every sample's likelihood scores from a server (``ScoresServed``): the reference's and each
    choice form's log-probabilities in one request a sample; a sample the server refuses (too long
    for its context) is left out. Raises ``ScoringUnavailable``."""
    rows = []
    for sample in samples:
        out: dict[str, Any] = {"sample_id": sample.sample_id, "task": sample.task}
        forms = list(dict.fromkeys(f for c in choices_of(sample) for f in (c, c.capitalize())))
        texts = list(dict.fromkeys(([sample.reference] if sample.reference else []) + forms))
        if texts:
            try:
                scored = backend.continuation_logprobs(request_of(sample), texts, MAX_CONTINUATION)
            except SampleNotScored:
                continue
            got = dict(zip(texts, scored, strict=True))
            _reference(out, got.get(sample.reference, []) if sample.reference else [])
            _choice_scores(sample, out, lambda text, got=got: float(sum(got[text])))
        rows.append(out)
    return rows


def top_k(positions: Any) -> dict[str, Any]:
    """The standard's part of a sample: top-k log-probs, their ids, and the rest's log-mass."""
    import torch

    values, ids = positions.topk(min(TOP_K, positions.shape[-1]), dim=-1)
    rest = torch.log1p(-values.exp().sum(-1).clamp(max=1 - 1e-7))
    return {"values": values.to(torch.float32), "ids": ids.to(torch.int32), "rest": rest.to(torch.float32)}


def kl_from_top_k(standard: dict[str, Any], positions: Any) -> tuple[list[float], list[float]]:
    """Per position: KL(standard || variant) over the standard's top-k plus the rest (a lower bound),
    and whether the variant's most likely token is the standard's."""
    import torch

    s_top = standard["values"].float()
    ids = standard["ids"].long()
    v_top = positions.gather(-1, ids)
    s_rest, v_rest = standard["rest"], torch.log1p(-v_top.exp().sum(-1).clamp(max=1 - 1e-7))
    kl = (s_top.exp() * (s_top - v_top)).sum(-1) + s_rest.exp() * (s_rest - v_rest)
    agree = (positions.argmax(-1) == ids[:, 0]).float()
    return kl.clamp(min=0).tolist(), agree.tolist()


@on_compute  # its torch ops on the engine's thread: a second OpenMP pool slows every decode step after
def measure(backend: Any, samples: Sequence[Any], spec: LikelihoodSpec, is_standard: bool,
            prompt_of: Callable[[Any], list[int]]) -> dict[str, Any]:  # fmt: skip
    """Every sample's likelihood scores (and, beside the standard's kept distributions, its KL)."""
    import torch

    per_sample, parts = [], {}
    for sample in samples:
        scores, positions = score_sample(backend, sample, prompt_of(sample))
        per_sample.append(scores)
        parts[sample.sample_id] = (positions, scores)
    key = "|".join(f"{s['sample_id']}:{s.get('ref_tokens', 0)}" for s in per_sample)
    cache = spec.cache_file(key)
    if is_standard:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({sid: top_k(pos) for sid, (pos, _) in parts.items()}, tmp)
        tmp.replace(cache)
    kept = torch.load(cache) if cache.exists() else None
    for scores in per_sample:
        standard = kept.get(scores["sample_id"]) if kept else None
        positions = parts[scores["sample_id"]][0]
        if standard is not None and standard["ids"].shape[0] == positions.shape[0]:
            kl, agree = kl_from_top_k(standard, positions)
            scores["kl"] = sum(kl) / len(kl)
            scores["top1"] = sum(agree) / len(agree)
    return {"samples": per_sample, "summary": summarize(per_sample)}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(per_sample: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the samples: reference log-likelihood per token (and its perplexity), choice
    accuracy and normalized accuracy, KL and top-1 agreement on the samples' own positions."""
    lp = [s["ref_logprob"] for s in per_sample if "ref_logprob" in s]
    n = sum(s["ref_tokens"] for s in per_sample if "ref_tokens" in s)
    per_token = sum(lp) / n if n else None
    return {
        "samples": len(per_sample),
        "ref_logprob_per_token": per_token,
        "ref_perplexity": math.exp(-per_token) if per_token is not None else None,
        "choice_accuracy": _mean([s["acc"] for s in per_sample if "acc" in s]),
        "choice_accuracy_norm": _mean([s["acc_norm"] for s in per_sample if "acc_norm" in s]),
        "choice_samples": sum(1 for s in per_sample if "acc" in s),
        "kl_mean": _mean([s["kl"] for s in per_sample if "kl" in s]),
        "top1_agreement": _mean([s["top1"] for s in per_sample if "top1" in s]),
    }
