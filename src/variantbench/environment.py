"""What machine and software produced the numbers (recorded in every report)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import psutil


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_flags() -> list[str]:
    """The instruction-set extensions that decide which kernels run (from /proc/cpuinfo)."""
    wanted = (
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
        "asimd",
        "sve",
    )
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def describe_environment(torch_details: bool = True) -> dict[str, Any]:
    """The machine and library versions; ``torch_details`` also imports torch for its threads,
    CPU capability and GPU (an endpoint run measures another process and does not load torch)."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_logical_cores": psutil.cpu_count(logical=True),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "torch_threads": None,
        "cpu_capability": None,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "gpu": None,
    }
    if torch_details and env["torch"] is not None:
        import torch

        env.update(
            torch_threads=torch.get_num_threads(), cpu_capability=torch.backends.cpu.get_cpu_capability()
        )
        if torch.cuda.is_available():
            env["gpu"] = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return env


def cpu_summary() -> str:
    """One line for a benchmark's head: the CPU, the extensions that pick its kernels, the cores."""
    flags = cpu_flags()
    return f"CPU: {cpu_model()} ({', '.join(flags) or 'no extensions read'}), {usable_cores()} usable cores"
