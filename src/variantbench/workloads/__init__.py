"""Sample libraries: what is asked of the system under test."""

from variantbench.workloads.base import Sample, SampleLibrary
from variantbench.workloads.synthetic import SyntheticLibrary

__all__ = ["Sample", "SampleLibrary", "SyntheticLibrary"]
