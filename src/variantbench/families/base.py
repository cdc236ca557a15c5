"""A model family: where a Hugging Face architecture differs from the Llama block, stated as data.

The engine (``backends/engine.py``) runs one block shape: norms around attention and the MLP, a
fused q/k/v projection with optional per-head or whole-projection q/k norms, rotary positions,
softmax attention (scaled, optionally soft-capped and windowed), a gated MLP or a mixture of
experts, and residual sums with an optional multiplier. A family says which of those parts its
checkpoints have and under which module and config names; ``describe`` reads a loaded model
through it. Nothing in the engine branches on a family's name, and a model whose
``config.model_type`` no family registers never reaches the engine (the transformers fallback
backend runs it instead).

Each family file is proven by ``tests/test_families.py``: a tiny random model of that config,
our engine against transformers' own forward (prefill and decode logits, greedy tokens, the
ragged and the paged serving batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import importlib
import json
from pathlib import Path
import pkgutil
from typing import Any

# The block's norm positions, by role: before attention ("attn_in"), on attention's output
# before the residual sum ("attn_out", Gemma's sandwich and OLMo 2's post-norm), before the MLP
# ("mlp_in") and on its output ("mlp_out")
LLAMA_NORMS = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
NORM_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out")

# the projection names of a Llama block (q/k/v under self_attn, gate/up under mlp)
SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
SPLIT_MLP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (transformers 5 stores experts as 3-D tensors, ``experts.gate_up_proj``
    [E, 2I, H] and ``experts.down_proj`` [E, H, I]; the router is ``gate.weight`` [E, H])."""

    # config key that says whether the top-k weights are renormalized (None: always, as Mixtral)
    normalize_key: str | None = None
    # a dense expert every token passes through, scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)
    shared_expert: bool = False
    # the top-k weights are cast to the model's dtype before they scale the experts (Qwen2-MoE)
    # or kept in float32 (Mixtral): they differ only below fp32
    weights_in_model_dtype: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    norm_offset: float = 0.0  # Gemma scales by (1 + w)
    norm_upcast: bool = False  # the scale applied in float32, then cast (Gemma, OLMo 2); Llama casts first
    qk_norm: str | None = (
        None  # "head": over each head's D (Qwen3, Gemma 3); "all": over the projection (OLMo 2)
    )
    qkv: tuple[str, ...] = SPLIT_PROJECTIONS  # module names under self_attn, concatenated in this order
    gate_up: tuple[str, ...] = SPLIT_MLP  # under mlp; a single fused name holds gate then up (Phi-3)
    activation_key: str = "hidden_act"
    embed_scale: str | None = None  # "sqrt_hidden" (Gemma) or a config key (Granite's embedding_multiplier)
    residual_scale_key: str | None = None  # Granite: residual + block(x) * residual_multiplier
    attn_scale_key: str | None = None  # the scale itself (Granite's attention_multiplier)
    attn_scale_inv_sqrt_key: str | None = None  # scale = value ** -0.5 (Gemma's query_pre_attn_scalar)
    attn_softcap_key: str | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap_key: str | None = None  # Gemma 2/3: the same on the logits
    logit_divisor_key: str | None = None  # Granite: logits / logits_scaling
    sliding_every_layer: bool = False  # config.sliding_window applies to all layers (Mistral, Phi-3)
    rope_by_layer_type: bool = False  # Gemma 3: local and global layers have their own RoPE base
    experts: Experts | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        if model_type in FAMILIES:
            raise ValueError(f"model type {model_type!r} is registered twice")
        FAMILIES[model_type] = family
    return family


def _load_all() -> None:
    from variantbench import families as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base":
            importlib.import_module(f"{package.__name__}.{info.name}")


def _families() -> dict[str, Family]:
    """The registry, its family files imported on first use."""
    if not FAMILIES:
        _load_all()
    return FAMILIES


def family_for(config: Any) -> Family | None:
    """The registered family of a transformers config (by ``model_type``), or None."""
    return _families().get(str(getattr(config, "model_type", "")))


def registered_types() -> list[str]:
    return sorted(_families())


def model_type_of(folder: str | Path) -> str | None:
    """``model_type`` from a Hugging Face folder's config.json, without importing transformers."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def family_of_folder(folder: str | Path) -> Family | None:
    """The registered family of a model folder, or None (unregistered, or no config to read)."""
    return _families().get(str(model_type_of(folder)))
