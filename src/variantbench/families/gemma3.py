"""Gemma 3 (text): Gemma 2's sandwich block and (1 + w) norms, plus per-head q/k norms (also 1 + w),
a RoPE base of its own for the local (sliding-window) layers (``rope_by_layer_type``: transformers'
rotary embedding takes the layer type), and no attention soft-cap by default."""

from variantbench.families.base import Family, register
from variantbench.families.gemma2 import FAMILY as GEMMA2

FAMILY = register(
    Family(
        name="gemma3",
        model_types=("gemma3_text",),
        norms=dict(GEMMA2.norms),
        norm_offset=1.0,
        norm_upcast=True,
        qk_norm="head",
        activation_key="hidden_activation",
        embed_scale="sqrt_hidden",
        attn_scale_inv_sqrt_key="query_pre_attn_scalar",
        attn_softcap_key="attn_logit_softcapping",
        final_softcap_key="final_logit_softcapping",
        rope_by_layer_type=True,
    )
)
