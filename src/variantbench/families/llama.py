"""Llama 1, 2 and 3.x (rope scaling "llama3", "linear", "yarn" as the config says: the tables come
from transformers' own rotary embedding), and SmolLM2, the default model. The block the engine was
written for; every Llama-named structural recipe applies."""

from variantbench.families.base import Family, register

FAMILY = register(Family(name="llama", model_types=("llama",)))
