"""OLMo 2: no norms before attention or the MLP; instead norms on their outputs before each residual
sum (``post_attention_layernorm``, ``post_feedforward_layernorm``), q and k normed over the whole
projection (not per head) before RoPE, every norm scaling in float32 before the cast."""

from variantbench.families.base import Family, register

FAMILY = register(
    Family(
        name="olmo2",
        model_types=("olmo2",),
        norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
        norm_upcast=True,
        qk_norm="all",
    )
)
