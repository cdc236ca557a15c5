"""Run ``vllm bench serve`` unchanged and record the schedule it meant to keep (run by vLLM's venv).

    VENV/bin/python benchmarks/peer_vllm_driver.py SCHEDULE.json -- <vllm bench serve arguments>

vLLM's client draws its Poisson gaps with ``np.random.gamma`` inside ``get_request`` and rescales
them so the last one falls at ``n / rate``; its detailed result keeps each request's send time
(``start_times``, perf_counter) but not the time it was scheduled for. This driver wraps
``get_request``: before the generator starts, it draws the same gaps from a copy of NumPy's global
random state (which it then restores, so vLLM's own draw is untouched) and writes the scheduled
perf_counter times to SCHEDULE.json. ``harness_vs_peers.py`` then takes dispatch lag as send time
minus scheduled time, as it does for guidellm and for us. Only constant-rate runs (no ramp-up, no
trace timestamps) are supported, which is all the benchmark asks.
"""

from __future__ import annotations

import json
import sys
import time


def scheduled_offsets(n: int, rate: float, burstiness: float) -> list[float]:
    """vLLM's ``get_request`` delays for a constant rate, drawn from the current global state."""
    import numpy as np

    if rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        delays = [1.0 / rate] * n
    else:
        theta = 1.0 / (rate * burstiness)
        delays = [float(np.random.gamma(shape=burstiness, scale=theta)) for _ in range(n)]
    for i in range(1, n):
        delays[i] += delays[i - 1]
    if delays and delays[-1] != 0:
        factor = (n / rate) / delays[-1]
        delays = [d * factor for d in delays]
    return delays


class _AnchoredClock:
    """Stands in for the ``time`` module inside vLLM's serve module: its first ``time()`` call is
    ``get_request``'s ``start_ts``, from which every send is scheduled; the perf_counter read beside
    it puts the schedule on the clock of the recorded send times."""

    def __init__(self) -> None:
        self.anchor: float | None = None

    def time(self) -> float:
        now = time.time()
        if self.anchor is None:
            self.anchor = time.perf_counter()
        return now

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(time, name)


def main() -> None:
    if "--" not in sys.argv:
        sys.exit("usage: peer_vllm_driver.py SCHEDULE.json -- <vllm bench serve arguments>")
    cut = sys.argv.index("--")
    out_path = sys.argv[1]
    import numpy as np
    import vllm.benchmarks.serve as serve

    original = serve.get_request

    async def recorded(input_requests, request_rate, burstiness=1.0, *args, **kwargs):  # noqa: ANN001, ANN202
        requests = list(input_requests)
        state = np.random.get_state()
        offsets = scheduled_offsets(len(requests), float(request_rate), float(burstiness))
        np.random.set_state(state)
        clock = _AnchoredClock()
        serve.time = clock
        try:
            async for item in original(requests, request_rate, burstiness, *args, **kwargs):
                yield item
        finally:
            serve.time = time
        with open(out_path, "w") as f:  # after the last send, so the write cannot delay one
            json.dump({"scheduled_perf": [clock.anchor + o for o in offsets]}, f)

    serve.get_request = recorded
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[cut + 1 :]]
    vllm_main()


if __name__ == "__main__":
    main()
