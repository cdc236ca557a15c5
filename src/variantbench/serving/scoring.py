"""Prompt scoring and the tokenizer endpoints: what lm-evaluation-harness and a likelihood client need.

``POST /v1/completions`` with ``echo: true`` scores the prompt instead of generating: each prompt
token's log-probability given the tokens before it (the first token has none) and the ``logprobs``
most likely tokens at each position, in OpenAI's legacy ``logprobs`` object (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), with one greedy next token appended when
``max_tokens`` is 1. That is the request lm-eval's ``local-completions`` model sends for every
log-likelihood (``max_tokens: 1, logprobs: 1, echo: true``; it reads ``token_logprobs[ctxlen:-1]``),
and vLLM answers it the same way. A list of prompts (lm-eval sends a list of token-id lists) gives one
choice per prompt. More than one new token is refused: scoring a prompt and generating from it are
different requests here, and a generation's own log-probabilities are not offered.

``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` are vLLM's endpoints, so a
client without the model's tokenizer (lm-eval's remote tokenizer, our served-likelihood client in
``backends/openai_http.py``) splits text into tokens as the server does.

The forward runs on the variant's worker thread between two decode steps
(``BatchWorker.call_between_steps``): the model is the worker's, and a scoring request waits for one
step at most.
"""

from __future__ import annotations

from typing import Any


class ScoringError(ValueError):
    """A request this module cannot score: the server answers 400 with the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def prompts_of(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], list[str | None]]:
    """The prompts of a scoring request as token ids, and each one's text where it came as text (its
    tokens' character offsets are then exact): a string, a list of strings, a list of token ids or a
    list of such lists."""
    prompt = body.get("prompt")
    items = prompt if isinstance(prompt, list) and prompt and not is_token_ids(prompt) else [prompt]
    ids: list[list[int]] = []
    texts: list[str | None] = []
    vocab = len(tokenizer)
    for item in items:
        if isinstance(item, str) and item:
            ids.append(list(tokenizer(item)["input_ids"]))
            texts.append(item)
        elif isinstance(item, list) and item and is_token_ids(item):
            if why := outside_vocab(item, vocab):
                raise ScoringError(f"'prompt' {why}", "prompt")
            ids.append(list(item))
            texts.append(None)
        else:
            raise ScoringError(
                "'prompt' must be a non-empty string, token ids, or a list of either", "prompt"
            )
    return ids, texts


def is_token_ids(value: list[Any]) -> bool:
    """A list of token ids (ints, not bools): a prompt given as tokens."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def outside_vocab(ids: list[int], vocab: int) -> str | None:
    """Why token ids cannot be read by a tokenizer of ``vocab`` tokens (the message a 400 carries), or
    None: what a prompt given as ids, a scoring prompt and ``/detokenize`` all check."""
    return None if all(0 <= t < vocab for t in ids) else f"token ids must lie in [0, {vocab})"


def score(backend: Any, ids: list[int], top: int, next_token: bool) -> dict[str, Any]:
    """One prompt's token log-probabilities (row ``i - 1`` of the model's next-token log-probs gives
    token ``i``'s), the top ``top`` at each position (the token itself among them, as vLLM does),
    and the greedy next token when asked. Runs on the worker's thread."""
    lp = backend.token_log_probs(ids)  # float32 [len(ids), vocab]
    tokens = list(ids)
    token_lp: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    rows = range(1, len(ids) + (1 if next_token else 0))
    if next_token:
        tokens.append(int(lp[-1].argmax()))
    k = min(top, lp.shape[-1])
    best = lp[[i - 1 for i in rows]].topk(k, dim=-1) if k and len(rows) else None
    for j, i in enumerate(rows):
        own = float(lp[i - 1, tokens[i]])
        token_lp.append(own)
        if best is None:
            tops.append([(tokens[i], own)])
            continue
        pairs = [(int(t), float(v)) for v, t in zip(best.values[j], best.indices[j], strict=True)]
        if tokens[i] not in {t for t, _ in pairs}:
            pairs.append((tokens[i], own))
        tops.append(pairs)
    return {"tokens": tokens, "token_logprobs": token_lp, "top": tops}


def logprobs_object(tokenizer: Any, scored: dict[str, Any], text: str | None) -> tuple[str, dict[str, Any]]:
    """OpenAI's legacy ``logprobs`` object for one scored prompt, and the choice's text (the prompt and
    any next token). ``text_offset``: each token's first character in that text, from the tokenizer's
    offsets where the prompt came as text, else from each token decoded alone (exact for byte-level
    BPE vocabularies; a SentencePiece token's leading space is then not counted)."""
    ids = scored["tokens"]
    pieces = [tokenizer.decode([t]) for t in ids]
    offsets: list[int] = []
    if text is not None:
        enc = tokenizer(text, return_offsets_mapping=True)
        mapped = [start for start, _ in enc["offset_mapping"]]
        offsets = mapped[: len(ids)]
        full = text
        if len(ids) > len(mapped):  # the next token follows the prompt's text
            offsets.append(len(text))
            full = text + pieces[-1]
    else:
        at = 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        full = "".join(pieces)
    top = [None if t is None else {str(tokenizer.decode([tid])): lp for tid, lp in t} for t in scored["top"]]
    return full, {"tokens": pieces, "token_logprobs": scored["token_logprobs"], "top_logprobs": top,
                  "text_offset": offsets}  # fmt: skip


def tokenizer_info(tokenizer: Any, max_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: what a remote-tokenizer client needs (lm-eval checks ``eos_token``)."""
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": max_len,
        "vocab_size": len(tokenizer),
    }
