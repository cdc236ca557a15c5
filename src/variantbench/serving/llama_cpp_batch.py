"""Continuous batching on llama.cpp: one context, one sequence id per request, one ``llama_decode`` per step.

The same contract as ``ContinuousBatch`` (join / step / leave between decode steps), so the batch
worker, the scheduler and the HTTP server run a GGUF exactly as they run our torch engine, and the
serving benchmark can compare the engine and the batching apart. llama.cpp's own server
(``python -m llama_cpp.server``) runs one request at a time per process; this runs up to
``max_batch`` sequences in one decode call, as llama.cpp's C++ server does with ``--parallel``.

The KV cache is unified (``kv_unified``): every sequence may use up to ``max_len`` positions, and
all together at most ``kv_tokens``; a request is admitted only when the tokens it may still need
(prompt + max_new) fit beside the running requests' reservations, else ``NoRoom``. Greedy decoding
(argmax of the logits), as everywhere else. Not thread-safe: one executor owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from variantbench.serving.continuous import NoRoom, check_join


@dataclass
class _Seq:
    key: Any
    seq_id: int
    max_new: int
    reserved: int  # prompt + max_new: the cache positions this request may take
    position: int  # position of the last token fed
    next_id: int
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class LlamaCppBatch:
    def __init__(
        self,
        llm: Any,
        max_batch: int = 32,
        max_len: int = 4096,
        stop_ids: tuple[int, ...] = (),
        threads: int = 1,
        kv_tokens: int | None = None,
        n_batch: int = 512,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self.max_batch = max_batch
        self.max_len = max_len
        self.stop_ids = frozenset(stop_ids)
        self.kv_tokens = kv_tokens or min(max_len * max_batch, 32768)
        self.n_batch = max(n_batch, max_batch)
        # the model's own context settings (flash attention, rope, ...) with room for max_batch sequences
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_ctx = self.kv_tokens
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = max_batch
        params.kv_unified = True
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self._llama_cpp = llama_cpp
        self._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = llm.n_vocab()
        self.slots: list[_Seq] = []
        self._free = list(range(max_batch - 1, -1, -1))

    def close(self) -> None:
        self._batch.close()
        self._ctx.close()

    @property
    def active(self) -> int:
        return len(self.slots)

    def keys(self) -> list[Any]:
        return [s.key for s in self.slots]

    def describe(self) -> str:
        return f"llama.cpp KV cache of {self.kv_tokens} tokens"

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= min(self.max_len, self.kv_tokens)

    def _argmax(self, i: int) -> int:
        ptr = self._llama_cpp.llama_get_logits_ith(self._ctx.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _put(self, j: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self._batch.batch
        b.token[j] = token
        b.pos[j] = pos
        b.n_seq_id[j] = 1
        b.seq_id[j][0] = seq_id
        b.logits[j] = logits

    def join(self, key: Any, prompt: list[int], max_new: int) -> tuple[int, bool]:
        n = len(prompt)
        check_join(self, n, max_new)
        if sum(s.reserved for s in self.slots) + n + max_new > self.kv_tokens:
            raise NoRoom(f"no room for {n} + {max_new} tokens beside the running requests")
        seq_id = self._free.pop()
        memory = self._ctx.memory
        self._llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
        try:
            for start in range(0, n, self.n_batch):  # prompt in chunks of n_batch, logits for the last only
                chunk = prompt[start : start + self.n_batch]
                self._batch.batch.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    self._put(i, token, start + i, seq_id, start + i == n - 1)
                self._ctx.decode(self._batch)
            first = self._argmax(len(chunk) - 1)
        except Exception:
            self._llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
            self._free.append(seq_id)
            raise
        seq = _Seq(key, seq_id, max_new, n + max_new, n - 1, first, [first])
        seq.done = first in self.stop_ids or max_new <= 1
        self.slots.append(seq)
        return first, seq.done

    def step(self) -> list[tuple[Any, int, bool]]:
        rows = [s for s in self.slots if not s.done]
        if not rows:
            return []
        self._batch.batch.n_tokens = len(rows)
        for i, s in enumerate(rows):
            self._put(i, s.next_id, s.position + 1, s.seq_id, True)
        self._ctx.decode(self._batch)
        out = []
        for i, s in enumerate(rows):
            token = self._argmax(i)
            s.position += 1
            s.next_id = token
            s.tokens.append(token)
            s.done = token in self.stop_ids or len(s.tokens) >= s.max_new
            out.append((s.key, token, s.done))
        return out

    def leave(self, key: Any) -> None:
        idx = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if idx is None:
            return
        seq = self.slots.pop(idx)
        self._llama_cpp.llama_memory_seq_rm(self._ctx.memory, seq.seq_id, -1, -1)
        self._free.append(seq.seq_id)
