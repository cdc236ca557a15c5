"""Cold start: from a fresh process's start to its first generated token, model files out of the cache.

Before the child starts, every file of the variant (the base folder, its built folder or export) is
dropped from the OS page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``: no root needed, and
the kernel honours it for clean pages. Python, torch and the other libraries stay cached (dropping
them needs root: ``echo 1 > /proc/sys/vm/drop_caches``), so this is "cold model, warm libraries", and
the note says so. The child is ``python -m variantbench.analysis.startup JOB.pickle``: it loads the
built variant, produces one token and prints ``READY``.
"""

from __future__ import annotations

import os
from pathlib import Path
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any


def evict(paths: list[str | Path]) -> tuple[int, int]:
    """Drop the files under ``paths`` from the page cache; (files, bytes) evicted."""
    files = nbytes = 0
    if not hasattr(os, "posix_fadvise"):
        return 0, 0
    for root in paths:
        root = Path(root)
        candidates = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in candidates:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
                nbytes += path.stat().st_size
            except OSError:
                pass
            finally:
                os.close(fd)
    return files, nbytes


def cold_start(spec: Any, artifact: Any, base_dir: str, threads: int | None = None, device: str = "cpu",
               timeout_s: float = 900) -> tuple[float | None, str]:  # fmt: skip
    """(seconds from process start to the first token, how cold it was) for one built variant.

    ``spec`` (a VariantSpec) and ``artifact`` (what its build left on disk) reach the child pickled in
    a file: the child loads exactly what the measured run loaded, and builds nothing.
    """
    files, nbytes = evict(artifact.files())
    note = (
        f"fresh process; {files} model files ({nbytes / 1e6:,.0f} MB) dropped from the page cache with "
        "posix_fadvise(DONTNEED); Python and libraries stay cached"
        if files
        else "fresh process; the model files could not be dropped from the page cache (warm OS cache)"
    )
    with tempfile.TemporaryDirectory(prefix="variantbench-cold-") as tmp:
        job = Path(tmp) / "job.pickle"
        job.write_bytes(pickle.dumps((spec, artifact, base_dir, threads, device)))
        cmd = [sys.executable, "-m", "variantbench.analysis.startup", str(job)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            return None, f"could not start a process: {exc}"
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == "READY":
                    elapsed = time.perf_counter() - t0
                    proc.wait(timeout=timeout_s)
                    return elapsed, note
            proc.wait(timeout=timeout_s)
            err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-1:] or ["no output"]
            return None, f"cold start failed: {err[0]}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _child(job_path: str) -> None:
    from variantbench.backends.registry import make_backend
    from variantbench.quiet import quiet_libraries

    quiet_libraries()
    spec, artifact, base_dir, threads, device = pickle.loads(Path(job_path).read_bytes())
    backend = make_backend(spec, artifact, base_dir, device=device, threads=threads)
    backend.load()  # ends with one generated token
    print("READY", flush=True)
    backend.close()


if __name__ == "__main__":
    _child(sys.argv[1])
