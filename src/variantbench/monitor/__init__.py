"""Continuous monitoring of a live server: probes, its /metrics, change-point alerts."""
