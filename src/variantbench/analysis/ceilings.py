"""The machine's measured ceilings: matmul GFLOP/s and memory bandwidth, probed in a few seconds.

The diagnosis reads a variant's achieved FLOP/s and bytes/s against these, so "slow" means slow
for this machine. Probed with torch on the CPU (best of several repeats), or on a CUDA device:
there timed with CUDA events (the kernels are asynchronous), over a 1 GiB buffer (an H100's 50 MB
L2 would flatter a smaller one), with a bf16 8192^3 product for the tensor cores' FLOP/s.

The CPU probes run on the compute thread (``variantbench.compute``): a probe on any other thread
opens a second libgomp pool, and every later parallel region in the process pays a wake-up. Probed
on the main thread before the engine ran, a 64-wide copy of SmolLM2's 30 layers decoded at 12-15
ms a token against 4.2-5.0 ms with one pool (2 cores, AVX-512 BF16).
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

from variantbench.compute import on_compute


@on_compute
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


@on_compute
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


def cuda_seconds(fn: Any, repeats: int) -> float:
    """Best time of ``fn()`` on the current CUDA stream, by CUDA events, after one warm call."""
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def cuda_probe(device: str, nbytes: int = 1 << 30, n: int = 8192) -> dict[str, Any]:
    """A CUDA device's read bandwidth (a reduction) and its bf16 and fp32 matmul throughput."""
    import torch

    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    read_s = cuda_seconds(buf.sum, 10)
    del buf
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16_s = cuda_seconds(functools.partial(torch.matmul, a, b), 5)
    a32, b32 = a.float(), b.float()
    fp32_s = cuda_seconds(functools.partial(torch.matmul, a32, b32), 3)
    del a, b, a32, b32
    torch.cuda.empty_cache()
    return {
        "memory_gbps": round(nbytes / read_s / 1e9, 1),
        "bf16_gflops": round(2 * n**3 / bf16_s / 1e9, 1),
        "matmul_gflops": round(2 * n**3 / fp32_s / 1e9, 1),
        "device": device,
        "how": f"CUDA events: a {nbytes >> 20} MiB bf16 reduction, bf16 and fp32 {n}^3 products, best of 3-10",
    }


def probe(device: str = "cpu", nbytes: int = 1 << 28) -> dict[str, Any]:
    if device.startswith("cuda"):
        return cuda_probe(device)
    return {
        "matmul_gflops": round(matmul_gflops(device=device), 1),
        "memory_gbps": round(memory_bandwidth_gbs(nbytes, device=device), 2),
        "device": device,
        "how": "fp32 1024^3 GEMM and a 256 MiB reduction, best of 5-7 repeats (torch)",
    }
