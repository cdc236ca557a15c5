"""Turning measurements into a decision: cost, machine ceilings, diagnosis, scenario recommendation."""
