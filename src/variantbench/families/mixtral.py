"""Mixtral: the Mistral block (sliding window over every layer when set) with a mixture of experts:
softmax router, top ``num_experts_per_tok`` renormalized, the weights kept in float32."""

from variantbench.families.base import Experts, Family, register

FAMILY = register(
    Family(
        name="mixtral",
        model_types=("mixtral",),
        sliding_every_layer=True,
        experts=Experts(normalize_key=None, weights_in_model_dtype=False),
    )
)
