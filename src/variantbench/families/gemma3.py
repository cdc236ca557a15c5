"""Gemma 3 (text): Gemma 2's sandwich block and (1 + w) norms, plus per-head q/k norms (also 1 + w),
a RoPE base of its own for the local (sliding-window) layers (``rope_by_layer_type``: transformers'
rotary embedding takes the layer type), and no attention soft-cap by default (the config's
``attn_logit_softcapping`` is read all the same)."""

import dataclasses

from variantbench.families.base import register
from variantbench.families.gemma2 import FAMILY as GEMMA2

FAMILY = register(
    dataclasses.replace(
        GEMMA2, name="gemma3", model_types=("gemma3_text",), qk_norm="head", rope_by_layer_type=True
    )
)
