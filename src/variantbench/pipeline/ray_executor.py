"""``--executor ray``: each job a Ray task on a node of its own; results come back as a local run's.

Placement: every node offers one ``variantbench_node`` resource (``ray start --resources
'{"variantbench_node": 1}'``; a local ``ray.init()`` gives itself one), and every job asks for it
with a CPU (and a GPU for a CUDA variant): a node runs one variantbench job at a time, so no measurement shares a CPU with
another measurement, nor with a build. A custom resource rather than a placement group with a
strict spread: a group is reserved whole up front, while the jobs here come one after another
(a variant's build, its measurement, its cold start) and a node freed by one should take the next.

Results: a measurement's query records come back in its payload and are appended to the run's
query log here (the node writes its log to a private temporary file), so the log, the raw results
and the report are a local run's; each result also says which node ran it (``node``: Ray's node
id, host, IP, CPU model and flags). Builds are cached in the variantbench cache, which must be the
same path on every node (one machine, or a shared filesystem: ``execution.shared_cache`` sets
``VARIANTBENCH_CACHE`` in every job); a node that cannot see an artifact fails that job with one
line. ``execution.memory_gb`` reserves Ray's memory resource for each job.

Faults: a job whose worker or node died (not one that raised: that is its result) is submitted
again, at most ``retries`` times; each retry and its reason are kept in the result (``retried``).

Progress events cross to the driver through a small actor, fire-and-forget, at most one progress
event per half second: a measuring node must not spend its time reporting.
"""

from __future__ import annotations

from dataclasses import replace
import itertools
import os
import threading
import time
from typing import Any

from variantbench.errors import UserError
from variantbench.pipeline.executors import Job, JobFailed, OnEvent, _one_line
from variantbench.pipeline.jobs import MeasureJob
from variantbench.ray_cluster import NODE_RESOURCE, connect, fingerprint
from variantbench.report.results import VariantResult

PROGRESS_EVERY_S = 0.5


def _whole_node() -> None:
    """The job's threads as in a fresh process of its own: Ray sets OMP_NUM_THREADS to a task's
    num_cpus (1 here), but a variantbench job holds its node whole. Left as Ray set it, torch ran on
    one thread of two: fp32 decode measured 11.5 tokens/s on Ray against 17.5 and 16.3 inline in the
    same benchmarks/scale_out.py run (bf16: 3.3 against 5.9 and 6.0); the cold start's fresh
    process inherits the variable too."""
    import psutil

    from variantbench.environment import usable_cores

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.pop(name, None)
    try:
        import torch
    except ImportError:  # an endpoint's jobs need no torch
        return
    torch.set_num_threads(min(psutil.cpu_count(logical=False) or usable_cores(), usable_cores()))


def _run_on_node(job: Job, events: Any, key: str) -> Any:
    """The Ray task: the job run in this worker, its events sent on, its node named in the result."""
    import tempfile

    from variantbench.quiet import quiet_libraries

    quiet_libraries()
    _whole_node()
    last = {"at": 0.0}

    def emit(event: tuple[Any, ...]) -> None:
        now = time.monotonic()
        if event[0] == "progress" and now - last["at"] < PROGRESS_EVERY_S and event[2] != event[3]:
            return
        last["at"] = now
        events.put.remote(key, event)

    if isinstance(job, MeasureJob):  # its log on this node, its records in the result; saved by the driver
        job = replace(job, log_path=os.path.join(tempfile.mkdtemp(prefix="variantbench-"), "queries.jsonl"),
                      result_path=None)  # fmt: skip
    try:
        result = job.run(emit)
    except UserError as exc:
        raise JobFailed(str(exc)) from exc
    if isinstance(result, VariantResult):
        result.node = fingerprint()
    return result


class _Events:
    """Every running job's events, by job, kept until the driver takes them. One actor for the
    executor: an actor a job cost a worker process of its own, most of a second a job."""

    def __init__(self) -> None:
        self.items: dict[str, list[tuple[Any, ...]]] = {}

    def put(self, key: str, event: tuple[Any, ...]) -> None:
        self.items.setdefault(key, []).append(event)

    def drain(self, key: str) -> list[tuple[Any, ...]]:
        return self.items.pop(key, [])


class RayExecutor:
    """Jobs as Ray tasks, one per node at a time (``NODE_RESOURCE``); thread-safe, so the pipeline
    may run every variant's jobs at once from threads of its own."""

    def __init__(self, address: str | None = None, retries: int = 1, cpus: int | None = None, gpus: int = 0,
                 memory_gb: float | None = None, shared_cache: str | None = None) -> None:  # fmt: skip
        import ray

        self.retries = retries
        self.nodes = connect(address)
        self.cpus = cpus or 1
        self.gpus = gpus  # a CUDA variant's job holds a GPU of its node as well
        if gpus and ray.cluster_resources().get("GPU", 0) < gpus:
            raise UserError("model.device is CUDA but no node of the Ray cluster offers a GPU")
        self.options: dict[str, Any] = {}
        if memory_gb:  # Ray admits a job to a node only with this much of its memory unreserved
            self.options["memory"] = int(memory_gb * 2**30)
        if shared_cache:  # every job reads and writes builds where every node sees them
            self.options["runtime_env"] = {"env_vars": {"VARIANTBENCH_CACHE": shared_cache}}
        # a fresh worker process a job (max_calls=1), as the local executor spawns one: a reused worker
        # kept what earlier jobs left in its memory (a distillation's teacher) and read it as this
        # job's peak RSS
        self._task = ray.remote(max_calls=1)(_run_on_node)
        self._events = ray.remote(num_cpus=0)(_Events).remote()
        self._count = itertools.count()

    def capacity(self) -> int:
        return self.nodes

    def run(self, job: Job, on_event: OnEvent) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayTaskError

        retried: list[str] = []
        while True:
            events, key = self._events, f"{job.id}#{next(self._count)}"
            ref = self._task.options(num_cpus=self.cpus, num_gpus=self.gpus, resources={NODE_RESOURCE: 1},
                                     max_retries=0, name=job.id, **self.options).remote(job, events, key)  # fmt: skip
            try:
                while True:
                    try:
                        result = ray.get(ref, timeout=0.25)
                        break
                    except GetTimeoutError:
                        for event in ray.get(events.drain.remote(key)):
                            on_event(event)
                for event in ray.get(events.drain.remote(key)):
                    on_event(event)
            except RayTaskError as exc:  # the job raised: its reason, as the local executor gives it
                cause = getattr(exc, "cause", None)
                raise JobFailed(
                    str(cause) if isinstance(cause, JobFailed) else _one_line(cause or exc)
                ) from None
            except ray.exceptions.RayError as exc:  # its worker or node died: another try, or a failure
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                reason = f"{type(exc).__name__}: {first}"
                if len(retried) >= self.retries:
                    raise JobFailed(
                        f"{job.id}: lost its worker or node {len(retried) + 1} time(s); last: {reason}"
                    ) from None
                retried.append(reason)
                on_event(("status", f"retrying after {reason}"))
                continue
            finally:
                events.drain.remote(key)  # what a failed attempt left
            if isinstance(result, VariantResult):
                result.retried = retried
                _append_log(job.log_path, result.records or [])
            return result


_LOG_LOCK = threading.Lock()


def _append_log(path: str, records: list[dict[str, Any]]) -> None:
    """A node's records into the run's query log, as a local measurement writes them."""
    from variantbench.records import QueryLog, QueryRecord

    with _LOG_LOCK, QueryLog(path) as log:
        for row in records:
            log.append(QueryRecord.from_json(row))
