"""The command line run as a user runs it, in its own process: the report's runs by variant."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
from typing import Any


def run_report(args: list[str], out: Path, timeout_s: float = 900) -> dict[str, dict[str, Any]]:
    """``variantbench run ARGS --out OUT``; asserts it exits 0 and returns report.json's runs by
    variant (the whole report under the key ``""``)."""
    proc = subprocess.run([sys.executable, "-m", "variantbench", "run", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    return {"": report, **{r["variant"]: r for r in report["runs"]}}
