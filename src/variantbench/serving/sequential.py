"""One request at a time over a transformers model: how the fallback backend is served.

A model whose family the engine does not register runs on transformers' own forward
(``backends/transformers_backend.py``), which has no ragged batch to join and leave: this batch
holds one row, prefilled alone and decoded token by token over transformers' dynamic cache, under
the same contract as the engine's batches (``join``/``step``/``leave``), so the worker, scheduler,
priorities and the HTTP API work unchanged; requests queue behind the one in flight. The start-up
line says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import inspect
from typing import Any

import torch

from variantbench.compute import on_compute
from variantbench.serving.continuous import check_join


@dataclass
class _Row:
    key: Any
    max_new: int
    stops: frozenset[int]
    cache: Any
    next_id: int
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class SequentialBatch:
    def __init__(self, model: Any, max_len: int, stop_ids: tuple[int, ...] = ()) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch = 1
        self.max_len = max_len
        self.stop_ids = frozenset(stop_ids)
        self._row: _Row | None = None
        # transformers renamed forward's ``past_key_values`` to ``cache`` (5.2x; the old name goes in 5.40)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def active(self) -> int:
        return 0 if self._row is None else 1

    def keys(self) -> list[Any]:
        return [] if self._row is None else [self._row.key]

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= self.max_len

    def describe(self) -> str:
        return (
            "one request at a time (transformers fallback: this architecture has no engine family to batch)"
        )

    def _forward(self, ids: list[int], cache: Any) -> tuple[int, Any]:
        with torch.inference_mode():
            out = self.model(
                torch.tensor([ids], device=self.device), use_cache=True, **{self._cache_arg: cache}
            )
        return int(out.logits[0, -1].argmax()), getattr(out, "cache", None) or out.past_key_values

    @on_compute
    def join(
        self, key: Any, prompt: list[int], max_new: int, stops: frozenset[int] | None = None
    ) -> tuple[int, bool]:
        check_join(self, len(prompt), max_new)
        first, cache = self._forward(list(prompt), None)
        row = _Row(key, max_new, self.stop_ids if stops is None else stops, cache, first, [first])
        row.done = first in row.stops or max_new <= 1
        self._row = row
        return first, row.done

    @on_compute
    def step(self) -> list[tuple[Any, int, bool]]:
        row = self._row
        if row is None or row.done:
            return []
        token, row.cache = self._forward([row.next_id], row.cache)
        row.tokens.append(token)
        row.next_id = token
        row.done = token in row.stops or len(row.tokens) >= row.max_new
        return [(row.key, token, row.done)]

    def leave(self, key: Any) -> None:
        if self._row is not None and self._row.key == key:
            self._row = None
