"""Qwen2 and Qwen2.5: the Llama block with biases on q, k and v (the engine concatenates them with
the fused projection), sliding windows only on the layers ``config.layer_types`` marks."""

from variantbench.families.base import Family, register

FAMILY = register(Family(name="qwen2", model_types=("qwen2",)))
