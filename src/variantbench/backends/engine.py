"""A lean greedy decoder over a static KV cache, for every registered model family.

The block it runs is read from the model's family (``variantbench.families``: Llama, Mistral,
Qwen2/3, Gemma 2/3, Phi-3, OLMo 2, Granite, Qwen2-MoE, Mixtral), each proven against transformers'
forward by ``tests/test_families.py``; the layout choices below were made on Llama-shaped blocks
and hold for all of them.

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
import functools
import time
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
import torch.nn.functional as F

from variantbench.backends import attention_kernel, bf16_kernel, fused_decode, norm_kernel

# bf16/fp16 weights on a CPU without instructions for them (issue 42): oneDNN's bf16 product then
# costs about 205 us per row of a 576x3072 weight, so a 512-token prompt took 106 ms against 14.6 ms
# computed in fp32 from the weight widened for the call (fp32 weights: 14.1 ms), and bf16 prefill ran
# at 0.18x fp32's in the default run (2 AVX2 cores). Widening costs more than it saves below a few
# rows. One projection timed alone (its weight in cache) crossed over at 8 rows (1,625 us bf16, 1,174
# widened), but a decode step streams 30 layers' weights from DRAM and widening writes and reads an
# fp32 copy of each: bf16 batch-8 decode measured 34.2 tokens/s widened against 47.3 native (median
# of 4 interleaved pairs), batch 16 72 against 59 and batch 32 109 against 51 (3 pairs each). So
UPCAST_MIN_ROWS = 16
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.cache
def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype``'s matrix products (fp32 always)."""
    if dtype not in NATIVE_FLAGS:
        return True
    from variantbench.environment import cpu_flags

    return any(flag in cpu_flags() for flag in NATIVE_FLAGS[dtype])


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Inductor lowers this op only for weights it froze as graph constants; ours live outside any
# module, so a compiled step (the ``compile`` variant) ran into an AssertionError at load on its
# first multi-row call. It runs the op eagerly instead, a graph break per projection. Made by
# ``compile_decode_step``, not at import: ``torch.compiler.disable`` imports torch._dynamo and
# sympy, 76 MiB of RSS in every process that imports this module (a llama.cpp server among them).
_packed_linear_eager: Callable[..., torch.Tensor] = _packed_linear


class _DenseT:
    """Fused dense projection over ``cat(weights)``: the row-major ``[N, K]`` weight (its plain copy)
    and, for float32 on the CPU, a oneDNN-packed copy for more than one row.

    One row (a batch-1 decode step, where the fused step (``fused_decode.py``) does not take it):
    float32 through the fused library's row product (each thread dots the row with its share of the
    weight's rows: 33.5 GB/s over SmolLM2's weights, against 23.7 for the split-K ``bmm`` over a
    transposed copy the engine ran before, and MKL's ``x @ Wt`` on one thread at 16.2); bf16 through
    our kernel where it timed faster for the shape (``bf16_kernel.py``: oneDNN read bf16 weights at
    27% of the bandwidth at one row, and bf16 decoded at 0.94x fp32's), else oneDNN's ``F.linear``.

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

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        with torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
            self.out_features, self.in_features = weight.shape
            self.fp32 = weight.dtype == torch.float32
            on_cpu = weight.device.type == "cpu"
            self.pack = on_cpu and self.fp32 and torch.backends.mkldnn.is_available()
            # reduced precision with no instructions for it: prompt rows computed in fp32 (upcast_rows)
            self.upcast_rows = None if not on_cpu or native_on_cpu(weight.dtype) else UPCAST_MIN_ROWS
            # bf16 at a decode step's rows: our kernel where it beats oneDNN (bf16_kernel.py)
            self.bf16_kernel = on_cpu and not self.fp32 and bf16_kernel.usable(weight)
            # fp32 at one row: the fused library's row product (None: no compiler, or switched off)
            self.row_product = fused_decode.row_product() if on_cpu and self.fp32 else None
            self.packed: torch.Tensor | None = None  # the oneDNN copy
            self.weight: torch.Tensor | None = weight.contiguous()  # the plain copy (one row, lookups)
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

    def _ensure_packed(self) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        return self.packed

    def step_weights(self, dtype: torch.dtype) -> fused_decode.Weights | None:
        """The plain copy as the fused decode step reads it (fused_decode.StepWeights), if kept."""
        if self.weight is None:
            return None
        return fused_decode.dense_weights(self.weight, self.bias, dtype)

    def drop_plain(self) -> bool:
        """Keep only the packed copy (every row count runs through it); False where there is none."""
        if not self.pack:
            return False
        self._ensure_packed()
        self.weight = None
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.fp32:
            if (
                self.bf16_kernel
                and rows <= bf16_kernel.MAX_ROWS
                and self.weight is not None
                and not torch.compiler.is_compiling()
                and bf16_kernel.choice(self.weight, self.bias, rows) == "kernel"
            ):
                run, _ = bf16_kernel.kernel()
                assert run is not None
                out = run(x.reshape(rows, self.in_features).contiguous(), self.weight, self.bias)
                return out.view(*x.shape[:-1], self.out_features)
            if self.upcast_rows is not None and rows >= self.upcast_rows and self.weight is not None:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if self.pack and (rows > 1 or self.weight is None):
            self._ensure_packed()  # made on the first multi-row call
            linear = _packed_linear_eager if torch.compiler.is_compiling() else _packed_linear
            out = linear(x.reshape(rows, self.in_features), self.packed, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if rows == 1 and self.row_product is not None and not torch.compiler.is_compiling():
            out = self.row_product(x.reshape(self.in_features).contiguous(), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


class _Modules:
    """Projections that are not plain dense layers: call each module and join the outputs."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)

    def step_weights(self, dtype: torch.dtype) -> fused_decode.Weights | None:
        """One fused module's weights as the fused decode step reads them (int8's q8 copy), or None."""
        return fused_decode.module_weights(self.modules[0], dtype) if len(self.modules) == 1 else None

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


class Norm:
    """An RMSNorm as a family computes it: the statistics in float32; the scale (offset folded in:
    Gemma's 1 + w) applied after the cast to the model's dtype (Llama) or before it (``upcast``:
    Gemma, OLMo 2). On the CPU one C call (``norm_kernel.py``); elsewhere ``torch.rms_norm`` in
    float32, torch's ops in bf16."""

    def __init__(self, module: nn.Module, offset: float = 0.0, upcast: bool = False) -> None:
        weight = module.weight.detach()
        self.upcast = upcast
        self.weight = (weight.float() + offset) if upcast else (weight + offset if offset else weight.clone())
        eps = getattr(module, "variance_epsilon", None)
        self.eps = float(eps if eps is not None else module.eps)
        self.kernel, _ = norm_kernel.kernel() if self.weight.device.type == "cpu" else (None, "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # one C call on the CPU (norm_kernel.py: 2.4 us against torch's 9.4 us a decode-step row)
        if (
            self.kernel is not None
            and not torch.compiler.is_compiling()
            and norm_kernel.applies(x := x.contiguous(), self.weight, self.upcast)
        ):
            return self.kernel(x, self.weight, self.eps, self.upcast)
        return self.torch_ops(x)

    def torch_ops(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch's ops (on CUDA, in a compiled step, and where the kernel is not built)."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.upcast:
            return (x32 * self.weight).to(x.dtype)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class AttentionSpec:
    """How a layer's softmax attention differs from plain SDPA: its scale (None: head_dim^-1/2),
    a soft-cap on the scores (Gemma 2), a sliding window (a query sees itself and the ``window - 1``
    positions before it, as transformers' ``sliding_window_overlay``)."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.window is None

    def unwindowed(self) -> AttentionSpec:
        return AttentionSpec(self.scale, self.softcap, None)


PLAIN_ATTENTION = AttentionSpec()


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec = PLAIN_ATTENTION, *,
    mask: torch.Tensor | None = None, causal: bool = False, q_index: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Softmax attention of ``q`` [B, Hq, S, D] over ``k``, ``v`` [B, Hkv, K, D] as the layer's spec says.

    ``mask`` (bool, True: may attend) broadcasts to [B, H, S, K]; ``causal``: query i sits at key
    index K - S + i; ``q_index`` [S or 1]: each query's key index where that is not so (grouped
    decode rows, prompt chunks), needed for a window. A plain spec is one SDPA call, the fused path
    every Llama-shaped layer has always taken; a soft-capped one is computed as transformers'
    eager attention does (scores, cap, mask, float32 softmax), which is all transformers offers for it."""
    if spec.plain:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=spec.scale, enable_gqa=enable_gqa
        )
    n_keys, n_q = k.shape[-2], q.shape[-2]
    keys = torch.arange(n_keys, device=q.device)
    if q_index is None:
        q_index = torch.arange(n_keys - n_q, n_keys, device=q.device)
    allowed: torch.Tensor | None = None
    if spec.window is not None:
        allowed = keys[None, :] > q_index[:, None] - spec.window
    if causal:
        before = keys[None, :] <= q_index[:, None]
        allowed = before if allowed is None else allowed & before
    if mask is not None:
        allowed = mask if allowed is None else mask & allowed
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=spec.scale, enable_gqa=enable_gqa
        )
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


class Experts:
    """A mixture-of-experts MLP: a softmax router, the top-k experts of each token (weights
    renormalized where the family says), each a gated MLP, and an optional shared expert scaled by
    a sigmoid gate. Computed expert by expert over the tokens routed to it, as transformers does."""

    def __init__(
        self, mlp: nn.Module, style: Any, config: Any, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.router = mlp.gate.weight.detach().clone()
        self.gate_up = mlp.experts.gate_up_proj.detach().clone()  # [E, 2I, H]
        self.down = mlp.experts.down_proj.detach().clone()  # [E, H, I]
        self.top_k = int(config.num_experts_per_tok)
        self.normalize = bool(getattr(config, style.normalize_key)) if style.normalize_key else True
        self.cast_weights = style.weights_in_model_dtype
        self.act = act
        self.shared: tuple[Callable[..., torch.Tensor], ...] | None = None
        if style.shared_expert:
            shared = mlp.shared_expert
            self.shared = (
                _projection([shared.gate_proj, shared.up_proj]),
                _projection([shared.down_proj]),
                _projection([mlp.shared_expert_gate]),
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat, self.router)
        top, chosen = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(-1, keepdim=True)
        if self.cast_weights:
            top = top.to(logits.dtype)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(flat[token], self.gate_up[e]).chunk(2, dim=-1)
            h = F.linear(self.act(gate) * up, self.down[e]) * top[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        if self.shared is not None:
            gate_up, down, gate_of = self.shared
            gu = gate_up(flat)
            inter = gu.shape[-1] // 2
            out = out + torch.sigmoid(gate_of(flat)) * down(self.act(gu[..., :inter]) * gu[..., inter:])
        return out.view(x.shape)


@dataclass
class _Layer:
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None
    down: Callable[[torch.Tensor], torch.Tensor] | None
    n_heads: int
    n_kv_heads: int
    # the block's norms by role (None: the family has none there; see families/base.py)
    attn_in: Norm | None = None
    attn_out: Norm | None = None
    mlp_in: Norm | None = None
    mlp_out: Norm | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    qk_norm_per_head: bool = True
    attention: AttentionSpec = PLAIN_ATTENTION
    rope: str | None = None  # which rotary table (Gemma 3: local and global layers differ)
    experts: Experts | None = None
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
    layer ``li`` and the layer's ``AttentionSpec``, stores the keys and values where the group keeps
    them, and returns the attention output [T, q_heads * D]. Keys of a sequence sit at consecutive
    positions of its store, so a window is a distance in that store. Where keys live (one contiguous cache, a paged block pool) is the
    group's business; the forward only runs the projections once over every group's tokens."""

    length: int

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec = PLAIN_ATTENTION) -> torch.Tensor: ...  # fmt: skip


@dataclass
class PromptPiece:
    """A chunk of one prompt in a ragged forward: tokens ``start:start+length`` of a sequence whose
    per-layer (keys, values) views ``cache`` ([1, kv_heads, positions, head_dim]) hold its earlier
    tokens. ``mask`` [1, 1, length, start+length] (None: plain causal from position 0)."""

    cache: list[tuple[torch.Tensor, torch.Tensor]]
    start: int
    length: int
    mask: torch.Tensor | None = None

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec = PLAIN_ATTENTION) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = self.cache[li]
        end = self.start + self.length
        k_cache[0, :, self.start : end] = k.transpose(0, 1)
        v_cache[0, :, self.start : end] = v.transpose(0, 1)
        nq, nkv = q.shape[1], k.shape[1]
        attn = attend(
            q.transpose(0, 1)[None], k_cache[:, :, :end], v_cache[:, :, :end], spec, mask=self.mask,
            causal=self.mask is None and self.length > 1, enable_gqa=nq != nkv,
            q_index=None if spec.plain else torch.arange(self.start, end, device=q.device),
        )  # fmt: skip
        return attn[0].transpose(0, 1).reshape(self.length, -1)


@dataclass
class CachedRows:
    """Decode rows of one shared cache (``row_cache`` per layer, [rows, kv_heads, positions, D]):
    each writes its new key/value at ``cur`` and attends under ``row_mask``, or row by row from
    ``row_starts`` (see ``Decoder._forward_ragged``)."""

    row_cache: list[tuple[torch.Tensor, torch.Tensor]]
    cur: int
    row_mask: torch.Tensor | None
    row_starts: Sequence[int] | None
    length: int

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec = PLAIN_ATTENTION) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = self.row_cache[li]
        cur, rows = self.cur, self.length
        k_cache[:, :, cur] = k
        v_cache[:, :, cur] = v
        nkv, d = k.shape[1], k.shape[2]
        q = q.reshape(rows, nkv, -1, d)  # grouped: each kv head with its query heads
        if self.row_starts is None:
            attn = attend(
                q, k_cache[:, :, : cur + 1], v_cache[:, :, : cur + 1], spec, mask=self.row_mask,
                q_index=None if spec.plain else torch.tensor([cur], device=q.device),
            )  # fmt: skip
        else:  # each row over its own positions, the window's included
            low = 0 if spec.window is None else cur + 1 - spec.window
            rest = spec.unwindowed()
            attn = torch.cat([
                attend(q[i : i + 1], k_cache[i : i + 1, :, max(a, low) : cur + 1],
                       v_cache[i : i + 1, :, max(a, low) : cur + 1], rest)
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


class UnsupportedModel(ValueError):
    """The model's architecture is not one the engine runs (no registered family, or a part of it
    the family file does not describe)."""


def _config_value(config: Any, key: str | None) -> Any:
    return None if key is None else getattr(config, key, None)


class Decoder:
    """Greedy decoding for any model of a registered family (``families``).

    The decoder takes over the model's weights in a decode-friendly layout, reading the block
    through the family's description, not attribute names; the original module tree can be
    dropped afterwards.
    """

    def __init__(self, model: nn.Module, family: Any = None) -> None:
        from variantbench.families import family_for

        config = model.config
        family = family or family_for(config)
        if family is None:
            raise UnsupportedModel(f"no engine family for model type {getattr(config, 'model_type', '?')!r}")
        self.family = family
        inner = model.model
        self.config = config
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.act = _activation(_config_value(config, family.activation_key) or "silu")
        embed = inner.embed_tokens.weight.detach()
        self.dtype = embed.dtype
        self.device = embed.device
        self.final_norm = Norm(inner.norm, family.norm_offset, family.norm_upcast)
        self.lm_head = _projection([model.lm_head])
        scale = _config_value(config, family.embed_scale) if family.embed_scale != "sqrt_hidden" else (
            float(torch.tensor(config.hidden_size**0.5, dtype=self.dtype))  # as Gemma: rounded to the dtype
        )  # fmt: skip
        self.embed_scale = float(scale) if scale is not None and scale != 1 else None
        residual = _config_value(config, family.residual_scale_key)
        self.residual_scale = float(residual) if residual is not None and residual != 1 else None
        self.final_softcap = _config_value(config, family.final_softcap_key)
        self.logit_divisor = _config_value(config, family.logit_divisor_key)
        # Tied embeddings: look tokens up in the head's own (possibly transposed) copy instead of
        # keeping a second table. Everything else is copied, so no tensor keeps the loaded
        # checkpoint (often a memory map) alive once the caller drops the model.
        head_weight = getattr(model.lm_head, "weight", None)
        tied = isinstance(head_weight, torch.Tensor) and head_weight is inner.embed_tokens.weight
        self._embed_from_head = tied and isinstance(self.lm_head, _DenseT)
        self.embed = None if self._embed_from_head else embed.clone()
        self.rotary = inner.rotary_emb
        self.layers: list[_Layer] = [self._layer(i, block) for i, block in enumerate(inner.layers)]
        self.softmax_layers = [i for i, layer in enumerate(self.layers) if layer.linear is None]
        self._rope_cache: dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._step = self._decode_step
        self.compiled = False
        # "eager": the step as Python calls it; "cuda-graphs": replayed from a captured graph
        # (cuda_graphs.py; ``use_cuda_graphs``); "static": the graphs' fixed-shape step run eagerly
        self.decode_mode = "eager"
        self._graphs: Any = None
        self.profile_regions = False  # label prefill and decode steps for torch.profiler (diagnosis)
        # a decode step's attention in one C call on the CPU (attention_kernel.py)
        self._attn_kernel = attention_kernel.kernel()[0] if self.device.type == "cpu" else None
        # a float32 batch-1 decode step in one C call for the whole stack (fused_decode.py)
        self._fused, self.fused_how = fused_decode.plan(self)

    def _layer(self, index: int, block: nn.Module) -> _Layer:
        family, config = self.family, self.config
        attn, mlp = block.self_attn, block.mlp

        def norm(module: nn.Module | None) -> Norm | None:
            return None if module is None else Norm(module, family.norm_offset, family.norm_upcast)

        try:
            qkv_modules = [getattr(attn, name) for name in family.qkv]
            norms = {role: norm(getattr(block, name)) for role, name in family.norms.items()}
            qk_norms = (norm(attn.q_norm), norm(attn.k_norm)) if family.qk_norm else (None, None)
            if family.experts is not None and isinstance(getattr(mlp, "experts", None), nn.Module):
                experts, gate_up, down = Experts(mlp, family.experts, config, self.act), None, None
            else:
                experts = None
                gate_up = _projection([getattr(mlp, name) for name in family.gate_up])
                down = _projection([mlp.down_proj])
        except AttributeError as exc:
            raise UnsupportedModel(
                f"{type(block).__name__} of family {family.name} has no {exc.name or exc}: the family file "
                "does not describe this checkpoint"
            ) from None
        if len(qkv_modules) == 3:
            n_heads = _out_features(qkv_modules[0]) // self.head_dim
            n_kv = _out_features(qkv_modules[1]) // self.head_dim
        else:
            n_heads = int(config.num_attention_heads)
            n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[index] if layer_types else None
        sliding = (
            bool(config.sliding_window) if family.sliding_every_layer else layer_type == "sliding_attention"
        )
        window = int(config.sliding_window) if sliding else None
        scale = _config_value(config, family.attn_scale_key)
        inv_sqrt = _config_value(config, family.attn_scale_inv_sqrt_key)
        if inv_sqrt is not None:
            scale = float(inv_sqrt) ** -0.5
        return _Layer(
            qkv=_projection(qkv_modules),
            o=_projection([attn.o_proj]),
            gate_up=gate_up,
            down=down,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            q_norm=qk_norms[0],
            k_norm=qk_norms[1],
            qk_norm_per_head=family.qk_norm == "head",
            attention=AttentionSpec(
                scale=None if scale is None else float(scale),
                softcap=_config_value(config, family.attn_softcap_key),
                window=window,
            ),
            rope=layer_type if family.rope_by_layer_type else None,
            experts=experts,
            linear=(attn.feature_q, attn.feature_k) if isinstance(attn, LinearAttentionBlock) else None,
            **norms,
        )

    def drop_plain_copies(self) -> int:
        """Each layer keeps only its packed weights (see ``_DenseT``); the vocabulary head keeps
        both, as tied embeddings look tokens up in its plain copy. Returns the bytes freed.
        A compiled step keeps both: the packed op runs outside its graph, so every row would."""
        if self.compiled:
            return 0
        freed = 0
        for layer in self.layers:
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):  # None in an MoE layer
                if isinstance(proj, _DenseT) and proj.weight is not None:
                    size = proj.weight.numel() * proj.weight.element_size()
                    freed += size if proj.drop_plain() else 0
        if freed:  # the fused step reads the plain copies
            self._fused, self.fused_how = None, "the plain weights were dropped (served with one copy)"
        return freed

    # ---- building blocks -------------------------------------------------------------------

    def _rope_tables(self, length: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, signed sin) [positions, rotary dims] per rotary table the layers use (one, or
        Gemma 3's local and global), from transformers' own rotary embedding: the config's RoPE
        variant (llama3, linear, yarn, longrope, partial rotary) is computed as transformers does."""
        if self._rope_cache is None or next(iter(self._rope_cache.values()))[0].shape[0] < length:
            size = max(length, 256)
            positions = torch.arange(size, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
            for key in dict.fromkeys(layer.rope for layer in self.layers):
                with torch.no_grad():
                    cos, sin = self._rope_rows(key, probe, positions)
                sin = sin[0].to(self.dtype).clone()
                sin[..., : sin.shape[-1] // 2] *= -1
                tables[key] = (cos[0].to(self.dtype), sin)
            self._rope_cache = tables
        return self._rope_cache

    def _rope_rows(
        self, key: str | None, probe: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` [1, N] for one rotary table, each row as transformers computes
        the token at that position when it is decoded.

        Two RoPE variants depend on the length of the forward they run in: "dynamic" (NTK) rescales
        beyond the original context by the longest position seen, "longrope" (Phi-3) switches to
        its long factors once a forward passes the original context. Rows below the original context
        come from one call (unscaled, the short factors), rows past it from calls ending at their own
        position (longrope: one call; dynamic: one a row, in increasing order as transformers grows
        its cache). So a decode step matches transformers exactly; a prompt prefilled past the original
        context does not (transformers rotates it whole with the frequencies of its last position)."""
        rotary = self.rotary
        call = (lambda pos: rotary(probe, pos)) if key is None else (lambda pos: rotary(probe, pos, key))
        kinds = getattr(rotary, "rope_type", "default")
        kind = kinds.get(key, "default") if isinstance(kinds, dict) else kinds
        params = getattr(self.config, "rope_parameters", None) or {}
        params = params.get(key, params) if key is not None else params
        if "dynamic" in str(kind):
            original = int(getattr(rotary, "original_max_seq_len", 0) or 0)
        elif kind == "longrope":
            original = int(params.get("original_max_position_embeddings") or 0)
        else:
            original = 0
        size = positions.shape[-1]
        if not original or size <= original:
            return call(positions)
        if kind == "longrope":
            parts = [call(positions[:, :original]), call(positions[:, original:])]
        else:  # a first short call resets what an earlier, longer forward left in the module
            call(positions[:, :1])
            parts = [call(positions[:, :original])] + [
                call(positions[:, p : p + 1]) for p in range(original, size)
            ]
        return torch.cat([c for c, _ in parts], 1), torch.cat([s for _, s in parts], 1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers' x*cos + rotate_half(x)*sin, with rotate_half(x) = cat(-x2, x1)
        # = roll(x, D/2) * [-1.., +1..]: the sign lives in the precomputed sin table. Partial
        # rotary (Phi-4-mini): the table covers the first dims only; the rest pass unchanged.
        dims = cos.shape[-1]
        if dims == x.shape[-1]:
            return torch.addcmul(x * cos, x.roll(dims // 2, -1), signed_sin)
        head = x[..., :dims]
        return torch.cat([torch.addcmul(head * cos, head.roll(dims // 2, -1), signed_sin), x[..., dims:]], -1)

    def _split_qkv(self, layer: _Layer, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused projection's output [..., (Hq + 2 Hkv) * D] as queries and keys [..., Hq + Hkv, D]
        (q/k-normed where the family norms them) and values [..., Hkv, D]."""
        d, nq, nkv = self.head_dim, layer.n_heads, layer.n_kv_heads
        lead = qkv.shape[:-1]
        if layer.q_norm is None or layer.k_norm is None:
            heads = qkv.view(*lead, -1, d)
            return heads[..., : nq + nkv, :], heads[..., nq + nkv :, :]
        q, k, v = qkv[..., : nq * d], qkv[..., nq * d : (nq + nkv) * d], qkv[..., (nq + nkv) * d :]
        if layer.qk_norm_per_head:
            q, k = layer.q_norm(q.reshape(*lead, nq, d)), layer.k_norm(k.reshape(*lead, nkv, d))
        else:
            q, k = layer.q_norm(q).view(*lead, nq, d), layer.k_norm(k).view(*lead, nkv, d)
        return torch.cat([q, k], -2), v.reshape(*lead, nkv, d)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post: Norm | None) -> torch.Tensor:
        if post is not None:
            out = post(out)
        if self.residual_scale is not None:
            out = out * self.residual_scale
        return x + out

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP half of a block, its residual sum included."""
        h = layer.mlp_in(x) if layer.mlp_in is not None else x
        if layer.experts is not None:
            out = layer.experts(h)
        else:
            assert layer.gate_up is not None and layer.down is not None
            gu = layer.gate_up(h)
            inter = gu.shape[-1] // 2
            out = layer.down(self.act(gu[..., :inter]) * gu[..., inter:])
        return self._residual(x, out, layer.mlp_out)

    @staticmethod
    def _rope_at(rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                 shape: Callable[[torch.Tensor], torch.Tensor]) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        return {key: (shape(cos[positions]), shape(sin[positions])) for key, (cos, sin) in rope.items()}

    def _forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run all blocks on ``x`` [B, S, H] at cache slots ``start:start+S``; return hidden states.

        ``rope`` is ``_rope_tables(n)`` for some ``n`` past every position (made outside, so this
        function has no side effects and ``torch.compile`` can trace it whole).

        ``slot`` (a one-element tensor; one token per row): the cache slot as a tensor instead of
        ``start``, and attention over the whole cache under ``attn_mask``: every shape is then the
        same from step to step, as a CUDA graph's replay needs (``_static_step``).
        """
        bsz, seq, _ = x.shape
        tables = self._rope_at(rope, positions, lambda t: t.unsqueeze(1))  # [B, 1, S, D]
        end = start + seq
        d = self.head_dim
        q_index: torch.Tensor | None = None
        for layer, entry in zip(self.layers, cache, strict=True):
            h = layer.attn_in(x) if layer.attn_in is not None else x
            qk, v = self._split_qkv(layer, layer.qkv(h).view(bsz, seq, -1))
            nq, nkv = layer.n_heads, layer.n_kv_heads
            # RoPE on queries and keys in one go: [B, S, Hq+Hkv, D] -> [B, Hq+Hkv, S, D]
            qk = self._rotate(qk.transpose(1, 2), *tables[layer.rope])
            q, k = qk[:, :nq], qk[:, nq:]
            v = v.transpose(1, 2)
            if layer.linear is not None:
                assert isinstance(entry, LinearState)
                # a named region while profiling, so the diagnosis counts it as attention
                with self._region("linear_attention") if self.profile_regions else contextlib.nullcontext():
                    attn = self._linear_attention(layer, q, k, v, entry, attn_mask)
                x = self._residual(x, layer.o(attn.transpose(1, 2).reshape(bsz, seq, nq * d).to(x.dtype)),
                                   layer.attn_out)  # fmt: skip
                x = self._mlp(layer, x)
                continue
            k_cache, v_cache = entry
            if slot is None:
                k_cache[:, :, start:end] = k
                v_cache[:, :, start:end] = v
                keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
            else:
                k_cache.index_copy_(2, slot, k)
                v_cache.index_copy_(2, slot, v)
                keys, values = k_cache, v_cache
            spec = layer.attention
            if not spec.plain and q_index is None:
                q_index = slot if slot is not None else torch.arange(start, end, device=x.device)
            attn = self._kernel_attention(q, keys, values, spec) if seq == 1 and attn_mask is None else None
            if attn is None:
                if seq == 1 and nq != nkv:
                    # Decode with grouped-query attention: the G query heads of a group become G query
                    # rows against their one shared KV head, so the cache is never expanded (copied)
                    # to Hq heads; the (key-only) mask broadcasts over the rows.
                    grouped = q.reshape(bsz, nkv, nq // nkv, d)
                    if spec.plain:  # SDPA inline: a call here is a frame of its own under torch.compile,
                        # and its guards recompiled the compiled step at a new batch size
                        attn = F.scaled_dot_product_attention(
                            grouped, keys, values, attn_mask=attn_mask, scale=spec.scale
                        )
                    else:
                        attn = attend(grouped, keys, values, spec, mask=attn_mask, q_index=q_index)
                    attn = attn.reshape(bsz, nq, 1, d)
                elif spec.plain:
                    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                                          scale=spec.scale, enable_gqa=nq != nkv)  # fmt: skip
                else:
                    attn = attend(q, keys, values, spec, mask=attn_mask, causal=is_causal, q_index=q_index,
                                  enable_gqa=nq != nkv)  # fmt: skip
            x = self._residual(x, layer.o(attn.transpose(1, 2).reshape(bsz, seq, nq * d)), layer.attn_out)
            x = self._mlp(layer, x)
        return x

    def _kernel_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor | None:
        """One new query a row [B, Hq, 1, D] over unmasked ``keys``/``values`` [B, Hkv, T, D] through
        the C kernel (its G = Hq / Hkv grouped heads against their one KV head), or None where it does
        not apply: a soft-capped or windowed layer, another device or dtype, a compiled step."""
        if self._attn_kernel is None or not spec.plain or torch.compiler.is_compiling():
            return None
        bsz, nq, _, d = q.shape
        grouped = q.reshape(bsz, keys.shape[1], nq // keys.shape[1], d).contiguous()
        if not attention_kernel.usable(grouped, keys, values):
            return None
        scale = spec.scale if spec.scale is not None else d**-0.5
        return self._attn_kernel(grouped, keys, values, scale).view(bsz, nq, 1, d)

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
    def batch1_step(self) -> str:
        """How a batch-1 decode step runs, for the variant's info."""
        if self._fused is not None:
            return f"one C call for the layer stack ({self.fused_how})"
        return f"operator by operator ({self.fused_how})"

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
                        rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """One forward over a ragged set of tokens ``x`` [T, H], the ``groups``' tokens in order:
        every projection runs once over all T tokens; attention, the only part that mixes tokens,
        runs per group (``AttentionGroup.attend``)."""
        if self.has_linear_attention:
            raise ValueError("continuous batching does not run linear-attention layers yet")
        tables = self._rope_at(rope, positions, lambda t: t[None, None])  # [1, 1, T, D]
        total = x.shape[0]
        for layer_index, layer in enumerate(self.layers):
            h = layer.attn_in(x) if layer.attn_in is not None else x
            qk, v = self._split_qkv(layer, layer.qkv(h).view(total, -1))  # [T, Hq+Hkv, D], [T, Hkv, D]
            nq = layer.n_heads
            qk = self._rotate(qk.transpose(0, 1)[None], *tables[layer.rope])[0].transpose(0, 1)
            outs, at = [], 0
            for group in groups:
                end = at + group.length
                outs.append(
                    group.attend(layer_index, qk[at:end, :nq], qk[at:end, nq:], v[at:end], layer.attention)
                )
                at = end
            x = self._residual(x, layer.o(outs[0] if len(outs) == 1 else torch.cat(outs)), layer.attn_out)
            x = self._mlp(layer, x)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = F.embedding(ids, self.embed)
        else:
            head = self.lm_head
            assert isinstance(head, _DenseT)
            x = F.embedding(ids, head.weight)
        return x if self.embed_scale is None else x * self.embed_scale

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._finish_logits(self.lm_head(self.final_norm(hidden)).float())

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

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

    def _fused_logits(self, x: torch.Tensor, storage: torch.Tensor, cur: int, positions: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """The logits [1, vocab] of one token ``x`` [1, 1, H] at slot ``cur`` through the fused C step
        (``fused_decode.py``), or None where the step runs operator by operator: a batch, a mask, a
        compiled step, or the diagnosis's profiler (it files time by operator family)."""
        if (
            self._fused is None
            or x.shape[0] != 1
            or mask is not None
            or self.profile_regions
            or torch.compiler.is_compiling()
        ):
            return None
        return self._finish_logits(self._fused.step(x, storage, cur, int(positions.reshape(-1)[0])))

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
        fused = self._fused_logits(x, storage, cur, positions, mask)
        if fused is not None:
            return fused.argmax(-1)
        cache = self._cache_views(storage, states)
        hidden = self._forward(x, positions.unsqueeze(1), cache, cur, mask, False, rope)
        return self._logits(hidden[:, -1]).argmax(-1)

    def _static_step(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        slot: torch.Tensor,
        storage: torch.Tensor,
        valid: torch.Tensor,
        rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The decode step with every shape and address fixed, what a CUDA graph captures and
        replays (``cuda_graphs.GraphedDecode``): the step's cache slot is a tensor, and attention
        reads the whole cache under ``valid`` [B, length] instead of a slice that grows each step.
        Same tokens as ``_decode_step`` (tests/test_cuda_logic.py runs both on the CPU)."""
        x = self._embed(next_ids.unsqueeze(1))
        cache = self._cache_views(storage)
        hidden = self._forward(
            x, positions.unsqueeze(1), cache, 0, valid[:, None, None, :], False, rope, slot
        )
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

    def use_cuda_graphs(self, on: bool = True, static_on_cpu: bool = False) -> str | None:
        """Decode from CUDA graphs from now on (or eagerly, ``on=False``); returns why not where the
        model cannot be captured (it then decodes eagerly). ``static_on_cpu``: run the graphs'
        fixed-shape step on the CPU, uncaptured (what the tests compare with the eager step)."""
        from variantbench.backends import cuda_graphs

        self.decode_mode, self._graphs = "eager", None
        if not on:
            return None
        why = cuda_graphs.refusal(self, capture=not (static_on_cpu and self.device.type == "cpu"))
        if why is None:
            capture = self.device.type == "cuda"
            self._graphs = cuda_graphs.GraphCache(self, capture=capture)
            self.decode_mode = "cuda-graphs" if capture else "static"
        return why

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
    def teacher_forced_logits(
        self, prompt: Sequence[int], forced: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The prompt's prefill logits at every position [len(prompt), vocab], then one decode step
        per ``forced`` token fed in turn (each step's logits), through the same forward a generation
        runs: what a parity check compares with another implementation's per-step logits without
        letting a first difference change every later input."""
        total = len(prompt) + len(forced)
        storage, states = self._new_cache(1, total)
        cache = self._cache_views(storage, states)
        rope = self._rope_tables(total)
        ids = torch.tensor([list(prompt)], device=self.device)
        hidden = self._forward(self._embed(ids), torch.arange(len(prompt), device=self.device)[None], cache, 0, None,
                               len(prompt) > 1, rope)  # fmt: skip
        prefill = self._logits(hidden[0])
        steps = [prefill[-1]]
        for i, token in enumerate(list(forced)[:-1]):
            at = len(prompt) + i
            x = self._embed(torch.tensor([[token]], device=self.device))
            position = torch.tensor([[at]], device=self.device)
            fused = self._fused_logits(x, storage, at, position, None)
            if fused is not None:
                steps.append(fused[0])
                continue
            hidden = self._forward(x, position, cache, at, None, False, rope)
            steps.append(self._logits(hidden[0, -1]))
        return prefill, steps

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
        from variantbench.backends.device_clock import phase_clock

        t0 = clock() if start_ns is None else start_ns
        dev = self.device
        # marks in the device's stream (CUDA events), resolved to host ns at the end: a host clock
        # read after an asynchronous kernel would time its launch (device_clock.py)
        marks = phase_clock(dev, clock)
        lengths = [len(p) for p in prompts]
        seq = max(lengths)
        budget = max(max_new_tokens)
        total = seq + budget
        graphed = self._graphs.get(bsz, total) if self._graphs is not None and budget > 1 else None
        ids = torch.zeros(bsz, seq, dtype=torch.long, device=dev)
        if graphed is not None:  # the graph's own cache and mask, reused from call to call
            storage, states = graphed.storage, []
            graphed.valid.zero_()
            valid = graphed.valid[:, :total]
        else:
            storage, states = self._new_cache(bsz, total)
            valid = torch.zeros(bsz, total, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            ids[b, seq - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=dev)
            valid[b, seq - len(p) :] = True
        if graphed is not None:
            valid[:, seq:] = False
        padded = any(n != seq for n in lengths)
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
        now = marks.mark()

        stop = set(int(s) for s in stop_ids)
        out: list[list[int]] = [[] for _ in range(bsz)]
        token_marks: list[list[int]] = [[] for _ in range(bsz)]
        end_marks: list[int | None] = [None] * bsz
        done = [False] * bsz
        last_pos = positions[:, -1].clone()
        step = 0
        while True:
            tokens = next_ids.tolist()
            for b in range(bsz):
                if done[b]:
                    continue
                out[b].append(tokens[b])
                token_marks[b].append(now)
                if tokens[b] in stop or len(out[b]) >= max_new_tokens[b]:
                    done[b] = True
                    end_marks[b] = now
            if all(done) or step + 1 >= budget:
                break
            cur = seq + step
            last_pos = last_pos + 1
            with self._region("decode_step"):
                if graphed is not None:
                    valid[:, cur] = True
                    next_ids = graphed.step(next_ids, last_pos, cur)
                else:
                    if padded or self.compiled:
                        # the compiled step always takes a mask: one graph for padded and unpadded batches
                        valid[:, cur] = True
                        step_mask = valid[:, None, None, : cur + 1]
                    else:
                        step_mask = None
                    next_ids = self._step(next_ids, last_pos, storage, cur, step_mask, rope, states)
            now = marks.mark()
            step += 1
        times = marks.resolve()
        timings = [
            DecodeTimings(
                t0, [times[m] for m in token_marks[b]], times[now if end_marks[b] is None else end_marks[b]]
            )
            for b in range(bsz)
        ]
        return DecodeOutput(out, timings, times[0] - t0, step)


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
