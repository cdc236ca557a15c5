"""Llama 1, 2 and 3.x (rope scaling "llama3", "linear", "yarn" as the config says: the tables come
from transformers' own rotary embedding), and SmolLM2, the default model. The block the engine was
written for; every Llama-named structural recipe applies."""

from variantbench.backends.families.base import Family, register

LLAMA_RECIPES = frozenset(
    {"prune-heads", "drop-layers", "linear-attn", "smooth", "keep-fp32", "mixed-bf16", "distill", "qat-int8"}
)

FAMILY = register(Family(name="llama", model_types=("llama",), recipes=LLAMA_RECIPES))
