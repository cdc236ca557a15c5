"""Mistral: the Llama block with a sliding window over every layer where ``config.sliding_window``
is set (transformers applies it to all layers; Mistral 7B v0.1 had 4,096)."""

from variantbench.backends.families.base import Family, register
from variantbench.backends.families.llama import LLAMA_RECIPES

FAMILY = register(
    Family(name="mistral", model_types=("mistral",), sliding_every_layer=True, recipes=LLAMA_RECIPES)
)
