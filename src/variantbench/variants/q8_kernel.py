"""An int8 product for the few rows of a decode step, where FBGEMM's is slow (issue 42).

FBGEMM's dynamic int8 linear (what ``int8`` runs) read its weights at 10 GB/s at one row on our
2-core AVX2 host, a third of the memory bandwidth, so int8 decoded no faster than fp32 although it
reads a quarter of the bytes. This is llama.cpp's Q8_0 dot product on AVX2, in 30 lines of C: each
row quantized to int8 with one scale (its absolute maximum / 127), ``maddubs`` over sign-adjusted
bytes, int32 sums, times the row's scale and the weight row's; the weights int8 per output channel
as ``int8`` stores them, read once for all the rows. ``benchmarks/q8_gemv.py``: 91.6 us against
FBGEMM's 174.1 us for a 3072x576 product at one row (19.3 against 10.2 GB/s), relative error 1.1%.

Weights are kept in [-127, 127] (a -128 would wrap when negated by the sign trick).
It is compiled on first use (``cc -O3 -mavx2 -mfma -fopenmp``, ``variantbench.native``) and called
through ctypes on the tensors' memory. Where the CPU lacks
AVX2 or there is no C compiler, ``kernel()`` is None with the reason, and ``int8`` keeps FBGEMM.
Prompts (more than ``MAX_ROWS`` rows) stay on FBGEMM, whose GEMM is the faster there: 512 rows of a
3072x576 product took 9.2 ms in FBGEMM against 12-16 ms in this kernel's 8-row blocks. So the kernel
keeps its own int8 copy of the weights beside FBGEMM's packed one: +134 MB resident for SmolLM2-135M
(smooth+int8's peak RSS 1,039-1,090 MB against 934 before, over the edge profile's 1 GiB in one run).
"""

from __future__ import annotations

import ctypes
import functools

import torch

MAX_ROWS = 8  # a decode step's batch; more rows (a prompt) go to FBGEMM's GEMM

# What the fused decode step shares (backends/fused_decode.py): a row quantized to int8 with one
# scale (its absolute maximum / 127, to nearest), and the int8 dot product of two rows (``maddubs`` over
# sign-adjusted bytes, int32 sums); K % 32 == 0
DOT_C = r"""
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
static inline int hsum(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  return _mm_cvtsi128_si32(a);
}
static inline float quantize_row(const float* r, int K, int8_t* q) {
  float amax = 0;
  for (int k = 0; k < K; k++) { float a = fabsf(r[k]); if (a > amax) amax = a; }
  float s = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / s;
  for (int k = 0; k < K; k++) q[k] = (int8_t)nearbyintf(r[k] * inv);
  return s;
}
static inline int dot_q8(const int8_t* xq, const int8_t* w, int K) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int k = 0; k < K; k += 32) {
    __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k)), xv = _mm256_loadu_si256((const __m256i*)(xq + k));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv),
                                                                       _mm256_sign_epi8(wv, xv)), ones));
  }
  return hsum(acc);
}
"""

SOURCE = DOT_C + r"""
/* y[M, N] = quantized x[M, K] . W[N, K]^T * scales; K % 32 == 0, M <= 8; xq, sx: M*K and M scratch */
void q8_gemm(const float* x, int M, int K, const int8_t* W, const float* ws, float* y, int N,
             int8_t* xq, float* sx) {
  for (int m = 0; m < M; m++) sx[m] = quantize_row(x + (long)m * K, K, xq + (long)m * K);
  const __m256i ones = _mm256_set1_epi16(1);
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const int8_t* w = W + (long)n * K;
    __m256i acc[8];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_si256();
    for (int k = 0; k < K; k += 32) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
      for (int m = 0; m < M; m++) {
        __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (long)m * K + k));
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
      }
    }
    for (int m = 0; m < M; m++) y[(long)m * N + n] = hsum(acc[m]) * sx[m] * ws[n];
  }
}
"""
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


class Kernel:
    """The compiled ``q8_gemm``, called on contiguous float32 rows and int8 weights."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.q8_gemm
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        self.fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] float32 contiguous (M <= MAX_ROWS), ``weight`` [N, K] int8, ``scales`` [N] float32."""
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n)
        xq = torch.empty(rows, k, dtype=torch.int8)
        sx = torch.empty(rows)
        self.fn(x.data_ptr(), rows, k, weight.data_ptr(), scales.data_ptr(), y.data_ptr(), n, xq.data_ptr(),
                sx.data_ptr())  # fmt: skip
        return y


@functools.cache
def kernel() -> tuple[Kernel | None, str]:
    """(the kernel, how it was had) or (None, why not): compiled once per source and flags, cached."""
    from variantbench import native
    from variantbench.environment import cpu_flags

    if "avx2" not in cpu_flags():
        return None, "this CPU has no AVX2"
    lib, how = native.load("q8", SOURCE, FLAGS, "VARIANTBENCH_Q8_KERNEL")
    return (Kernel(lib), f"AVX2 q8 kernel ({how})") if lib is not None else (None, how)
