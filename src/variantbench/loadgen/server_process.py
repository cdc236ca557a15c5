"""A server command in its own process, ready once it answers: the serving benchmarks' systems.

Each benchmark system (ours, llama.cpp's, a peer's) is started the way a user starts it, as its own
process on 127.0.0.1, so nothing of the client's process (its GIL, its threads) touches it.
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import time
import urllib.request

from variantbench.credentials import auth_headers
from variantbench.loadgen.noop_server import stop_process


class Running:
    """A server command in its own process, ready when /v1/models answers."""

    def __init__(self, command: list[str], port: int, timeout_s: float = 900.0) -> None:
        self.command, self.port, self.timeout_s = command, port, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Running:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"vb-serving-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                probe = urllib.request.Request(self.url + "/v1/models", headers=auth_headers())
                with urllib.request.urlopen(probe, timeout=2) as r:  # noqa: S310 - our own server
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{' '.join(self.command[:4])} did not start: {' | '.join(tail)}")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, 60)
        self.log.close()
