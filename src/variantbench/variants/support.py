"""Which recipes apply to which model: each recipe declares the families it can transform
(``Recipe.families``); the model's family comes from its folder's ``config.model_type``.

Asked for a pair that does not apply, a run stops before it builds or loads anything, with one line
naming the family and the recipes that do apply (``variantbench variants --model PATH`` lists them).
"""

from __future__ import annotations

from pathlib import Path

from variantbench.errors import UserError
from variantbench.families import family_of_folder, model_type_of
from variantbench.variants.base import EVERY_FAMILY, Recipe, known_kinds, recipe_type


def applies(recipe_type: type[Recipe], family: str | None) -> bool:
    """Whether recipes of this type can transform a model of ``family`` (None: no registered family)."""
    wanted = recipe_type.families
    if wanted is None:
        return True
    return family is not None and (wanted == EVERY_FAMILY or family in wanted)


def kinds_for(family: str | None) -> tuple[list[str], list[str]]:
    """(kinds that apply, kinds that do not) for a model of ``family``."""
    kinds = {kind: recipe_type(kind) for kind in known_kinds()}
    yes = [k for k, t in kinds.items() if t is not None and applies(t, family)]
    return yes, [k for k in kinds if k not in yes]


def describe_model(folder: str | Path) -> tuple[str, str | None]:
    """(model type, family name or None) of a Hugging Face folder."""
    family = family_of_folder(folder)
    return str(model_type_of(folder) or "unknown"), family.name if family else None


def check_support(recipes: tuple[Recipe, ...], folder: str | Path, variant: str) -> None:
    """One line when a recipe of ``variant`` cannot transform the model in ``folder``."""
    model_type, family = describe_model(folder)
    for recipe in recipes:
        if not applies(type(recipe), family):
            yes, _ = kinds_for(family)
            who = (
                f"family {family}"
                if family
                else f"model type {model_type!r} (no engine family: the transformers fallback)"
            )
            raise UserError(
                f"{variant}: {recipe.kind} cannot transform {who}; recipes that apply: {', '.join(yes)}"
            )
