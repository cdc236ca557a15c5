"""``compile``: our decode step through ``torch.compile`` (Inductor by default).

Inductor fuses the per-layer elementwise work (RMSNorm, RoPE, SiLU x up, residual adds) into
generated C++ kernels around the matmuls. The recipe changes no weight: it marks the model, and the
decoder built from it compiles its decode step (backends/engine.py). Compilation happens in the
backend's ``load()``, on warm-up batches of size 1 and 2 (the two graphs dynamic shapes need),
and is reported apart as ``compile_s``, never inside a latency. Inductor keeps its generated code in
its own on-disk cache, so a second load compiles faster: ``compile_s`` says which it was.

``compile:backend=eager`` traces the step with TorchDynamo but runs it op by op (no code
generation): it checks the capture in seconds, which is what the tests use.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from torch import nn

from variantbench.variants.base import Recipe, keyword_args, register

COMPILE_ATTRIBUTE = "variantbench_compile"


class Compile(Recipe):
    weight_format: ClassVar[str] = "float32 (torch.compile)"
    backend: Literal["inductor", "eager", "aot_eager"] = "inductor"
    mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> Recipe:
        fields = keyword_args(kind, args, ("backend", "mode"))
        return cls(kind=kind, **fields)


@register("compile", Compile, "torch.compile of the decode step (compile time reported apart)")
def mark_compiled(model: nn.Module, recipe: Recipe) -> nn.Module:
    assert isinstance(recipe, Compile)
    options = {"backend": recipe.backend}
    if recipe.mode != "default":
        options["mode"] = recipe.mode
    setattr(model, COMPILE_ATTRIBUTE, options)
    return model
