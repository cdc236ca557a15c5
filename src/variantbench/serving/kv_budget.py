"""How many tokens of keys/values a served variant's cache may hold: the worst case, within memory.

The paged pool is sized for every row at the longest context (``max_batch x max_len`` tokens) so
that admission never has to guess; on a CPU its pages are committed only as keys are written. For a
larger model that worst case outgrows the machine: SmolLM2-1.7B's shape in fp32 keeps 384 KiB of
keys/values per token, so 32 rows x 2,304 tokens is 27 GiB, and on this 24 GiB machine the
reservation itself failed (Linux's overcommit heuristic refuses one allocation larger than RAM +
swap) before a request was served. And had it been granted, a load that filled it would have been
killed for memory instead of queued. So the pool holds at most a budget: ``--kv-cache-gb``, or by
default 80% of the memory available once the weights are loaded (``psutil``; on CUDA the device's
free memory), and a request the pool cannot hold waits in the queue for room (``PagedBatch.begin``
raises ``NoRoom``; the worker keeps it) rather than taking memory the machine does not have.
"""

from __future__ import annotations

from typing import Any

from variantbench.errors import UserError

AUTO_SHARE = 0.8  # of the memory available at start: the rest for activations, the tokenizer, the HTTP stack


def available_bytes(device: Any) -> int:
    """Memory a KV cache could take now: free device memory on CUDA, available RAM on a CPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def budget_bytes(kv_cache_gb: float | None, device: Any) -> tuple[int, str]:
    """The cache's budget in bytes and where it came from (for the start-up line)."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30), f"--kv-cache-gb {kv_cache_gb:g}"
    free = available_bytes(device)
    return int(AUTO_SHARE * free), f"{AUTO_SHARE:.0%} of the {free / 2**30:.1f} GiB available at start"


def cache_blocks(worst_blocks: int, bytes_per_block: int, block: int, max_len: int,
                 budget: tuple[int, str]) -> int:  # fmt: skip
    """Blocks the cache holds: the worst case, or what the budget allows if less; at least one
    request of ``max_len`` (else a clear error: nothing could ever be served)."""
    limit, source = budget
    blocks = min(worst_blocks, limit // max(1, bytes_per_block))
    if blocks * block < max_len:
        raise UserError(
            f"the KV cache's budget ({source}: {limit / 2**30:.3g} GiB) holds {blocks * block} tokens at "
            f"{bytes_per_block / block / 2**10:.0f} KiB a token, less than one request of --max-len {max_len}; "
            "lower --max-len or give the cache more memory (--kv-cache-gb)"
        )
    return blocks
