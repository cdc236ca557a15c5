"""Counting a prompt's tokens with the model's own tokenizer (the only place workloads load transformers)."""

from __future__ import annotations

from variantbench.workloads.base import TokenCounter


def tokenizer_counter(tokenizer_dir: str) -> TokenCounter:
    """Counts tokens of a text with the model's own tokenizer (no special tokens, no chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count
