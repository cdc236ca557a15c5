"""One thread does the process's torch work, whichever thread asks (see ``variantbench.compute``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import threading

import pytest

from variantbench import compute


def test_calls_run_on_one_thread_raise_where_called_and_nest_inline() -> None:
    home = compute.compute_thread_id()
    assert home != threading.get_ident()
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda _: compute.call(threading.get_ident), range(16))) == {home}

    def boom() -> None:
        raise ValueError("from the compute thread")

    with pytest.raises(ValueError, match="from the compute thread"):
        compute.call(boom)
    # a call made on the compute thread runs inline (it would wait for itself otherwise)
    assert compute.call(lambda: compute.call(threading.get_ident)) == home


def test_a_forked_child_gets_a_compute_thread_of_its_own() -> None:
    import multiprocessing as mp

    compute.compute_thread_id()  # started here first
    with mp.get_context("fork").Pool(1) as pool:
        # before: no thread served the inherited queue, and the call waited forever
        assert pool.apply_async(compute.call, (sum, [1, 2, 3])).get(timeout=30) == 6


def test_a_loaded_backend_and_its_serving_batch_compute_on_the_compute_thread(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded from this (main) thread, generating from a harness-like executor thread and stepping
    from a server-like worker thread: every forward pass runs on the one compute thread."""
    from variantbench.backends.base import GenerationRequest
    from variantbench.backends.engine import Decoder
    from variantbench.backends.torch_backend import TorchBackend
    from variantbench.serving.batching import batch_for

    threads: list[int] = []
    for name in ("_forward", "_forward_groups"):
        real = getattr(Decoder, name)

        def recorded(self, *args, _real=real, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            threads.append(threading.get_ident())
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Decoder, name, recorded)
    backend = TorchBackend(str(tiny_model_dir))
    backend.load()
    request = GenerationRequest("q", prompt="one two three", max_new_tokens=4)
    with ThreadPoolExecutor(1) as executor:
        result = executor.submit(backend.generate, [request]).result()[0]
    assert result.status == "ok" and result.output_tokens > 0
    batch = batch_for(backend, max_batch=2, max_len=64)

    def serve() -> list:
        batch.begin("a", [5, 6, 7, 8], 3)
        return [batch.step() for _ in range(3)]

    with ThreadPoolExecutor(1) as worker:
        steps = worker.submit(serve).result()
    assert any(steps)
    backend.close()
    assert threads and set(threads) == {compute.compute_thread_id()}


def test_likelihood_and_fidelity_scoring_run_on_the_compute_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their torch ops (top-k, KL, gathers over [tokens, vocab]) once ran on the job's main thread: a
    second OpenMP pool in every variant's process from the first look on, and the fused decode step
    paid its barriers as wake-ups (int8 TPOT 5.5 -> 12.5 ms in the default run)."""
    from variantbench.metrics import fidelity, likelihood

    seen: list[int] = []

    class Stop(Exception):
        pass

    def record(*_args: object) -> None:
        seen.append(threading.get_ident())
        raise Stop

    monkeypatch.setattr(likelihood, "score_sample", record)
    monkeypatch.setattr(fidelity, "read_text", record)
    with pytest.raises(Stop):
        likelihood.measure(None, [object()], None, True, lambda _s: [])
    with pytest.raises(Stop):
        fidelity.measure(None, type("Spec", (), {"text_path": None})(), True)
    assert seen == [compute.compute_thread_id()] * 2
