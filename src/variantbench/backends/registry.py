"""Which backend runs a variant: one place, keyed by the variant's engine.

A variant whose chain ends in an export for another engine (``gguf-*``, ``onnx-*``) names the
backend that runs it (``Recipe.engine_backend``, "module:Class"); every other variant runs on our
PyTorch engine when the model's family is registered (``families``), else on the
transformers fallback (``transformers_backend.py``). A family added later moves a model off the
fallback with no change for the user. The module is imported only when a variant needs it, so a run of fp32 alone never
imports onnxruntime or llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

from variantbench.backends.base import Backend
from variantbench.variants.spec import Artifact, VariantSpec

TORCH_BACKEND = "variantbench.backends.torch_backend:TorchBackend"
FALLBACK_BACKEND = "variantbench.backends.transformers_backend:TransformersBackend"


def backend_path(spec: VariantSpec, model_dir: str | None = None) -> str:
    """ "module:Class" of the backend that runs ``spec`` on the model in ``model_dir``."""
    from variantbench.families import family_of_folder, model_type_of

    if spec.engine is not None:
        return type(spec.engine).engine_backend
    if model_dir is not None and model_type_of(model_dir) is not None and family_of_folder(model_dir) is None:
        return FALLBACK_BACKEND
    return TORCH_BACKEND


def backend_class(spec: VariantSpec, model_dir: str | None = None) -> type[Any]:
    path = backend_path(spec, model_dir)
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
    from variantbench.device_probe import device_info
    from variantbench.devices import check_variant

    check_variant(spec.name, spec.recipes, device_info(device))
    cls = backend_class(spec, base_dir)
    if spec.engine is not None:
        return cls(base_dir, spec, threads=threads, build_seed=build_seed, artifact=artifact)
    return cls(base_dir, spec, device=device, threads=threads, build_seed=build_seed, artifact=artifact)
