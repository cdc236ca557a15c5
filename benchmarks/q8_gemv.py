"""Is a small AVX2 int8 kernel faster than FBGEMM's at one row? The measurement that decides issue
42's next step for int8 decode.

    python benchmarks/q8_gemv.py [--n 3072] [--k 576] [--matrices 40]

FBGEMM's dynamic int8 product (what ``int8`` runs) reads its weights at well under the memory
bandwidth at one row, so int8 decodes no faster than fp32 although it reads a quarter of the bytes.
This compiles a 30-line C kernel (``cc -O3 -mavx2 -fopenmp``, under a second), the dot product
llama.cpp's Q8_0 uses on AVX2: the row quantized to int8 with one scale, ``maddubs`` over
sign-adjusted bytes, int32 sums, scaled by the row's and each weight row's scale; weights int8 per
output channel, as ``int8`` stores them. Then it times both on ``--matrices`` distinct [N, K]
weights (so they stream from memory, as in a decode step) at one row, and prints GB/s of weights
read and the relative error against fp32.

Measured (2 AVX2 cores, 3072x576, 40 matrices, two interleaved rounds): this kernel 95.5 and 91.6 us
a product (18.5, 19.3 GB/s); FBGEMM 176.8 and 174.1 us (10.0, 10.2 GB/s): 1.85x and 1.90x; relative
error 1.1% (8-bit activations, one scale a row). Not yet the engine's:
wiring it in (a compiled kernel cached by source hash, chosen per shape at load by this
measurement, FBGEMM kept for prompts) is issue 42's next step.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path
import shutil
import subprocess
import tempfile
import time

import torch

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
static inline int hsum(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  return _mm_cvtsi128_si32(a);
}
/* y[N] = (x quantized per row) . W[N, K] int8, times the row's and each weight row's scale; K % 32 == 0 */
void q8_gemv(const float* x, int K, const int8_t* W, const float* ws, float* y, int N, int8_t* xq) {
  float amax = 0;
  for (int k = 0; k < K; k++) { float a = fabsf(x[k]); if (a > amax) amax = a; }
  float sx = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / sx;
  for (int k = 0; k < K; k++) xq[k] = (int8_t)nearbyintf(x[k] * inv);
  const __m256i ones = _mm256_set1_epi16(1);
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const int8_t* w = W + (long)n * K;
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < K; k += 32) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
      __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + k));
      __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    y[n] = hsum(acc) * sx * ws[n];
  }
}
"""


def build(folder: Path) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc/gcc) on this machine")
    (folder / "q8.c").write_text(SOURCE)
    t0 = time.perf_counter()
    subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(folder / "q8.c"),
                    "-o", str(folder / "libq8.so")], check=True)  # fmt: skip
    print(f"compiled in {time.perf_counter() - t0:.2f} s")
    lib = ctypes.CDLL(str(folder / "libq8.so"))
    lib.q8_gemv.restype = None
    lib.q8_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_void_p]  # fmt: skip
    return lib


def timed_us(fn, repeats: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    from variantbench.environment import cpu_flags, cpu_model
    from variantbench.variants.int8 import Int8Linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--matrices", type=int, default=40)
    args = ap.parse_args()
    n, k = args.n, args.k
    flags = cpu_flags()
    print(f"cpu: {cpu_model()}; flags: {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx', 'fma'))))}; "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    if "avx2" not in flags or k % 32:
        raise SystemExit("needs AVX2 and K a multiple of 32")
    lib = build(Path(tempfile.mkdtemp(prefix="vb-q8-")))
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(args.matrices)]
    packed = []
    for w in weights:
        scale = (w.abs().amax(1) / 127).contiguous()
        packed.append((torch.round(w / scale[:, None]).to(torch.int8).contiguous(), scale))
    x, y, xq = torch.randn(1, k), torch.empty(n), torch.empty(k, dtype=torch.int8)

    def q8(i: int) -> torch.Tensor:
        wq, scale = packed[i]
        lib.q8_gemv(x.data_ptr(), k, wq.data_ptr(), scale.data_ptr(), y.data_ptr(), n, xq.data_ptr())
        return y

    ref = (x @ weights[0].t())[0]
    print(f"relative error against fp32: {float((q8(0) - ref).norm() / ref.norm()):.4f}")
    torch.backends.quantized.engine = "fbgemm"
    mods = []
    for w in weights:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data.copy_(w)
        mods.append(Int8Linear.from_linear(lin, per_token=True))
    with torch.inference_mode():
        for _ in range(2):  # interleaved
            ours = timed_us(lambda: [q8(i) for i in range(len(packed))]) / len(packed)
            fbgemm = timed_us(lambda: [m(x) for m in mods]) / len(mods)
            print(f"one row, {n}x{k}: q8 kernel {ours:7.1f} us ({n * k / ours / 1e3:5.1f} GB/s)   "
                  f"FBGEMM {fbgemm:7.1f} us ({n * k / fbgemm / 1e3:5.1f} GB/s)   {fbgemm / ours:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
