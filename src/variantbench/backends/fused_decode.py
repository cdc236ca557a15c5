"""A float32 decode step at batch 1 in one C call for the whole layer stack (issue 42).

At one row a decode step is bound by reading the weights, but the engine's torch path runs about
20 operators a layer (norm, projections, RoPE, cache writes, attention, SiLU, residual sums), 600 a
SmolLM2 token, each a few microseconds of dispatch: 5.5 ms of a 29 ms fp32 token on 2 AVX-512 cores
(``benchmarks/decode.py``'s fixed cost), which held fp32 at 61% of the memory roofline while its
projections alone read the weights at about 80%. llama.cpp, one C call a layer, reached 94%.

This kernel runs every layer of a Llama-shaped stack (pre-norm RMSNorm, fused QKV with optional
bias, full-width RoPE, grouped-query softmax attention over the cache, SiLU-gated MLP; a sliding window where the layer has one) and the final
norm and vocabulary head inside one OpenMP parallel region: each projection's output columns are
split across the threads, reading the engine's own transposed ``[K, N]`` float32 weights in place
(``_DenseT``) with the partial sums of a column block in L1; the phases meet at a barrier (about a
microsecond on 2 cores), 9 a layer. The result is the float32 logits, as ``Decoder._logits`` gives.

It serves what it computes exactly as the torch path does, and nothing else (``plan`` says why
not): float32 weights on the CPU, no q/k norms, no post-norms, no residual scale, no soft-cap,
SiLU, full-width rotary, dense projections with their plain copy kept. Batch 1 only, with no mask:
a batched step's rows stay on the torch path (its products reuse each weight across the rows).
Compiled once (``variantbench.native``); ``VARIANTBENCH_FUSED_DECODE=0`` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from variantbench import native

if TYPE_CHECKING:
    from variantbench.backends.engine import Decoder

SOURCE = (
    native.HELPERS_C
    + r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  const float *norm1, *wqkv, *bqkv, *wo, *bo, *norm2, *wgu, *bgu, *wd, *bd, *cos, *sin;
  float eps1, eps2, scale;
  int nq, nkv, inter, rot;  /* rot: the rotary table's row length (its head_dim) */
  int window;               /* a sliding window's length (the query and window - 1 keys before it); 0: none */
} layer_t;

/* this thread's share [*lo, *hi) of n items, in multiples of align */
static inline void share(int n, int align, int* lo, int* hi) {
  int nth = omp_get_num_threads(), id = omp_get_thread_num();
  int per = ((n + nth - 1) / nth + align - 1) / align * align;
  *lo = id * per < n ? id * per : n;
  *hi = *lo + per < n ? *lo + per : n;
}

static inline float rms_scale(const float* v, int d, float eps) { return 1.f / sqrtf(dot(v, v, d) / (float)d + eps); }

/* y = x . W (+ b) (+ y where acc) for a row-major [K, N] weight, inside the parallel region: each thread
   sums its own contiguous rows [k0, k1) (share(K, 8): the x[k] of those rows are all it reads, so a
   caller fills only those) into its partial [N], eight rows a pass, then each sums the partials of
   its share of the columns. A thread thus streams one contiguous slab of the weight: 28.6 GB/s over
   SmolLM2's per-token weights against 25.2 GB/s for a split of the columns (each thread reading a
   strided part of every row), a 33.3 GB/s read probe, 2 AVX-512 cores, 15 interleaved repeats. */
static void gemv(const float* x, int K, const float* W, const float* b, float* y, int N, int acc, float* partials) {
  int k0, k1, c0, c1;
  share(K, 8, &k0, &k1);
  int nth = omp_get_num_threads();
  float* part = partials + (long)omp_get_thread_num() * N;
  for (int c = 0; c < N; c++) part[c] = 0.f;
  int k = k0;
  for (; k + 8 <= k1; k += 8) {
    const float *w0 = W + (long)k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
    const float *w4 = w3 + N, *w5 = w4 + N, *w6 = w5 + N, *w7 = w6 + N;
    float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3], x4 = x[k + 4], x5 = x[k + 5], x6 = x[k + 6],
          x7 = x[k + 7];
    for (int c = 0; c < N; c++)
      part[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c] + x4 * w4[c] + x5 * w5[c] + x6 * w6[c] + x7 * w7[c];
  }
  for (; k < k1; k++) {
    const float* w0 = W + (long)k * N;
    float x0 = x[k];
    for (int c = 0; c < N; c++) part[c] += x0 * w0[c];
  }
  #pragma omp barrier
  share(N, 16, &c0, &c1);
  for (int c = c0; c < c1; c++) {
    float v = (acc ? y[c] : 0.f) + (b ? b[c] : 0.f);
    for (int t = 0; t < nth; t++) v += partials[(long)t * N + c];
    y[c] = v;
  }
}

/* h[k] = x[k] * rms * w[k] for this thread's rows of the next product (x whole: every thread takes its norm) */
static inline void norm_rows(const float* x, const float* w, float eps, int H, float* h) {
  int k0, k1;
  share(H, 8, &k0, &k1);
  float r = rms_scale(x, H, eps);
  for (int k = k0; k < k1; k++) h[k] = x[k] * r * w[k];
}

/* transformers' x * cos + rotate_half(x) * sin, the sign of rotate_half folded into ssin */
static inline void rope(float* v, const float* cos, const float* ssin, int d) {
  float tmp[512];
  int h = d / 2;
  for (int i = 0; i < d; i++) tmp[i] = v[i] * cos[i] + v[i < h ? i + h : i - h] * ssin[i];
  memcpy(v, tmp, sizeof(float) * d);
}

/* One token through every layer, the final norm and the head, on at most `threads` threads.
   x [H]: the embedded token in, the last hidden state out. kv: the cache storage
   [layers, 2, 1, max_kv, length, D] float32; pos: this token's slot (its rope row is rope_pos).
   scratch: H + 2 (nq_max + kv_max) D + 2 inter_max + nq_max (pos + 1) floats; partials: threads * n_max. */
void fused_decode(float* x, const layer_t* layers, int n_layers, int H, int D, float* kv, int max_kv,
                  int length, int pos, int rope_pos, const float* final_norm, float final_eps,
                  const float* head, const float* head_bias, int vocab, float* logits, float* scratch,
                  int nq_max, int inter_max, float* partials, int threads) {
  float* h = scratch;
  float* qkv = h + H;
  float* att = qkv + (long)(nq_max + 2 * max_kv) * D;
  float* gu = att + (long)nq_max * D;
  float* scores = gu + 2L * inter_max;
  int T = pos + 1;
  #pragma omp parallel num_threads(threads)
  {
    for (int l = 0; l < n_layers; l++) {
      const layer_t* L = layers + l;
      int nq = L->nq, nkv = L->nkv, G = nq / nkv, k0, k1;
      float* kc = kv + (long)l * 2 * max_kv * length * D;
      float* vc = kc + (long)max_kv * length * D;
      const float* cos = L->cos + (long)rope_pos * L->rot;
      const float* ssin = L->sin + (long)rope_pos * L->rot;
      norm_rows(x, L->norm1, L->eps1, H, h);
      gemv(h, H, L->wqkv, L->bqkv, qkv, (nq + 2 * nkv) * D, 0, partials);
      #pragma omp barrier
      #pragma omp single
      for (int j = 0; j < nkv; j++) {
        float* k = qkv + (long)(nq + j) * D;
        rope(k, cos, ssin, D);
        memcpy(kc + ((long)j * length + pos) * D, k, sizeof(float) * D);
        memcpy(vc + ((long)j * length + pos) * D, qkv + (long)(nq + nkv + j) * D, sizeof(float) * D);
      }
      #pragma omp for schedule(static)
      for (int i = 0; i < nq; i++) {
        float* q = qkv + (long)i * D;
        rope(q, cos, ssin, D);
        const float* kh = kc + (long)(i / G) * length * D;
        const float* vh = vc + (long)(i / G) * length * D;
        int t0 = L->window > 0 && T > L->window ? T - L->window : 0;
        float* s = scores + (long)i * T;
        for (int t = t0; t < T; t++) s[t] = dot(q, kh + (long)t * D, D) * L->scale;
        float inv = softmax_exp(s + t0, T - t0);
        float* o = att + (long)i * D;
        for (int c = 0; c < D; c++) o[c] = 0;
        for (int t = t0; t < T; t++) {
          float w = s[t] * inv;
          const float* vt = vh + (long)t * D;
          for (int c = 0; c < D; c++) o[c] += w * vt[c];
        }
      }
      gemv(att, nq * D, L->wo, L->bo, x, H, 1, partials); /* the residual sum in place */
      #pragma omp barrier
      norm_rows(x, L->norm2, L->eps2, H, h);
      gemv(h, H, L->wgu, L->bgu, gu, 2 * L->inter, 0, partials);
      #pragma omp barrier
      share(L->inter, 8, &k0, &k1); /* SiLU(gate) * up for this thread's rows of the down product */
      for (int i = k0; i < k1; i++) gu[i] = gu[i] / (1.f + expf(-gu[i])) * gu[L->inter + i];
      gemv(gu, L->inter, L->wd, L->bd, x, H, 1, partials);
      #pragma omp barrier
    }
    norm_rows(x, final_norm, final_eps, H, h);
    gemv(h, H, head, head_bias, logits, vocab, 0, partials);
  }
}
"""
)
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


class _LayerT(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("norm1", "wqkv", "bqkv", "wo", "bo", "norm2", "wgu", "bgu", "wd", "bd", "cos", "sin")] + [
        ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
        ("nq", ctypes.c_int), ("nkv", ctypes.c_int), ("inter", ctypes.c_int), ("rot", ctypes.c_int),
        ("window", ctypes.c_int),
    ]  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@functools.cache
def kernel() -> tuple[Any, str]:
    """(the compiled ``fused_decode``, how it was had) or (None, why not): compiled once, cached."""
    lib, how = native.load("fused_decode", SOURCE, FLAGS + native.vector_flags(), "VARIANTBENCH_FUSED_DECODE")
    if lib is None:
        return None, how
    fn = lib.fused_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    return fn, f"fused fp32 decode kernel ({how})"


class FusedStack:
    """The stack's pointers for the C call, made once per decoder (the weights never move)."""

    def __init__(self, decoder: Decoder, fn: Any) -> None:
        self.fn = fn
        self.decoder = decoder
        self.keep: list[torch.Tensor] = []  # tensors made here, alive as long as the pointers
        rope = decoder._rope_tables(256)
        self.rope_rows = next(iter(rope.values()))[0].shape[0]
        self.layers = (_LayerT * len(decoder.layers))()
        self._point(rope)
        head = decoder.lm_head
        self.head, self.head_bias = head.weight, head.bias  # type: ignore[union-attr]
        self.vocab = int(head.out_features)  # type: ignore[union-attr]
        self.nq_max = max(layer.n_heads for layer in decoder.layers)
        self.buffers: dict[str, torch.Tensor] = {}
        # the widest product's output: each thread's partial sums of it (fused_decode's gemv)
        self.widest = max([self.vocab, decoder.hidden_size] + [int(p.out_features) for layer in decoder.layers
                                                               for p in (layer.qkv, layer.gate_up)])  # type: ignore[attr-defined]  # fmt: skip
        self.inter_max = max(layer.gate_up.out_features // 2 for layer in decoder.layers)  # type: ignore[union-attr]

    def _point(self, rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        d = self.decoder
        for entry, layer in zip(self.layers, d.layers, strict=True):
            cos, sin = rope[layer.rope]
            fields = {
                "norm1": layer.attn_in.weight, "norm2": layer.mlp_in.weight,  # type: ignore[union-attr]
                "wqkv": layer.qkv.weight, "bqkv": layer.qkv.bias, "wo": layer.o.weight, "bo": layer.o.bias,  # type: ignore[attr-defined]
                "wgu": layer.gate_up.weight, "bgu": layer.gate_up.bias,  # type: ignore[union-attr]
                "wd": layer.down.weight, "bd": layer.down.bias, "cos": cos, "sin": sin,  # type: ignore[union-attr]
            }  # fmt: skip
            for name, tensor in fields.items():
                setattr(entry, name, _ptr(tensor))
            entry.eps1, entry.eps2 = layer.attn_in.eps, layer.mlp_in.eps  # type: ignore[union-attr]
            entry.scale = layer.attention.scale if layer.attention.scale is not None else d.head_dim**-0.5
            entry.nq, entry.nkv = layer.n_heads, layer.n_kv_heads
            entry.inter = layer.gate_up.out_features // 2  # type: ignore[union-attr]
            entry.rot = cos.shape[-1]
            entry.window = layer.attention.window or 0
        self.rope = rope

    def _buffer(self, name: str, size: int) -> torch.Tensor:
        """A float32 work buffer of at least ``size``, kept from token to token (a fresh 400 KB
        allocation a token is a fresh mapping, its pages faulted in again)."""
        have = self.buffers.get(name)
        if have is None or have.numel() < size:
            have = self.buffers[name] = torch.empty(max(size, 2 * (have.numel() if have is not None else 0)))
        return have

    def step(self, x: torch.Tensor, storage: torch.Tensor, cur: int, position: int) -> torch.Tensor:
        """The logits [1, vocab] of one token ``x`` [1, 1, H] (float32) at cache slot ``cur``."""
        d = self.decoder
        rope = d._rope_tables(position + 1)
        if rope is not self.rope:  # the tables grew: new pointers
            self._point(rope)
        x = x.reshape(-1).clone()
        _, _, _, max_kv, length, head_dim = storage.shape
        logits = torch.empty(1, self.vocab)
        threads = torch.get_num_threads()
        scratch = self._buffer("scratch", d.hidden_size + 2 * (self.nq_max + max_kv) * head_dim
                               + 2 * self.inter_max + self.nq_max * (cur + 1))  # fmt: skip
        partials = self._buffer("partials", threads * self.widest)
        final = d.final_norm
        with native.labelled("fused_decode_layers"):
            self.fn(x.data_ptr(), self.layers, len(self.layers), d.hidden_size, head_dim, storage.data_ptr(),
                    max_kv, length, cur, position, final.weight.data_ptr(), final.eps, self.head.data_ptr(),
                    _ptr(self.head_bias), self.vocab, logits.data_ptr(), scratch.data_ptr(), self.nq_max,
                    self.inter_max, partials.data_ptr(), threads)  # fmt: skip
        return logits


def plan(decoder: Decoder) -> tuple[FusedStack | None, str]:
    """The fused step for this decoder, or (None, why the torch path decodes it)."""
    from variantbench.backends.engine import _DenseT

    if decoder.device.type != "cpu" or decoder.dtype != torch.float32:
        return None, "not float32 on the CPU"
    if decoder.act is not F.silu:
        return None, "the MLP's activation is not SiLU"
    if decoder.residual_scale is not None or decoder.has_linear_attention:
        return None, "a residual scale or linear attention"
    rope = decoder._rope_tables(256)
    for i, layer in enumerate(decoder.layers):
        dense = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(isinstance(p, _DenseT) and p.transposed and p.weight is not None for p in dense):
            return None, f"layer {i}'s projections are not plain float32 dense weights"
        norms = (layer.attn_in, layer.mlp_in)
        if any(n is None or n.weight.dtype != torch.float32 for n in norms):
            return None, f"layer {i} has no float32 pre-norms"
        if any(n is not None for n in (layer.attn_out, layer.mlp_out, layer.q_norm, layer.k_norm)):
            return None, f"layer {i} has post-norms or q/k norms"
        if layer.attention.softcap is not None or layer.experts is not None or layer.linear is not None:
            return None, f"layer {i}'s attention scores are soft-capped or its MLP is not dense"
        if layer.n_heads % layer.n_kv_heads or rope[layer.rope][0].shape[-1] != decoder.head_dim:
            return None, f"layer {i}'s heads do not group evenly or its rotary is partial"
    if decoder.head_dim > 512 or not isinstance(decoder.lm_head, _DenseT) or not decoder.lm_head.transposed:
        return None, "the head is not a plain float32 dense weight"
    fn, how = kernel()
    if fn is None:
        return None, how
    return FusedStack(decoder, fn), how
