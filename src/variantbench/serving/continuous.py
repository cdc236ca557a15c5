"""Continuous batching over our decoder: requests join and leave the running batch between decode steps.

One shared KV-cache storage ``[layers, 2, max_batch, kv_heads, max_len, head_dim]`` and one shared
write index ``cur``: every decode step writes each active row's new key/value at ``cur``. A request
that joins is prefilled alone (batch 1) and its keys/values are copied into its row so that they end
at ``cur`` (left padding; a boolean row mask hides the rest). Keys carry their rotary position
already, so where they sit in the cache does not matter, only the mask and each row's own position
counter. A prompt longer than ``cur`` shifts the cache right first; when the write index would pass
``max_len``, the cache is compacted left by the space no active row uses.

Active rows are kept at the front (a leaving row's slot takes the last active row), so a step runs
on ``storage[:, :, :n]``, a view, never on idle rows. Greedy decoding, as the rest of the engine.
Not thread-safe: one executor owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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


@dataclass
class Slot:
    key: Any  # the caller's handle for the request
    max_new: int
    position: int  # rotary position of the last token fed
    next_id: int  # the token to feed at the next step (already emitted)
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class ContinuousBatch:
    def __init__(
        self, decoder: Any, max_batch: int = 32, max_len: int = 4096, stop_ids: tuple[int, ...] = ()
    ) -> None:
        self.decoder = decoder
        self.max_batch = max_batch
        self.max_len = max_len
        self.stop_ids = frozenset(stop_ids)
        layers = decoder.layers
        max_kv = max(layer.n_kv_heads for layer in layers) if layers else 1
        dev, dtype = decoder.device, decoder.dtype
        self.storage = torch.zeros(
            len(layers), 2, max_batch, max_kv, max_len, decoder.head_dim, dtype=dtype, device=dev
        )
        self.valid = torch.zeros(max_batch, max_len, dtype=torch.bool, device=dev)
        self.slots: list[Slot] = []
        self.cur = 0  # the next cache index every active row writes
        self.rope = decoder._rope_tables(max_len)

    # ---- admission ------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self.slots)

    def fits(self, prompt_len: int, max_new: int) -> bool:
        return prompt_len + max_new <= self.max_len

    @torch.inference_mode()
    def join(self, key: Any, prompt: list[int], max_new: int) -> tuple[int, bool]:
        """Prefill ``prompt`` and add it to the batch; returns (first token, finished already)."""
        n = len(prompt)
        check_join(self, n, max_new)
        dec = self.decoder
        # prefill alone into a private batch-1 cache
        max_kv = self.storage.shape[3]
        tmp = torch.zeros(len(dec.layers), 2, 1, max_kv, n, dec.head_dim, dtype=dec.dtype, device=dec.device)
        ids = torch.tensor([prompt], dtype=torch.long, device=dec.device)
        positions = torch.arange(n, device=dec.device).unsqueeze(0)
        with dec._region("prefill"):
            hidden = dec._forward(
                dec._embed(ids), positions, dec._cache_views(tmp), 0, None, n > 1, self.rope
            )
            first = int(dec._logits(hidden[:, -1]).argmax(-1).item())
        # make room: the prompt must end at self.cur, and every row's remaining steps must fit
        if max(n, self._used_span()) + self._steps_needed(max_new) > self.max_len:
            raise NoRoom(f"no room for {n} + {max_new} tokens beside the running requests")
        if max(n, self.cur) + self._steps_needed(max_new) > self.max_len:
            self._compact()
        if n > self.cur:
            self._shift_right(n - self.cur)
        row = self.active
        start = self.cur - n
        self.storage[:, :, row, :, start : self.cur] = tmp[:, :, 0, :, :n]
        self.valid[row] = False
        self.valid[row, start : self.cur] = True
        slot = Slot(key=key, max_new=max_new, position=n - 1, next_id=first, tokens=[first])
        slot.done = first in self.stop_ids or max_new <= 1
        self.slots.append(slot)
        return first, slot.done

    def _steps_needed(self, max_new: int) -> int:
        """Decode steps the batch may still run if every row (and a newcomer) goes to its limit."""
        remaining = max((s.max_new - len(s.tokens) for s in self.slots if not s.done), default=0)
        return max(remaining, max_new - 1)

    def _used_span(self) -> int:
        """Cache positions from the first one an active row uses up to the write index."""
        n = self.active
        if n == 0:
            return 0
        used = self.valid[:n, : self.cur].any(0)
        return self.cur - int(used.nonzero()[0].item()) if bool(used.any()) else 0

    def _shift_right(self, by: int) -> None:
        if self.cur + by > self.max_len:
            raise ValueError("no room to shift the cache")
        n = self.active
        if n and self.cur:
            self.storage[:, :, :n, :, by : by + self.cur] = self.storage[:, :, :n, :, : self.cur].clone()
            self.valid[:n, by : by + self.cur] = self.valid[:n, : self.cur].clone()
            self.valid[:n, :by] = False
        self.cur += by

    def _compact(self) -> None:
        """Shift every row left by the leading positions no active row uses."""
        first = self.cur - self._used_span()
        if first <= 0:
            return
        n, keep = self.active, self.cur - first
        if n:
            self.storage[:, :, :n, :, :keep] = self.storage[:, :, :n, :, first : self.cur].clone()
            self.valid[:n, :keep] = self.valid[:n, first : self.cur].clone()
            self.valid[:n, keep : self.cur] = False
        self.cur = keep

    # ---- decoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, int, bool]]:
        """One decode step for every active row not yet done: [(key, new token, done)]."""
        n = self.active
        if n == 0:
            return []
        if self.cur + 1 > self.max_len:
            self._compact()
            if self.cur + 1 > self.max_len:
                raise NoRoom("the KV cache is full")
        dec = self.decoder
        ids = torch.tensor([s.next_id for s in self.slots], dtype=torch.long, device=dec.device)
        pos = torch.tensor([s.position + 1 for s in self.slots], dtype=torch.long, device=dec.device)
        self.valid[:n, self.cur] = True
        mask = self.valid[:n, None, None, : self.cur + 1]
        with dec._region("decode_step"):
            nxt = dec._decode_step(ids, pos, self.storage[:, :, :n], self.cur, mask, self.rope)
        self.cur += 1
        out = []
        for slot, token in zip(self.slots, nxt.tolist(), strict=True):
            if slot.done:
                continue
            slot.position += 1
            slot.next_id = int(token)
            slot.tokens.append(int(token))
            slot.done = token in self.stop_ids or len(slot.tokens) >= slot.max_new
            out.append((slot.key, int(token), slot.done))
        return out

    def leave(self, key: Any) -> None:
        """Remove a request (finished, cancelled or disconnected): its row takes the last active row."""
        idx = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if idx is None:
            return
        last = self.active - 1
        if idx != last:
            self.storage[:, :, idx] = self.storage[:, :, last]
            self.valid[idx] = self.valid[last]
            self.slots[idx] = self.slots[last]
        self.valid[last] = False
        self.slots.pop()
        if not self.slots:
            self.cur = 0
