"""llama.cpp variants: gguf-f32, gguf-f16, gguf-bf16, gguf-q8_0, gguf-q4_0, gguf-q4_1, gguf-q5_0, gguf-q4_k_m.

How a GGUF file is made:

* ``gguf-f32`` (and ``gguf-f16``) are written by us from the Hugging Face folder with ``gguf-py``'s
  writer: llama.cpp's tensor names, its interleaved layout of the query and key rows (the same
  permutation as llama.cpp's ``convert_hf_to_gguf.py``), ``attention.key_length`` set explicitly (a
  head-pruned model's head size is not hidden size / heads), and the tokenizer's vocabulary and
  merges. Beside torch ``fp32`` it separates the engine's effect from quantization's.
* Every quantized type is made from that f32 file by ``llama_cpp.llama_model_quantize`` (never by
  requantizing a quantized file). The K-quants fall back to other types on tensors whose rows are
  not a multiple of 256 (576 and 1536 on SmolLM2-135M): prefer Q8_0 / Q4_0 / Q4_1 there.
* When the base model itself came from a GGUF file of the requested type and no structural step
  comes first (the default model is shipped as Q4_1), that file is run as it is.

Files live in the variant cache with a manifest, keyed by the source folder, the type and the
llama-cpp-python version. The llama.cpp backend (backends/llama_cpp.py) tokenizes with the model's
Hugging Face tokenizer, as the other engines do, so the vocabulary in the file is only what llama.cpp
needs to load it. llama-cpp-python is the optional ``llamacpp`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys
from typing import Any, ClassVar

import numpy as np

from variantbench.devices import DeviceNeed
from variantbench.errors import UserError
from variantbench.variants.base import Recipe, register

# kind -> (llama.cpp file type constant name, GGUF file_type number it writes)
TYPES: dict[str, tuple[str, int]] = {
    "gguf-f32": ("LLAMA_FTYPE_ALL_F32", 0),
    "gguf-f16": ("LLAMA_FTYPE_MOSTLY_F16", 1),
    "gguf-bf16": ("LLAMA_FTYPE_MOSTLY_BF16", 32),  # beside torch bf16 (benchmarks/engines.py)
    "gguf-q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", 2),
    "gguf-q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", 3),
    "gguf-q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", 7),
    "gguf-q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", 8),
    "gguf-q4_k_m": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", 15),
}
BACKEND = "variantbench.backends.llama_cpp:LlamaCppBackend"


class GgufVariant(Recipe):
    stage: ClassVar[str] = "engine"
    engine_backend: ClassVar[str] = BACKEND
    devices: ClassVar[DeviceNeed] = DeviceNeed(
        cuda="the llama.cpp library here is a CPU build (.ci/llama_cpp.sh); use --device cpu"
    )
    # the export writes llama.cpp's "llama" architecture (its tensor names, no biases, no windows,
    # no q/k norms): other families would load into llama.cpp and compute the wrong thing
    families: ClassVar[frozenset[str] | None] = frozenset({"llama"})

    @property
    def type_name(self) -> str:
        return self.kind.removeprefix("gguf-")

    def artifact(self, source: str | Path, root: Path, say: Any = None) -> Path:
        return gguf_path(source, self, root, say=say)


def _not_in_process(model: Any, recipe: Recipe) -> Any:
    raise UserError(f"{recipe.kind} is an export to llama.cpp, not a PyTorch transform")


for _kind in TYPES:
    _cls = type(
        f"Gguf_{_kind[5:]}",
        (GgufVariant,),
        {"weight_format": f"{_kind[5:].upper()} (GGUF)", "__module__": __name__},
    )
    globals()[_cls.__name__] = _cls  # picklable by name
    register(_kind, _cls, f"llama.cpp, {_kind[5:].upper()} GGUF (llama-cpp-python)")(_not_in_process)


def require_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "gguf-* variants need llama-cpp-python: pip install 'variantbench[llamacpp]' "
            "(it compiles llama.cpp, about 18 minutes on 2 cores)"
        ) from None
    return llama_cpp


# ---- f32/f16 export from a Hugging Face folder ---------------------------------------------------


def _permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half query/key rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _vocab(folder: Path, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) from tokenizer.json (byte-level BPE, as Llama-family models use)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"gguf export needs {path} (a fast byte-level BPE tokenizer)")
    data = json.loads(path.read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise UserError(f"gguf export supports BPE tokenizers; {path} is {model.get('type')!r}")
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused
    for token, i in model["vocab"].items():
        if i < size:
            tokens[i], types[i] = token, 1  # normal
    for added in data.get("added_tokens", []):
        if added["id"] < size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = 3 if added.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def _source_gguf(folder: Path) -> Path | None:
    """The GGUF file a base folder was converted from (models/source.py writes the record)."""
    record = folder / "variantbench-model.json"
    if not record.is_file():
        return None
    source = Path(json.loads(record.read_text()).get("source", ""))
    return source if source.suffix == ".gguf" and source.is_file() else None


def gguf_file_type(path: Path) -> int | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.file_type")
    return int(field.contents()) if field is not None else None


def write_gguf(folder: Path, out: Path, f16: bool = False) -> None:
    """Write the Llama-architecture model in ``folder`` as a GGUF file (float32 or float16 matrices)."""
    import gguf
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral") or "LlamaForCausalLM" not in config.get(
        "architectures", ["LlamaForCausalLM"]
    ):
        raise UserError(f"gguf export supports Llama-architecture models, not {config.get('model_type')!r}")
    n_head, n_kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"gguf export: rope type {rope.get('rope_type')!r} is not supported yet")
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(config.get("_model_name_or_path") or folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(1 if f16 else 0)
    tokens, types, merges = _vocab(folder, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    source = _source_gguf(folder)
    pre = "default"
    if source is not None:
        field = gguf.GGUFReader(str(source)).fields.get("tokenizer.ggml.pre")
        pre = str(field.contents()) if field is not None else pre
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):  # fmt: skip
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"gguf export needs safetensors weights in {folder}")
    tied = config.get("tie_word_embeddings", False)
    for file in files:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if name == "lm_head.weight" and tied:
                    continue
                if name.startswith("model.layers."):
                    _, _, idx, rest = name.split(".", 3)
                    if rest not in per_layer:
                        raise UserError(f"gguf export: unexpected tensor {name}")
                    target = f"blk.{idx}.{per_layer[rest]}"
                else:
                    if name not in names:
                        raise UserError(f"gguf export: unexpected tensor {name}")
                    target = names[name]
                data = np.asarray(f.get_tensor(name), dtype=np.float32)
                if target.endswith(("attn_q.weight", "attn_k.weight")):
                    data = _permute(data, data.shape[0] // head_dim)  # its own head count (query or kv)
                if f16 and data.ndim == 2 and target != "token_embd.weight":
                    data = data.astype(np.float16)
                writer.add_tensor(target, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- the cached files ----------------------------------------------------------------------------


def _quantize_in_subprocess(src: Path, dst: Path, ftype_name: str) -> None:
    """llama_model_quantize in a child process: its log goes to a pipe, a crash stays there."""
    code = (
        "import sys, llama_cpp as l\n"
        "p = l.llama_model_quantize_default_params()\n"
        f"p.ftype = l.{ftype_name}\n"
        "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True,
                          check=False)  # fmt: skip
    if proc.returncode != 0 or not dst.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise UserError(f"llama_model_quantize to {ftype_name} failed: {tail[0]}")


def gguf_path(source: str | Path, recipe: GgufVariant, root: Path, say: Any = None) -> Path:
    """The GGUF file of ``source`` (a Hugging Face folder) for the recipe: cached, made if missing."""
    llama_cpp = require_llama_cpp()
    from variantbench.variants.build import base_identity, cache_key, cached_build

    source = Path(source)
    ftype_name, ftype = TYPES[recipe.kind]
    native = _source_gguf(source)
    if native is not None and gguf_file_type(native) == ftype:
        return native  # the shipped file, as it is
    versions = {"llama_cpp": llama_cpp.__version__}
    if recipe.kind in ("gguf-f32", "gguf-f16"):
        key = cache_key({"base": base_identity(source), "recipe": recipe.model_dump(), "versions": versions})
        final = root / f"gguf-{key}"
        if not (final / "manifest.json").exists() and say:
            say(f"writing {recipe.kind} from {source.name} (once; cached in {root})")

        def make(folder: Path) -> dict[str, Any]:
            write_gguf(source, folder / "model.gguf", f16=recipe.kind == "gguf-f16")
            return {"name": recipe.kind, "source": str(source), "writer": "variantbench gguf-py export"}

        return cached_build(final, make) / "model.gguf"
    parent = gguf_path(source, parse_gguf("gguf-f32"), root, say)
    key = cache_key({"base": str(parent), "recipe": recipe.model_dump(), "versions": versions})
    final = root / f"gguf-{key}"
    if not (final / "manifest.json").exists() and say:
        say(f"quantizing {recipe.kind} with llama_model_quantize (once; cached in {root})")

    def quantize(folder: Path) -> dict[str, Any]:
        _quantize_in_subprocess(parent, folder / "model.gguf", ftype_name)
        return {"name": recipe.kind, "source": str(source), "from": str(parent), "quantizer": ftype_name}

    return cached_build(final, quantize) / "model.gguf"


def parse_gguf(kind: str) -> GgufVariant:
    from variantbench.variants import parse_variant

    (recipe,) = parse_variant(kind)
    assert isinstance(recipe, GgufVariant)
    return recipe
