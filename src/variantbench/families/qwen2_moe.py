"""Qwen2-MoE (and Qwen1.5-MoE): the Qwen2 block (q/k/v biases) with a mixture of experts in the MLP
of the layers ``decoder_sparse_step`` and ``mlp_only_layers`` choose: a softmax router over
``num_experts``, the top ``num_experts_per_tok`` (renormalized when ``norm_topk_prob``), and a
shared expert every token passes through, scaled by sigmoid(shared_expert_gate(x)).

The experts are 3-D tensors in transformers 5, not ``nn.Linear``: the int8 and weight-only recipes
quantize attention, the router-free shared expert and the head, and leave the experts as they are."""

from variantbench.families.base import Experts, Family, register

FAMILY = register(
    Family(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        experts=Experts(normalize_key="norm_topk_prob", shared_expert=True),
    )
)
