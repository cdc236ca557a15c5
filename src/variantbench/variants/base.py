"""Recipes: how a variant is made from the standard model.

A recipe is a frozen pydantic model with a ``kind``; exactly one transform is registered per kind
(torchao's ``quantize_(model, config)`` shape). Adding a variant kind means adding a module that
calls :func:`register`, not an ``elif``. A variant name is a chain of recipe specs joined by ``+``,
each ``kind`` or ``kind:args`` (``int8``, later ``prune-heads:0.3+int8``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from variantbench.devices import ANY, DeviceNeed
from variantbench.errors import UserError


class Recipe(BaseModel):
    """Base of every recipe: frozen, hashable, serializable with its kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str
    # What the transform leaves the weights as, for the report ("float32", "int8", ...).
    weight_format: ClassVar[str] = "float32"
    # "load": applied to the model each time it is loaded (cheap: dtype, dynamic int8).
    # "build": changes the architecture or trains; run once, saved as a Hugging Face folder in the
    # variant cache (variants/build.py); its transform also receives a BuildContext.
    stage: ClassVar[str] = "load"
    # "engine" recipes only: the backend that runs the exported model, as "module:Class".
    engine_backend: ClassVar[str] = ""
    # The model families (``variantbench.families``) whose blocks this recipe can transform. None:
    # it acts on plain modules (dtype, nn.Linear), so any model, the transformers fallback's too;
    # EVERY_FAMILY: any registered family (it needs ``model.model.layers``, not Llama's names).
    # Each set is what tests/test_family_recipes.py built and checked on that family's tiny model.
    families: ClassVar[frozenset[str] | None] = None
    # The devices it runs on, and on CUDA the compute capability it needs (``devices.DeviceNeed``):
    # checked before anything is built or loaded, so a device without it is one line, not a traceback.
    devices: ClassVar[DeviceNeed] = ANY

    def spec(self) -> str:
        """The recipe written back as ``kind[:args]`` (canonical: what the cache key hashes)."""
        fields = type(self).model_fields
        args = ",".join(
            f"{k}={v}"
            for k, v in self.model_dump().items()
            if k != "kind" and (fields[k].is_required() or v != fields[k].default)
        )
        return f"{self.kind}:{args}" if args else self.kind

    def written(self) -> str:
        """The recipe as a user writes it in a variant name: parses back to an equal recipe (the
        search composes names from recipes). ``spec()`` unless the kind takes positional arguments."""
        return self.spec()

    def caveat(self, device: Any) -> str | None:
        """Load recipes: why this recipe will not pay on ``device`` (a torch.device), or None."""
        return None

    def artifact(self, source: str | Path, root: Path, say: Callable[[str], None] | None = None) -> Path:
        """Engine recipes: export ``source`` (a Hugging Face folder) for the engine, cached under ``root``."""
        raise TypeError(f"{self.kind} is not an engine recipe")

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> Recipe:
        if args:
            raise UserError(f"variant {kind!r} takes no parameters (got {args!r})")
        return cls(kind=kind)


EVERY_FAMILY = frozenset({"*"})


def split_args(args: str | None) -> tuple[list[str], dict[str, str]]:
    """``"0.3,groups,seed=1"`` -> (["0.3", "groups"], {"seed": "1"})."""
    positional, named = [], {}
    for part in (args or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep:
            named[key.strip()] = value.strip()
        else:
            positional.append(part)
    return positional, named


def keyword_args(kind: str, args: str | None, allowed: tuple[str, ...]) -> dict[str, str]:
    """The ``key=value`` arguments of a recipe that takes only those, checked against ``allowed``."""
    positional, named = split_args(args)
    wrong = positional + [k for k in named if k not in allowed]
    if wrong:
        raise UserError(f"{kind} takes {', '.join(k + '=' for k in allowed)} (got {wrong[0]!r})")
    return named


Transform = Callable[..., Any]  # (torch.nn.Module, Recipe[, BuildContext]) -> torch.nn.Module


@dataclass(frozen=True)
class _Entry:
    recipe_type: type[Recipe]
    transform: Transform
    summary: str


_REGISTRY: dict[str, _Entry] = {}


def register(kind: str, recipe_type: type[Recipe], summary: str) -> Callable[[Transform], Transform]:
    """Register the one transform for ``kind``."""

    def decorator(fn: Transform) -> Transform:
        if kind in _REGISTRY:
            raise RuntimeError(f"variant kind {kind!r} registered twice")
        _REGISTRY[kind] = _Entry(recipe_type, fn, summary)
        return fn

    return decorator


# Functions that put back what a build step added beyond transformers' own architecture (linear
# attention): each takes (a freshly loaded model, its folder) and returns the model.
_RESTORERS: list[Callable[[Any, Path], Any]] = []


def restorer(fn: Callable[[Any, Path], Any]) -> Callable[[Any, Path], Any]:
    _RESTORERS.append(fn)
    return fn


def restore_built(model: Any, folder: str | Path) -> Any:
    """A model loaded from a built folder, with every registered extension put back."""
    _load_builtin()
    for fn in _RESTORERS:
        model = fn(model, Path(folder))
    return model


def known_kinds() -> dict[str, str]:
    _load_builtin()
    return {kind: entry.summary for kind, entry in sorted(_REGISTRY.items())}


def recipe_type(kind: str) -> type[Recipe] | None:
    """The recipe class registered for ``kind`` (None: unknown)."""
    _load_builtin()
    entry = _REGISTRY.get(kind)
    return entry.recipe_type if entry else None


def parse_variant(name: str) -> tuple[Recipe, ...]:
    """Parse ``kind[:args][+kind[:args]...]`` into recipes; unknown kinds list the known ones."""
    _load_builtin()
    name = name.strip()
    if not name:
        raise UserError("empty variant name")
    recipes = []
    for part in name.split("+"):
        kind, _, args = part.strip().partition(":")
        entry = _REGISTRY.get(kind)
        if entry is None:
            raise UserError(f"unknown variant {kind!r}; known: {', '.join(sorted(_REGISTRY))}")
        try:
            recipes.append(entry.recipe_type.from_args(kind, args or None))
        except ValidationError as exc:
            raise UserError(f"bad parameters for variant {kind!r}: {exc.errors()[0]['msg']}") from exc
    return tuple(recipes)


def apply_recipes(model: Any, recipes: tuple[Recipe, ...], ctx: object = None) -> Any:
    for recipe in recipes:
        transform = _REGISTRY[recipe.kind].transform
        model = transform(model, recipe, ctx) if recipe.stage == "build" else transform(model, recipe)  # type: ignore[call-arg]
    return model


def engine_of(recipes: tuple[Recipe, ...]) -> Recipe | None:
    """The engine recipe that ends the chain (onnx-int4, ...), or None for our PyTorch engine."""
    engines = [i for i, r in enumerate(recipes) if r.stage == "engine"]
    if not engines:
        return None
    if engines != [len(recipes) - 1] or any(r.stage == "load" for r in recipes):
        raise UserError(
            f"{recipes[engines[0]].kind} exports the model to another engine: it ends the chain, after "
            "structural steps only (e.g. prune-heads:0.3+onnx-int4)"
        )
    return recipes[-1]


def split_chain(recipes: tuple[Recipe, ...]) -> tuple[tuple[Recipe, ...], tuple[Recipe, ...]]:
    """(build recipes, load recipes); every build step must come before the first load step."""
    if engine_of(recipes) is not None:
        return recipes[:-1], ()
    first_load = next((i for i, r in enumerate(recipes) if r.stage == "load"), len(recipes))
    build, load = recipes[:first_load], recipes[first_load:]
    late = [r.kind for r in load if r.stage == "build"]
    if late:
        raise UserError(
            f"{', '.join(late)} changes the model's structure and must come before "
            f"{', '.join(r.kind for r in load if r.stage == 'load')} in the chain"
        )
    return build, load


def weight_format(recipes: tuple[Recipe, ...]) -> str:
    formats = [type(r).weight_format for r in recipes]
    return formats[-1] if formats else "float32"


def _load_builtin() -> None:
    # Importing the modules registers their kinds; done lazily so importing this module stays cheap.
    from variantbench.variants import (  # noqa: F401
        compiled,
        distill,
        fp8,
        gguf,
        int8,
        linear_student,
        mixed_int8,
        mixed_precision,
        onnx,
        precision,
        qat,
        smooth,
        structure,
        weight_only,
    )
