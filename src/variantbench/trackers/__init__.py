"""Trackers: context managers that measure something beside latency and always stop cleanly."""

from variantbench.trackers.memory import RssTracker

__all__ = ["RssTracker"]
