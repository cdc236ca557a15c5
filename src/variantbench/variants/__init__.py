"""Variant recipes and their registry."""

from variantbench.variants.base import (
    Recipe,
    apply_recipes,
    known_kinds,
    parse_variant,
    register,
    weight_format,
)

__all__ = ["Recipe", "apply_recipes", "known_kinds", "parse_variant", "register", "weight_format"]
