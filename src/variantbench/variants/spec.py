"""A variant parsed once (``VariantSpec``) and what building it left on disk (``Artifact``).

The name a user writes (``prune-heads:0.3+int8``) is parsed here, once, into recipes; from then on
the spec travels (to worker processes, to the cold-start child), never the string. Building runs
before a variant is measured (``build_variant``), in its own job timed as ``build_s``, so a variant
that is not cached yet does not count minutes of building as startup: the measured process loads
an ``Artifact`` that already exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import json
from pathlib import Path
import time
from typing import Any

from variantbench.variants.base import Recipe, engine_of, parse_variant, split_chain


@dataclass(frozen=True)
class VariantSpec:
    name: str
    recipes: tuple[Recipe, ...]

    @classmethod
    def parse(cls, name: str) -> VariantSpec:
        recipes = parse_variant(name)
        split_chain(recipes)  # a chain in the wrong order fails here, before anything runs
        return cls(name=name.strip(), recipes=recipes)

    @property
    def build_chain(self) -> tuple[Recipe, ...]:
        """Structural steps, built once into the variant cache."""
        return split_chain(self.recipes)[0]

    @property
    def load_chain(self) -> tuple[Recipe, ...]:
        """Steps applied to the weights each time the variant is loaded (dtype, dynamic int8)."""
        return split_chain(self.recipes)[1]

    @property
    def engine(self) -> Recipe | None:
        """The export to another engine that ends the chain (gguf-*, onnx-*), or None: ours."""
        return engine_of(self.recipes)

    @property
    def needs_build(self) -> bool:
        return bool(self.build_chain) or self.engine is not None


@dataclass(frozen=True)
class Artifact:
    """What a backend loads: a Hugging Face folder, and for another engine its exported file."""

    base_dir: str  # the base model's folder
    source_dir: str  # the folder the variant's weights and tokenizer come from: the base, or built
    engine_path: str | None = None  # a GGUF file or an ONNX folder, for engine variants
    manifest: dict[str, Any] | None = None  # the built folder's manifest (structural chains)
    build_s: float = 0.0  # how long building this variant took (when it was built, maybe earlier)
    built_now: bool = False  # whether this run built it (False: it came from the cache)
    build_wall_s: float = 0.0  # this run's time in the build step (a cache hit: milliseconds)

    def files(self) -> list[str]:
        """The paths a load reads (for the cold start's page-cache eviction)."""
        paths = [self.source_dir]
        if self.base_dir != self.source_dir:
            paths.append(self.base_dir)
        if self.engine_path:
            paths.append(self.engine_path)
        return paths


def _manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_variant(
    base_dir: str,
    spec: VariantSpec,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Artifact:
    """Everything ``spec`` needs on disk, from the cache or built now; timed as the variant's build."""
    from variantbench.variants.build import materialize, variants_root
    from variantbench.variants.support import check_support

    check_support(spec.recipes, base_dir, spec.name)
    started = time.perf_counter()
    began_at = time.time()
    source, manifest, build_s, built_now = base_dir, None, 0.0, False

    def fresh(folder: Path) -> bool:  # a manifest written during this call: built now, not cached
        try:
            return (folder / "manifest.json").stat().st_mtime >= began_at - 1e-3
        except OSError:
            return False

    if spec.build_chain:
        folder = materialize(base_dir, spec.build_chain, seed=seed, say=say, progress=progress)
        source, manifest = str(folder), _manifest(folder)
        build_s += float((manifest or {}).get("build_s") or 0.0)
        built_now = fresh(folder)
    engine_path = None
    if spec.engine is not None:
        path = spec.engine.artifact(source, variants_root(), say=say)
        folder = path if path.is_dir() else path.parent
        build_s += float((_manifest(folder) or {}).get("build_s") or 0.0)
        built_now = built_now or fresh(folder)
        engine_path = str(path)
    wall = time.perf_counter() - started
    return Artifact(
        base_dir=base_dir, source_dir=source, engine_path=engine_path, manifest=manifest,
        build_s=round(build_s, 3), built_now=built_now, build_wall_s=round(wall, 3),
    )  # fmt: skip


def plain_artifact(base_dir: str) -> Artifact:
    """The artifact of a variant with nothing to build: the base folder itself."""
    return Artifact(base_dir=base_dir, source_dir=base_dir)


def check_engine(spec: VariantSpec, engine_type: type[Recipe]) -> None:
    """One line when a backend is handed a variant of another engine."""
    if not isinstance(spec.engine, engine_type):
        from variantbench.errors import UserError

        raise UserError(f"{spec.name} is not a variant of this engine ({engine_type.__name__})")


def ensure_artifact(
    base_dir: str,
    spec: VariantSpec,
    artifact: Artifact | None,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
    engine_type: type[Recipe] | None = None,
) -> Artifact:
    """The artifact a backend loads: the one handed over by the build step, else built now (serving,
    tests), always before the backend starts its startup clock."""
    if engine_type is not None:
        check_engine(spec, engine_type)
    return artifact if artifact is not None else build_variant(base_dir, spec, seed=seed, say=say)
