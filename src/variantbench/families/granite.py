"""Granite (3.x): the Llama block with four multipliers from the config: embeddings times
``embedding_multiplier``, each block's output times ``residual_multiplier`` before the residual sum,
attention scaled by ``attention_multiplier`` (instead of head_dim^-1/2), logits divided by
``logits_scaling``."""

from variantbench.families.base import Family, register

FAMILY = register(
    Family(
        name="granite",
        model_types=("granite",),
        embed_scale="embedding_multiplier",
        residual_scale_key="residual_multiplier",
        attn_scale_key="attention_multiplier",
        logit_divisor_key="logits_scaling",
    )
)
