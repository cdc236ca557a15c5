"""SingleStream on the real torch backend: the query log, errors as data, the summary."""

from __future__ import annotations

import json
import pickle

import pytest

from variantbench.backends.base import GenerationRequest
from variantbench.backends.torch_backend import TorchBackend
from variantbench.loadgen.harness import LoadSettings, run_scenario, sample_order
from variantbench.records import QueryLog, read_log
from variantbench.report.schema import Resources
from variantbench.report.summary import summarize_run
from variantbench.workloads import SyntheticLibrary


class FlakyBackend(TorchBackend):
    """The real backend, except that every third call raises: the harness is under test here."""

    calls = 0

    def generate_encoded(
        self, requests: list[GenerationRequest], encoded
    ):  # the runner's (and generate's) path
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError("injected failure")
        return super().generate_encoded(requests, encoded)


@pytest.fixture(scope="module")
def library() -> SyntheticLibrary:
    return SyntheticLibrary(n=6, seed=3, tokens=(20, 60))


def test_query_log_has_one_line_per_issued_query_including_failures(
    tiny_model_dir, library, tmp_path
) -> None:
    backend = FlakyBackend(str(tiny_model_dir), "fp32")
    backend.load()
    settings = LoadSettings(min_queries=7, max_queries=7, warmup=2, sample_seed=1, max_new_tokens=6)
    with QueryLog(tmp_path / "q.jsonl") as log:
        records = run_scenario(backend, library, settings, log).records
    lines = (tmp_path / "q.jsonl").read_text().splitlines()
    assert len(lines) == 7 == len(records)
    logged = read_log(tmp_path / "q.jsonl")
    assert [r.index for r in logged] == list(range(7))
    # calls 1-2 are warm-up; calls 3, 6, 9 fail -> measured queries 0, 3, 6
    failed = [r.index for r in logged if r.status == "error"]
    assert failed == [0, 3, 6]
    assert all("injected failure" in (r.error or "") for r in logged if r.status == "error")
    for r in logged:
        if r.status == "ok":
            assert r.issued_ns < r.first_token_ns <= r.completed_ns
            assert 1 <= r.output_tokens <= 6
            assert len(r.token_ms) == r.output_tokens
            assert r.input_tokens > 0
    run = summarize_run("fp32", logged, Resources())
    assert run.queries.issued == 7 and run.queries.errors == 3 and run.queries.completed == 4
    assert run.latency_ms.p50 is not None and run.latency_ms.p50 > 0
    assert run.ttft_ms.p50 is not None and run.ttft_ms.p50 <= run.latency_ms.p99
    json.loads(lines[0])  # plain JSON per line


def test_backend_pickles_before_load_only(tiny_model_dir) -> None:
    backend = TorchBackend(str(tiny_model_dir), "int8")
    clone = pickle.loads(pickle.dumps(backend))
    assert clone.name == "int8" and clone.model_dir == str(tiny_model_dir)
    backend.load()
    with pytest.raises(TypeError):
        pickle.dumps(backend)
    backend.close()


def test_bad_requests_become_error_results(tiny_model_dir) -> None:
    backend = TorchBackend(str(tiny_model_dir), "fp32")
    backend.load()
    results = backend.generate(
        [
            GenerationRequest("a", prompt="hello there", max_new_tokens=4),
            GenerationRequest("b", prompt="word " * 3000, max_new_tokens=4),  # beyond 2048 positions
            GenerationRequest("c", prompt=None, max_new_tokens=4),
        ]
    )
    assert [r.status for r in results] == ["ok", "error", "error"]
    assert "exceeds" in (results[1].error or "")
    assert results[0].output_tokens >= 1 and results[0].text is not None


def test_sample_order_is_seeded_and_covers_the_library() -> None:
    a, b = sample_order(5, 12, seed=7), sample_order(5, 12, seed=7)
    assert a == b and len(a) == 12
    assert sorted(a[:5]) == list(range(5)) and sorted(a[5:10]) == list(range(5))
    assert sample_order(5, 12, seed=8) != a


def test_requests_are_encoded_ahead_on_a_cpu_thread_with_the_same_answers(tiny_model_dir) -> None:
    import threading

    from variantbench.loadgen.sut import Pending, ThreadedSUT
    from variantbench.records import QueryRecord

    backend = TorchBackend(str(tiny_model_dir), "fp32")
    backend.load()
    threads: list[str] = []
    encode = backend.encode_ahead

    def spy(request):  # the real encoding, noting the thread it ran on
        threads.append(threading.current_thread().name)
        return encode(request)

    backend.encode_ahead = spy  # type: ignore[method-assign]
    requests = [GenerationRequest(f"r{i}", prompt="word " * (20 + 7 * i), max_new_tokens=4) for i in range(4)]
    requests.append(GenerationRequest("bad", prompt="x", max_new_tokens=0))

    def run(ahead: bool) -> dict[str, object]:
        done, got = threading.Event(), {}

        def on_complete(pendings, results) -> None:
            got.update({r.request_id: r for r in results})
            if len(got) == len(requests):
                done.set()

        record = QueryRecord(run_id="r", variant="v", scenario="offline", index=0, sample_id="s", task="qa",
                             status="ok", error=None, scheduled_ns=0, issued_ns=0, first_token_ns=None,
                             completed_ns=0, input_tokens=0, output_tokens=0)  # fmt: skip
        sut = ThreadedSUT(backend, 1, on_complete, preprocess=ahead)
        sut.submit([Pending(record, r) for r in requests])
        assert done.wait(60)
        sut.close()
        return got

    inline = run(False)
    assert threads and all(t == "variantbench-executor" for t in threads)
    threads.clear()
    ahead = run(True)
    assert len(threads) == len(requests) and all(t.startswith("variantbench-preprocess") for t in threads)
    for r in requests[:-1]:
        assert ahead[r.request_id].text == inline[r.request_id].text and ahead[r.request_id].status == "ok"
        work = ahead[r.request_id].cpu_work
        assert work["encode_ms"] > 0 and 0 <= work["encode_waited_ms"] and work["detokenize_ms"] >= 0
        assert inline[r.request_id].cpu_work["encode_waited_ms"] == inline[r.request_id].cpu_work["encode_ms"]
    assert ahead["bad"].status == inline["bad"].status == "error" and "max_new_tokens" in ahead["bad"].error
    backend.close()
