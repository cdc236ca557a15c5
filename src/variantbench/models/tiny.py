"""Tiny random models of every registered family, built in-process (no download, under a second each).

The parity tests (``tests/test_families.py``), ``benchmarks/families.py`` and a user's smoke test
(``variantbench run --model DIR`` on a folder this writes) use them. Each config turns on what makes
its family differ from Llama, at a size where it bites: sliding windows of 6 positions under prompts
of 12 to 40 tokens, soft-caps near the scores' scale, multipliers far from 1, partial rotary, RoPE
scaling, experts with a dense layer between them. Weights are drawn larger than transformers' init
(standard deviation 0.15, norms 1 +/- 0.1) so the logits have clear winners and greedy decoding is
stable to compare token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}

# family name -> (transformers config class, its arguments beyond _COMMON)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": 6}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 6, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 6, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "final_logit_softcapping": 10.0}),
    "phi3": ("Phi3Config", {"sliding_window": 6, "partial_rotary_factor": 0.5}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                                  "attention_multiplier": 0.1, "logits_scaling": 4.0}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
                                     "mlp_only_layers": [1], "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}),
}  # fmt: skip


def tiny_tokenizer() -> Any:
    """A byte-level BPE of 400 tokens trained on the synthetic workload, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from variantbench.workloads import SyntheticLibrary

    texts = [
        s.prompt + " " + s.reference for s in (SyntheticLibrary(n=40, seed=1).sample(i) for i in range(40))
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    if family not in TINY:
        raise KeyError(f"no tiny config for {family!r}; known: {', '.join(sorted(TINY))}")
    name, extra = TINY[family]
    # the tiny tokenizer's special tokens: <|endoftext|> 0 (padding), <|im_start|> 1, <|im_end|> 2
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return getattr(transformers, name)(vocab_size=vocab_size, **{**_COMMON, **ids, **extra, **overrides})


def tiny_model(config: Any, seed: int = 0) -> Any:
    """A random model of ``config`` with the larger weights described above, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:  # a norm's scale: 1 +/- 0.1 in effect (Gemma stores the offset from 1)
                p.copy_((torch.randn_like(p) * 0.1) + (0.0 if p.abs().max() == 0 else 1.0))
    return model


def build_tiny(family: str, folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model of ``family`` and the tiny tokenizer to ``folder``; returns it."""
    tokenizer = tiny_tokenizer()
    config = tiny_config(
        family, len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **overrides,
    )  # fmt: skip
    folder = Path(folder)
    tiny_model(config, seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
