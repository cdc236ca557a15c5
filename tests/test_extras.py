"""The core installs and runs without model libraries; a missing extra is one line naming the install."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ImportError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, Block())
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] in BLOCKED else _find(name, *a)
from variantbench.cli import main
sys.argv = ['variantbench', *{args!r}]
main()
"""
MODEL_LIBRARIES = (
    "torch",
    "transformers",
    "safetensors",
    "accelerate",
    "gguf",
    "starlette",
    "prometheus_client",
)


def _without(blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKER.format(blocked=blocked, args=list(args))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_an_endpoint_run_needs_no_model_library(tmp_path: Path) -> None:
    from variantbench.loadgen.noop_server import ProcessServer

    out = tmp_path / "out"
    with ProcessServer() as server:
        proc = _without(MODEL_LIBRARIES, "run", "--endpoint", server.url, "--tasks", "8",
                        "--input-lengths", "fixed:64", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["runs"][0]["status"] == "ok" and report["runs"][0]["queries"]["completed"] == 8
    assert report["environment"]["torch_threads"] is None  # torch was never imported
    assert (out / "plan.yaml").exists()


def test_a_local_run_without_the_local_extra_is_one_line(tmp_path: Path) -> None:
    proc = _without(("torch", "transformers"), "run", "--variants", "fp32", "--out", str(tmp_path))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pip install 'variantbench[local]'" in lines[0] and "torch" in lines[0]


def test_serving_without_the_serve_extra_is_one_line() -> None:
    proc = _without(("starlette",), "serve", "--variants", "fp32")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pip install 'variantbench[serve]'" in lines[0]
