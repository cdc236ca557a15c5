"""The machine's measured ceilings: matmul GFLOP/s and memory bandwidth, probed in a few seconds.

The diagnosis reads a variant's achieved FLOP/s and bytes/s against these, so "slow" means slow
for this machine. Probed with torch on the CPU (best of several repeats), or on a CUDA device.
"""

from __future__ import annotations

import gc
import time
from typing import Any


def memory_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 7, device: str = "cpu") -> float:
    """Read bandwidth: one reduction over a buffer far larger than the caches, best of ``repeats``."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written: every page is real
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del buf
    gc.collect()
    return nbytes / best / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """fp32 GEMM throughput on an n x n x n product, best of ``repeats``."""
    import torch

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def probe(device: str = "cpu", nbytes: int = 1 << 28) -> dict[str, Any]:
    return {
        "matmul_gflops": round(matmul_gflops(device=device), 1),
        "memory_gbps": round(memory_bandwidth_gbs(nbytes, device=device), 2),
        "device": device,
        "how": "fp32 1024^3 GEMM and a 256 MiB reduction, best of 5-7 repeats (torch)",
    }
