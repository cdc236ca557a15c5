"""Resident memory of this process, sampled in a background thread (psutil)."""

from __future__ import annotations

from dataclasses import dataclass
import threading

import psutil


@dataclass
class RssResult:
    peak_rss_bytes: int = 0
    mean_rss_bytes: float = 0.0
    samples: int = 0


class RssTracker:
    """``with RssTracker() as t: ...`` then ``t.result``; the sampler stops in ``__exit__`` even on error."""

    def __init__(self, interval_s: float = 0.01, pid: int | None = None) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sum = 0.0
        self.result = RssResult()

    def _sample(self) -> None:
        rss = self._process.memory_info().rss
        self.result.peak_rss_bytes = max(self.result.peak_rss_bytes, rss)
        self.result.samples += 1
        self._sum += rss
        self.result.mean_rss_bytes = self._sum / self.result.samples

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except psutil.Error:
                return

    def __enter__(self) -> RssTracker:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="variantbench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._sample()
        except psutil.Error:
            pass
