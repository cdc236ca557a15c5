"""Logit fidelity: how closely a variant's next-token distributions follow the standard's.

As llama.cpp's perplexity tool reports it (``--kl-divergence``): the same token ids of a held-out
text go through every variant; the text is cut into chunks of ``ctx`` tokens and, in each chunk,
the second half is scored with the first half as context. Per variant: perplexity of the text,
mean and p99 KL divergence KL(standard || variant) over the scored positions, and top-1 agreement
(the variant's most likely next token is the standard's). Deterministic and generation-free.

The standard variant runs first and leaves its log-probabilities (float16) in a cache file; the
others, in their own processes, read it. The default text is CPython's ``pydoc_data.topics``
(plain English documentation that ships with Python); users may give any UTF-8 text file.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import math
from pathlib import Path
from typing import Any

from variantbench.compute import on_compute
from variantbench.metrics.latency import percentile

DEFAULT_CTX = 512
DEFAULT_CHUNKS = 2


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str | None) -> tuple[str, str]:
    """(text, its name) of the held-out text: a user file or pydoc_data.topics."""
    if path is None:
        return default_text(), "pydoc_data.topics"
    try:
        return Path(path).read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        from variantbench.errors import UserError

        raise UserError(f"cannot read the fidelity text {path}: {exc}") from None


@dataclass(frozen=True)
class FidelitySpec:
    """Picklable: where the text is, how it is cut, where the standard's distributions live."""

    text_path: str | None = None
    ctx: int = DEFAULT_CTX
    chunks: int = DEFAULT_CHUNKS
    cache_dir: str = ""
    model_key: str = ""  # the base model's identity (folder), part of the cache key

    def cache_file(self, ids: list[int]) -> Path:
        digest = hashlib.sha256(
            f"{self.model_key}|{self.ctx}|{self.chunks}|{','.join(map(str, ids))}".encode()
        ).hexdigest()[:20]
        return Path(self.cache_dir) / f"standard-logprobs-{digest}.pt"


def chunk_ids(all_ids: list[int], ctx: int, chunks: int) -> list[list[int]]:
    usable = len(all_ids) // ctx
    if usable == 0:
        raise ValueError(f"the fidelity text has {len(all_ids)} tokens, fewer than one chunk of {ctx}")
    return [all_ids[i * ctx : (i + 1) * ctx] for i in range(min(chunks, usable))]


def scored_log_probs(backend: Any, chunk: list[int]) -> Any:
    """Log-probs at the scored positions of one chunk (second half, each predicting the next id)."""
    first = len(chunk) // 2
    return backend.token_log_probs(chunk)[first:-1]


@on_compute  # its torch ops on the engine's thread: a second OpenMP pool slows every decode step after
def measure(backend: Any, spec: FidelitySpec, is_standard: bool) -> dict[str, float | int | str | None]:
    """Perplexity, KL mean/p99 and top-1 agreement of a loaded backend with ``token_log_probs``."""
    import torch

    text, name = read_text(spec.text_path)
    # only the start of the text is used: tokenize a generous prefix (a token is rarely > 8 chars)
    ids = backend.tokenize(text[: spec.ctx * spec.chunks * 8])
    if len(ids) < spec.ctx * spec.chunks:
        ids = backend.tokenize(text)
    chunks = chunk_ids(ids, spec.ctx, spec.chunks)
    flat = [i for c in chunks for i in c]
    cache = spec.cache_file(flat)
    mine = [scored_log_probs(backend, c) for c in chunks]
    targets = torch.tensor([t for c in chunks for t in c[len(c) // 2 + 1 :]], dtype=torch.long)
    lp = torch.cat(mine)  # [N, V] float32
    nll = -lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    out: dict[str, float | int | str | None] = {
        "text": name,
        "tokens_scored": int(targets.numel()),
        "perplexity": float(math.exp(nll.mean().item())),
        "kl_mean": None,
        "kl_p99": None,
        "top1_agreement": None,
    }
    if is_standard:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save(lp.to(torch.float16), tmp)
        tmp.replace(cache)
    if not cache.exists():
        return out  # the standard did not run (or failed): nothing to compare with
    ref = torch.load(cache).to(torch.float32)
    if ref.shape != lp.shape:
        return out
    kl = (ref.exp() * (ref - lp)).sum(-1).clamp(min=0)
    out["kl_mean"] = float(kl.mean())
    out["kl_p99"] = percentile(kl.tolist(), 99)
    out["top1_agreement"] = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
    return out
