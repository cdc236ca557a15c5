"""A decode step at batch 1 in one C call for the whole layer stack (issue 42).

At one row a decode step is bound by reading the weights, but the engine's torch path runs about
20 operators a layer (norm, projections, RoPE, cache writes, attention, SiLU, residual sums), 600 a
SmolLM2 token, each a few microseconds of dispatch: 5.5 ms of a 29 ms fp32 token on 2 AVX-512 cores
(``benchmarks/decode.py``'s fixed cost), which held fp32 at 61% of the memory roofline while its
projections alone read the weights at about 80%. llama.cpp, one C call a layer, reached 94%.

This kernel runs every layer of a Llama-shaped stack (pre-norm RMSNorm, fused QKV with optional
bias, full-width RoPE, grouped-query softmax attention over the cache with a sliding window where
the layer has one, SiLU-gated MLP) and the final norm and vocabulary head inside one OpenMP parallel
region, reading the engine's own weights in place; the phases meet at barriers (about a microsecond
on 2 cores). Three weight kinds, each product as the operator path computes it:

* float32 (``_DenseT``'s row-major ``[N, K]`` copy): each thread dots the input with its own
  contiguous share of the weight's rows, one sequential stream (``gemv``);
* bf16 (``[N, K]``, the model in bf16): each thread its slab of output rows through the bf16 dot
  product of ``bf16_kernel.DOT_C`` (AVX-512 BF16 or AVX2), every activation rounded to bf16 where
  the operator path rounds it, so both decode the same tokens (bit-equal logits measured on tiny
  Llama and Qwen2 models);
* int8 (``Int8Linear``'s q8 copy, in a float32 model): the input row quantized with one scale and
  dotted in int32 as ``variants/q8_kernel.py`` does.

Measured (``benchmarks/decode.py``, SmolLM2-135M, 2 AVX-512 BF16 EPYC cores, 3 interleaved repeats):
fixed cost 0.5-0.7 ms a token against 4.2-5.5; fp32 52.4 tokens/s (85% of the roofline) against
34.4 (61%); bf16 88.1 against 62.9; smooth+int8 at 3.8x fp32's tokens/s against 2.6x.

It serves what it computes exactly as the torch path does, and nothing else (``plan`` says why
not): float32 or bf16 on the CPU, no q/k norms, no post-norms, no residual scale, no soft-cap, SiLU,
full-width rotary, projections that are plain dense weights with their plain copy kept, or int8
ones. Batch 1 only, with no mask: a batched step's rows stay on the torch path (its products reuse
each weight across the rows), and so does the diagnosis's profiled step (it files time by operator).
Compiled once (``variantbench.native``); ``VARIANTBENCH_FUSED_DECODE=0`` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from variantbench import native
from variantbench.backends import bf16_kernel
from variantbench.variants import q8_kernel

if TYPE_CHECKING:
    from variantbench.backends.engine import Decoder

# What both builds share: the per-layer pointers and the split of work across the threads
COMMON_C = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* a projection's weights: kind 0, the model's dtype (float32 [K, N], bf16 [N, K]); kind 1, int8
   [N, K] with one float32 scale an output (q8); its bias float32 (bf16 in a bf16 model) or NULL */
typedef struct {
  const void* w;
  const float* scales;
  const void* bias;
  int kind;
} proj_t;

typedef struct {
  const void *norm1, *norm2, *cos, *sin;
  proj_t qkv, o, gu, down;
  float eps1, eps2, scale;
  int nq, nkv, inter, rot;  /* rot: the rotary table's row length (its head_dim) */
  int window;               /* a sliding window's length (the query and window - 1 keys before it); 0: none */
} layer_t;

/* layer l's views, in the step's element type T: its keys and values in the cache storage
   [layers, 2, 1, max_kv, length, D] (kc, vc) and its rotary rows at rope_pos (cos, ssin) */
#define LAYER_VIEWS(T)                                                  \
  T* kc = kv + (long)l * 2 * max_kv * length * D;                       \
  T* vc = kc + (long)max_kv * length * D;                               \
  const T* cos = (const T*)L->cos + (long)rope_pos * L->rot;            \
  const T* ssin = (const T*)L->sin + (long)rope_pos * L->rot

/* one thread rotates the layer's new keys and stores them and the values at slot pos */
#define STORE_KV(T, ROPE)                                                                   \
  _Pragma("omp single")                                                                     \
  for (int j = 0; j < nkv; j++) {                                                           \
    T* k = qkv + (long)(nq + j) * D;                                                        \
    ROPE(k, cos, ssin, D);                                                                  \
    memcpy(kc + ((long)j * length + pos) * D, k, sizeof(T) * D);                            \
    memcpy(vc + ((long)j * length + pos) * D, qkv + (long)(nq + nkv + j) * D, sizeof(T) * D); \
  }

/* the first key a query at T - 1 sees: a sliding window's start, else 0 */
static inline int window_start(const layer_t* L, int T) { return L->window > 0 && T > L->window ? T - L->window : 0; }

/* this thread's share [*lo, *hi) of n items, in multiples of align */
static inline void share(int n, int align, int* lo, int* hi) {
  int nth = omp_get_num_threads(), id = omp_get_thread_num();
  int per = ((n + nth - 1) / nth + align - 1) / align * align;
  *lo = id * per < n ? id * per : n;
  *hi = *lo + per < n ? *lo + per : n;
}

"""
F32_C = r"""
/* y = x . W^T (+ b) (+ y where acc) for a row-major [N, K] float32 weight, inside the parallel region:
   each thread dots x with its own contiguous share of the rows, one sequential stream through the
   weight. Over SmolLM2's per-token weights (538 MB, 2 AVX-512 cores, 9 interleaved repeats) it read
   33.5 GB/s (up to 47.0 in a fast hour of the host) against 32.3 (never above 33.4) for a [K, N]
   layout split by rows of K into partial sums with eight weight rows streamed at once, and 25.2 for
   that layout split by columns; the read probe 35.0 GB/s (llama.cpp's F32, a dot form too, read at
   110% of it). */
static void gemv(const float* x, int K, const float* W, const float* b, float* y, int N, int acc) {
  int n0, n1;
  share(N, 1, &n0, &n1);
  for (int n = n0; n < n1; n++) {
    float v = dot(x, W + (long)n * K, K) + (b ? b[n] : 0.f);
    y[n] = acc ? y[n] + v : v;
  }
}

/* the operator path's one-row float32 product (a batch-1 step the fused one does not take) */
void gemv_f32(const float* x, int K, const float* W, const float* b, float* y, int N, int threads) {
  #pragma omp parallel num_threads(threads)
  gemv(x, K, W, b, y, N, 0);
}

/* y = x . W (+ b) (+ y where acc) through the projection's own weights: float32 (gemv) or int8
   (q8: x quantized per token with one scale, as variants/q8_kernel.py computes it, every output row
   dotted in int32 by the thread whose share it is). xq, sx: K int8 and one float of shared scratch. */
static void project(const proj_t* p, const float* x, int K, float* y, int N, int acc, int8_t* xq, float* sx) {
  #pragma omp barrier /* every row of x written */
  if (p->kind == 0) {
    gemv(x, K, (const float*)p->w, (const float*)p->bias, y, N, acc);
    return;
  }
#ifdef HAVE_Q8
  int n0, n1;
  #pragma omp single
  *sx = quantize_row(x, K, xq);
  share(N, 1, &n0, &n1);
  const int8_t* W = (const int8_t*)p->w;
  const float* b = (const float*)p->bias;
  for (int n = n0; n < n1; n++) {
    float v = dot_q8(xq, W + (long)n * K, K) * *sx * p->scales[n];
    if (b) v += b[n];
    y[n] = acc ? y[n] + v : v;
  }
#endif
}

/* h[k] = x[k] * rms * w[k] for this thread's share of the rows (x whole: every thread takes its norm) */
static inline void norm_rows(const float* x, const float* w, float eps, int H, float* h) {
  int k0, k1;
  share(H, 8, &k0, &k1);
  float r = inv_rms(x, H, eps);
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
   scratch: H + 2 (nq_max + kv_max) D + 2 inter_max + nq_max (pos + 1) + k_max / 4 + 2 floats. */
void fused_decode(float* x, const layer_t* layers, int n_layers, int H, int D, float* kv, int max_kv,
                  int length, int pos, int rope_pos, const float* final_norm, float final_eps, const proj_t* head,
                  int vocab, float* logits, float* scratch, int nq_max, int inter_max, int threads) {
  float* h = scratch;
  float* qkv = h + H;
  float* att = qkv + (long)(nq_max + 2 * max_kv) * D;
  float* gu = att + (long)nq_max * D;
  float* scores = gu + 2L * inter_max;
  float* sx = scores + (long)nq_max * (pos + 1);
  int8_t* xq = (int8_t*)(sx + 1);
  int T = pos + 1;
  #pragma omp parallel num_threads(threads)
  {
    for (int l = 0; l < n_layers; l++) {
      const layer_t* L = layers + l;
      int nq = L->nq, nkv = L->nkv, G = nq / nkv, k0, k1;
      LAYER_VIEWS(float);
      norm_rows(x, (const float*)L->norm1, L->eps1, H, h);
      project(&L->qkv, h, H, qkv, (nq + 2 * nkv) * D, 0, xq, sx);
      #pragma omp barrier
      STORE_KV(float, rope);
      #pragma omp for schedule(static)
      for (int i = 0; i < nq; i++) {
        float* q = qkv + (long)i * D;
        rope(q, cos, ssin, D);
        const float* kh = kc + (long)(i / G) * length * D;
        const float* vh = vc + (long)(i / G) * length * D;
        int t0 = window_start(L, T);
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
      project(&L->o, att, nq * D, x, H, 1, xq, sx); /* the residual sum in place */
      #pragma omp barrier
      norm_rows(x, (const float*)L->norm2, L->eps2, H, h);
      project(&L->gu, h, H, gu, 2 * L->inter, 0, xq, sx);
      #pragma omp barrier
      share(L->inter, 8, &k0, &k1); /* SiLU(gate) * up for this thread's rows of the down product */
      for (int i = k0; i < k1; i++) gu[i] = gu[i] / (1.f + expf(-gu[i])) * gu[L->inter + i];
      project(&L->down, gu, L->inter, x, H, 1, xq, sx);
      #pragma omp barrier
    }
    norm_rows(x, final_norm, final_eps, H, h);
    project(head, h, H, logits, vocab, 0, xq, sx);
  }
}
"""
BF16_C = r"""/* bf16: the same step, rounded to bf16 where the engine's torch path rounds (each operator's
   output), so it decodes the tokens that path decodes. An activation is kept twice: bf16 (what
   vdpbf16ps reads) and widened (what the AVX2 build reads). */
static inline float rb(float v) { return from_bf16(to_bf16(v)); }
static inline void put(uint16_t* b, float* f, int i, float v) { b[i] = to_bf16(v); f[i] = from_bf16(b[i]); }

/* this thread's share of h = bf16(w * bf16(x * rms)) (the Llama order, as Norm computes bf16) */
static void norm_b(const uint16_t* x, const uint16_t* w, float eps, int H, uint16_t* hb, float* hf) {
  int k0, k1;
  share(H, 8, &k0, &k1);
  float ss[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0;
  int i = 0;
  for (; i + 8 <= H; i += 8)
    for (int j = 0; j < 8; j++) { float v = from_bf16(x[i + j]); ss[j] += v * v; }
  for (; i < H; i++) { float v = from_bf16(x[i]); sum += v * v; }
  for (int j = 0; j < 8; j++) sum += ss[j];
  float r = 1.f / sqrtf(sum / (float)H + eps);
  for (int k = k0; k < k1; k++) put(hb, hf, k, from_bf16(w[k]) * rb(from_bf16(x[k]) * r));
}

/* y = bf16(x . W^T + b) for a row-major [N, K] bf16 weight, this thread's share of the N rows (one
   contiguous slab); acc: y = bf16(y + that), the residual sum. yf: y widened (NULL: not needed). */
static void gemv_b(const uint16_t* xb, const float* xf, int K, const uint16_t* W, const uint16_t* b, uint16_t* y,
                   float* yf, int N, int acc) {
  int n0, n1;
  share(N, 1, &n0, &n1);
  for (int n = n0; n < n1; n++) {
    float v = rb(dot_bf16(xb, xf, W + (long)n * K, K) + (b ? from_bf16(b[n]) : 0.f));
    if (acc) v += from_bf16(y[n]);
    y[n] = to_bf16(v);
    if (yf) yf[n] = from_bf16(y[n]);
  }
}

/* bf16 RoPE as torch computes it: addcmul(bf16(x * cos), roll(x), ssin), rounded once */
static inline void rope_b(uint16_t* v, const uint16_t* cos, const uint16_t* ssin, int d) {
  uint16_t tmp[512];
  int h = d / 2;
  for (int i = 0; i < d; i++)
    tmp[i] = to_bf16(rb(from_bf16(v[i]) * from_bf16(cos[i])) + from_bf16(v[i < h ? i + h : i - h]) * from_bf16(ssin[i]));
  memcpy(v, tmp, sizeof(uint16_t) * d);
}

void fused_decode_bf16(uint16_t* x, const layer_t* layers, int n_layers, int H, int D, uint16_t* kv, int max_kv,
                       int length, int pos, int rope_pos, const uint16_t* final_norm, float final_eps,
                       const proj_t* head, int vocab, uint16_t* logits, float* scratch,
                       int nq_max, int inter_max, int threads) {
  /* scratch (floats): hf H, qkvf, attf nq_max D, guf 2 inter_max, scores nq_max (pos + 1), then the bf16 arrays */
  int wide = (nq_max + 2 * max_kv) * D;
  float* hf = scratch;
  float* attf = hf + H;
  float* guf = attf + (long)nq_max * D;
  float* scores = guf + 2L * inter_max;
  uint16_t* hb = (uint16_t*)(scores + (long)nq_max * (pos + 1));
  uint16_t* qkv = hb + H;
  uint16_t* attb = qkv + wide;
  uint16_t* gub = attb + (long)nq_max * D;
  int T = pos + 1;
  #pragma omp parallel num_threads(threads)
  {
    for (int l = 0; l < n_layers; l++) {
      const layer_t* L = layers + l;
      int nq = L->nq, nkv = L->nkv, G = nq / nkv, k0, k1;
      LAYER_VIEWS(uint16_t);
      norm_b(x, (const uint16_t*)L->norm1, L->eps1, H, hb, hf);
      #pragma omp barrier
      gemv_b(hb, hf, H, (const uint16_t*)L->qkv.w, (const uint16_t*)L->qkv.bias, qkv, NULL, (nq + 2 * nkv) * D, 0);
      #pragma omp barrier
      STORE_KV(uint16_t, rope_b);
      #pragma omp for schedule(static)
      for (int i = 0; i < nq; i++) {
        uint16_t* q = qkv + (long)i * D;
        rope_b(q, cos, ssin, D);
        float qf[512], kf[512], o[512];
        for (int c = 0; c < D; c++) qf[c] = from_bf16(q[c]);
        const uint16_t* kh = kc + (long)(i / G) * length * D;
        const uint16_t* vh = vc + (long)(i / G) * length * D;
        int t0 = window_start(L, T);
        float* s = scores + (long)i * T;
        for (int t = t0; t < T; t++) { /* each key widened, then dot's 8 sums (one sum would not vectorize) */
          const uint16_t* kt = kh + (long)t * D;
          for (int c = 0; c < D; c++) kf[c] = from_bf16(kt[c]);
          s[t] = dot(qf, kf, D) * L->scale;
        }
        float inv = softmax_exp(s + t0, T - t0);
        for (int c = 0; c < D; c++) o[c] = 0;
        for (int t = t0; t < T; t++) {
          float w = s[t] * inv;
          const uint16_t* vt = vh + (long)t * D;
          for (int c = 0; c < D; c++) o[c] += w * from_bf16(vt[c]);
        }
        for (int c = 0; c < D; c++) put(attb, attf, i * D + c, o[c]);
      }
      gemv_b(attb, attf, nq * D, (const uint16_t*)L->o.w, (const uint16_t*)L->o.bias, x, NULL, H, 1);
      #pragma omp barrier
      norm_b(x, (const uint16_t*)L->norm2, L->eps2, H, hb, hf);
      #pragma omp barrier
      gemv_b(hb, hf, H, (const uint16_t*)L->gu.w, (const uint16_t*)L->gu.bias, gub, NULL, 2 * L->inter, 0);
      #pragma omp barrier
      share(L->inter, 8, &k0, &k1); /* bf16(bf16(SiLU(gate)) * up), as F.silu and the product round */
      for (int i = k0; i < k1; i++) {
        float g = from_bf16(gub[i]);
        put(gub, guf, i, rb(g / (1.f + expf(-g))) * from_bf16(gub[L->inter + i]));
      }
      #pragma omp barrier
      gemv_b(gub, guf, L->inter, (const uint16_t*)L->down.w, (const uint16_t*)L->down.bias, x, NULL, H, 1);
      #pragma omp barrier
    }
    norm_b(x, final_norm, final_eps, H, hb, hf);
    #pragma omp barrier
    gemv_b(hb, hf, H, (const uint16_t*)head->w, (const uint16_t*)head->bias, logits, NULL, vocab, 0);
  }
}
"""
BF16_SOURCE = native.HELPERS_C + bf16_kernel.DOT_C + COMMON_C + BF16_C
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
SWITCH = "VARIANTBENCH_FUSED_DECODE"


def q8_built() -> bool:
    """Whether the float32 library has the q8 product (int8 projections): it is built with AVX2."""
    return "-mavx2" in native.vector_flags()


def f32_source() -> str:
    """The float32 step's source, with the q8 product where the build has AVX2."""
    q8 = "#define HAVE_Q8 1\n" + q8_kernel.DOT_C if q8_built() else ""
    return native.HELPERS_C + q8 + COMMON_C + F32_C


@runtime_checkable
class Q8Weights(Protocol):
    """A projection that offers its weights as the q8 kernel reads them (``variants.int8.Int8Linear``)."""

    in_features: int
    out_features: int

    def q8_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class _Proj(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("kind", ctypes.c_int),
    ]


class _LayerT(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "norm2", "cos", "sin")] + [
        (name, _Proj) for name in ("qkv", "o", "gu", "down")] + [
        ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
        ("nq", ctypes.c_int), ("nkv", ctypes.c_int), ("inter", ctypes.c_int), ("rot", ctypes.c_int),
        ("window", ctypes.c_int),
    ]  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.POINTER(_Proj),
         ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # fmt: skip


@functools.cache
def _library(dtype: torch.dtype) -> tuple[Any, str]:
    """(the compiled library for ``dtype``, how it was had: its ISA and file) or (None, why not).
    float32: plain C loops the compiler vectorizes (and the q8 product with AVX2); bf16: the widest bf16
    dot product this CPU runs (``bf16_kernel.DOT_C``: AVX-512 BF16, else AVX2)."""
    if dtype == torch.float32:
        lib, how = native.load("fused_decode", f32_source(), FLAGS + native.vector_flags(), SWITCH)
        return lib, f"fp32 ({how})"
    if dtype == torch.bfloat16:
        widest = bf16_kernel.isa()
        if widest is None:
            return None, "this CPU has neither AVX-512 BF16 nor AVX2"
        lib, how = native.load("fused_decode_bf16", BF16_SOURCE, FLAGS + widest[1], SWITCH)
        return lib, f"{widest[0]} bf16 ({how})"
    return None, f"no fused step for {dtype}"


@functools.cache
def kernel(dtype: torch.dtype = torch.float32) -> tuple[Any, str]:
    """(the compiled step for ``dtype``, how it was had) or (None, why not): compiled once, cached."""
    lib, how = _library(dtype)
    if lib is None:
        return None, how
    fn = lib.fused_decode if dtype == torch.float32 else lib.fused_decode_bf16
    fn.restype = None
    fn.argtypes = _ARGS + [ctypes.c_int]
    return fn, f"fused {how.replace(' (', ' decode kernel (', 1)}"


class RowProduct:
    """The float32 library's one-row product ``y = x . W^T + b`` over a row-major ``[N, K]`` weight:
    the operator path's batch-1 projections (families the fused step does not take, the diagnosis's
    profiled step) stream the weights as the fused step does. MKL's ``F.linear`` ran one row on one
    thread; the engine's earlier split-K ``bmm`` over a transposed copy read 23.7 GB/s."""

    def __init__(self, lib: Any) -> None:
        fn = lib.gemv_f32
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int]  # fmt: skip
        self.fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [K] or [1, K] float32 contiguous; ``weight`` [N, K] float32 contiguous; returns [N]."""
        n, k = weight.shape
        y = torch.empty(n)
        with native.labelled("f32_gemm"):
            self.fn(x.data_ptr(), k, weight.data_ptr(), _ptr(bias), y.data_ptr(), n, torch.get_num_threads())
        return y


@functools.cache
def row_product() -> RowProduct | None:
    """The one-row float32 product where the library builds here, else None (torch's ``F.linear``)."""
    lib, _ = _library(torch.float32)
    return None if lib is None else RowProduct(lib)


class Weights(NamedTuple):
    kind: int  # 0: the model's dtype, 1: int8 (q8)
    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int


@runtime_checkable
class StepWeights(Protocol):
    """A projection that can hand the step its weights (the engine's ``_DenseT`` and ``_Modules``)."""

    def step_weights(self, dtype: torch.dtype) -> Weights | None: ...


def dense_weights(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Weights | None:
    """A row-major ``[N, K]`` dense weight as the step reads it, or None: in the model's dtype, its
    bias too; bf16 with K % 32 == 0 (the bf16 dot product's step)."""
    if weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        return None
    if dtype == torch.bfloat16 and weight.shape[1] % 32:
        return None
    return Weights(0, weight, None, bias, int(weight.shape[0]))


def module_weights(module: object, dtype: torch.dtype) -> Weights | None:
    """An int8 module's q8 copy in a float32 model where the q8 product is built, or None."""
    if dtype != torch.float32 or not isinstance(module, Q8Weights) or module.in_features % 32 or not q8_built():
        return None
    ints, scales, bias = module.q8_arrays()
    return Weights(1, ints, scales, bias, int(ints.shape[0]))


def _weights(p: object, dtype: torch.dtype) -> Weights | None:
    return p.step_weights(dtype) if isinstance(p, StepWeights) else None


class FusedStack:
    """The stack's pointers for the C call, made once per decoder (the weights never move)."""

    def __init__(self, decoder: Decoder, fn: Any, projections: dict[int, Weights]) -> None:
        self.fn = fn
        self.decoder = decoder
        self.projections = projections  # id(projection) -> _weights(...): the tensors stay alive here
        self.float32 = decoder.dtype == torch.float32
        self.layers = (_LayerT * len(decoder.layers))()
        self._point(decoder._rope_tables(256))
        self.head = self._proj(decoder.lm_head)
        self.vocab = projections[id(decoder.lm_head)].out_features
        self.nq_max = max(layer.n_heads for layer in decoder.layers)
        self.buffers: dict[str, torch.Tensor] = {}
        self.inter_max = max(self._out(layer.gate_up) // 2 for layer in decoder.layers)
        self.k_max = max([decoder.hidden_size, self.inter_max, self.nq_max * decoder.head_dim])
        self.kinds = sorted({"int8 (q8)" if w[0] else str(decoder.dtype).removeprefix("torch.")
                             for w in projections.values()})  # fmt: skip

    def _out(self, module: object) -> int:
        return self.projections[id(module)].out_features

    def _proj(self, module: object) -> _Proj:
        kind, weight, scales, bias, _ = self.projections[id(module)]
        return _Proj(weight.data_ptr(), _ptr(scales), _ptr(bias), kind)

    def _point(self, rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        d = self.decoder
        for entry, layer in zip(self.layers, d.layers, strict=True):
            cos, sin = rope[layer.rope]
            entry.norm1, entry.norm2 = layer.attn_in.weight.data_ptr(), layer.mlp_in.weight.data_ptr()  # type: ignore[union-attr]
            entry.cos, entry.sin = cos.data_ptr(), sin.data_ptr()
            entry.qkv, entry.o = self._proj(layer.qkv), self._proj(layer.o)
            entry.gu, entry.down = self._proj(layer.gate_up), self._proj(layer.down)
            entry.eps1, entry.eps2 = layer.attn_in.eps, layer.mlp_in.eps  # type: ignore[union-attr]
            entry.scale = layer.attention.scale if layer.attention.scale is not None else d.head_dim**-0.5
            entry.nq, entry.nkv = layer.n_heads, layer.n_kv_heads
            entry.inter = self._out(layer.gate_up) // 2
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
        """The float32 logits [1, vocab] of one token ``x`` [1, 1, H] at cache slot ``cur``."""
        d = self.decoder
        rope = d._rope_tables(position + 1)
        if rope is not self.rope:  # the tables grew: new pointers
            self._point(rope)
        x = x.reshape(-1).clone()
        _, _, _, max_kv, length, head_dim = storage.shape
        logits = torch.empty(1, self.vocab, dtype=d.dtype)
        threads = torch.get_num_threads()
        h, inter, nq = d.hidden_size, self.inter_max, self.nq_max
        # the float32 step: h, q/k/v, attention, gate/up, scores and a quantized row; the bf16 step
        # keeps each activation twice (bf16 and widened: half a float more an element)
        floats = h + (2 * nq + 2 * max_kv) * head_dim + 2 * inter + nq * (cur + 1) + self.k_max // 4 + 2
        if not self.float32:
            floats += (h + nq * head_dim + 2 * inter) // 2 + 8
        scratch = self._buffer("scratch", floats)
        args = [x.data_ptr(), self.layers, len(self.layers), h, head_dim, storage.data_ptr(), max_kv, length, cur,
                position, d.final_norm.weight.data_ptr(), d.final_norm.eps, ctypes.byref(self.head), self.vocab,
                logits.data_ptr(), scratch.data_ptr(), nq, inter]  # fmt: skip
        args.append(threads)
        with native.labelled("fused_decode_layers"):
            self.fn(*args)
        return logits.float()


def plan(decoder: Decoder) -> tuple[FusedStack | None, str]:
    """The fused step for this decoder, or (None, why the torch path decodes it)."""
    dtype = decoder.dtype
    if decoder.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None, "not float32 or bf16 on the CPU"
    if decoder.act is not F.silu:
        return None, "the MLP's activation is not SiLU"
    if decoder.residual_scale is not None or decoder.has_linear_attention:
        return None, "a residual scale or linear attention"
    fp32 = dtype == torch.float32
    projections: dict[int, Weights] = {}
    rope = decoder._rope_tables(256)
    for i, layer in enumerate(decoder.layers):
        norms = (layer.attn_in, layer.mlp_in)
        if any(n is None or n.weight.dtype != dtype or (n.upcast and not fp32) for n in norms):
            return None, f"layer {i} has no pre-norms in the model's dtype"
        if any(n is not None for n in (layer.attn_out, layer.mlp_out, layer.q_norm, layer.k_norm)):
            return None, f"layer {i} has post-norms or q/k norms"
        if layer.attention.softcap is not None or layer.experts is not None or layer.linear is not None:
            return None, f"layer {i}'s attention scores are soft-capped or its MLP is not dense"
        if layer.n_heads % layer.n_kv_heads or rope[layer.rope][0].shape[-1] != decoder.head_dim:
            return None, f"layer {i}'s heads do not group evenly or its rotary is partial"
        for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if (weights := _weights(proj, dtype)) is None:
                return None, f"layer {i}'s projections are neither plain dense {dtype} weights nor int8 ones"
            projections[id(proj)] = weights
    final = decoder.final_norm
    head = _weights(decoder.lm_head, dtype)
    if decoder.head_dim > 512 or head is None or final.weight.dtype != dtype or (final.upcast and not fp32):
        return None, "the head is not a plain dense or int8 weight in the model's dtype"
    projections[id(decoder.lm_head)] = head
    fn, how = kernel(dtype)
    if fn is None:
        return None, how
    stack = FusedStack(decoder, fn, projections)
    return stack, f"{how}; {' and '.join(stack.kinds)} weights"
