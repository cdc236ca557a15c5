"""What machine and software produced the numbers (recorded in every report)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import psutil


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_environment() -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_logical_cores": psutil.cpu_count(logical=True),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "gpu": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return env
