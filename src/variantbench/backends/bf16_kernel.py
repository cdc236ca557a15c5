"""A bf16 product for the few rows of a decode step, reading each weight once (issue 42).

bf16 weights are half of fp32's bytes, so a decode step bound by reading them should run near twice
as fast. oneDNN's bf16 ``F.linear`` (what the engine ran) does not at a few rows: on a 2-core AVX-512
BF16 host (AMD EPYC) bf16 decoded at 0.94x fp32's tokens/s, its weights read at 27% of the memory
bandwidth. This kernel computes ``y = x . W^T`` for up to ``MAX_ROWS`` rows straight from the row-major
``[N, K]`` bf16 weight, the output rows split across the OpenMP threads, float32 sums, the result
rounded to bf16 (nearest even) as ``F.linear`` rounds it:

* with AVX-512 BF16 (``avx512_bf16``: Cooper Lake, Sapphire Rapids, Zen 4): ``vdpbf16ps``, 32
  products a instruction, the activations read as bf16;
* with AVX2 only: each weight widened in registers (a 16-bit shift) and multiplied in float32 by the
  activations widened once, so a CPU without bf16 instructions still reads half the bytes, where the
  engine before widened the whole weight in memory for every call or ran oneDNN's slow reference.

One library per instruction set, compiled on first use (``variantbench.native``); the engine times it
against ``F.linear`` per shape at first use and keeps the faster (``Bf16Choices``), said in the
variant's info. ``VARIANTBENCH_BF16_KERNEL=0`` keeps ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from variantbench import native

MAX_ROWS = 8  # a decode step's batch; more rows (a prompt) stay on oneDNN's GEMM

# One output of a product at one row: the dot product of a bf16 row of activations with a bf16 row
# of the weight, in float32 (``xf``: the activations widened, read by the AVX2 build only); K % 32 == 0.
# Shared with the fused decode step (fused_decode.py).
DOT_C = r"""
#include <immintrin.h>
#ifndef __AVX512BF16__
static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
static inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
static inline float dot_bf16(const uint16_t* x, const float* xf, const uint16_t* w, int K) {
#ifdef __AVX512BF16__  /* two chains, so the sums do not wait on each other */
  (void)xf;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(w + k + 32));
  }
  if (k < K) a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else  /* four chains, each weight widened in registers */
  (void)x;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), widen8(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 8), widen8(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 16), widen8(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 24), widen8(w + k + 24), a3);
  }
  return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
}
"""

SOURCE = (
    native.HELPERS_C
    + DOT_C
    + r"""
#include <stdint.h>
#include <string.h>
/* sums[m] = x[m] . w for M rows (2 <= M <= 8), one weight row read once for all of them */
static inline void rows_dot(const uint16_t* x, const float* xf, int M, int K, const uint16_t* w, float* sums) {
#ifdef __AVX512BF16__
  (void)xf;
  __m512 acc[8];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; m++)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + (long)m * K + k), wv);
  }
  for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
#else
  (void)x;
  __m256 acc[8];
  for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 wv = widen8(w + k);
    for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + (long)m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; m++) sums[m] = hsum8(acc[m]);
#endif
}
/* y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]), bf16 in and out, float32 sums; K % 32 == 0, M <= 8;
   xf: M * K floats of scratch (the AVX2 build's widened activations) */
void bf16_gemm(const uint16_t* x, int M, int K, const uint16_t* W, const uint16_t* bias, uint16_t* y,
               int N, float* xf) {
#ifndef __AVX512BF16__
  for (long i = 0; i < (long)M * K; i++) xf[i] = from_bf16(x[i]);
#endif
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const uint16_t* w = W + (long)n * K;
    float sums[8];
    if (M == 1) sums[0] = dot_bf16(x, xf, w, K);
    else rows_dot(x, xf, M, K, w, sums);
    float b = bias ? from_bf16(bias[n]) : 0.f;
    for (int m = 0; m < M; m++) y[(long)m * N + n] = to_bf16(sums[m] + b);
  }
}
"""
)
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
AVX512_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
AVX2 = ("-mavx2", "-mfma")


class Kernel:
    """The compiled ``bf16_gemm``, called on contiguous bf16 rows and a row-major bf16 weight."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        fn = lib.bf16_gemm
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        self.fn = fn
        self.isa = isa

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] bf16 contiguous (M <= MAX_ROWS), ``weight`` [N, K] bf16 contiguous, ``bias`` [N]."""
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        scratch = torch.empty(rows * k) if self.isa == "AVX2" else None
        with native.labelled("bf16_gemm"):
            self.fn(x.data_ptr(), rows, k, weight.data_ptr(), None if bias is None else bias.data_ptr(),
                    y.data_ptr(), n, None if scratch is None else scratch.data_ptr())  # fmt: skip
        return y


def isa() -> tuple[str, tuple[str, ...]] | None:
    """(the widest instruction set ``DOT_C`` builds for on this CPU, its compiler flags), or None."""
    from variantbench.environment import cpu_flags

    flags = cpu_flags()
    if "avx512_bf16" in flags:
        return "AVX-512 BF16", AVX512_BF16
    if "avx2" in flags:
        return "AVX2", AVX2
    return None


@functools.cache
def kernel() -> tuple[Kernel | None, str]:
    """(the kernel, how it was had) or (None, why not): the widest build this CPU runs, compiled once."""
    widest = isa()
    if widest is None:
        return None, "this CPU has neither AVX-512 BF16 nor AVX2"
    isa_name, extra = widest
    lib, how = native.load("bf16", SOURCE, BASE_FLAGS + extra, "VARIANTBENCH_BF16_KERNEL")
    return (Kernel(lib, isa_name), f"{isa_name} bf16 kernel ({how})") if lib is not None else (None, how)


# (N, K) -> which product this process chose for one row and for more rows of that shape:
# "kernel" | "onednn" each
CHOICES: dict[tuple[int, int], tuple[str, str]] = {}


def usable(weight: torch.Tensor) -> bool:
    """Whether the kernel can compute against ``weight`` (bf16 on the CPU, contiguous, K % 32 == 0)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % 32 == 0
        and weight.is_contiguous()
    )


def choice(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> str:
    """The faster of the kernel and ``F.linear`` for ``rows`` rows (<= MAX_ROWS) of ``weight``'s shape.

    Timed once per shape and process, at one row and at ``MAX_ROWS`` (the best of 5 calls after a warm
    one each, the weights out of cache: ``native.best_cold``); two to ``MAX_ROWS`` rows take the
    latter's winner. The kernel's margin shrinks with the
    rows (on AVX-512 BF16, 4.9x oneDNN at one row of a 960x576 product, 2.0x at 8; its AVX2 build,
    2.7x and 0.8x against oneDNN's AVX-512 BF16 kernels there), so a shape may keep both."""
    key = (int(weight.shape[0]), int(weight.shape[1]))
    if key not in CHOICES:
        run, _ = kernel()
        if run is None:
            CHOICES[key] = ("onednn", "onednn")
        else:
            picks = []
            with torch.inference_mode():
                for n in (1, MAX_ROWS):
                    x = torch.randn(n, key[1]).to(torch.bfloat16)
                    ours = native.best_cold(lambda x=x: run(x, weight, bias))
                    onednn = native.best_cold(lambda x=x: F.linear(x, weight, bias))
                    picks.append("kernel" if ours < onednn else "onednn")
            CHOICES[key] = (picks[0], picks[1])
    return CHOICES[key][0 if rows == 1 else 1]


def summary() -> str | None:
    """What this process's bf16 products ran on at a decode step's rows, for the variant's info."""
    if not CHOICES:
        return None
    _, how = kernel()
    chosen = sorted(f"{n}x{k}: {one}/{many}" for (n, k), (one, many) in CHOICES.items())
    return f"bf16 at 1/2-{MAX_ROWS} rows, chosen per shape by a timing at first use ({how}): " + ", ".join(
        chosen
    )
