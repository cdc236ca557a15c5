"""Where a base model comes from: the bundled default, a Hugging Face folder, or a GGUF file."""

from variantbench.models.source import (
    DEFAULT_MODEL,
    ModelSpec,
    parse_model,
    prepare_model,
)

__all__ = ["DEFAULT_MODEL", "ModelSpec", "parse_model", "prepare_model"]
