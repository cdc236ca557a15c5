"""Model families the engine runs: one file each, registered by ``config.model_type`` (see base.py)."""

from variantbench.families.base import (
    FAMILIES,
    Experts,
    Family,
    family_for,
    family_of_folder,
    model_type_of,
    register,
    registered_types,
)

__all__ = ["FAMILIES", "Experts", "Family", "family_for", "family_of_folder", "model_type_of", "register",
           "registered_types"]  # fmt: skip
