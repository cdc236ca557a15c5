"""Which continuous batch serves a loaded backend: a registry keyed by the backend's engine.

Serving picks the batch for a backend (``info()["backend"]``); backends never import serving.
A new engine that can be served is one more entry here.

- ``torch`` (our decoder): ``ContinuousBatch``, chunked prefill beside the decode rows and, when
  ``prefix_cache_mb`` > 0, prefix caching.
- ``llama.cpp``: ``LlamaCppBatch``, up to ``max_batch`` sequences per ``llama_decode``. Prompts are
  prefilled at admission in llama.cpp's own ``n_batch`` chunks; ``prefill_chunk`` and
  ``prefix_cache_mb`` do not apply: on this CPU a llama.cpp step costs rows x one row's time, so
  riding a prompt along a decode step saves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from variantbench.errors import UserError


def _torch(backend: Any, max_batch: int, max_len: int, prefill_chunk: int, prefix_cache_mb: float) -> Any:
    from variantbench.serving.continuous import ContinuousBatch

    if backend.decoder is None:
        raise RuntimeError("a batch for a backend that is not loaded")
    limit = min(max_len, backend.max_positions or max_len)
    return ContinuousBatch(backend.decoder, max_batch=max_batch, max_len=limit, stop_ids=backend.stop_ids,
                           prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb)  # fmt: skip


def _llama_cpp(backend: Any, max_batch: int, max_len: int, prefill_chunk: int, prefix_cache_mb: float) -> Any:
    from variantbench.serving.llama_cpp_batch import LlamaCppBatch

    if backend.llm is None:
        raise RuntimeError("a batch for a backend that is not loaded")
    return LlamaCppBatch(backend.llm, max_batch=max_batch, max_len=min(max_len, backend.n_ctx),
                         stop_ids=backend.stop_ids, threads=backend.threads())  # fmt: skip


BATCHES: dict[str, Callable[..., Any]] = {"torch": _torch, "llama.cpp": _llama_cpp}


def batch_for(backend: Any, max_batch: int, max_len: int, prefill_chunk: int = 256,
              prefix_cache_mb: float = 0.0) -> Any:  # fmt: skip
    """A continuous batch over a loaded backend, or one line saying its engine cannot be served."""
    engine = backend.info().get("backend", "?")
    make = BATCHES.get(engine)
    if make is None:
        raise UserError(f"{backend.name}: its engine ({engine}) cannot be served yet; "
                        f"serve {' or '.join(BATCHES)} variants")  # fmt: skip
    return make(backend, max_batch, max_len, prefill_chunk, prefix_cache_mb)
