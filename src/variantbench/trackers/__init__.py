"""Trackers: context managers that measure beside a run and always clean up."""

from variantbench.trackers.resources import ResourceTracker

__all__ = ["ResourceTracker"]
