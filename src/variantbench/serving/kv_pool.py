"""A pool of fixed-size key/value blocks whose memory follows the tokens actually held.

vLLM's PagedAttention keeps each sequence's keys and values in fixed-size blocks drawn from one
pool, mapped by a block table, so long and short requests share memory without fragmentation and
a shared prefix is one set of blocks, referenced, not copied. Its CUDA kernel reads the blocks
through the table. On a CPU we have no such kernel, and gathering a row's blocks into one tensor
every step copies its whole cache each time, so the pool is laid out so that a run of consecutive
blocks is one strided view: ``data[layer, k|v, kv_head, positions, head_dim]``, a block being
``block`` consecutive positions. A request is given consecutive blocks where the free list allows
(first fit over runs of free blocks), and attention reads each run as a view.

Memory follows use: the pool's tensor is reserved (an anonymous mmap, not charged against the
overcommit heuristic), not written, so the kernel commits a page only when a key is stored in it;
a freed block's pages are handed back with ``madvise(MADV_DONTNEED)`` (block sizes are chosen so
that a block of one head is whole pages). The pool can therefore be sized for the worst case (every
row at the longest context, within the budget of ``kv_budget.py``) while resident memory is the
live tokens, rounded up to a block per row. On a GPU memory is committed at allocation, so there
the pool is what is allocated.

Blocks are reference-counted: a row holds its own and any prefix blocks it borrowed; the prefix
cache holds the blocks it indexes; a block returns to the free list at zero.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import platform
import sys
from typing import Any

import torch

_MADV_DONTNEED = 4


def _madvise() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# mmap's MAP_NORESERVE (Linux x86-64 and arm64; Python's mmap module does not name it): the mapping
# is not charged against the overcommit heuristic, so a pool reserved for the worst case is granted
# even where it exceeds RAM + swap; its pages still commit only as keys are written
_MAP_NORESERVE = 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0


def reserve(nbytes: int) -> mmap.mmap:
    """Anonymous, private, page-aligned memory of ``nbytes``, committed page by page as it is written."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    try:
        return mmap.mmap(-1, max(nbytes, 1), flags=flags | _MAP_NORESERVE)
    except OSError:
        return mmap.mmap(-1, max(nbytes, 1), flags=flags)


class PoolFull(RuntimeError):
    """Fewer free blocks than asked for."""


def block_size(head_dim: int, element_size: int, minimum: int = 16, page: int = mmap.PAGESIZE) -> int:
    """The smallest block (positions) of at least ``minimum`` whose bytes per head are whole pages,
    so that a freed block can be handed back to the kernel (``minimum`` if none up to 256 is)."""
    size = minimum
    while size <= 256:
        if (size * head_dim * element_size) % page == 0:
            return size
        size *= 2
    return minimum


class BlockPool:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", block: int | None = None) -> None:  # fmt: skip
        self.device = torch.device(device)
        element = torch.empty((), dtype=dtype).element_size()
        self.block = block or block_size(head_dim, element)
        self.blocks = blocks
        self.shape = (layers, 2, kv_heads, blocks * self.block, head_dim)
        numel = layers * 2 * kv_heads * blocks * self.block * head_dim
        page = mmap.PAGESIZE
        self._madvise = _madvise() if self.device.type == "cpu" else None
        if self._madvise is not None:
            # page-aligned (an mmap), so each block of each head is whole pages
            self._map = reserve(numel * element)
            self.data = torch.frombuffer(self._map, dtype=dtype, count=numel).view(self.shape)
        else:
            self.data = torch.zeros(self.shape, dtype=dtype, device=self.device)
        self.bytes_per_block = layers * 2 * kv_heads * self.block * head_dim * element
        self._run_bytes = self.block * head_dim * element  # one block of one head
        self._releasable = self._madvise is not None and self._run_bytes % page == 0
        self.refs = [0] * blocks
        self.dirty = bytearray(blocks)  # written since it was last handed back
        self._free: list[tuple[int, int]] = [(0, blocks)]  # sorted runs (start, length)
        self.free_blocks = blocks

    # ---- allocation -----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, consecutive where a free run is long enough (first fit), else the fewest runs."""
        if n <= 0:
            return []
        if n > self.free_blocks:
            raise PoolFull(f"{n} blocks asked, {self.free_blocks} free")
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._take(i, n)
                return self._hold(range(start, start + n))
        out: list[int] = []  # fragmented: the longest runs first
        for start, length in sorted(self._free, key=lambda r: -r[1]):
            take = min(length, n - len(out))
            out.extend(range(start, start + take))
            if len(out) == n:
                break
        for b in out:
            self._remove_block(b)
        return self._hold(out)

    def _take(self, i: int, n: int) -> None:
        start, length = self._free[i]
        if length == n:
            self._free.pop(i)
        else:
            self._free[i] = (start + n, length - n)
        self.free_blocks -= n

    def _remove_block(self, b: int) -> None:
        i = bisect.bisect_right(self._free, (b, self.blocks + 1)) - 1
        start, length = self._free[i]
        parts = [(start, b - start), (b + 1, start + length - b - 1)]
        self._free[i : i + 1] = [p for p in parts if p[1] > 0]
        self.free_blocks -= 1

    def _hold(self, blocks: Any) -> list[int]:
        out = list(blocks)
        for b in out:
            self.refs[b] = 1
        return out

    def retain(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks no one holds go back, their pages to the kernel."""
        freed = []
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                freed.append(b)
        if not freed:
            return
        freed.sort()
        for start, length in runs(freed):
            self._give_back(start, length)
            i = bisect.bisect_left(self._free, (start, 0))
            self._free.insert(i, (start, length))
            self.free_blocks += length
            # merge with the neighbours
            if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:
                self._free[i] = (start, length + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def _give_back(self, start: int, length: int) -> None:
        dirty = [b for b in range(start, start + length) if self.dirty[b]]
        if not dirty:
            return
        for b in dirty:
            self.dirty[b] = 0
        if not self._releasable:
            return
        layers, sides, heads, _, _ = self.shape
        for s, n in runs(dirty):
            size = n * self._run_bytes
            for li in range(layers):
                for side in range(sides):
                    for h in range(heads):
                        ptr = self.data[li, side, h, s * self.block].data_ptr()
                        self._madvise(ptr, size, _MADV_DONTNEED)

    def written(self, blocks: list[int]) -> None:
        for b in blocks:
            self.dirty[b] = 1

    # ---- what it holds --------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        return self.blocks - self.free_blocks

    @property
    def committed_bytes(self) -> int:
        """Bytes of the blocks written and not handed back: what the pool makes resident."""
        return sum(self.dirty) * self.bytes_per_block

    @property
    def resident_bytes(self) -> int:
        """What the pool holds in memory now: its committed blocks where pages are handed back (a
        CPU under Linux), else all of it (a GPU's pool, or ``torch.zeros`` elsewhere, is allocated whole)."""
        return self.committed_bytes if self._madvise is not None else self.reserved_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.blocks * self.bytes_per_block


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids grouped: [(first, count)], in the given order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
