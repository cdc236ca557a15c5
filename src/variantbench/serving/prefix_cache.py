"""Prefix caching: the keys and values of prompt prefixes seen before, reused instead of recomputed.

Requests to one deployment share long prefixes: the chat template's system prompt, a task's
instructions, few-shot examples. Their keys and values depend only on the tokens before them
(causal attention, rotary positions from 0), so a request that starts with a cached prefix copies
it and prefills only the rest. The same idea as vLLM's automatic prefix caching, at its granularity:
prompts are cut into blocks of ``block`` tokens; a block is named by a hash chained over every
block before it, so a hit on block i means the whole prefix up to it matches (each block also keeps
its tokens, compared on a hit, so a hash collision cannot return the wrong prefix). Blocks are
kept least-recently-used first out, within a byte budget; a hit touches a path from its last block
back to the first, so the shared roots stay the freshest and are evicted after their descendants.

Storage-agnostic: by default a block is a copy of the tensor slice ``kv[..., start:end, :]`` along
``axis`` and the caller copies hits into its own cache; with a ``Keeper`` a block is whatever the
keeper keeps (the paged batch keeps a reference to a pool block: a hit shares it, nothing is
copied). Not thread-safe: the batch's executor thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Keeper(Protocol):
    """How the cache keeps block ``index`` of a prompt's ``kv`` and lets it go."""

    def keep(self, kv: Any, index: int) -> tuple[Any, int]:
        """(what to keep for the block, its bytes)"""
        ...

    def drop(self, kept: Any) -> None: ...


class _Copies:
    def __init__(self, block: int, axis: int) -> None:
        self.block, self.axis = block, axis

    def keep(self, kv: Any, index: int) -> tuple[Any, int]:
        piece = kv.narrow(self.axis, index * self.block, self.block).clone()  # a view would keep all of kv
        return piece, piece.numel() * piece.element_size()

    def drop(self, kept: Any) -> None:
        pass


@dataclass
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    kv: Any  # the block's keys/values, ``block`` positions along ``axis``
    nbytes: int


class PrefixCache:
    def __init__(
        self, budget_bytes: int, block: int = 16, axis: int = -2, keeper: Keeper | None = None
    ) -> None:
        if block < 1:
            raise ValueError("block must be at least 1 token")
        self.budget_bytes = max(0, int(budget_bytes))
        self.block = block
        self.axis = axis
        self.keeper = keeper or _Copies(block, axis)
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def _chain(self, prompt: Sequence[int], limit: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(hash, parent hash, tokens) of each full block within the first ``limit`` tokens."""
        out = []
        parent: int | None = None
        for start in range(0, limit - self.block + 1, self.block):
            tokens = tuple(prompt[start : start + self.block])
            h = hash((parent, tokens))
            out.append((h, parent, tokens))
            parent = h
        return out

    def lookup(self, prompt: Sequence[int], limit: int | None = None) -> tuple[int, list[Any]]:
        """The longest cached prefix of ``prompt`` within ``limit`` tokens: (its length, its blocks' kv)."""
        if not self.enabled:
            return 0, []
        limit = len(prompt) if limit is None else min(limit, len(prompt))
        path: list[int] = []
        for h, parent, tokens in self._chain(prompt, limit):
            b = self._blocks.get(h)
            if b is None or b.parent != parent or b.tokens != tokens:
                break
            path.append(h)
        for h in reversed(path):  # deepest first, so the roots end the freshest
            self._blocks.move_to_end(h)
        return len(path) * self.block, [self._blocks[h].kv for h in path]

    def insert(self, prompt: Sequence[int], kv: Any, length: int | None = None) -> int:
        """Keep the full blocks of ``prompt``'s first ``length`` positions of ``kv``; returns blocks added.

        ``kv`` holds positions 0.. along ``axis`` (or whatever the keeper reads blocks from)."""
        if not self.enabled:
            return 0
        length = len(prompt) if length is None else min(length, len(prompt))
        added = 0
        chain = self._chain(prompt, length)
        for i, (h, parent, tokens) in enumerate(chain):
            old = self._blocks.get(h)
            if old is not None and old.parent == parent and old.tokens == tokens:
                continue
            piece, nbytes = self.keeper.keep(kv, i)
            if nbytes > self.budget_bytes:
                self.keeper.drop(piece)
                break
            if old is not None:  # a collision: the newer block wins
                self._drop(h)
            self._blocks[h] = _Block(parent, tokens, piece, nbytes)
            self.nbytes += nbytes
            added += 1
        for h, _, _ in reversed(chain):
            if h in self._blocks:
                self._blocks.move_to_end(h)
        while self.nbytes > self.budget_bytes and self._blocks:
            self._drop(next(iter(self._blocks)))
        return added

    def _drop(self, h: int) -> None:
        b = self._blocks.pop(h)
        self.nbytes -= b.nbytes
        self.keeper.drop(b.kv)

    def evict_oldest(self) -> bool:
        """Let the least recently used block go (False: none is kept)."""
        if not self._blocks:
            return False
        self._drop(next(iter(self._blocks)))
        return True

    def clear(self) -> None:
        while self._blocks:
            self._drop(next(iter(self._blocks)))
