"""Which device runs a variant, and whether that device can run each recipe of it (issue 43).

A device is ``cpu`` or ``cuda[:N]``. What a CUDA device can do is decided by its compute capability
(``major.minor``), read once through ``torch.cuda.get_device_properties`` in
:mod:`variantbench.device_probe` (the only CUDA calls, kept apart so that the plan, which checks a
device's name here, imports no torch); everything here is plain logic over a :class:`DeviceInfo`,
tested on the CPU with the properties of real cards (a T4, an A100, an H100) written down.

Each recipe declares what it needs (``Recipe.devices``, a :class:`DeviceNeed`): the devices it runs
on, and on CUDA the lowest compute capability whose tensor cores compute its format. A variant
asked for on a device that lacks it stops before anything is built or loaded, in one line naming
the recipe, the device, and what is missing:

* bf16 (and mixed-bf16): 8.0, Ampere's bf16 tensor cores (older cards emulate it, slower than fp32);
* int8 dynamic (torchao's int8 x int8 ``_int_mm``) and int4 weight-only (tinygemm): 8.0;
* fp8 (``torch._scaled_mm`` on e4m3 weights and activations): 8.9, Ada and Hopper;
* the exports for other engines (``onnx-*``, ``gguf-*``): the CPU, where their runtimes are built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from variantbench.errors import UserError


@dataclass(frozen=True)
class DeviceInfo:
    """What a recipe check needs to know of a device."""

    type: str  # "cpu" | "cuda"
    index: int | None = None
    name: str = "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    memory_bytes: int | None = None

    @property
    def label(self) -> str:
        if self.type == "cpu":
            return "the CPU"
        cc = f"compute capability {self.capability[0]}.{self.capability[1]}" if self.capability else "?"
        return f"cuda:{self.index} ({self.name}, {cc})"

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type, "index": self.index, "name": self.name,
            "capability": ".".join(map(str, self.capability)) if self.capability else None,
            "memory_bytes": self.memory_bytes,
        }  # fmt: skip


CPU = DeviceInfo("cpu")


def parse_device(text: str) -> tuple[str, int | None]:
    """``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", 0); ``"cuda:1"`` -> ("cuda", 1); else one line."""
    if text == "cpu":
        return "cpu", None
    if text == "cuda":
        return "cuda", 0
    head, sep, index = text.partition(":")
    if head == "cuda" and sep and index.isdigit():
        return "cuda", int(index)
    raise UserError(f"device must be 'cpu' or 'cuda[:N]', got {text!r}")


def select(text: str, count: int) -> tuple[str, int | None]:
    """The device ``text`` names, checked against the ``count`` CUDA devices torch sees."""
    kind, index = parse_device(text)
    if kind == "cuda":
        if count == 0:
            raise UserError(
                f"device {text}: torch sees no CUDA device on this machine (a CPU build of torch?)"
            )
        if index is not None and index >= count:
            raise UserError(
                f"device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return kind, index


@dataclass(frozen=True)
class DeviceNeed:
    """What a recipe needs of the device that runs it.

    ``cpu`` / ``cuda``: True, or the reason it does not run there. ``min_capability``: on CUDA, the
    lowest compute capability that computes it, ``for_what`` naming the hardware feature.
    """

    cpu: bool | str = True
    cuda: bool | str = True
    min_capability: tuple[int, int] | None = None
    for_what: str = ""

    def refusal(self, kind: str, device: DeviceInfo) -> str | None:
        """Why ``kind`` cannot run on ``device`` (one line), or None."""
        allowed = self.cpu if device.type == "cpu" else self.cuda
        if allowed is not True:
            why = allowed if isinstance(allowed, str) else "not supported"
            return f"{kind} does not run on {device.label}: {why}"
        if device.type == "cuda" and self.min_capability and device.capability is not None:
            if device.capability < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                return (f"{kind} needs compute capability {need} or newer ({self.for_what}); "
                        f"{device.label} has not")  # fmt: skip
        return None


ANY = DeviceNeed()
AMPERE_BF16 = DeviceNeed(min_capability=(8, 0), for_what="bf16 tensor cores, Ampere and newer")


def refusals(recipes: Iterable[Any], device: DeviceInfo) -> list[str]:
    """One line for each recipe (``Recipe`` instances) that ``device`` cannot run."""
    out = []
    for recipe in recipes:
        need: DeviceNeed = getattr(type(recipe), "devices", ANY)
        line = need.refusal(recipe.kind, device)
        if line:
            out.append(line)
    return out


def check_variant(name: str, recipes: Iterable[Any], device: DeviceInfo) -> None:
    """One line (a UserError) when ``device`` cannot run a recipe of variant ``name``."""
    lines = refusals(recipes, device)
    if lines:
        raise UserError(f"{name}: {lines[0]}")
