"""Continuous batching over a paged key/value cache: each row's keys and values in blocks of a pool.

The contiguous batch (``continuous.py``) gives every row ``max_len`` positions of one preallocated
storage and one shared write index, so memory is the worst case from the start (3.0 GB for 32 x
2,048 tokens of SmolLM2-135M), short rows are padded to the longest, and a long prompt shifts every
row. Here a row holds a block table into a ``BlockPool`` (vLLM's PagedAttention, ``kv_pool.py``):

* admission reserves the blocks of its prompt and answer (one run of consecutive blocks where the
  free list allows), so a request that is admitted never runs out of room; a reserved block takes
  memory only once a key is written into it, and is handed back when the row leaves;
* each row has its own length and write position: no shared index, no shifting, no compaction,
  and each decode row attends over its own positions only (a view per run of blocks);
* the prefix cache indexes pool blocks (reference-counted): a prompt that starts with a cached
  prefix computes only the rest. By default the hit's blocks are copied into the row's own run
  (one view per row in every step); with ``share_prefixes`` they are borrowed, and attention merges
  the runs by their log-sum-exp (``_scaled_dot_product_flash_attention_for_cpu`` returns it):
  no copy and no memory for the prefix, but a merge per row, layer and step;
* a prompt's chunks are computed straight into its blocks (no private cache to copy in).

Same contract as ``ContinuousBatch`` (``begin``/``join``/``step``/``leave``, plans with paused rows),
so the worker and scheduler drive either. Greedy decoding. Not thread-safe: one executor owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any

import torch

from variantbench.backends.engine import PLAIN_ATTENTION, AttentionSpec, attend
from variantbench.compute import on_compute
from variantbench.serving.continuous import NoRoom, batch_basics, check_join
from variantbench.serving.kv_budget import cache_blocks
from variantbench.serving.kv_pool import BlockPool, PoolFull, block_size, runs
from variantbench.serving.prefix_cache import PrefixCache
from variantbench.serving.scheduler import Pending, StepPlan


@dataclass
class _Row:
    key: Any
    prompt: list[int]
    max_new: int
    priority: int
    seq: int
    blocks: list[int]  # the block table: borrowed prefix blocks, then its own
    borrowed: int  # leading blocks that came from the prefix cache
    length: int = 0  # positions whose keys/values are stored (prompt computed or cached, then answers)
    first: int | None = None  # the first output token, once the whole prompt is in
    tokens: list[int] = field(default_factory=list)
    next_id: int = 0
    done: bool = False
    stops: frozenset[int] = frozenset()  # tokens that end it (none: ``ignore_eos``)

    @property
    def prefilling(self) -> bool:
        return self.first is None


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Softmax attention over a union of key runs from each run's output and log-sum-exp."""
    top = torch.stack(lses).amax(0)
    weights = [torch.exp(lse - top)[..., None] for lse in lses]
    total = sum(weights)
    return sum(o * w for o, w in zip(outs, weights, strict=True)) / total


class _Rows:
    """The decode rows of one step, as an ``AttentionGroup``: row i writes its new key/value at
    ``write[i]`` and attends over ``spans[i]`` (runs of pool positions, the new one included)."""

    def __init__(self, pool: BlockPool, write: torch.Tensor, spans: list[list[tuple[int, int]]]) -> None:
        self.pool, self.write, self.spans, self.length = pool, write, spans, len(spans)

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec = PLAIN_ATTENTION) -> torch.Tensor:  # fmt: skip
        nkv, d = k.shape[1], k.shape[2]
        keys, values = self.pool.data[li, 0, :nkv], self.pool.data[li, 1, :nkv]  # [kv, positions, D]
        keys[:, self.write] = k.transpose(0, 1)
        values[:, self.write] = v.transpose(0, 1)
        q = q.reshape(self.length, nkv, -1, d)  # grouped: each kv head with its query heads
        rest = spec.unwindowed()  # a window is the last positions of a row's runs
        outs = []
        for i, spans in enumerate(self.spans):
            qi = q[i : i + 1]
            if spec.window is not None:
                spans = _last(spans, spec.window)
            if len(spans) == 1:
                a, b = spans[0]
                outs.append(attend(qi, keys[None, :, a:b], values[None, :, a:b], rest))
            elif qi.device.type == "cpu" and rest.plain and rest.scale is None:
                parts = [
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        qi, keys[None, :, a:b], values[None, :, a:b], 0.0, False
                    )
                    for a, b in spans
                ]
                outs.append(_merge([p[0] for p in parts], [p[1] for p in parts]))
            else:  # no log-sum-exp kernel for it: gather the runs (a copy of this row's keys)
                ks = torch.cat([keys[:, a:b] for a, b in spans], 1)[None]
                vs = torch.cat([values[:, a:b] for a, b in spans], 1)[None]
                outs.append(attend(qi, ks, vs, rest))
        return torch.cat(outs).reshape(self.length, -1)


def _last(spans: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The runs of pool positions that hold a row's last ``count`` positions."""
    kept: list[tuple[int, int]] = []
    for a, b in reversed(spans):
        if count <= 0:
            break
        kept.append((max(a, b - count), b))
        count -= b - a
    return kept[::-1]


class _Chunk:
    """Prompt tokens ``start:start+length`` of one row, as an ``AttentionGroup``: written into the
    row's blocks, attending causally over everything before them (borrowed blocks included)."""

    def __init__(self, pool: BlockPool, write: torch.Tensor, spans: list[tuple[int, int]], start: int,
                 length: int) -> None:  # fmt: skip
        self.pool, self.write, self.spans, self.start, self.length = pool, write, spans, start, length

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec = PLAIN_ATTENTION) -> torch.Tensor:  # fmt: skip
        nq, nkv = q.shape[1], k.shape[1]
        keys, values = self.pool.data[li, 0, :nkv], self.pool.data[li, 1, :nkv]
        keys[:, self.write] = k.transpose(0, 1)
        values[:, self.write] = v.transpose(0, 1)
        if len(self.spans) == 1:
            a, b = self.spans[0]
            ks, vs = keys[None, :, a:b], values[None, :, a:b]
        else:  # a prompt's chunk: compute-bound, a copy of the keys before it costs little
            ks = torch.cat([keys[:, a:b] for a, b in self.spans], 1)[None]
            vs = torch.cat([values[:, a:b] for a, b in self.spans], 1)[None]
        end = self.start + self.length
        mask = None
        if self.start > 0:  # every earlier position, and its own causally
            positions = torch.arange(end, device=q.device)
            mask = (positions[None, :] <= positions[self.start :, None])[None, None]
        attn = attend(
            q.transpose(0, 1)[None], ks, vs, spec, mask=mask, causal=mask is None and self.length > 1,
            enable_gqa=nq != nkv, q_index=None if spec.plain else torch.arange(self.start, end, device=q.device),
        )  # fmt: skip
        return attn[0].transpose(0, 1).reshape(self.length, -1)


class _PoolBlocks:
    """The prefix cache's keeper: a cached block is a reference to a pool block."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def keep(self, blocks: list[int], index: int) -> tuple[int, int]:
        self.pool.retain([blocks[index]])
        return blocks[index], self.pool.bytes_per_block

    def drop(self, block: int) -> None:
        self.pool.release([block])


class PagedBatch:
    @on_compute
    def __init__(
        self,
        decoder: Any,
        max_batch: int = 32,
        max_len: int = 4096,
        stop_ids: tuple[int, ...] = (),
        prefill_chunk: int = 256,
        prefix_cache_mb: float = 0.0,
        pool_tokens: int | None = None,
        share_prefixes: bool = False,
        kv_budget: tuple[int, str] | None = None,
    ) -> None:
        # Borrowed prefix blocks make a row two runs, merged by log-sum-exp in every layer of every
        # step: with the default prefix cache (28 of 124 prompt tokens cached) decode steps of 8 rows
        # took 155 ms against about 80 with one run (fp32, 2 AVX2 cores). So by default a hit's
        # blocks are copied into the row's own run (the prefill is still saved); sharing them
        # (``share_prefixes``) saves their memory at that price.
        self.share_prefixes = share_prefixes
        max_kv = batch_basics(self, decoder, max_batch, max_len, stop_ids, prefill_chunk)
        layers = decoder.layers
        # reserved for the worst case (every row at the longest context): untouched pages cost nothing;
        # within ``kv_budget`` (bytes, and where it came from) when that is less (``kv_budget.py``)
        element = torch.empty((), dtype=decoder.dtype).element_size()
        block = block_size(decoder.head_dim, element)
        blocks = math.ceil((pool_tokens or max_batch * max_len) / block) + max_batch  # a part block a row
        if kv_budget and not pool_tokens:
            per_block = len(layers) * 2 * max_kv * block * decoder.head_dim * element
            worst, blocks = blocks, cache_blocks(blocks, per_block, block, max_len, kv_budget)
            self.capped_by = kv_budget[1] if blocks < worst else None
        else:
            self.capped_by = None
        self.pool = BlockPool(len(layers), max_kv, decoder.head_dim, blocks, decoder.dtype, decoder.device,
                              block=block)  # fmt: skip
        self.block = self.pool.block
        self.prefix = PrefixCache(
            int(prefix_cache_mb * 2**20), block=self.block, keeper=_PoolBlocks(self.pool)
        )
        self.rope = decoder._rope_tables(max_len)
        self.rows: list[_Row] = []
        self.last_rows = 0
        self.last_prompt_tokens = 0
        self.prompt_tokens = {"computed": 0, "cached": 0}
        self._taken = 0

    # ---- admission ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self.rows)

    def keys(self) -> list[Any]:
        return [r.key for r in self.rows]

    def describe(self) -> str:
        kv = f"paged KV cache: blocks of {self.block} tokens, {self.pool.reserved_bytes / 1e9:.2f} GB reserved, used as written"
        if self.capped_by:
            held = self.pool.blocks * self.block
            kv += (f" (capped by {self.capped_by}: {held:,} tokens, under {self.max_batch} x {self.max_len}; "
                   "requests beyond it wait for room)")  # fmt: skip
        if self.prefix.enabled:
            kv += f", prefix cache up to {self.prefix.budget_bytes / 2**20:g} MiB of shared blocks"
        return kv

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= self.max_len

    @property
    def kv_resident_bytes(self) -> int:
        """The pool's written blocks not handed back (rows' and the prefix cache's keys/values), or
        the whole pool where it is allocated at once (a GPU)."""
        return self.pool.resident_bytes

    @property
    def live_tokens(self) -> int:
        """Positions whose keys/values the rows hold now."""
        return sum(r.length for r in self.rows)

    @on_compute
    def begin(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
              stops: frozenset[int] | None = None) -> None:  # fmt: skip
        """Take a request in (its blocks reserved); the next steps prefill its prompt in chunks.
        ``stops``: the tokens that end it (None: the model's; empty: none, ``ignore_eos``)."""
        n = len(prompt)
        check_join(self, n, max_new)
        # the last prompt token is always computed: its logits give the first output token
        hit, borrowed = self.prefix.lookup(prompt, n - 1)
        share = self.share_prefixes and borrowed
        need = math.ceil((n + max_new) / self.block) - (len(borrowed) if share else 0)
        if need > self.pool.free_blocks:
            # the prefix cache's blocks come from the same pool: they give way to a request, least
            # recently used first (kept, a serve with a batch of one never started: the warm-up's
            # cached prompts held 8 of its 17 blocks), and the hit is looked up again after
            while self.pool.free_blocks < need and self.prefix.evict_oldest():
                pass
            hit, borrowed = self.prefix.lookup(prompt, n - 1)
            share = self.share_prefixes and borrowed
            need = math.ceil((n + max_new) / self.block) - (len(borrowed) if share else 0)
        try:
            own = self.pool.allocate(need)
        except PoolFull:
            raise NoRoom(f"no room for {n} + {max_new} tokens beside the running requests") from None
        if share:
            self.pool.retain(borrowed)
            blocks = list(borrowed) + own
        else:  # copied into its own run: every decode step then reads one view per row
            for src, dst in zip(borrowed, own, strict=False):
                b = self.block
                self.pool.data[:, :, :, dst * b : (dst + 1) * b] = self.pool.data[
                    :, :, :, src * b : (src + 1) * b
                ]
            self.pool.written(own[: len(borrowed)])
            blocks = own
        self.prompt_tokens["cached"] += hit
        self.prompt_tokens["computed"] += n - hit
        self._taken += 1
        self.rows.append(_Row(key, list(prompt), max_new, priority, self._taken, blocks,
                              len(borrowed) if share else 0, length=hit,
                              stops=self.stop_ids if stops is None else stops))  # fmt: skip

    @on_compute
    @torch.inference_mode()
    def join(
        self, key: Any, prompt: list[int], max_new: int, stops: frozenset[int] | None = None
    ) -> tuple[int, bool]:
        """Prefill ``prompt`` now, alone, and add it to the batch; returns (first token, finished already)."""
        self.begin(key, prompt, max_new, stops=stops)
        row = self.rows[-1]
        self._compute([], [(row, row.length, len(prompt) - row.length)])
        return row.next_id, row.done

    def pending_prefills(self) -> list[Pending]:
        return [
            Pending(r.key, r.priority, len(r.prompt) - r.length, r.seq) for r in self.rows if r.prefilling
        ]

    # ---- positions ------------------------------------------------------------------------------

    def _position(self, row: _Row, index: int) -> int:
        return row.blocks[index // self.block] * self.block + index % self.block

    def _spans(self, row: _Row, end: int) -> list[tuple[int, int]]:
        """Pool position runs holding the row's positions 0..end-1."""
        out = []
        left = end
        for start, count in runs(row.blocks[: math.ceil(end / self.block)]):
            size = min(count * self.block, left)
            out.append((start * self.block, start * self.block + size))
            left -= size
        return out

    # ---- decoding -------------------------------------------------------------------------------

    def _compute(self, rows: list[_Row], chunks: list[tuple[_Row, int, int]]) -> list[int]:
        """One ragged forward: a decode step for ``rows`` and the prompt ``chunks`` (row, first
        position, tokens). Returns the decode rows' next tokens; a chunk that completes its prompt
        sets the row's first token."""
        dec = self.decoder
        dev = dec.device
        ids = [r.next_id for r in rows]
        pos = [r.length for r in rows]
        groups: list[Any] = []
        if rows:
            write = torch.tensor([self._position(r, r.length) for r in rows], device=dev)
            groups.append(_Rows(self.pool, write, [self._spans(r, r.length + 1) for r in rows]))
        for row, start, length in chunks:
            ids.extend(row.prompt[start : start + length])
            pos.extend(range(start, start + length))
            write = torch.tensor([self._position(row, i) for i in range(start, start + length)], device=dev)
            groups.append(_Chunk(self.pool, write, self._spans(row, start + length), start, length))
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        with dec._region("decode_step" if not chunks else "mixed_step" if rows else "prefill"):
            hidden = dec._forward_groups(dec._embed(ids_t), pos_t, groups, self.rope)
            pick, ends, at = list(range(len(rows))), [], len(rows)
            for row, start, length in chunks:
                at += length
                if start + length == len(row.prompt):
                    pick.append(at - 1)
                    ends.append(row)
            tokens = dec._logits(hidden[pick]).argmax(-1).tolist() if pick else []
        for r in rows:
            self._wrote(r, r.length, r.length + 1)
            r.length += 1
        for row, start, length in chunks:
            self._wrote(row, start, start + length)
            row.length = start + length
        for row, token in zip(ends, tokens[len(rows) :], strict=True):
            row.first = row.next_id = int(token)
            row.tokens = [row.first]
            row.done = row.first in row.stops or row.max_new <= 1
            self.prefix.insert(row.prompt, row.blocks)
        return [int(t) for t in tokens[: len(rows)]]

    def _wrote(self, row: _Row, start: int, end: int) -> None:
        self.pool.written(row.blocks[start // self.block : math.ceil(end / self.block)])

    @on_compute
    @torch.inference_mode()
    def step(self, plan: StepPlan | None = None) -> list[tuple[Any, int, bool]]:
        """One step: a decode step for every decoding row (unless ``plan`` pauses them), plus prompt
        tokens of the prefilling rows, as ``plan`` says or up to ``prefill_chunk`` by level then
        order taken in. Returns [(key, new token, done)], a row's first token once its prompt is in."""
        decoding = [r for r in self.rows if not r.prefilling and not r.done]
        if plan is not None and not plan.decode and plan.prefill:
            decoding = []
        chunks = []
        if plan is None:
            budget = self.prefill_chunk
            for r in sorted((r for r in self.rows if r.prefilling), key=lambda r: (r.priority, r.seq)):
                if budget:
                    take = min(len(r.prompt) - r.length, budget)
                    chunks.append((r, r.length, take))
                    budget -= take
        else:
            by_key = {r.key: r for r in self.rows if r.prefilling}
            for key, take in plan.prefill:
                r = by_key[key]
                take = min(take, len(r.prompt) - r.length)
                if take > 0:
                    chunks.append((r, r.length, take))
        self.last_rows, self.last_prompt_tokens = len(decoding), sum(c[2] for c in chunks)
        if not decoding and not chunks:
            return []
        tokens = self._compute(decoding, chunks)
        out = []
        for row, token in zip(decoding, tokens, strict=True):
            row.next_id = token
            row.tokens.append(token)
            row.done = token in row.stops or len(row.tokens) >= row.max_new
            out.append((row.key, token, row.done))
        for row, start, length in chunks:
            if row.first is not None and start + length == len(row.prompt):
                out.append((row.key, row.first, row.done))
        return out

    @on_compute
    def leave(self, key: Any) -> None:
        """Remove a request (finished, cancelled or disconnected): its blocks go back to the pool
        (those the prefix cache indexes stay, held by it)."""
        for i, row in enumerate(self.rows):
            if row.key == key:
                self.rows.pop(i)
                self.pool.release(row.blocks)
                return

    @on_compute
    def close(self) -> None:
        for row in self.rows:
            self.pool.release(row.blocks)
        self.rows.clear()
        self.prefix.clear()
