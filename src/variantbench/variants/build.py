"""Building variants whose recipes change the model (prune, drop layers, distill), once, into a cache.

A built variant is a Hugging Face folder under ``<cache>/variants/<key>/``, where the key hashes the
base model (its config and weight files), the canonical chain of build recipes, the calibration
seed and the versions of variantbench, torch and transformers. A ``manifest.json`` beside the
weights records the chain, parameter count, bytes on disk, build time, calibration seed and what
each recipe measured (kept heads, block influences, the distillation loss). A build writes into a
``.partial`` folder and renames it into place when complete, so an interrupted build leaves no
half-written entry. Load-stage recipes (dtype, int8) are applied when the variant is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
import hashlib
import json
import os
from pathlib import Path
import shutil
import time
from typing import Any

from variantbench.paths import bytes_under, cache_root
from variantbench.variants.base import Recipe

CALIBRATION_PROMPTS = 8
CALIBRATION_TOKENS = 256
Progress = Callable[[str, int, int], None]


@dataclass
class BuildContext:
    """What build recipes may use: calibration prompts, training text, the teacher, a notebook."""

    calibration: list[list[int]]
    distill_ids: list[int]
    held_out_ids: list[int]
    teacher_dir: str
    seed: int
    artifact_dir: str
    progress: Progress = lambda *_: None  # noqa: E731 - a default no-op
    notes: dict[str, Any] = field(default_factory=dict)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    from variantbench import __version__

    return {"variantbench": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def base_identity(base_dir: str | Path) -> str:
    """The base model's config plus the names and sizes of its weight files."""
    base = Path(base_dir)
    parts = [(base / "config.json").read_text(encoding="utf-8")]
    for f in sorted(base.glob("*.safetensors")) + sorted(base.glob("*.bin")):
        parts.append(f"{f.name}:{f.stat().st_size}")
    return "\n".join(parts)


def cache_key(payload: dict[str, Any]) -> str:
    """A cache entry's key: the payload (base identity, recipe fields...) plus the library versions."""
    text = json.dumps({**payload, **_versions()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def variant_key(base_dir: str | Path, chain: tuple[Recipe, ...], seed: int) -> str:
    # every field, defaults included: a changed default must not return an old artifact
    return cache_key(
        {"base": base_identity(base_dir), "chain": [r.model_dump() for r in chain], "seed": seed}
    )


def cached_build(final: Path, make: Callable[[Path], dict[str, Any]]) -> Path:
    """The cache entry ``final``: returned if complete, else made by ``make(partial_folder)``.

    ``make`` fills the folder and returns its manifest; the key, bytes on disk, build time and
    versions are added here. The folder is renamed into place only when complete, so an interrupted
    build leaves no half-written entry; if another process finished first, its entry is kept.
    """
    if (final / "manifest.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    started = time.perf_counter()
    try:
        manifest = make(partial)
        manifest.update(
            key=final.name,
            bytes_on_disk=bytes_under(partial),
            build_s=round(time.perf_counter() - started, 2),
            versions=_versions(),
        )
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))
        try:
            partial.rename(final)
        except OSError:  # another process finished the same build first: keep theirs
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def variants_root(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "variants"


def built_path(
    base_dir: str | Path, chain: tuple[Recipe, ...], seed: int = 0, cache: Path | None = None
) -> Path:
    return variants_root(cache) / variant_key(base_dir, chain, seed)


def list_built(cache: Path | None = None) -> list[dict[str, Any]]:
    root = variants_root(cache)
    out = []
    for manifest in sorted(root.glob("*/manifest.json")) if root.exists() else []:
        try:
            out.append({**json.loads(manifest.read_text()), "path": str(manifest.parent)})
        except (OSError, ValueError):
            continue
    return out


def _context(
    base_dir: str, tokenizer: Any, seed: int, artifact_dir: Path, progress: Progress
) -> BuildContext:
    from variantbench.metrics.fidelity import default_text
    from variantbench.workloads import build_synthetic
    from variantbench.workloads.lengths import LengthDistribution

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    fixed = LengthDistribution("fixed", CALIBRATION_TOKENS, CALIBRATION_TOKENS)
    calibration = build_synthetic(CALIBRATION_PROMPTS, seed=seed + 1000, lengths=fixed, counter=count)
    training = build_synthetic(
        64, seed=seed + 2000, lengths=LengthDistribution("uniform", 128, 512), counter=count
    )
    distill_ids: list[int] = []
    for s in training.samples:
        distill_ids += ids(s.prompt + "\n" + s.reference + "\n\n")
    return BuildContext(
        calibration=[ids(s.prompt) for s in calibration.samples],
        distill_ids=distill_ids,
        held_out_ids=ids(default_text()[:20_000]),
        teacher_dir=base_dir,
        seed=seed,
        artifact_dir=str(artifact_dir),
        progress=progress,
    )


def materialize(
    base_dir: str | Path,
    chain: tuple[Recipe, ...],
    seed: int = 0,
    say: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    cache: Path | None = None,
) -> Path:
    """The built folder of ``chain`` (build-stage recipes) on ``base_dir``: from the cache, or built now."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from variantbench.variants.base import apply_recipes

    hf_logging.disable_progress_bar()

    final = built_path(base_dir, chain, seed, cache)
    if (final / "manifest.json").exists():
        return final
    spec = "+".join(r.spec() for r in chain)
    (say or (lambda _msg: None))(f"building {spec} (once; cached in {final.parent})")

    def make(folder: Path) -> dict[str, Any]:
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        params_before = sum(p.numel() for p in model.parameters())
        ctx = _context(str(base_dir), tokenizer, seed, folder, progress or (lambda *_: None))
        model = apply_recipes(model, chain, ctx)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return {
            "chain": [r.spec() for r in chain],
            "name": spec,
            "base": str(base_dir),
            "parameters": sum(p.numel() for p in model.parameters()),
            "parameters_before": params_before,
            "calibration": {
                "seed": seed + 1000,
                "prompts": CALIBRATION_PROMPTS,
                "tokens": CALIBRATION_TOKENS,
            },
            "notes": ctx.notes,
        }

    return cached_build(final, make)


def manifest_of(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "manifest.json").read_text())


def stale_entries(cache: Path | None = None, everything: bool = False) -> list[tuple[Path, int, str]]:
    """Cache entries that ``variantbench clean`` removes: (path, bytes, why).

    Always: half-written ``.partial-*`` folders left by a killed build, and built variants whose
    manifest records other library versions than the installed ones (their key can no longer be
    asked for). With ``everything``: every variant, every cached fidelity reference and every
    converted base model (downloads of the default model's package are kept).
    """
    root = cache or cache_root()
    current = _versions()
    found: list[tuple[Path, int, str]] = []
    variants = variants_root(root)
    for entry in sorted(variants.iterdir()) if variants.exists() else []:
        if not entry.is_dir():
            continue
        if ".partial-" in entry.name:
            found.append((entry, bytes_under(entry), "interrupted build"))
            continue
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
        except (OSError, ValueError):
            found.append((entry, bytes_under(entry), "no readable manifest"))
            continue
        if manifest.get("versions") != current:
            found.append((entry, bytes_under(entry), "built with other library versions"))
        elif everything:
            found.append((entry, bytes_under(entry), "built variant"))
    if everything:
        for sub, why in (("fidelity", "fidelity reference"), ("models", "converted base model")):
            folder = root / sub
            for entry in sorted(folder.iterdir()) if folder.exists() else []:
                size = bytes_under(entry)
                found.append((entry, size, why))
    return found


def remove_entries(entries: list[tuple[Path, int, str]]) -> int:
    """Delete the entries; return the bytes freed."""
    freed = 0
    for path, size, _ in entries:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        freed += size
    return freed
