"""Optional parts of the install, and the one line that says which to add when one is missing.

The core (plans, the harness, the endpoint client, workloads, quality scores, reports) needs no
model library: someone who only benchmarks a served model installs ``variantbench``. Local models,
variants and serving come with extras.
"""

from __future__ import annotations

from importlib.util import find_spec

from variantbench.errors import UserError

EXTRAS: dict[str, tuple[str, ...]] = {
    "local": ("torch", "transformers", "safetensors", "gguf", "accelerate"),
    "serve": ("torch", "transformers", "starlette", "prometheus_client"),
    "search": ("optuna", "torch", "transformers"),
}


def missing(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra] if find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise one line naming the ``pip install`` that brings ``extra``, when any of its modules is missing."""
    absent = missing(extra)
    if absent:
        raise UserError(
            f"{what} needs the '{extra}' extra ({', '.join(absent)} not installed): "
            f"pip install 'variantbench[{extra}]'"
        )
