"""What is asked: a sample library.

A library is a seeded, deterministic list of samples with reference answers. It is plain data, so
it pickles to another process or machine; scoring is a pure function of a sample and an output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import math
from typing import Any, Protocol, runtime_checkable

TASKS = ("generation", "qa", "summarization", "classification")
# Output caps per task (new tokens); a sample may carry its own. Classification's is a sentence, not
# a word: the default model answers "The writer's opinion of the plan for market hours is positive."
# (12-16 tokens measured on 8 samples); at 4 tokens every variant, fp32 included, scored 0.
MAX_NEW_TOKENS = {"generation": 64, "qa": 24, "summarization": 64, "classification": 24}

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class Sample:
    sample_id: str
    task: str  # one of TASKS, or "custom" for a user prompt without a task
    prompt: str
    reference: str  # "" when the sample has none
    max_new_tokens: int
    alternatives: tuple[str, ...] = ()  # further accepted answers (SQuAD lists several)
    messages: tuple[dict[str, str], ...] | None = None  # chat samples
    input_tokens: int | None = None  # counted by the workload's tokenizer, when it had one


@runtime_checkable
class SampleLibrary(Protocol):
    name: str
    seed: int

    # samples one pass takes (a look comes after each); None: every pass is the whole library
    pass_size: int | None

    def __len__(self) -> int: ...

    def sample(self, index: int) -> Sample: ...

    def describe(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class Workload:
    """A built sample library: the samples and how they were made. Plain data; pickles anywhere."""

    name: str
    seed: int
    samples: tuple[Sample, ...]
    info: dict[str, Any] = field(default_factory=dict)
    # a library of several passes (``build_synthetic(passes=k)``): pass j is samples
    # [j * pass_size, (j + 1) * pass_size), each with the task mix, so every look brings new samples
    pass_size: int | None = None

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a workload needs at least one sample")
        if self.pass_size is not None and (self.pass_size < 1 or len(self.samples) % self.pass_size):
            raise ValueError(f"{len(self.samples)} samples do not split into passes of {self.pass_size}")

    @property
    def passes(self) -> int:
        return len(self.samples) // self.pass_size if self.pass_size else 1

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> Sample:
        return self.samples[index]

    def describe(self) -> dict[str, object]:
        counts = [s.input_tokens for s in self.samples if s.input_tokens is not None]
        tasks: dict[str, int] = {}
        for s in self.samples:
            tasks[s.task] = tasks.get(s.task, 0) + 1
        return {
            "name": self.name,
            "seed": self.seed,
            "samples": len(self.samples),
            **({"passes": self.passes, "pass_size": self.pass_size} if self.pass_size else {}),
            "tasks": tasks,
            **self.info,
            "input_tokens": token_stats(counts),
        }


def token_stats(counts: Sequence[int]) -> dict[str, int | None]:
    if not counts:
        return {"p50": None, "p99": None, "min": None, "max": None}
    from variantbench.metrics.latency import percentile

    def rank(p: float) -> int:
        return int(percentile(counts, p) or 0)

    return {"p50": rank(50), "p99": rank(99), "min": min(counts), "max": max(counts)}


def approximate_counter(text: str) -> int:
    """Without a tokenizer: about 4/3 tokens per word, the usual ratio of English BPE vocabularies."""
    return math.ceil(len(text.split()) * 4 / 3)
