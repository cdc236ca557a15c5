"""Executors run jobs: ``local`` in a fresh spawned process per job, ``inline`` in this process.

An executor takes a job (picklable, with ``id`` and ``run(emit)``) and a callback for its progress
events, and returns the job's typed result or raises ``JobFailed`` with one line. The process
executor gives each variant its own memory, threads and startup, and a crash in one (a segfault in a
native kernel, an out-of-memory kill) fails that job only. The Ray executor (``ray_executor.py``)
takes the same jobs and returns the same results; ``registry.py`` names them all.
"""

from __future__ import annotations

from collections.abc import Callable
import multiprocessing as mp
import queue as queue_mod
import traceback
from typing import Any, Protocol, runtime_checkable

from variantbench.errors import UserError

OnEvent = Callable[[tuple[Any, ...]], None]


class Job(Protocol):
    @property
    def id(self) -> str: ...

    def run(self, emit: OnEvent) -> Any: ...


class JobFailed(RuntimeError):
    """A job that did not finish: its one-line reason."""


class Executor(Protocol):
    def run(self, job: Job, on_event: OnEvent) -> Any: ...


class ResidentJob(Protocol):
    """A job that stays loaded and answers calls: ``open(emit)`` returns an object whose methods
    take their arguments and ``emit`` (an interleaved variant: ``block``, ``finish``, ``close``)."""

    @property
    def id(self) -> str: ...

    def open(self, emit: OnEvent) -> Any: ...


class Session(Protocol):
    def call(self, method: str, *args: Any, on_event: OnEvent) -> Any: ...

    def close(self) -> None: ...


@runtime_checkable
class Resident(Protocol):
    """An executor that can keep a job loaded between calls (what interleaving needs)."""

    def open(self, job: ResidentJob, on_event: OnEvent) -> Session: ...


class InlineExecutor:
    """In this process: for debugging, and where a second process is not wanted (``--no-isolate``)."""

    def run(self, job: Job, on_event: OnEvent) -> Any:
        try:
            return job.run(on_event)
        except UserError as exc:
            raise JobFailed(str(exc)) from exc

    def open(self, job: ResidentJob, on_event: OnEvent) -> Session:
        try:
            return _InlineSession(job.open(on_event))
        except UserError as exc:
            raise JobFailed(str(exc)) from exc


class _InlineSession:
    def __init__(self, target: Any) -> None:
        self.target = target
        self.closed = False

    def call(self, method: str, *args: Any, on_event: OnEvent) -> Any:
        try:
            return getattr(self.target, method)(*args, on_event)
        except UserError as exc:
            raise JobFailed(str(exc)) from exc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.target.close()


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, UserError):
        return str(exc)
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _resident(job: ResidentJob, commands: Any, channel: Any, preload: tuple[str, ...] = ()) -> None:
    """A spawned process holding one opened job; it answers calls until told to stop."""
    _prepare(preload)
    try:
        target = job.open(channel.put)
    except BaseException as exc:  # report, never hang the parent
        channel.put(("failed", _one_line(exc)))
        return
    channel.put(("done", None))
    while True:
        command = commands.get()
        if command is None:
            try:
                target.close()
            except BaseException:  # noqa: BLE001 - closing at the end: nothing left to report to
                pass
            _exit(channel)
        method, args = command
        try:
            channel.put(("done", getattr(target, method)(*args, channel.put)))
        except BaseException as exc:  # noqa: BLE001 - the parent decides what a failed call means
            channel.put(("failed", _one_line(exc)))


def _prepare(preload: tuple[str, ...]) -> None:
    import importlib

    from variantbench.quiet import quiet_libraries

    quiet_libraries()
    for name in preload:  # loaded before the job's own clocks start
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _exit(channel: Any) -> None:
    """Leave once the last message is through, without the interpreter's teardown: a child that had
    loaded torch and transformers took about 2 s to exit normally, and the parent waits for it (over
    a test suite's few dozen runs, a minute). Every file the job wrote is closed by then."""
    import os
    import sys

    channel.close()
    channel.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(job: Job, channel: Any, preload: tuple[str, ...] = ()) -> None:
    _prepare(preload)
    try:
        channel.put(("done", job.run(channel.put)))
    except BaseException as exc:  # report, never hang the parent
        channel.put(("failed", _one_line(exc)))
    _exit(channel)


def _await(proc: Any, channel: Any, on_event: OnEvent, what: str) -> Any:
    """Relay a process's events until its answer; a process that dies without one fails the call."""
    while True:
        try:
            event = channel.get(timeout=0.2)
        except queue_mod.Empty:
            if proc.is_alive():
                continue
            try:  # one last look: the result may have landed just before the exit
                event = channel.get(timeout=1.0)
            except queue_mod.Empty:
                raise JobFailed(f"{what}: its process exited with code {proc.exitcode}") from None
        if event[0] == "done":
            return event[1]
        if event[0] == "failed":
            raise JobFailed(event[1])
        on_event(event)


class LocalProcessExecutor:
    """Each job in its own spawned process; progress events come back over a queue."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        # modules the child imports before the job starts, so a job's own timers (startup_s) see a
        # warm process with its libraries loaded, not the import of torch
        self.preload = preload

    def run(self, job: Job, on_event: OnEvent) -> Any:
        ctx = mp.get_context("spawn")
        channel = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(job, channel, self.preload),
                           name=f"variantbench-{job.id}")  # fmt: skip
        proc.start()
        try:
            return _await(proc, channel, on_event, job.id)
        finally:
            _stop(proc)

    def open(self, job: ResidentJob, on_event: OnEvent) -> Session:
        ctx = mp.get_context("spawn")
        commands, channel = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_resident, args=(job, commands, channel, self.preload),
                           name=f"variantbench-{job.id}")  # fmt: skip
        proc.start()
        try:
            _await(proc, channel, on_event, job.id)
        except BaseException:
            _stop(proc)
            raise
        return _ProcessSession(proc, commands, channel, job.id)


def _stop(proc: Any, timeout_s: float = 10) -> None:
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()


class _ProcessSession:
    """A resident job in its own process: each call is a message, its events relayed as they come."""

    def __init__(self, proc: Any, commands: Any, channel: Any, name: str) -> None:
        self.proc, self.commands, self.channel, self.name = proc, commands, channel, name

    def call(self, method: str, *args: Any, on_event: OnEvent) -> Any:
        if not self.proc.is_alive():
            raise JobFailed(f"{self.name}: its process exited with code {self.proc.exitcode}")
        self.commands.put((method, args))
        return _await(self.proc, self.channel, on_event, f"{self.name} ({method})")

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(None)
        _stop(self.proc)


@runtime_checkable
class Concurrent(Protocol):
    """An executor whose ``run`` may be called from several threads at once, each job on hardware
    of its own (Ray: a node each): the pipeline then measures the variants at once."""

    def capacity(self) -> int: ...
