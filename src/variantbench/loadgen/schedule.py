"""Arrival schedules, generated whole before the run from their own seed.

Server scenario arrivals are Poisson (exponential gaps) or, with ``burstiness`` != 1, gamma gaps
with shape ``burstiness`` and the same mean (vLLM's convention: 1.0 is Poisson, < 1 burstier,
> 1 more regular). The gaps are drawn once and rescaled so the schedule's mean rate is exactly the
target: drawing delays on the fly drifts from the target rate (vLLM's lesson).
"""

from __future__ import annotations

import numpy as np


def arrival_offsets_ns(n: int, rate_qps: float, seed: int | list[int], burstiness: float = 1.0) -> list[int]:
    """Offsets from the run start (ns) of ``n`` arrivals at ``rate_qps`` on average; first at 0."""
    if rate_qps <= 0:
        raise ValueError(f"rate must be positive, got {rate_qps}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if n <= 0:
        return []
    rng = np.random.default_rng(seed)
    mean_gap_s = 1.0 / rate_qps
    gaps = rng.gamma(shape=burstiness, scale=mean_gap_s / burstiness, size=n)
    gaps[0] = 0.0
    if n > 1:
        # n arrivals span n-1 gaps: rescale those so the realized rate is the target exactly
        gaps[1:] *= mean_gap_s * (n - 1) / gaps[1:].sum()
    return [int(round(x)) for x in np.cumsum(gaps) * 1e9]
