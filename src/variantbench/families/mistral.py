"""Mistral: the Llama block with a sliding window over every layer where ``config.sliding_window``
is set (transformers applies it to all layers; Mistral 7B v0.1 had 4,096)."""

from variantbench.families.base import Family, register

FAMILY = register(Family(name="mistral", model_types=("mistral",), sliding_every_layer=True))
