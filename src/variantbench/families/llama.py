"""Llama 1, 2 and 3.x (RoPE scaling "llama3", "linear", "yarn", "dynamic", "longrope" as the config
says: the tables come from transformers' own rotary embedding, row by row past the original context
where the variant depends on the length; tests/test_families.py checks each past it), and SmolLM2,
the default model. The block the engine was written for."""

from variantbench.families.base import Family, register

FAMILY = register(Family(name="llama", model_types=("llama",)))
