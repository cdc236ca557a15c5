"""Gemma 2: four norms a block (a sandwich around attention and the MLP), norms that scale by
1 + w in float32, embeddings scaled by sqrt(hidden) (in the model's dtype), attention scaled by
query_pre_attn_scalar^-1/2 and soft-capped (cap * tanh(s / cap)), sliding-window layers as
``layer_types`` says, final logits soft-capped, GELU-tanh.

transformers 5.25 runs Gemma 2 with eager attention only (``_supports_sdpa = False``: SDPA has no
soft-capping); so do we on its layers: scores, cap, mask, float32 softmax. SmoothQuant does not
apply (its scales move through a Llama pre-norm; Gemma's (1 + w) sandwich is another layout)."""

from variantbench.families.base import Family, register

FAMILY = register(
    Family(
        name="gemma2",
        model_types=("gemma2",),
        norms={
            "attn_in": "input_layernorm",
            "attn_out": "post_attention_layernorm",
            "mlp_in": "pre_feedforward_layernorm",
            "mlp_out": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
        norm_upcast=True,
        activation_key="hidden_activation",
        embed_scale="sqrt_hidden",
        attn_scale_inv_sqrt_key="query_pre_attn_scalar",
        attn_softcap_key="attn_logit_softcapping",
        final_softcap_key="final_logit_softcapping",
    )
)
