"""The layers hold: the import contracts in pyproject.toml, checked by import-linter on every test run."""

from __future__ import annotations

from pathlib import Path
import subprocess
import sys

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_plan_loads_without_torch_or_measuring_code() -> None:
    """Reading and resolving a plan is pure: it imports no model library and no measuring module."""
    code = (
        "import sys; from variantbench.plan_file import load_plan, dump_plan; dump_plan(load_plan());"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or m.startswith("
        "('variantbench.loadgen', 'variantbench.backends', 'variantbench.pipeline', 'variantbench.serving'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
