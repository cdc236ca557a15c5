"""Softmax attention for a decode step's one query a row, in one C call (issue 42).

At a decode step each layer attends one new query a sequence (its grouped query heads, G of them,
sharing one KV head) over the keys so far. torch's CPU SDPA (the flash-attention kernel) costs
23 us for SmolLM2's 9 heads over 64 keys and 48-50 us over 300, float32 or bf16 (2 AVX-512 cores),
30 calls a token, while the arithmetic is a few microseconds. This kernel computes, per sequence and
KV head (split over the OpenMP threads), every grouped query's scores against the keys in float32,
their softmax (a polynomial 2^x, relative error under 2e-7) and the weighted sum of the values,
rounded once to the model's dtype, reading the keys and values in place in the engine's cache.

It serves plain attention only (no soft-cap, no window, no mask: an unpadded batch); the engine
keeps SDPA elsewhere. Compiled once (``variantbench.native``); ``VARIANTBENCH_ATTENTION_KERNEL=0``
keeps SDPA everywhere.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from variantbench import native

SOURCE = (
    native.HELPERS_C
    + r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
/* q [B, H, G, D] contiguous; k, v: element (b, h, t, :) at b * sb + h * sh + t * D; out like q.
   bf16 != 0: q, k, v, out hold bf16. scratch: B * H * (G * T + (G + 2) * D) floats. */
void attn_decode(const void* q, const void* k, const void* v, void* out, int B, int H, int G, int D, int T,
                 long sb, long sh, float scale, int bf16, float* scratch) {
  #pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++) {
      long row = (long)(b * H + h) * G;
      float* s = scratch + (long)(b * H + h) * (G * T + (G + 2) * D);
      float* qf = s + (long)G * T;  /* G * D: the queries in float */
      float* kv = qf + (long)G * D;  /* D: one key or value row in float */
      float* acc = kv + D;           /* D */
      long base = b * sb + h * sh;
      for (int i = 0; i < G * D; i++)
        qf[i] = bf16 ? from_bf16(((const uint16_t*)q)[row * D + i]) : ((const float*)q)[row * D + i];
      for (int t = 0; t < T; t++) {
        const float* kt;
        if (bf16) {
          const uint16_t* src = (const uint16_t*)k + base + (long)t * D;
          for (int i = 0; i < D; i++) kv[i] = from_bf16(src[i]);
          kt = kv;
        } else {
          kt = (const float*)k + base + (long)t * D;
        }
        for (int g = 0; g < G; g++) s[(long)g * T + t] = dot(qf + (long)g * D, kt, D) * scale;
      }
      for (int g = 0; g < G; g++) {
        float* sg = s + (long)g * T;
        float inv = softmax_exp(sg, T);
        for (int t = 0; t < T; t++) sg[t] *= inv;
      }
      for (int g = 0; g < G; g++) {
        const float* sg = s + (long)g * T;
        for (int i = 0; i < D; i++) acc[i] = 0;
        for (int t = 0; t < T; t++) {
          float w = sg[t];
          if (bf16) {
            const uint16_t* src = (const uint16_t*)v + base + (long)t * D;
            for (int i = 0; i < D; i++) acc[i] += w * from_bf16(src[i]);
          } else {
            const float* src = (const float*)v + base + (long)t * D;
            for (int i = 0; i < D; i++) acc[i] += w * src[i];
          }
        }
        if (bf16) for (int i = 0; i < D; i++) ((uint16_t*)out)[(row + g) * D + i] = to_bf16(acc[i]);
        else memcpy((float*)out + (row + g) * D, acc, sizeof(float) * D);
      }
    }
}
"""
)
FLAGS = (
    "-O3",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
)  # no FP traps: the clamp in exp vectorizes


class Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.attn_decode
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                                                   ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        self.fn = fn

    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q`` [B, H, G, D] contiguous; ``keys``, ``values`` [B, H, T, D] views with the same strides,
        rows of D contiguous (``usable``). Returns [B, H, G, D] in q's dtype."""
        bsz, heads, group, d = q.shape
        n = keys.shape[2]
        out = torch.empty_like(q)
        scratch = torch.empty(bsz * heads * (group * n + (group + 2) * d))
        with native.labelled("attention_kernel"):
            self.fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), bsz, heads, group, d, n,
                    keys.stride(0), keys.stride(1), scale, int(q.dtype == torch.bfloat16), scratch.data_ptr())  # fmt: skip
        return out


@functools.cache
def kernel() -> tuple[Kernel | None, str]:
    """(the kernel, how it was had) or (None, why not): compiled once, cached."""

    lib, how = native.load(
        "attention", SOURCE, FLAGS + native.vector_flags(), "VARIANTBENCH_ATTENTION_KERNEL"
    )
    return (Kernel(lib), f"decode attention kernel ({how})") if lib is not None else (None, how)


def usable(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel can attend ``q`` [B, H, G, D] over these cache views (CPU, float32 or bf16)."""
    d = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and keys.dtype == values.dtype == q.dtype
        and q.is_contiguous()
        and keys.stride() == values.stride()
        and keys.stride(-1) == 1
        and keys.stride(-2) == d
        and keys.shape == values.shape
        and keys.shape[:2] == q.shape[:2]
        and keys.shape[2] > 0
    )
