"""A lean greedy decoder for Llama-architecture models over a static KV cache.

Why our own loop instead of ``model.generate``: on CPU, decode at batch 1 is bound by reading the
weights once per token. PyTorch's ``F.linear`` computes ``x @ W.T`` against the row-major
``[out, in]`` weight, which this machine's MKL streams at well under half the memory bandwidth;
``x @ Wt`` with ``Wt`` stored pre-transposed and contiguous streams much faster. We also fuse
q/k/v and gate/up into one matmul each, keep the KV cache preallocated (no concatenation per
step), compute the vocabulary projection for the last position only, and keep the per-step
Python work to a few tensor ops per layer. ``benchmarks/decode.py`` measures the result against
``generate`` and against the memory-bandwidth roofline.

Any projection that is not a plain ``nn.Linear`` (dynamic int8, weight-only quantized, ...) is
called as the module it is, so every recipe runs through the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
from dataclasses import dataclass, field
import time
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
import torch.nn.functional as F

# Up to this many rows, a split-K batched matmul beats one matmul (see _DenseT); above it (prefill
# of long prompts) the library's own multi-threaded GEMM wins.
SPLIT_K_MAX_ROWS = 32


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Inductor lowers this op only for weights it froze as graph constants; ours live outside any
# module, so a compiled step (the ``compile`` variant) ran into an AssertionError at load on its
# first multi-row call. It runs the op eagerly instead, a graph break per projection. Made by
# ``compile_decode_step``, not at import: ``torch.compiler.disable`` imports torch._dynamo and
# sympy, 76 MiB of RSS in every process that imports this module (a llama.cpp server among them).
_packed_linear_eager: Callable[..., torch.Tensor] = _packed_linear


class _DenseT:
    """Fused dense projection over ``cat(weights)``, stored in the layout that decodes fastest.

    fp32: ``Wt = cat(weights).T`` contiguous ``[K, N]``. For the few rows of a decode step, MKL runs
    ``x @ Wt`` on one thread; viewing ``Wt`` as ``[P, K/P, N]`` (no copy) and computing
    ``bmm(x split in P chunks of K, Wt) .sum(0)`` puts every core on its own slice of the weights:
    measured here 23.7 GB/s against 16.2 GB/s for ``x @ Wt`` at one row, and faster up to 32 rows.
    bf16/fp16: the row-major ``[N, K]`` weight through ``F.linear`` (oneDNN's reduced-precision
    kernels are multi-threaded; ``x @ Wt`` in bf16 falls to a slow reference path).

    fp32 at 2 rows or more (a batched decode step, a prefill): MKL's GEMM repacks the weights on
    every call, so 4 rows cost 4-6x one row and batching gained nothing. A oneDNN copy of the
    weights, packed once (``mkldnn._reorder_linear_weight``) on the first such call, runs 4 rows of
    the 576x3072 MLP projection in 398 us against 868 us (split-K) and 1088 us (``x @ Wt``), and
    is 1.02-1.5x faster than ``x @ Wt`` from 32 to 512 rows, measured here.

    A server can keep one copy instead of two (``drop_plain``, issue 21: a served variant's idle
    RSS was 2.8x its weights). The packed copy serves one row too, but slower when the weights
    stream from DRAM: a decode step's 30 SmolLM2 layers took 19.7 ms packed against 17.4 ms
    split-K at one row (2 rows 21.4 against 22.2; 4 rows 16.6 against 30.7), measured here with
    405 MB of distinct weights. So ``variantbench run`` keeps both (batch-1 latency is what it
    measures) and ``serve`` keeps one by default (``--weight-layout``).
    """

    def __init__(self, linears: Sequence[nn.Linear], threads: int | None = None) -> None:
        with torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
            self.out_features, self.in_features = weight.shape
            self.transposed = weight.dtype == torch.float32
            on_cpu = weight.device.type == "cpu"
            self.pack = on_cpu and self.transposed and torch.backends.mkldnn.is_available()
            self.packed: torch.Tensor | None = None  # the oneDNN copy
            self.weight: torch.Tensor | None = None  # the plain copy (x @ weight, split-K, lookups)
            self.weight_split: torch.Tensor | None = None
            self.split = 1
            self._keep_plain(weight, threads or torch.get_num_threads(), on_cpu)
            biases = [lin.bias for lin in linears]
            if all(b is None for b in biases):
                self.bias = None
            else:
                self.bias = torch.cat(
                    [
                        b.detach() if b is not None else torch.zeros(lin.out_features, dtype=weight.dtype)
                        for b, lin in zip(biases, linears, strict=True)
                    ]
                )

    def _keep_plain(self, weight: torch.Tensor, threads: int, on_cpu: bool) -> None:
        self.weight = weight.t().contiguous() if self.transposed else weight.contiguous()
        self.split = (
            threads if on_cpu and self.transposed and threads > 1 and self.in_features % threads == 0 else 1
        )
        self.weight_split = (
            self.weight.view(self.split, self.in_features // self.split, self.out_features)
            if self.split > 1
            else None
        )

    def _ensure_packed(self) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.t().contiguous())
        return self.packed

    def drop_plain(self) -> bool:
        """Keep only the packed copy (every row count runs through it); False where there is none."""
        if not self.pack:
            return False
        self._ensure_packed()
        self.weight = self.weight_split = None
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if self.pack and (rows > 1 or self.weight is None):
            self._ensure_packed()  # made on the first multi-row call
            linear = _packed_linear_eager if torch.compiler.is_compiling() else _packed_linear
            out = linear(x.reshape(rows, self.in_features), self.packed, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.weight_split is not None and rows <= SPLIT_K_MAX_ROWS:
            chunk = self.in_features // self.split
            if rows == 1:  # the decode step at batch 1: a plain view, no transpose
                parts = x.reshape(self.split, 1, chunk)
            else:
                parts = x.reshape(rows, self.split, chunk).transpose(0, 1)
            out = torch.bmm(parts, self.weight_split).sum(0).view(*x.shape[:-1], self.out_features)
        else:
            out = x @ self.weight
        if self.bias is not None:
            out = out + self.bias
        return out


class _Modules:
    """Projections that are not plain dense layers: call each module and join the outputs."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.modules) == 1:
            return self.modules[0](x)
        return torch.cat([m(x) for m in self.modules], dim=-1)


@runtime_checkable
class FusableProjection(Protocol):
    """A projection module type that can merge several of its kind into one (q/k/v, gate/up):
    one kernel call instead of several, the output equal to their concatenation."""

    @classmethod
    def fuse(cls, modules: Sequence[nn.Module]) -> nn.Module: ...


def _projection(modules: Sequence[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    # plain Linear layers with plain tensors get our layout; a fusable kind (our int8) is merged
    # into one module; anything else (torchao's quantized tensor subclasses) runs module by module
    if all(type(m) is nn.Linear and type(m.weight.detach()) is torch.Tensor for m in modules):
        return _DenseT(modules)  # type: ignore[arg-type]
    kinds = {type(m) for m in modules}
    if len(kinds) == 1 and isinstance(modules[0], FusableProjection):
        return _Modules([type(modules[0]).fuse(modules)])
    return _Modules(modules)


@runtime_checkable
class LinearAttentionBlock(Protocol):
    """An attention block that is linear attention (the linear-attn recipe): feature maps for
    queries and keys; decoding keeps a fixed-size state per KV head instead of a KV cache."""

    feature_q: nn.Module
    feature_k: nn.Module
    kv_heads: int


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    n_heads: int
    n_kv_heads: int
    # linear attention: (query map, key map); None: softmax attention over the KV cache
    linear: tuple[nn.Module, nn.Module] | None = None


@dataclass
class LinearState:
    """A linear-attention layer's decoding state: S [B, Hkv, F, D] and z [B, Hkv, F] (float32)."""

    s: torch.Tensor
    z: torch.Tensor


class AttentionGroup(Protocol):
    """Tokens of a ragged forward that attend together: a batch's decode rows, or one prompt's chunk.

    ``attend`` gets the group's rotated queries [T, q_heads, D], keys and values [T, kv_heads, D] of
    layer ``li``, stores the keys and values where the group keeps them, and returns the attention
    output [T, q_heads * D]. Where keys live (one contiguous cache, a paged block pool) is the
    group's business; the forward only runs the projections once over every group's tokens."""

    length: int

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PromptPiece:
    """A chunk of one prompt in a ragged forward: tokens ``start:start+length`` of a sequence whose
    per-layer (keys, values) views ``cache`` ([1, kv_heads, positions, head_dim]) hold its earlier
    tokens. ``mask`` [1, 1, length, start+length] (None: plain causal from position 0)."""

    cache: list[tuple[torch.Tensor, torch.Tensor]]
    start: int
    length: int
    mask: torch.Tensor | None = None

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache[li]
        end = self.start + self.length
        k_cache[0, :, self.start : end] = k.transpose(0, 1)
        v_cache[0, :, self.start : end] = v.transpose(0, 1)
        nq, nkv = q.shape[1], k.shape[1]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=self.mask,
            is_causal=self.mask is None and self.length > 1, enable_gqa=nq != nkv,
        )  # fmt: skip
        return attn[0].transpose(0, 1).reshape(self.length, -1)


@dataclass
class CachedRows:
    """Decode rows of one shared cache (``row_cache`` per layer, [rows, kv_heads, positions, D]):
    each writes its new key/value at ``cur`` and attends under ``row_mask``, or row by row from
    ``row_starts`` (see ``LlamaDecoder._forward_ragged``)."""

    row_cache: list[tuple[torch.Tensor, torch.Tensor]]
    cur: int
    row_mask: torch.Tensor | None
    row_starts: Sequence[int] | None
    length: int

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.row_cache[li]
        cur, rows = self.cur, self.length
        k_cache[:, :, cur] = k
        v_cache[:, :, cur] = v
        nkv, d = k.shape[1], k.shape[2]
        q = q.reshape(rows, nkv, -1, d)  # grouped: each kv head with its query heads
        if self.row_starts is None:
            attn = F.scaled_dot_product_attention(
                q, k_cache[:, :, : cur + 1], v_cache[:, :, : cur + 1], attn_mask=self.row_mask
            )
        else:
            attn = torch.cat([
                F.scaled_dot_product_attention(q[i : i + 1], k_cache[i : i + 1, :, a : cur + 1],
                                               v_cache[i : i + 1, :, a : cur + 1])
                for i, a in enumerate(self.row_starts)
            ])  # fmt: skip
        return attn.reshape(rows, -1)


@dataclass
class DecodeTimings:
    """Integer-nanosecond timestamps of one sequence in a batch."""

    start_ns: int
    token_ns: list[int] = field(default_factory=list)  # when each output token was known
    end_ns: int = 0


@dataclass
class DecodeOutput:
    token_ids: list[list[int]]
    timings: list[DecodeTimings]
    prefill_ns: int
    decode_steps: int


class LlamaDecoder:
    """Greedy decoding for a ``LlamaForCausalLM`` (and models of the same block structure).

    The decoder takes over the model's weights in a decode-friendly layout; the original
    module tree can be dropped afterwards.
    """

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        inner = model.model
        self.config = config
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.act = _activation(config.hidden_act)
        embed = inner.embed_tokens.weight.detach()
        self.dtype = embed.dtype
        self.device = embed.device
        self.final_norm = inner.norm.weight.detach().clone()
        self.lm_head = _projection([model.lm_head])
        # Tied embeddings: look tokens up in the head's own (possibly transposed) copy instead of
        # keeping a second table. Everything else is copied, so no tensor keeps the loaded
        # checkpoint (often a memory map) alive once the caller drops the model.
        head_weight = getattr(model.lm_head, "weight", None)
        tied = isinstance(head_weight, torch.Tensor) and head_weight is inner.embed_tokens.weight
        self._embed_from_head = tied and isinstance(self.lm_head, _DenseT)
        self.embed = None if self._embed_from_head else embed.clone()
        self.rotary = inner.rotary_emb
        self.layers: list[_Layer] = []
        for block in inner.layers:
            attn, mlp = block.self_attn, block.mlp
            n_heads = _out_features(attn.q_proj) // self.head_dim
            n_kv = _out_features(attn.k_proj) // self.head_dim
            self.layers.append(
                _Layer(
                    input_norm=block.input_layernorm.weight.detach().clone(),
                    post_norm=block.post_attention_layernorm.weight.detach().clone(),
                    qkv=_projection([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o=_projection([attn.o_proj]),
                    gate_up=_projection([mlp.gate_proj, mlp.up_proj]),
                    down=_projection([mlp.down_proj]),
                    n_heads=n_heads,
                    n_kv_heads=n_kv,
                    linear=(attn.feature_q, attn.feature_k)
                    if isinstance(attn, LinearAttentionBlock)
                    else None,
                )
            )
        self.softmax_layers = [i for i, layer in enumerate(self.layers) if layer.linear is None]
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step = self._decode_step
        self.compiled = False
        self.profile_regions = False  # label prefill and decode steps for torch.profiler (diagnosis)

    def drop_split_copies(self) -> int:
        """Each layer keeps only its packed weights (see ``_DenseT``); the vocabulary head keeps
        both, as tied embeddings look tokens up in its plain copy. Returns the bytes freed.
        A compiled step keeps both: the packed op runs outside its graph, so every row would."""
        if self.compiled:
            return 0
        freed = 0
        for layer in self.layers:
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if isinstance(proj, _DenseT) and proj.weight is not None:
                    size = proj.weight.numel() * proj.weight.element_size()
                    freed += size if proj.drop_plain() else 0
        return freed

    # ---- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm: statistics in fp32, scale in model dtype.
        if x.dtype == torch.float32:
            return torch.rms_norm(x, weight.shape, weight, self.eps)  # one fused kernel, same result
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None or self._rope_cache[0].shape[0] < length:
            size = max(length, 256)
            positions = torch.arange(size, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                cos, sin = self.rotary(probe, positions)
            sin = sin[0].to(self.dtype).clone()
            sin[..., : sin.shape[-1] // 2] *= -1
            self._rope_cache = (cos[0].to(self.dtype), sin)
        return self._rope_cache

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers' x*cos + rotate_half(x)*sin, with rotate_half(x) = cat(-x2, x1)
        # = roll(x, D/2) * [-1.., +1..]: the sign lives in the precomputed sin table.
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gu = layer.gate_up(self._rms_norm(x, layer.post_norm))
        inter = gu.shape[-1] // 2
        return layer.down(self.act(gu[..., :inter]) * gu[..., inter:])

    def _forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Run all blocks on ``x`` [B, S, H] at cache slots ``start:start+S``; return hidden states.

        ``rope`` is ``_rope_tables(n)`` for some ``n`` past every position (made outside, so this
        function has no side effects and ``torch.compile`` can trace it whole).
        """
        bsz, seq, _ = x.shape
        cos_t, sin_t = rope
        cos = cos_t[positions].unsqueeze(1)  # [B, 1, S, D]
        sin = sin_t[positions].unsqueeze(1)
        end = start + seq
        d = self.head_dim
        for layer, entry in zip(self.layers, cache, strict=True):
            h = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(h).view(bsz, seq, -1, d)
            nq, nkv = layer.n_heads, layer.n_kv_heads
            # RoPE on queries and keys in one go: [B, S, Hq+Hkv, D] -> [B, Hq+Hkv, S, D]
            qk = self._rotate(qkv[:, :, : nq + nkv].transpose(1, 2), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
            v = qkv[:, :, nq + nkv :].transpose(1, 2)
            if layer.linear is not None:
                assert isinstance(entry, LinearState)
                # a named region while profiling, so the diagnosis counts it as attention
                with self._region("linear_attention") if self.profile_regions else contextlib.nullcontext():
                    attn = self._linear_attention(layer, q, k, v, entry, attn_mask)
                x = x + layer.o(attn.transpose(1, 2).reshape(bsz, seq, nq * d).to(x.dtype))
                x = x + self._mlp(layer, x)
                continue
            k_cache, v_cache = entry
            k_cache[:, :, start:end] = k
            v_cache[:, :, start:end] = v
            keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
            if seq == 1 and nq != nkv:
                # Decode with grouped-query attention: the G query heads of a group become G query
                # rows against their one shared KV head, so the cache is never expanded (copied)
                # to Hq heads; the (key-only) mask broadcasts over the rows.
                grouped = q.reshape(bsz, nkv, nq // nkv, d)
                attn = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attn_mask)
                attn = attn.reshape(bsz, nq, 1, d)
            else:
                attn = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=nq != nkv
                )
            x = x + layer.o(attn.transpose(1, 2).reshape(bsz, seq, nq * d))
            x = x + self._mlp(layer, x)
        return x

    def _linear_attention(
        self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LinearState,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """Linear attention of ``q`` [B, Hq, S, D] over ``k``, ``v`` [B, Hkv, S, D] and the state of
        the earlier tokens (updated): one token is a recurrent step, more the chunked parallel form.
        Left padding (a key no query may see, per the mask's last row) is kept out of the state."""
        from variantbench.variants.linear_attention import grouped, parallel, step

        assert layer.linear is not None
        map_q, map_k = layer.linear
        bsz, nq, seq, d = q.shape
        nkv = k.shape[1]
        fq, fk = grouped(map_q(q), nkv), map_k(k)
        if attn_mask is not None and seq > 1:
            fk = fk * attn_mask[:, 0, -1, -seq:].to(fk.dtype)[:, None, :, None]
        if seq == 1:
            out, _ = step(fq[:, :, :, 0], fk[:, :, 0], v[:, :, 0], (state.s, state.z))
            return out.reshape(bsz, nq, 1, d)
        out, (state.s, state.z) = parallel(fq, fk, v, (state.s, state.z))
        return out.reshape(bsz, nq, seq, d)

    def _new_cache(self, bsz: int, length: int) -> tuple[torch.Tensor, list[LinearState]]:
        """KV storage for the softmax layers [L_softmax, 2, B, kv, length, D] and a zero state per
        linear layer (its size independent of ``length``)."""
        max_kv = max((layer.n_kv_heads for layer in self.layers), default=1)
        storage = torch.zeros(
            len(self.softmax_layers),
            2,
            bsz,
            max_kv,
            length,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        states = []
        for layer in self.layers:
            if layer.linear is not None:
                features = int(layer.linear[1].weight.shape[-1]) * 2
                states.append(
                    LinearState(
                        torch.zeros(bsz, layer.n_kv_heads, features, self.head_dim, device=self.device),
                        torch.zeros(bsz, layer.n_kv_heads, features, device=self.device),
                    )
                )
        return storage, states

    @property
    def has_linear_attention(self) -> bool:
        return len(self.softmax_layers) != len(self.layers)

    def _forward_ragged(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rows: int,
        row_cache: list[tuple[torch.Tensor, torch.Tensor]],
        cur: int,
        row_mask: torch.Tensor | None,
        pieces: Sequence[PromptPiece],
        rope: tuple[torch.Tensor, torch.Tensor],
        row_starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One forward over a ragged set of tokens ``x`` [T, H] (continuous batching's mixed step).

        The first ``rows`` tokens are decode rows, one per sequence of ``row_cache`` (whose keys and
        values go to slot ``cur``, attending under ``row_mask``); the rest are prompt chunks, each
        attending causally to its own cache (``pieces``). Every projection runs once over all T
        tokens, so a prompt chunk rides along with a decode step instead of stalling it: the weights
        are read once for both. Attention, the only part that mixes tokens, runs per group.

        ``row_starts`` (each row's first position in the view): attend row by row over its own
        positions only, instead of all rows over the longest row's window under a mask. With one
        2,000-token row among short ones, the masked window made every row read 2,000 positions of
        keys and values: decode steps of 10 rows took 150-240 ms where short rows alone took 60-70
        (fp32 SmolLM2-135M, 2 AVX2 cores); the price is one attention call per row and layer.
        """
        groups: list[Any] = []
        if rows:
            groups.append(CachedRows(row_cache, cur, row_mask, row_starts, rows))
        groups.extend(pieces)
        return self._forward_groups(x, positions, groups, rope)

    def _forward_groups(self, x: torch.Tensor, positions: torch.Tensor, groups: Sequence[AttentionGroup],
                        rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """One forward over a ragged set of tokens ``x`` [T, H], the ``groups``' tokens in order:
        every projection runs once over all T tokens; attention, the only part that mixes tokens,
        runs per group (``AttentionGroup.attend``)."""
        if self.has_linear_attention:
            raise ValueError("continuous batching does not run linear-attention layers yet")
        cos_t, sin_t = rope
        cos = cos_t[positions][None, None]  # [1, 1, T, D]
        sin = sin_t[positions][None, None]
        total = x.shape[0]
        d = self.head_dim
        for layer_index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(h).view(total, -1, d)
            nq, nkv = layer.n_heads, layer.n_kv_heads
            qk = self._rotate(qkv[:, : nq + nkv].transpose(0, 1)[None], cos, sin)[0].transpose(
                0, 1
            )  # [T, Hq+Hkv, D]
            v = qkv[:, nq + nkv :]  # [T, Hkv, D]
            outs, at = [], 0
            for group in groups:
                end = at + group.length
                outs.append(group.attend(layer_index, qk[at:end, :nq], qk[at:end, nq:], v[at:end]))
                at = end
            x = x + layer.o(outs[0] if len(outs) == 1 else torch.cat(outs))
            x = x + self._mlp(layer, x)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        head = self.lm_head
        assert isinstance(head, _DenseT)
        if head.transposed:  # [hidden, vocab]: gather columns
            return head.weight.index_select(1, ids.reshape(-1)).t().reshape(*ids.shape, -1)
        return F.embedding(ids, head.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms_norm(hidden, self.final_norm)).float()

    def _region(self, name: str) -> contextlib.AbstractContextManager:
        """A labelled region: a torch.profiler range when profiling (the diagnosis), and on CUDA always
        an NVTX range too, so ``nsys profile variantbench run ...`` shows prefill and decode steps."""
        stack = contextlib.ExitStack()
        if self.profile_regions:
            stack.enter_context(torch.profiler.record_function(name))
        if self.device.type == "cuda":
            stack.enter_context(torch.cuda.nvtx.range(name))
        return stack

    def _cache_views(self, storage: torch.Tensor, states: Sequence[LinearState] = ()) -> list[Any]:
        """Per layer: (keys, values) views of the storage, [B, kv_heads, positions, head_dim], for a
        softmax layer (the storage holds those only), the next of ``states`` for a linear one."""
        views: list[Any] = []
        slot, linear = 0, iter(states)
        for layer in self.layers:
            if layer.linear is not None:
                views.append(next(linear))
            else:
                views.append(
                    (storage[slot, 0, :, : layer.n_kv_heads], storage[slot, 1, :, : layer.n_kv_heads])
                )
                slot += 1
        return views

    def _decode_step(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        storage: torch.Tensor,
        cur: int,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        states: Sequence[LinearState] = (),
    ) -> torch.Tensor:
        """One decode step for the batch: the previous tokens in, the next greedy tokens out."""
        x = self._embed(next_ids.unsqueeze(1))
        cache = self._cache_views(storage, states)
        hidden = self._forward(x, positions.unsqueeze(1), cache, cur, mask, False, rope)
        return self._logits(hidden[:, -1]).argmax(-1)

    def compile_decode_step(self, **options: object) -> None:
        """Run the decode step through ``torch.compile`` (Inductor) from now on.

        Weights stay static shapes (they never change); the batch size, the cache length and the
        step position become dynamic after the first change, and each generate call marks the
        cache length dynamic up front, so a run needs two graphs (batch 1 and batch > 1), which
        the backend compiles while loading, before anything is timed.
        """
        import torch._dynamo

        global _packed_linear_eager
        _packed_linear_eager = torch.compiler.disable(_packed_linear)
        if self.has_linear_attention:
            raise ValueError(
                "compile: linear-attention layers are not compiled yet (drop compile from the chain)"
            )
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        self._step = torch.compile(self._decode_step, dynamic=None, **options)  # type: ignore[assignment]
        self.compiled = True

    # ---- public ----------------------------------------------------------------------------

    @torch.inference_mode()
    def log_probs(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token log-probabilities at every position of one sequence: float32 [len(ids), vocab]."""
        if not ids:
            raise ValueError("empty sequence")
        seq = len(ids)
        x = self._embed(torch.tensor([list(ids)], dtype=torch.long, device=self.device))
        storage, states = self._new_cache(1, seq)
        cache = self._cache_views(storage, states)
        positions = torch.arange(seq, device=self.device).unsqueeze(0)
        hidden = self._forward(x, positions, cache, 0, None, seq > 1, self._rope_tables(seq))
        return torch.log_softmax(self._logits(hidden[0]), dim=-1)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int] | int,
        stop_ids: Sequence[int] = (),
        clock: Callable[[], int] = time.perf_counter_ns,
        start_ns: int | None = None,
    ) -> DecodeOutput:
        """Greedy-decode a batch of token-id prompts (left-padded internally).

        Each sequence stops at its own ``max_new_tokens`` or at a stop id (kept in the output);
        its timings record when each of its tokens became known.
        """
        bsz = len(prompts)
        if bsz == 0:
            return DecodeOutput([], [], 0, 0)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * bsz
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: at least one input token is required")
        t0 = clock() if start_ns is None else start_ns
        lengths = [len(p) for p in prompts]
        seq = max(lengths)
        budget = max(max_new_tokens)
        total = seq + budget
        dev = self.device
        ids = torch.zeros(bsz, seq, dtype=torch.long, device=dev)
        valid = torch.zeros(bsz, total, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            ids[b, seq - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=dev)
            valid[b, seq - len(p) :] = True
        padded = any(n != seq for n in lengths)
        storage, states = self._new_cache(bsz, total)
        cache = self._cache_views(storage, states)
        if self.compiled:
            torch._dynamo.mark_dynamic(storage, 4)  # the cache length differs from call to call
            torch._dynamo.mark_dynamic(valid, 1)

        positions = (valid[:, :seq].long().cumsum(-1) - 1).clamp(min=0)
        if padded:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()
            mask = causal.unsqueeze(0) & valid[:, None, :seq]
            # A padded query row would see no key at all (NaN); let it see itself. Its output is never used.
            mask = mask | torch.eye(seq, dtype=torch.bool, device=dev).unsqueeze(0)
            prefill_mask, causal_flag = mask.unsqueeze(1), False
        else:
            prefill_mask, causal_flag = None, seq > 1

        rope = self._rope_tables(total)
        with self._region("prefill"):
            x = self._embed(ids)
            hidden = self._forward(x, positions, cache, 0, prefill_mask, causal_flag, rope)
            next_ids = self._logits(hidden[:, -1]).argmax(-1)
        now = clock()
        prefill_ns = now - t0

        stop = set(int(s) for s in stop_ids)
        out: list[list[int]] = [[] for _ in range(bsz)]
        timings = [DecodeTimings(start_ns=t0) for _ in range(bsz)]
        done = [False] * bsz
        last_pos = positions[:, -1].clone()
        step = 0
        while True:
            tokens = next_ids.tolist()
            for b in range(bsz):
                if done[b]:
                    continue
                out[b].append(tokens[b])
                timings[b].token_ns.append(now)
                if tokens[b] in stop or len(out[b]) >= max_new_tokens[b]:
                    done[b] = True
                    timings[b].end_ns = now
            if all(done) or step + 1 >= budget:
                break
            cur = seq + step
            last_pos = last_pos + 1
            if padded or self.compiled:
                # the compiled step always takes a mask: one graph for padded and unpadded batches
                valid[:, cur] = True
                step_mask = valid[:, None, None, : cur + 1]
            else:
                step_mask = None
            with self._region("decode_step"):
                next_ids = self._step(next_ids, last_pos, storage, cur, step_mask, rope, states)
            now = clock()
            step += 1
        for t in timings:
            if not t.end_ns:
                t.end_ns = now
        return DecodeOutput(out, timings, prefill_ns, step)


def _out_features(module: nn.Module) -> int:
    if hasattr(module, "out_features"):
        return int(module.out_features)
    weight = module.weight() if callable(getattr(module, "weight", None)) else module.weight
    return int(weight.shape[0])


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "gelu": F.gelu,
        "relu": F.relu,
        "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; known: {', '.join(sorted(table))}")
    return table[name]
