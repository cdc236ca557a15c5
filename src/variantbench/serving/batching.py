"""Which continuous batch serves a loaded backend: a registry keyed by the backend's engine.

Serving picks the batch for a backend (``info()["backend"]``); backends never import serving.
A new engine that can be served is one more entry here.

- ``torch`` (our decoder): ``PagedBatch`` (a paged KV cache, the default) or ``ContinuousBatch``
  (one contiguous cache), chunked prefill beside the decode rows and, when ``prefix_cache_mb`` > 0,
  prefix caching.
- ``transformers`` (the fallback for a model without an engine family): ``SequentialBatch``, one
  request at a time over transformers' own forward.
- ``llama.cpp``: ``LlamaCppBatch`` (its cache within the same ``--kv-cache-gb`` budget), up to
  ``max_batch`` sequences per ``llama_decode``, with the same
  chunked prefill (prompt tokens ride in the decode rows' call) and prefix reuse (finished prompts'
  keys/values kept under their sequence ids; ``prefix_cache_mb`` 0 turns it off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from variantbench.errors import UserError


class ServingBatch(Protocol):
    """What the per-variant worker drives: requests join, every step yields a token per row, rows leave."""

    max_batch: int
    max_len: int
    stop_ids: Any

    @property
    def active(self) -> int: ...

    def fits(self, prompt_len: int, max_new: int) -> bool: ...

    def join(
        self, key: Any, prompt: list[int], max_new: int, stops: frozenset[int] | None = None
    ) -> tuple[int, bool]:
        """``stops``: the tokens that end this request (None: the model's ``stop_ids``; empty: none,
        the request's ``ignore_eos``)."""
        ...

    def step(self) -> list[tuple[Any, int, bool]]: ...

    def leave(self, key: Any) -> None: ...

    def keys(self) -> list[Any]: ...

    def describe(self) -> str:
        """Its memory, for the start-up line (e.g. the KV cache's size)."""
        ...


@runtime_checkable
class ChunkedPrefill(Protocol):
    """Prompts begin now and are prefilled by the next steps, beside the decode rows, in chunks.

    After each step, ``last_rows`` decode rows and ``last_prompt_tokens`` prompt tokens were computed
    (the worker's cost model splits a mixed step's time between them).
    """

    last_rows: int
    last_prompt_tokens: int
    prefill_chunk: int  # prompt tokens per step when no plan says otherwise

    def begin(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
              stops: frozenset[int] | None = None) -> None: ...  # fmt: skip

    def pending_prefills(self) -> list[Any]:
        """``scheduler.Pending`` for each prompt still being prefilled."""
        ...

    def step(self, plan: Any = None) -> list[tuple[Any, int, bool]]:
        """``plan``: a ``scheduler.StepPlan`` (prompt tokens per request, whether the rows decode)."""
        ...


@runtime_checkable
class KvMemory(Protocol):
    """A batch that can say how much of its key/value memory is resident now (``/metrics`` exports
    it, so RSS that follows the live tokens can be told from RSS that grows)."""

    @property
    def kv_resident_bytes(self) -> int: ...


KV_CACHES = ("paged", "contiguous")


def _torch(backend: Any, max_batch: int, max_len: int, prefill_chunk: int, prefix_cache_mb: float,
           kv_cache: str = "paged", kv_cache_gb: float | None = None) -> Any:  # fmt: skip
    from variantbench.serving.continuous import ContinuousBatch
    from variantbench.serving.kv_budget import budget_bytes
    from variantbench.serving.paged import PagedBatch

    if backend.decoder is None:
        raise RuntimeError("a batch for a backend that is not loaded")
    limit = min(max_len, backend.max_positions or max_len)
    kind = PagedBatch if kv_cache == "paged" else ContinuousBatch
    return kind(backend.decoder, max_batch=max_batch, max_len=limit, stop_ids=backend.stop_ids,
                prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb,
                kv_budget=budget_bytes(kv_cache_gb, backend.decoder.device))  # fmt: skip


def _llama_cpp(backend: Any, max_batch: int, max_len: int, prefill_chunk: int, prefix_cache_mb: float,
               kv_cache: str = "paged", kv_cache_gb: float | None = None) -> Any:  # fmt: skip
    from variantbench.serving.kv_budget import budget_bytes
    from variantbench.serving.llama_cpp_batch import LlamaCppBatch

    if backend.llm is None:
        raise RuntimeError("a batch for a backend that is not loaded")
    return LlamaCppBatch(backend.llm, max_batch=max_batch, max_len=min(max_len, backend.n_ctx),
                         stop_ids=backend.stop_ids, threads=backend.thread_count(), prefill_chunk=prefill_chunk,
                         cache_seqs=8 if prefix_cache_mb > 0 else 0,
                         kv_budget=budget_bytes(kv_cache_gb, "cpu"))  # fmt: skip


def _transformers(backend: Any, max_batch: int, max_len: int, prefill_chunk: int, prefix_cache_mb: float,
                  kv_cache: str = "paged", kv_cache_gb: float | None = None) -> Any:  # fmt: skip
    from variantbench.serving.sequential import SequentialBatch

    if backend.model is None:
        raise RuntimeError("a batch for a backend that is not loaded")
    return SequentialBatch(backend.model, max_len=min(max_len, backend.max_positions or max_len),
                           stop_ids=backend.stop_ids)  # fmt: skip


BATCHES: dict[str, Callable[..., Any]] = {
    "torch": _torch,
    "llama.cpp": _llama_cpp,
    "transformers": _transformers,
}


def batch_for(backend: Any, max_batch: int, max_len: int, prefill_chunk: int = 256,
              prefix_cache_mb: float = 0.0, kv_cache: str = "paged", kv_cache_gb: float | None = None) -> Any:  # fmt: skip
    """A continuous batch over a loaded backend, or one line saying its engine cannot be served.

    ``kv_cache`` (torch engine): ``paged`` (blocks from a pool, memory as used: ``paged.py``) or
    ``contiguous`` (one preallocated storage: ``continuous.py``); ``kv_cache_gb`` its budget (None:
    80% of the memory available now, ``kv_budget.py``)."""
    if kv_cache not in KV_CACHES:
        raise UserError(f"kv cache {kv_cache!r}: one of {', '.join(KV_CACHES)}")
    engine = backend.info().get("backend", "?")
    make = BATCHES.get(engine)
    if make is None:
        raise UserError(f"{backend.name}: its engine ({engine}) cannot be served yet; "
                        f"serve {' or '.join(BATCHES)} variants")  # fmt: skip
    return make(backend, max_batch, max_len, prefill_chunk, prefix_cache_mb, kv_cache, kv_cache_gb)
