"""Which backend runs a variant: one place, keyed by the variant's engine.

A variant whose chain ends in an export for another engine (``gguf-*``, ``onnx-*``) names the
backend that runs it (``Recipe.engine_backend``, "module:Class"); every other variant runs on our
PyTorch engine. The module is imported only when a variant needs it, so a run of fp32 alone never
imports onnxruntime or llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

from variantbench.backends.base import Backend
from variantbench.errors import UserError
from variantbench.variants.spec import Artifact, VariantSpec

TORCH_BACKEND = "variantbench.backends.torch_backend:TorchBackend"


def backend_class(spec: VariantSpec) -> type[Any]:
    path = type(spec.engine).engine_backend if spec.engine is not None else TORCH_BACKEND
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(
    spec: VariantSpec,
    artifact: Artifact | None,
    base_dir: str,
    device: str = "cpu",
    threads: int | None = None,
    build_seed: int = 0,
) -> Backend:
    """The in-process backend that runs ``spec`` from its built ``artifact`` (None: built at load)."""
    cls = backend_class(spec)
    if spec.engine is not None:
        if device != "cpu":
            raise UserError(f"{spec.name}: {spec.engine.kind} variants run on the CPU here")
        return cls(base_dir, spec, threads=threads, build_seed=build_seed, artifact=artifact)
    return cls(base_dir, spec, device=device, threads=threads, build_seed=build_seed, artifact=artifact)
