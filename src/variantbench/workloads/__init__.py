"""Sample libraries: what is asked of the system under test."""

from variantbench.workloads.base import TASKS, Sample, SampleLibrary, Workload
from variantbench.workloads.lengths import LengthDistribution, parse_lengths, parse_mix
from variantbench.workloads.synthetic import DEFAULT_MIX, SyntheticLibrary, build_synthetic

__all__ = [
    "DEFAULT_MIX",
    "TASKS",
    "LengthDistribution",
    "Sample",
    "SampleLibrary",
    "SyntheticLibrary",
    "Workload",
    "build_synthetic",
    "parse_lengths",
    "parse_mix",
]
