"""Executors run jobs: ``local`` in a fresh spawned process per job, ``inline`` in this process.

An executor takes a job (picklable, with ``id`` and ``run(emit)``) and a callback for its progress
events, and returns the job's result dict or raises ``JobFailed`` with one line. The process
executor gives each variant its own memory, threads and startup, and a crash in one (a segfault in a
native kernel, an out-of-memory kill) fails that job only. A Ray executor (a later issue) takes the
same jobs and returns the same dicts.
"""

from __future__ import annotations

from collections.abc import Callable
import multiprocessing as mp
import queue as queue_mod
import traceback
from typing import Any, Protocol

from variantbench.errors import UserError

OnEvent = Callable[[tuple[Any, ...]], None]


class Job(Protocol):
    @property
    def id(self) -> str: ...

    def run(self, emit: OnEvent) -> dict[str, Any]: ...


class JobFailed(RuntimeError):
    """A job that did not finish: its one-line reason."""


class Executor(Protocol):
    def run(self, job: Job, on_event: OnEvent) -> dict[str, Any]: ...


class InlineExecutor:
    """In this process: for debugging, and where a second process is not wanted (``--no-isolate``)."""

    def run(self, job: Job, on_event: OnEvent) -> dict[str, Any]:
        try:
            return job.run(on_event)
        except UserError as exc:
            raise JobFailed(str(exc)) from exc


def _worker(job: Job, channel: Any, preload: tuple[str, ...] = ()) -> None:
    import importlib

    from variantbench.quiet import quiet_libraries

    quiet_libraries()
    for name in preload:  # loaded before the job's own clocks start
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:
        channel.put(("done", job.run(channel.put)))
    except UserError as exc:
        channel.put(("failed", str(exc)))
    except BaseException as exc:  # report, never hang the parent
        channel.put(("failed", traceback.format_exception_only(type(exc), exc)[-1].strip()))


class LocalProcessExecutor:
    """Each job in its own spawned process; progress events come back over a queue."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        # modules the child imports before the job starts, so a job's own timers (startup_s) see a
        # warm process with its libraries loaded, not the import of torch
        self.preload = preload

    def run(self, job: Job, on_event: OnEvent) -> dict[str, Any]:
        ctx = mp.get_context("spawn")
        channel = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(job, channel, self.preload),
                           name=f"variantbench-{job.id}")  # fmt: skip
        proc.start()
        try:
            while True:
                try:
                    event = channel.get(timeout=0.2)
                except queue_mod.Empty:
                    if proc.is_alive():
                        continue
                    try:  # one last look: the result may have landed just before the exit
                        event = channel.get(timeout=1.0)
                    except queue_mod.Empty:
                        raise JobFailed(f"{job.id}: its process exited with code {proc.exitcode}") from None
                if event[0] == "done":
                    return event[1]
                if event[0] == "failed":
                    raise JobFailed(event[1])
                on_event(event)
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


EXECUTORS: dict[str, Callable[[], Executor]] = {
    "local": lambda: LocalProcessExecutor(
        preload=(
            "torch",
            "transformers.models.auto.modeling_auto",
            "transformers.models.auto.tokenization_auto",
        )
    ),
    "inline": InlineExecutor,
}
