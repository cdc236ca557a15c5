"""Model families the engine runs: one file each, registered by ``config.model_type`` (see base.py)."""

from variantbench.backends.families.base import (
    FAMILIES,
    Experts,
    Family,
    family_for,
    register,
    registered_types,
)

__all__ = ["FAMILIES", "Experts", "Family", "family_for", "register", "registered_types"]
