"""What is asked: a sample library.

A library is a seeded, deterministic list of samples with reference answers. It is plain data, so
it pickles to another process or machine; scoring is a pure function of a sample and an output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Sample:
    sample_id: str
    task: str  # "generation" | "qa" | "summarization" | ...
    prompt: str
    reference: str
    max_new_tokens: int


@runtime_checkable
class SampleLibrary(Protocol):
    name: str
    seed: int

    def __len__(self) -> int: ...

    def sample(self, index: int) -> Sample: ...

    def score(self, sample: Sample, output: str) -> dict[str, float]: ...

    def describe(self) -> dict[str, object]: ...
