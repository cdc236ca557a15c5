"""Continuous batching over our decoder: requests join and leave the running batch between decode steps.

One shared KV-cache storage ``[layers, 2, max_batch, kv_heads, max_len, head_dim]`` and one shared
write index ``cur``: every decode step writes each active row's new key/value at ``cur``. A request
is prefilled into a private cache of its own, then its keys/values are copied into its row so that
they end at ``cur`` (left padding: a row attends to the positions from its ``start`` on). Keys
carry their rotary position already, so where they sit in the cache does not matter, only each
row's start and its own position counter. A prompt longer than ``cur`` shifts the cache right
first; when the write index would pass ``max_len``, the cache is compacted left by the space no
active row uses. Decode rows attend over the window from the first position an active row uses,
not from index 0: under steady load the write index climbs towards ``max_len`` long before a
compaction, and attending over the stale head cost 30% of a step at 8-16 rows with the write index
near 760 (measured here).

Chunked prefill (``begin``): a newcomer's prompt is not prefilled alone while the running rows wait.
Each ``step`` takes up to ``prefill_chunk`` prompt tokens of the waiting newcomers and runs them in
the same forward as the decode rows (``Decoder._forward_ragged``): every projection reads the
weights once for both, and a long prompt is spread over several steps instead of stalling every
running request for its whole prefill (vLLM's chunked prefill). ``join`` is the synchronous form:
prefill now, alone.

Prefix caching (``prefix_cache_mb``): the keys/values of prompt blocks seen before are copied
instead of recomputed (``serving.prefix_cache``), so a shared system prompt or instruction is
prefilled once.

Active rows are kept at the front (a leaving row's slot takes the last active row), so a step runs
on ``storage[:, :, :n]``, a view, never on idle rows. Greedy decoding, as the rest of the engine.
Not thread-safe: one executor owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from variantbench.backends.engine import PromptPiece
from variantbench.compute import on_compute
from variantbench.errors import UserError
from variantbench.serving.prefix_cache import PrefixCache
from variantbench.serving.scheduler import Pending, StepPlan

# On a GPU, decode rows attend row by row (each over its own positions) only when they use less than
# this share of the masked window and the padding exceeds this many row-positions (every call is a
# kernel launch); on a CPU always: 10 rows (one of 2,000 positions, nine of 150) stepped in 150 ms
# row by row against 264 ms masked, and nine rows of 150 in 103 ms against 111
PER_ROW_SHARE = 0.6
PER_ROW_MIN_WASTE = 2048


class NoRoom(RuntimeError):
    """The KV cache cannot take this request now; it may after running requests finish."""


def check_join(batch: Any, prompt_len: int, max_new: int) -> None:
    """What every batch refuses before it prefills: a full batch, an empty or too-long request."""
    if batch.active >= batch.max_batch:
        raise RuntimeError("the batch is full")
    if prompt_len == 0 or not batch.fits(prompt_len, max_new):
        raise ValueError(
            f"prompt of {prompt_len} tokens + {max_new} new does not fit {batch.max_len} positions"
        )


def batch_basics(batch: Any, decoder: Any, max_batch: int, max_len: int, stop_ids: tuple[int, ...],
                 prefill_chunk: int) -> int:  # fmt: skip
    """What every torch batch sets up first (refusing linear attention); returns the most kv heads
    of a layer (the cache's head axis)."""
    if decoder.has_linear_attention:
        raise UserError(
            "linear-attention variants are not served yet (the continuous batch keeps KV caches); "
            "measure them with variantbench run"
        )
    batch.decoder = decoder
    batch.max_batch = max_batch
    batch.max_len = max_len
    batch.stop_ids = frozenset(stop_ids)
    batch.prefill_chunk = max(1, int(prefill_chunk))
    return max((layer.n_kv_heads for layer in decoder.layers), default=1)


@dataclass
class Slot:
    key: Any  # the caller's handle for the request
    max_new: int
    position: int  # rotary position of the last token fed
    next_id: int  # the token to feed at the next step (already emitted)
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    start: int = 0  # the cache index of its first prompt token
    stops: frozenset[int] = frozenset()  # tokens that end it (none: ``ignore_eos``)


@dataclass
class _Prefill:
    """A request taken in whose prompt is still being prefilled (or waits for room in the batch)."""

    key: Any
    prompt: list[int]
    max_new: int
    cache: torch.Tensor  # its own keys/values, [layers, 2, 1, kv_heads, len(prompt), head_dim]
    done: int = 0  # prompt tokens whose keys/values are in ``cache``
    first: int | None = None  # the first output token, once the whole prompt is in
    priority: int = 0
    seq: int = 0  # order taken in
    stops: frozenset[int] = frozenset()


class ContinuousBatch:
    @on_compute
    def __init__(
        self,
        decoder: Any,
        max_batch: int = 32,
        max_len: int = 4096,
        stop_ids: tuple[int, ...] = (),
        prefill_chunk: int = 256,
        prefix_cache_mb: float = 0.0,
        prefix_block: int = 16,
        kv_budget: tuple[int, str] | None = None,
    ) -> None:
        max_kv = batch_basics(self, decoder, max_batch, max_len, stop_ids, prefill_chunk)
        layers = decoder.layers
        dev, dtype = decoder.device, decoder.dtype
        element = torch.empty((), dtype=dtype).element_size()
        size = len(layers) * 2 * max_batch * max_kv * max_len * decoder.head_dim * element
        if kv_budget and size > kv_budget[0]:  # written whole at start: it must fit at once
            raise UserError(
                f"the contiguous KV cache needs {size / 2**30:.2f} GiB ({max_batch} rows x {max_len} tokens), more "
                f"than its budget ({kv_budget[1]}: {kv_budget[0] / 2**30:.2f} GiB); use --kv-cache paged, or lower "
                "--max-batch-size or --max-len"
            )
        self.storage = torch.zeros(
            len(layers), 2, max_batch, max_kv, max_len, decoder.head_dim, dtype=dtype, device=dev
        )
        self.slots: list[Slot] = []
        self.pending: list[_Prefill] = []
        self.cur = 0  # the next cache index every active row writes
        self.rope = decoder._rope_tables(max_len)
        self.prefix = PrefixCache(int(prefix_cache_mb * 2**20), block=prefix_block, axis=4)
        self.last_rows = 0  # decode rows in the last step
        self.last_prompt_tokens = 0  # prompt tokens computed in the last step (chunked prefill)
        # every prompt token taken in, by where its keys/values came from
        self.prompt_tokens = {"computed": 0, "cached": 0}
        self._taken = 0  # requests taken in, for their order

    # ---- admission ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests in the batch: decoding, or taken in and still prefilling."""
        return len(self.slots) + len(self.pending)

    def keys(self) -> list[Any]:
        return [s.key for s in self.slots] + [p.key for p in self.pending]

    @property
    def kv_resident_bytes(self) -> int:
        """The contiguous cache is written whole at start (``torch.zeros``), plus the prefix cache's copies."""
        return self.storage.numel() * self.storage.element_size() + self.prefix.nbytes

    def describe(self) -> str:
        kv = f"KV cache {self.storage.numel() * self.storage.element_size() / 1e9:.2f} GB"
        if self.prefix is not None and self.prefix.enabled:
            kv += f", prefix cache up to {self.prefix.budget_bytes / 2**20:g} MiB"
        return kv

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= self.max_len

    def _new_prefill(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
                     stops: frozenset[int] | None = None) -> _Prefill:  # fmt: skip
        n = len(prompt)
        check_join(self, n, max_new)
        longest = max([n, *(len(p.prompt) for p in self.pending)])
        if max(longest, self._used_span()) + self._steps_needed(max_new, pending=True) > self.max_len:
            raise NoRoom(f"no room for {n} + {max_new} tokens beside the running requests")
        dec = self.decoder
        cache = torch.zeros(len(dec.layers), 2, 1, self.storage.shape[3], n, dec.head_dim,
                            dtype=dec.dtype, device=dec.device)  # fmt: skip
        # the last prompt token is always computed: its logits give the first output token
        hit, blocks = self.prefix.lookup(prompt, n - 1)
        at = 0
        for kv in blocks:
            size = kv.shape[4]
            cache[:, :, :, :, at : at + size] = kv
            at += size
        self.prompt_tokens["cached"] += hit
        self.prompt_tokens["computed"] += n - hit
        self._taken += 1
        return _Prefill(key, list(prompt), max_new, cache, done=hit, priority=priority, seq=self._taken,
                        stops=self.stop_ids if stops is None else stops)  # fmt: skip

    @on_compute
    def begin(self, key: Any, prompt: list[int], max_new: int, priority: int = 0,
              stops: frozenset[int] | None = None) -> None:  # fmt: skip
        """Take a request in; the next steps prefill its prompt in chunks beside the decode rows, and
        the step that completes it returns its first token. ``stops``: the tokens that end it (None:
        the model's; empty: none, ``ignore_eos``)."""
        self.pending.append(self._new_prefill(key, prompt, max_new, priority, stops))

    def pending_prefills(self) -> list[Pending]:
        """The prompts still being prefilled (for ``scheduler.plan_prefill``)."""
        return [Pending(p.key, p.priority, len(p.prompt) - p.done, p.seq) for p in self.pending]

    @on_compute
    @torch.inference_mode()
    def join(
        self, key: Any, prompt: list[int], max_new: int, stops: frozenset[int] | None = None
    ) -> tuple[int, bool]:
        """Prefill ``prompt`` now, alone, and add it to the batch; returns (first token, finished already)."""
        p = self._new_prefill(key, prompt, max_new, stops=stops)
        self._compute(0, [(p, p.done, len(p.prompt) - p.done)])
        self._prefilled(p)
        if not self._place(p):  # cannot happen: _new_prefill checked the same room
            raise NoRoom(f"no room for {len(prompt)} + {max_new} tokens beside the running requests")
        slot = self.slots[-1]
        return slot.next_id, slot.done

    def _steps_needed(self, max_new: int, pending: bool = False) -> int:
        """Decode steps the batch may still run if every row (and a newcomer) goes to its limit."""
        remaining = max((s.max_new - len(s.tokens) for s in self.slots if not s.done), default=0)
        if pending:
            remaining = max([remaining, *(p.max_new - 1 for p in self.pending)])
        return max(remaining, max_new - 1)

    def _used_span(self) -> int:
        """Cache positions from the first one an active row uses up to the write index."""
        return self.cur - min(s.start for s in self.slots) if self.slots else 0

    def _shift_right(self, by: int) -> None:
        if self.cur + by > self.max_len:
            raise ValueError("no room to shift the cache")
        n = len(self.slots)
        if n and self.cur:
            self.storage[:, :, :n, :, by : by + self.cur] = self.storage[:, :, :n, :, : self.cur].clone()
        for slot in self.slots:
            slot.start += by
        self.cur += by

    def _compact(self) -> None:
        """Shift every row left by the leading positions no active row uses."""
        first = self.cur - self._used_span()
        if first <= 0:
            return
        n, keep = len(self.slots), self.cur - first
        if n:
            self.storage[:, :, :n, :, :keep] = self.storage[:, :, :n, :, first : self.cur].clone()
        for slot in self.slots:
            slot.start -= first
        self.cur = keep

    def _prefilled(self, p: _Prefill) -> None:
        """A prompt is complete: offer its blocks to the prefix cache."""
        self.prefix.insert(p.prompt, p.cache)

    def _place(self, p: _Prefill) -> bool:
        """Copy a prefilled request into a batch row so that its prompt ends at ``cur``; False: no room yet."""
        n = len(p.prompt)
        if max(n, self._used_span()) + self._steps_needed(p.max_new) > self.max_len:
            return False
        if max(n, self.cur) + self._steps_needed(p.max_new) > self.max_len:
            self._compact()
        if n > self.cur:
            self._shift_right(n - self.cur)
        row = len(self.slots)
        start = self.cur - n
        self.storage[:, :, row, :, start : self.cur] = p.cache[:, :, 0, :, :n]
        assert p.first is not None
        slot = Slot(
            key=p.key,
            max_new=p.max_new,
            position=n - 1,
            next_id=p.first,
            tokens=[p.first],
            start=start,
            stops=p.stops,
        )
        slot.done = p.first in p.stops or p.max_new <= 1
        self.slots.append(slot)
        return True

    # ---- decoding -------------------------------------------------------------------------------

    def _compute(self, rows: int, chunks: list[tuple[_Prefill, int, int]]) -> list[int]:
        """One ragged forward: a decode step for the first ``rows`` slots and the prompt ``chunks``
        (request, first position, tokens). Returns the decode rows' next tokens; a chunk that
        completes its prompt sets the request's first token."""
        dec = self.decoder
        dev = dec.device
        ids = [s.next_id for s in self.slots[:rows]]
        pos = [s.position + 1 for s in self.slots[:rows]]
        pieces = []
        for p, start, length in chunks:
            ids.extend(p.prompt[start : start + length])
            pos.extend(range(start, start + length))
            mask = None
            if start > 0:  # a later chunk sees every earlier position and its own causally
                keys = torch.arange(start + length, device=dev)
                mask = (keys[None, :] <= keys[start:, None])[None, None]
            pieces.append(PromptPiece(dec._cache_views(p.cache), start, length, mask))
        row_cache, row_mask, lo, row_starts = [], None, 0, None
        if rows:
            # attend over the window the rows use, not from index 0: under steady load the write
            # index climbs towards max_len long before the cache is compacted
            first = [s.start for s in self.slots[:rows]]
            lo = min(first)
            window = self.cur + 1 - lo
            used = sum(self.cur + 1 - a for a in first)
            padded = used < PER_ROW_SHARE * rows * window and rows * window - used > PER_ROW_MIN_WASTE
            if rows > 1 and (dev.type == "cpu" or padded):
                row_starts = [a - lo for a in first]  # row by row: most of the window is other rows' padding
            else:
                starts = torch.tensor(first, device=dev)
                row_mask = (torch.arange(lo, self.cur + 1, device=dev)[None, :] >= starts[:, None])[
                    :, None, None
                ]
            row_cache = dec._cache_views(self.storage[:, :, :rows, :, lo:])
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        with dec._region("decode_step" if not chunks else "mixed_step" if rows else "prefill"):
            hidden = dec._forward_ragged(dec._embed(ids_t), pos_t, rows, row_cache, self.cur - lo, row_mask,
                                         pieces, self.rope, row_starts)  # fmt: skip
            pick, ends, at = list(range(rows)), [], rows
            for p, start, length in chunks:
                at += length
                if start + length == len(p.prompt):
                    pick.append(at - 1)
                    ends.append(p)
            tokens = dec._logits(hidden[pick]).argmax(-1).tolist() if pick else []
        if rows:
            self.cur += 1
        for p, start, length in chunks:
            p.done = start + length
        for p, token in zip(ends, tokens[rows:], strict=True):
            p.first = int(token)
            self._prefilled(p)
        return [int(t) for t in tokens[:rows]]

    @on_compute
    @torch.inference_mode()
    def step(self, plan: StepPlan | None = None) -> list[tuple[Any, int, bool]]:
        """One step: a decode step for every active row, plus prompt tokens of the requests taken in
        by ``begin``: as ``plan`` says (the scheduler's: tokens per request, and whether the rows
        decode or pause this step), or up to ``prefill_chunk`` by level then order taken in. Returns
        [(key, new token, done)], a newcomer's first token among them once its prompt is complete.
        A paused row keeps its keys/values and position: it simply does not advance this step."""
        for p in [p for p in self.pending if p.first is not None]:  # prefilled earlier, waiting for room
            if self._place(p):
                self.pending.remove(p)
        rows = len(self.slots) if plan is None or plan.decode or not plan.prefill else 0
        chunks = []
        if plan is None:
            budget = self.prefill_chunk
            for p in sorted(self.pending, key=lambda p: (p.priority, p.seq)):
                left = len(p.prompt) - p.done
                if left and budget:
                    take = min(left, budget)
                    chunks.append((p, p.done, take))
                    budget -= take
        else:
            by_key = {p.key: p for p in self.pending}
            for key, take in plan.prefill:
                p = by_key[key]
                take = min(take, len(p.prompt) - p.done)
                if take > 0:
                    chunks.append((p, p.done, take))
        self.last_rows, self.last_prompt_tokens = rows, sum(c[2] for c in chunks)
        if not rows and not chunks:
            return []
        if rows and self.cur + 1 > self.max_len:
            self._compact()
            if self.cur + 1 > self.max_len:
                raise NoRoom("the KV cache is full")
        tokens = self._compute(rows, chunks)
        out = []
        for slot, token in zip(self.slots[:rows], tokens, strict=True):
            if slot.done:
                continue
            slot.position += 1
            slot.next_id = token
            slot.tokens.append(token)
            slot.done = token in slot.stops or len(slot.tokens) >= slot.max_new
            out.append((slot.key, token, slot.done))
        for p, _, _ in chunks:
            if p.first is None:
                continue
            done = p.first in p.stops or p.max_new <= 1
            out.append((p.key, p.first, done))
            if done or self._place(p):
                self.pending.remove(p)
        return out

    @on_compute
    def leave(self, key: Any) -> None:
        """Remove a request (finished, cancelled or disconnected): its row takes the last active row."""
        for p in self.pending:
            if p.key == key:
                self.pending.remove(p)
                return
        idx = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if idx is None:
            return
        last = len(self.slots) - 1
        if idx != last:
            # only the positions the moved row uses: the rest are masked (before its start) or written
            # before they are read (from the write index on); a whole row is max_len positions
            start = self.slots[last].start
            self.storage[:, :, idx, :, start : self.cur] = self.storage[:, :, last, :, start : self.cur]
            self.slots[idx] = self.slots[last]
        self.slots.pop()
        if not self.slots:
            self.cur = 0
