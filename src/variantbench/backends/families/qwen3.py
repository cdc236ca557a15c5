"""Qwen3: RMSNorm on each query and key head (over head_dim) before RoPE; no q/k/v biases.
Head pruning is not offered: it would have to keep the per-head norms consistent."""

from variantbench.backends.families.base import Family, register
from variantbench.backends.families.llama import LLAMA_RECIPES

FAMILY = register(
    Family(name="qwen3", model_types=("qwen3",), qk_norm="head", recipes=LLAMA_RECIPES - {"prune-heads"})
)
