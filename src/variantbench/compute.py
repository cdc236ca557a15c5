"""One thread of the process does torch's work: loading, building, generating, serving steps.

Why: torch's CPU parallelism on Linux is libgomp (OpenMP), which keeps a pool of worker threads
for every thread that opened a parallel region. When the pools' threads outnumber the CPUs,
libgomp stops spinning between regions (100 spins, then a futex sleep), and every one of the
hundreds of parallel regions in a decode step pays a wake-up. A model loaded on the main thread
and run on another (the harness's executor thread, the server's batch worker) is exactly that
case: two pools. Measured on 2 cores (AVX-512 with bf16 and VNNI, SmolLM2-135M, the paged batch,
``python benchmarks/compute_thread.py --repeats 2``), loaded on the main thread and stepped on
another against both on one thread: smooth+int8:act=token one decode row 39-44 against 19-23 ms
(2.05x), a 110-token prompt 162-243 against 102-134 ms (1.70x), the pool's worker busy 25% of
the time against 99%; fp32 decode 1.29x (1.03-1.54), its prompt 1.07x. In the server a 110-token
interactive prompt took 161-229 ms a step against 88-95 ms in one thread, which is what kept the
priority benchmark's misses over 500 ms.

So every caller hands torch work to ``call`` (or a loaded ``TorchBackend`` does it for them), and
one long-lived thread runs it; a call made on that thread runs inline. Serving several variants
serializes their steps on it, which on a CPU is what running them would cost anyway (each step
wants every core).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
import functools
import os
import queue
import threading
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_work: queue.SimpleQueue[tuple[Callable[..., Any], tuple, dict, Future]] | None = None
_ident: int | None = None


def _serve(work: queue.SimpleQueue) -> None:
    while True:
        fn, args, kwargs, done = work.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)


def _queue() -> queue.SimpleQueue:
    """Started on first use; a daemon, like the harness's executor thread: a generation stuck past
    its timeout must not keep the process from exiting."""
    global _work, _ident
    with _lock:
        if _work is None:
            work: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(work,), name="variantbench-compute", daemon=True)
            thread.start()
            _work, _ident = work, thread.ident
        return _work


def _forget() -> None:
    """A forked child has no compute thread: it starts its own on first use."""
    global _work, _ident, _lock
    _work, _ident, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget)


def on_compute_thread() -> bool:
    return _ident is not None and threading.get_ident() == _ident


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, waited for; its exception is raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    done: Future[T] = Future()
    _queue().put((fn, args, kwargs, done))
    return done.result()


def compute_thread_id() -> int:
    """The compute thread's ``threading.get_ident()`` (started if it was not)."""
    _queue()
    assert _ident is not None
    return _ident


def on_compute(fn: Callable[P, T]) -> Callable[P, T]:
    """A function or method that always runs on the compute thread, whoever calls it."""

    @functools.wraps(fn)
    def routed(*args: P.args, **kwargs: P.kwargs) -> T:
        return call(fn, *args, **kwargs)

    return routed
