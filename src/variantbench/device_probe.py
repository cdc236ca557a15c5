"""The device a name stands for on this machine: the only torch calls of the device checks.

Kept apart from :mod:`variantbench.devices` so that the plan, which checks a device's name there,
imports no torch (the import contract "The plan imports no measuring code and no model library").
"""

from __future__ import annotations

from variantbench.devices import CPU, DeviceInfo, parse_device, select


def cuda_info(index: int) -> DeviceInfo:
    """The properties of CUDA device ``index`` (thin: one torch call)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    return DeviceInfo("cuda", index, p.name, (p.major, p.minor), int(p.total_memory))


def device_info(text: str) -> DeviceInfo:
    """The device ``text`` names, as this machine has it (one line when it has not)."""
    kind, index = parse_device(text)
    if kind == "cpu":
        return CPU
    import torch

    select(text, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert index is not None
    return cuda_info(index)
