"""Qwen3: RMSNorm on each query and key head (over head_dim) before RoPE; no q/k/v biases.
Its norms are shared by every head, so head pruning applies; linear-attn does not (it has no q/k norms)."""

from variantbench.families.base import Family, register

FAMILY = register(Family(name="qwen3", model_types=("qwen3",), qk_norm="head"))
