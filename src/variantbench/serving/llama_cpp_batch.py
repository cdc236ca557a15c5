"""Continuous batching on llama.cpp: one context, one sequence id per request, one ``llama_decode`` per step.

The same contract as ``ContinuousBatch`` (begin / step / leave between steps, or ``join`` to prefill
at once), so the batch worker, the scheduler and the HTTP server run a GGUF exactly as they run our
torch engine: chunked prefill beside the decode rows in the same ``llama_decode`` call (prompt
tokens and decode tokens share one llama batch, as llama.cpp's C++ server does), the scheduler's
plan per step (an urgent prompt alone, less urgent ones in short chunks), and prefix reuse.

Prefix reuse: a finished request's keys/values stay in the cache under its sequence id (up to
``cache_seqs`` of them, least recently used first out, and only while their cells are not needed by
running requests). A newcomer takes over the retained sequence that shares the longest prefix with
its prompt (its cells past the shared prefix are dropped) or, when a running request shares more,
gets that prefix by ``llama_memory_seq_cp``, which in the unified cache shares the cells instead of
copying them. Only the rest of the prompt is computed, and always its last token (its logits give
the first output token). This is what llama.cpp's own servers do (``cache_prompt``; the Python
server reuses its last prompt's prefix): without it our server paid the chat template's tokens for
every request that llama_cpp.server had paid once.

The KV cache is unified (``kv_unified``): every sequence may use up to ``max_len`` positions, and
all together at most ``kv_tokens``; a request is admitted only when the tokens it may still need
(prompt + max_new) fit beside the running requests' reservations once retained sequences have given
way, else ``NoRoom``. Greedy decoding (argmax of the logits), as everywhere else. Not thread-safe:
one executor owns it.

Flash attention is on. In the unified cache every row's attention spans every occupied cell, its
own under the mask and every other sequence's masked out: without flash attention that is computed
in full, so a step's attention grows with rows x all live tokens. With it, llama.cpp's CPU kernel
skips masked cells. Measured on the default GGUF (Q4_1), 2 AVX-512 cores, rows of ~170 positions:
decode steps of 8 / 16 / 32 rows took 57.8 / 125.8 / 319.6 ms without, 36.3 / 69.3 / 143.1 ms with
(one row 8.9 against 7.0 ms), and 64-token chat prompts prefilled ~15% faster. Split (per-sequence)
caches instead (``kv_unified`` off) took 61.5 / 127.7 / 216.8 ms and cannot share a running
request's prefix cells (llama.cpp copies only whole streams between sequences).

Memory: llama.cpp allocates its cache whole when the context is made and clears it (so it is
resident at once), ``kv_tokens`` cells of K and V for every layer in the context's cache type (f16
by default). So the cache holds the worst case (``max_batch x max_len``, at most 32,768 cells)
only within the same budget as the torch engine's pool (``--kv-cache-gb``, else 80% of the memory
available at start, ``kv_budget.py``), and ``kv_resident_bytes`` (``/metrics``) reports it whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from variantbench.compute import on_compute
from variantbench.serving.continuous import NoRoom, check_join
from variantbench.serving.kv_budget import cache_blocks
from variantbench.serving.scheduler import Pending, StepPlan


@dataclass
class _Seq:
    key: Any
    seq_id: int
    prompt: list[int]
    max_new: int
    reserved: int  # prompt + max_new: the cache positions this request may take
    done: int = 0  # prompt tokens whose keys/values are in the cache
    priority: int = 0
    order: int = 0  # taken in
    tokens: list[int] = field(default_factory=list)  # output tokens (the last one not fed yet)
    finished: bool = False
    stops: frozenset[int] = frozenset()  # tokens that end it (none: ``ignore_eos``)

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prompt)

    def fed(self) -> list[int]:
        """The tokens whose keys/values this sequence holds, in position order."""
        return self.prompt[: self.done] + (self.tokens[:-1] if not self.prefilling else [])


# bytes per element of llama.cpp's cache types (ggml_type): f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, bf16
_TYPE_BYTES = {0: 4.0, 1: 2.0, 2: 18 / 32, 3: 20 / 32, 6: 22 / 32, 7: 24 / 32, 8: 34 / 32, 30: 2.0}


def kv_bytes_per_token(llm: Any, params: Any) -> int:
    """Bytes of one cache cell: K and V of every layer's KV heads in the context's ``type_k``/``type_v``."""
    import llama_cpp

    model = llm._model.model
    layers, heads = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_head(model)
    width = llama_cpp.llama_model_n_head_kv(model) * (llama_cpp.llama_model_n_embd(model) // max(1, heads))
    per = _TYPE_BYTES.get(int(params.type_k), 2.0) + _TYPE_BYTES.get(int(params.type_v), 2.0)
    return int(layers * width * per)


def _common(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class LlamaCppBatch:
    @on_compute
    def __init__(
        self,
        llm: Any,
        max_batch: int = 32,
        max_len: int = 4096,
        stop_ids: tuple[int, ...] = (),
        threads: int = 1,
        kv_tokens: int | None = None,
        prefill_chunk: int = 256,
        cache_seqs: int = 8,
        kv_budget: tuple[int, str] | None = None,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self.max_batch = max_batch
        self.max_len = max_len
        self.stop_ids = frozenset(stop_ids)
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        self.bytes_per_token = kv_bytes_per_token(llm, params)
        worst = kv_tokens or min(max_len * max_batch, 32768)
        # a budget caps the worst case (at least one request of max_len, else one line saying so)
        self.kv_tokens = (
            cache_blocks(worst, self.bytes_per_token, 1, max_len, kv_budget) if kv_budget else worst
        )
        self.capped_by = kv_budget[1] if kv_budget and self.kv_tokens < worst else None
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.cache_seqs = max(0, int(cache_seqs))
        # one llama batch holds a step: every decode row and the prompt chunks of a plan (a plan's
        # urgent prompt may take up to prefill_chunk beside the rows); join prefills in such chunks
        self.n_batch = self.prefill_chunk + max_batch
        # the model's own context settings (flash attention, rope, ...) with room for max_batch sequences
        params.n_ctx = self.kv_tokens
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = max_batch + self.cache_seqs
        params.kv_unified = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED  # see the module's doc
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self._llama_cpp = llama_cpp
        self._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._memory = self._ctx.memory
        self.n_vocab = llm.n_vocab()
        self.slots: list[_Seq] = []  # in the batch: prefilling or decoding, in order taken in
        self._free = list(range(max_batch + self.cache_seqs - 1, -1, -1))
        self._kept: OrderedDict[int, list[int]] = OrderedDict()  # retained seq id -> its tokens, LRU first
        self.last_rows = 0  # decode rows in the last step
        self.last_prompt_tokens = 0  # prompt tokens computed in the last step
        self.prompt_tokens = {"computed": 0, "cached": 0}  # every prompt token taken in, by source
        self._taken = 0

    @on_compute
    def close(self) -> None:
        self._batch.close()
        self._ctx.close()

    # ---- admission ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self.slots)

    def keys(self) -> list[Any]:
        return [s.key for s in self.slots]

    @property
    def live_tokens(self) -> int:
        """Positions whose keys/values the running requests hold (retained prompts not counted)."""
        return sum(len(s.fed()) for s in self.slots)

    @property
    def kv_resident_bytes(self) -> int:
        """The whole cache: llama.cpp allocates and clears it when the context is made."""
        return self.kv_tokens * self.bytes_per_token

    def describe(self) -> str:
        kv = f"llama.cpp KV cache of {self.kv_tokens:,} tokens ({self.kv_resident_bytes / 1e9:.2f} GB, allocated whole)"
        if self.capped_by:
            kv += f" (capped by {self.capped_by}, under {self.max_batch} x {self.max_len}; requests beyond it wait for room)"
        return kv + f", up to {self.cache_seqs} finished prompts kept"

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= min(self.max_len, self.kv_tokens)

    def _drop(self, seq_id: int) -> None:
        self._llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        self._free.append(seq_id)

    def _source(self, prompt: list[int]) -> tuple[int, int | None, bool]:
        """(shared tokens, the sequence holding them, whether it is a retained one) for ``prompt``;
        the last prompt token is never shared (its logits give the first output token)."""
        limit = len(prompt) - 1
        best, src, kept = 0, None, False
        for seq_id, tokens in self._kept.items():
            n = _common(tokens, prompt, limit)
            if n > best:
                best, src, kept = n, seq_id, True
        for s in self.slots:
            n = _common(s.fed(), prompt, limit)
            if n > best:
                best, src, kept = n, s.seq_id, False
        return best, src, kept

    def _make_room(self, need: int, keep: int | None, new_id: bool) -> None:
        """Retained sequences give way, least recently used first, until ``need`` more reserved cells
        fit in the cache beside the running requests' reservations and, with ``new_id``, a sequence
        id is free (never ``keep``, the one being taken over)."""

        def used() -> int:
            return sum(s.reserved for s in self.slots) + sum(len(t) for t in self._kept.values())

        for seq_id in [i for i in self._kept if i != keep]:
            if used() + need <= self.kv_tokens and (self._free or not new_id):
                break
            del self._kept[seq_id]
            self._drop(seq_id)
        if used() + need > self.kv_tokens:
            raise NoRoom(f"no room for {need} more tokens beside the running requests")
        if new_id and not self._free:
            raise NoRoom("every sequence id is running")

    def _take_in(self, key: Any, prompt: list[int], max_new: int, priority: int,
                 stops: frozenset[int] | None = None) -> _Seq:  # fmt: skip
        n = len(prompt)
        check_join(self, n, max_new)
        shared, src, kept = self._source(prompt)
        if kept:  # take the retained sequence over: its cells past the shared prefix go
            # its cells become part of this request's reservation
            self._make_room(n + max_new - len(self._kept[src]), keep=src, new_id=False)
            del self._kept[src]
            seq_id = src
            self._llama_cpp.llama_memory_seq_rm(self._memory, seq_id, shared, -1)
        else:
            self._make_room(n + max_new, keep=None, new_id=True)
            seq_id = self._free.pop()
            self._llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            if src is not None and shared:  # the running one's cells, shared (unified cache)
                self._llama_cpp.llama_memory_seq_cp(self._memory, src, seq_id, 0, shared)
            else:
                shared = 0
        self.prompt_tokens["cached"] += shared
        self.prompt_tokens["computed"] += n - shared
        self._taken += 1
        seq = _Seq(
            key,
            seq_id,
            list(prompt),
            max_new,
            n + max_new,
            done=shared,
            priority=priority,
            order=self._taken,
            stops=self.stop_ids if stops is None else stops,
        )
        self.slots.append(seq)
        return seq

    @on_compute
    def begin(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
              stops: frozenset[int] | None = None) -> None:  # fmt: skip
        """Take a request in; the next steps prefill its prompt beside the decode rows, and the step
        that completes it returns its first token. ``stops``: the tokens that end it (None: the
        model's; empty: none, ``ignore_eos``)."""
        self._take_in(key, prompt, max_new, priority, stops)

    def pending_prefills(self) -> list[Pending]:
        return [
            Pending(s.key, s.priority, len(s.prompt) - s.done, s.order) for s in self.slots if s.prefilling
        ]

    @on_compute
    def join(
        self, key: Any, prompt: list[int], max_new: int, stops: frozenset[int] | None = None
    ) -> tuple[int, bool]:
        """Prefill ``prompt`` now, alone (in chunks of ``n_batch``); returns (first token, finished already)."""
        seq = self._take_in(key, prompt, max_new, 0, stops)
        try:
            while seq.prefilling:
                self._decode([], [(seq, min(self.n_batch, len(seq.prompt) - seq.done))])
        except Exception:
            self.leave(key)
            raise
        return seq.tokens[0], seq.finished

    # ---- steps ----------------------------------------------------------------------------------

    def _put(self, j: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self._batch.batch
        b.token[j] = token
        b.pos[j] = pos
        b.n_seq_id[j] = 1
        b.seq_id[j][0] = seq_id
        b.logits[j] = logits

    def _argmax(self, i: int) -> int:
        ptr = self._llama_cpp.llama_get_logits_ith(self._ctx.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _decode(self, rows: list[_Seq], chunks: list[tuple[_Seq, int]]) -> list[tuple[Any, int, bool]]:
        """One ``llama_decode``: a token per decode row, then each chunk's prompt tokens (logits for
        a prompt's last token only). Returns the rows' new tokens and the completed prompts' first."""
        j = 0
        for s in rows:
            pos = len(s.prompt) + len(s.tokens) - 1
            self._put(j, s.tokens[-1], pos, s.seq_id, True)
            j += 1
        ends = []
        for s, take in chunks:
            for i in range(s.done, s.done + take):
                last = i == len(s.prompt) - 1
                self._put(j, s.prompt[i], i, s.seq_id, last)
                if last:
                    ends.append((s, j))
                j += 1
        self._batch.batch.n_tokens = j
        code = self._llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        if code == 1:  # no cache slot: admission reserves every request's room, so only fragmentation
            raise NoRoom("the llama.cpp KV cache has no slot for this step")  # the worker fails the step
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        for s, take in chunks:
            s.done += take
        out = []
        for i, s in enumerate(rows):
            token = self._argmax(i)
            s.tokens.append(token)
            s.finished = token in s.stops or len(s.tokens) >= s.max_new
            out.append((s.key, token, s.finished))
        for s, at in ends:
            token = self._argmax(at)
            s.tokens.append(token)
            s.finished = token in s.stops or s.max_new <= 1
            out.append((s.key, token, s.finished))
        return out

    @on_compute
    def step(self, plan: StepPlan | None = None) -> list[tuple[Any, int, bool]]:
        """One step: a token for every decode row, plus prompt tokens of the requests taken in by
        ``begin``, as ``plan`` says (tokens per request, whether the rows decode or pause), or up
        to ``prefill_chunk`` by level then order taken in. Returns [(key, new token, done)], a
        newcomer's first token among them once its prompt is complete. A paused row keeps its
        keys/values and position."""
        decoding = [s for s in self.slots if not s.prefilling and not s.finished]
        pending = [s for s in self.slots if s.prefilling]
        chunks: list[tuple[_Seq, int]] = []
        if plan is None:
            budget = self.prefill_chunk
            for s in sorted(pending, key=lambda s: (s.priority, s.order)):
                if budget:
                    take = min(len(s.prompt) - s.done, budget)
                    chunks.append((s, take))
                    budget -= take
        else:
            by_key = {s.key: s for s in pending}
            for key, take in plan.prefill:
                s = by_key.get(key)
                if s is not None and take > 0:
                    chunks.append((s, min(take, len(s.prompt) - s.done, self.prefill_chunk)))
        rows = decoding if plan is None or plan.decode or not chunks else []
        self.last_rows, self.last_prompt_tokens = len(rows), sum(t for _, t in chunks)
        if not rows and not chunks:
            return []
        return self._decode(rows, chunks)

    @on_compute
    def leave(self, key: Any) -> None:
        """Remove a request (finished, cancelled or disconnected). A finished prompt's keys/values
        are retained for prefix reuse (``cache_seqs`` at most, least recently used out first)."""
        idx = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if idx is None:
            return
        seq = self.slots.pop(idx)
        fed = seq.fed()
        if not self.cache_seqs or not fed:
            self._drop(seq.seq_id)
            return
        # what may stay: the fed tokens (a cancelled prompt's computed part too)
        self._llama_cpp.llama_memory_seq_rm(self._memory, seq.seq_id, len(fed), -1)
        self._kept[seq.seq_id] = fed
        while len(self._kept) > self.cache_seqs:
            old, _ = self._kept.popitem(last=False)
            self._drop(old)
