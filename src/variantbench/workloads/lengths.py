"""Input-length distributions, in tokens of the model's tokenizer: uniform, normal, or fixed.

Written on the command line as ``uniform:128-2048``, ``normal:512,128`` (mean, std; drawn values
are clipped to 128-2048 unless a range follows: ``normal:512,128,64-1024``) or ``fixed:256``.
"""

from __future__ import annotations

from dataclasses import dataclass
import random
import re

DEFAULT_LOW, DEFAULT_HIGH = 128, 2048
SMALLEST = 16  # below this a prompt cannot hold its instruction and a fact


@dataclass(frozen=True)
class LengthDistribution:
    kind: str = "uniform"  # "uniform" | "normal" | "fixed"
    low: int = DEFAULT_LOW
    high: int = DEFAULT_HIGH
    mean: float | None = None
    std: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "normal", "fixed"):
            raise ValueError(f"unknown length distribution {self.kind!r}; known: uniform, normal, fixed")
        if self.low < SMALLEST or self.high < self.low:
            raise ValueError(f"input lengths need {SMALLEST} <= low <= high, got {self.low}-{self.high}")
        if self.kind == "normal" and (self.mean is None or self.std is None or self.std < 0):
            raise ValueError("a normal length distribution needs a mean and a non-negative std")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        assert self.mean is not None and self.std is not None
        return min(self.high, max(self.low, round(rng.gauss(self.mean, self.std))))

    def describe(self) -> dict[str, object]:
        if self.kind == "fixed":
            return {"kind": "fixed", "tokens": self.low}
        out: dict[str, object] = {"kind": self.kind, "low": self.low, "high": self.high}
        if self.kind == "normal":
            out.update(mean=self.mean, std=self.std)
        return out

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.low}"
        if self.kind == "uniform":
            return f"uniform:{self.low}-{self.high}"
        return f"normal:{self.mean:g},{self.std:g},{self.low}-{self.high}"


_RANGE = r"(\d+)\s*-\s*(\d+)"


def parse_lengths(text: str) -> LengthDistribution:
    """``uniform:128-2048`` | ``normal:MEAN,STD[,LOW-HIGH]`` | ``fixed:N``; ValueError with the reason."""
    spec = text.strip().lower()
    kind, _, rest = spec.partition(":")
    rest = rest.strip()
    if kind == "fixed" and rest.isdigit():
        n = int(rest)
        return LengthDistribution("fixed", n, n)
    if kind == "uniform" and (m := re.fullmatch(_RANGE, rest)):
        return LengthDistribution("uniform", int(m[1]), int(m[2]))
    if kind == "normal" and (m := re.fullmatch(r"([\d.]+)\s*,\s*([\d.]+)(?:\s*,\s*" + _RANGE + ")?", rest)):
        low = int(m[3]) if m[3] else DEFAULT_LOW
        high = int(m[4]) if m[4] else DEFAULT_HIGH
        return LengthDistribution("normal", low, high, float(m[1]), float(m[2]))
    raise ValueError(
        f"cannot read input lengths {text!r}; use uniform:128-2048, normal:MEAN,STD[,LOW-HIGH] or fixed:N"
    )


def parse_mix(text: str, known: tuple[str, ...]) -> dict[str, float]:
    """``qa=0.4,summarization=0.3,generation=0.3`` -> weights normalized to sum 1."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"mix entry {part.strip()!r} needs the form task=weight")
        if name not in known:
            raise ValueError(f"unknown task {name!r} in the mix; known: {', '.join(known)}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"weight of {name!r} is not a number: {value.strip()!r}") from None
        if weight < 0:
            raise ValueError(f"weight of {name!r} is negative")
        weights[name] = weights.get(name, 0.0) + weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("the mix needs at least one task with a positive weight")
    return {k: v / total for k, v in weights.items() if v > 0}
