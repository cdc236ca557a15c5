"""Decode steps replayed from CUDA graphs (issue 43).

A 135M-parameter model's decode step on a GPU is a few hundred small kernels of a few microseconds
each: launched one by one from Python, the step is bound by the launches, not by the device. A CUDA
graph records the step's kernels once and replays them with one launch. What a graph needs is a
step whose shapes and tensor addresses never change: ``Decoder._static_step`` (the cache slot a
tensor, attention over the whole cache under a mask), on a KV cache of a fixed length kept by the
graph (``GraphedDecode.storage``, the request's length rounded up to ``BUCKET``), so one capture
serves every request of that batch size and length bucket.

Where a model cannot be captured (``refusal``), the engine decodes eagerly and says why; so does a
run with ``model.cuda_graphs: false`` (``--no-cuda-graphs``). The rules and the static step are
tested on the CPU (tests/test_cuda_logic.py); the capture itself is three CUDA calls.
"""

from __future__ import annotations

from typing import Any

import torch

BUCKET = 256  # cache lengths are rounded up to a multiple of this: one graph per bucket and batch size
WARMUP = 2  # eager steps on a side stream before the capture (cuBLAS picks its workspaces there)


def bucket(total: int) -> int:
    return -(-total // BUCKET) * BUCKET


def refusal(decoder: Any, capture: bool = True) -> str | None:
    """Why ``decoder``'s decode step cannot be captured in a CUDA graph, or None. ``capture=False``:
    why the fixed-shape step cannot run at all (the static step on the CPU, uncaptured)."""
    if decoder.compiled:
        return "the compile variant's step is torch.compile's (its own graphs)"
    if decoder.has_linear_attention:
        return "linear-attention layers keep a state outside the KV cache"
    if not capture:
        return None
    if decoder.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this decoder is on {decoder.device.type})"
    if any(layer.experts is not None for layer in decoder.layers):
        return "mixture-of-experts routing sends a data-dependent number of tokens to each expert"
    return None


class GraphedDecode:
    """One captured decode step for ``bsz`` rows over a cache of ``length`` positions."""

    def __init__(self, decoder: Any, bsz: int, length: int, capture: bool = True) -> None:
        self.decoder, self.bsz, self.length, self.capture = decoder, bsz, length, capture
        dev = decoder.device
        self.storage, _ = decoder._new_cache(bsz, length)
        self.valid = torch.zeros(bsz, length, dtype=torch.bool, device=dev)
        self.rope = decoder._rope_tables(length)
        self.ids = torch.zeros(bsz, dtype=torch.long, device=dev)
        self.positions = torch.zeros(bsz, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.out: torch.Tensor | None = None
        self.graph: Any = None

    def _run(self) -> torch.Tensor:
        return self.decoder._static_step(
            self.ids, self.positions, self.slot, self.storage, self.valid, self.rope
        )

    def _load(self, ids: torch.Tensor, positions: torch.Tensor, cur: int) -> None:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.slot.fill_(cur)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, cur: int) -> torch.Tensor:
        """The next tokens: the first call runs the step (on a side stream, then captures it), later
        calls replay it. The output tensor is the graph's own: read it before the next step."""
        self._load(ids, positions, cur)
        if not self.capture:  # the static step run eagerly (the CPU; what the tests compare)
            return self._run()
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        assert self.out is not None
        return self.out

    def _capture(self) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):  # the same inputs each time: the same keys written, the same tokens
                result = self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._run()
        self.graph = graph
        return result


class GraphCache:
    """The captured steps of one decoder, by (batch size, length bucket)."""

    def __init__(self, decoder: Any, capture: bool = True) -> None:
        self.decoder, self.capture = decoder, capture
        self.steps: dict[tuple[int, int], GraphedDecode] = {}

    def get(self, bsz: int, total: int) -> GraphedDecode:
        key = (bsz, bucket(total))
        if key not in self.steps:
            self.steps[key] = GraphedDecode(self.decoder, *key, capture=self.capture)
        return self.steps[key]
