"""Linear attention with a learned feature map (Hedgehog), and its two equal forms.

Softmax attention ``o_t = sum_s exp(q_t.k_s) v_s / sum_s exp(q_t.k_s)`` keeps every key and value
(a KV cache growing with the context). Linear attention replaces ``exp(q.k)`` by ``phi(q).phi(k)``
with non-negative features, so the sums factor through a state of fixed size per KV head:
``S = sum_s phi(k_s) v_s^T`` ([F, D]) and ``z = sum_s phi(k_s)`` ([F]); ``o_t = phi(q_t) S / phi(q_t) z``.

Hedgehog's map (Zhang et al., 2024, as LoLCATs uses it): ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]``
per head, a learned ``W`` [D, F] initialized to the identity, so 2F features that can learn softmax's
spikiness. Queries and keys have maps of their own, applied after RoPE (the model's positions stay).

Two forms of the same function, used where each is fast: ``parallel`` (prefill, training: chunks of
C tokens, quadratic inside a chunk, the state carried between chunks, so memory stays O(S C) not
O(S^2)) and ``step`` (decode: one token updates the state). Tests hold them equal on the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

EPS = 1e-6
CHUNK = 128


class HedgehogMap(nn.Module):
    """Per-head learned feature map: [..., heads, S, D] -> [..., heads, S, 2F] (non-negative)."""

    def __init__(self, heads: int, head_dim: int, features: int) -> None:
        super().__init__()
        eye = (
            torch.eye(head_dim, features)
            if features <= head_dim
            else torch.eye(head_dim).repeat(1, -(-features // head_dim))[:, :features]
        )
        self.weight = nn.Parameter(eye.unsqueeze(0).repeat(heads, 1, 1).contiguous())  # [H, D, F]
        self.bias = nn.Parameter(torch.zeros(heads, 1, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("...hsd,hdf->...hsf", x.float(), self.weight) + self.bias
        return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)


def parallel(
    fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Causal linear attention over a sequence, in chunks.

    ``fq`` [B, Hkv, G, S, F2] (the G query heads of each KV head), ``fk`` [B, Hkv, S, F2] (zero rows
    for padding), ``v`` [B, Hkv, S, D]; ``state`` (S [B, Hkv, F2, D], z [B, Hkv, F2]) of earlier
    tokens. Returns the outputs [B, Hkv, G, S, D] and the state after the last token.
    """
    bsz, hkv, _, seq, f2 = fq.shape
    d = v.shape[-1]
    s_state = fk.new_zeros(bsz, hkv, f2, d) if state is None else state[0]
    z_state = fk.new_zeros(bsz, hkv, f2) if state is None else state[1]
    outs = []
    for c0 in range(0, seq, chunk):
        c1 = min(seq, c0 + chunk)
        q_c, k_c, v_c = fq[:, :, :, c0:c1], fk[:, :, c0:c1], v[:, :, c0:c1].float()
        scores = torch.einsum("bhgsf,bhtf->bhgst", q_c, k_c).tril()  # inside the chunk, causal
        num = torch.einsum("bhgst,bhtd->bhgsd", scores, v_c) + torch.einsum("bhgsf,bhfd->bhgsd", q_c, s_state)
        den = scores.sum(-1) + torch.einsum("bhgsf,bhf->bhgs", q_c, z_state)
        outs.append(num / (den.unsqueeze(-1) + EPS))
        s_state = s_state + torch.einsum("bhtf,bhtd->bhfd", k_c, v_c)
        z_state = z_state + k_c.sum(2)
    return torch.cat(outs, 3), (s_state, z_state)


def step(
    fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One token: ``fq`` [B, Hkv, G, F2], ``fk`` [B, Hkv, F2], ``v`` [B, Hkv, D]; the state updated
    (in place) and the outputs [B, Hkv, G, D]."""
    s_state, z_state = state
    s_state.add_(fk.unsqueeze(-1) * v.float().unsqueeze(-2))
    z_state.add_(fk)
    num = torch.einsum("bhgf,bhfd->bhgd", fq, s_state)
    den = torch.einsum("bhgf,bhf->bhg", fq, z_state)
    return num / (den.unsqueeze(-1) + EPS), (s_state, z_state)


def grouped(fq: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, S, F] -> [B, Hkv, G, S, F]: query head h reads KV head h // G (as repeat_kv)."""
    b, hq, s, f = fq.shape
    return fq.view(b, kv_heads, hq // kv_heads, s, f)


class LinearAttention(nn.Module):
    """In place of a Llama attention block: the same q/k/v/o projections (same weight names), RoPE,
    then linear attention through the learned feature maps. Its forward is the parallel form over
    whole unpadded sequences (training, scoring); our engine runs the recurrent form when decoding.

    ``transfer``: attention transfer (LoLCATs' first stage): the forward also computes the softmax
    attention it replaces, keeps the mean squared error between the two outputs in
    ``transfer_loss`` and passes the softmax output on, so every layer learns against the
    teacher's own stream at once.
    """

    def __init__(self, attn: nn.Module, heads: int, kv_heads: int, features: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
        )
        self.head_dim = attn.head_dim
        self.layer_idx = getattr(attn, "layer_idx", None)
        self.scaling = attn.scaling
        self.heads, self.kv_heads = heads, kv_heads
        self.feature_q = HedgehogMap(heads, self.head_dim, features)
        self.feature_k = HedgehogMap(kv_heads, self.head_dim, features)
        self.transfer = False
        self.transfer_loss: torch.Tensor | None = None

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None, **kwargs: object,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        bsz, seq, _ = hidden_states.shape
        shape = (bsz, seq, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        assert position_embeddings is not None
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out, _ = parallel(grouped(self.feature_q(q), self.kv_heads), self.feature_k(k), v)
        out = out.reshape(bsz, self.heads, seq, self.head_dim).to(v.dtype)
        if self.transfer:
            target = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=seq > 1, scale=self.scaling, enable_gqa=self.heads != self.kv_heads
            ).detach()
            self.transfer_loss = torch.nn.functional.mse_loss(out, target)
            out = target
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1)), None
