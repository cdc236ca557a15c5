"""Small C kernels the engine compiles on first use, where torch has no fast one (issue 42).

A kernel is one C source and its compiler flags; it is built once (``cc``, under a second) into the
cache, keyed by the hash of both, and loaded with ctypes. The build writes to a temporary file and
renames it, so two processes building at once leave one whole library. The OpenMP it links is the
libgomp torch already loaded (same soname): its parallel loops share torch's one thread pool on the
compute thread (``variantbench.compute``), where a second pool would throttle both.

``VARIANTBENCH_NATIVE_KERNELS=0`` turns every kernel off (the engine then keeps torch's products);
where the CPU lacks the instructions a kernel needs or there is no C compiler, the kernel is None
with the reason, said in the variant's info.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import ctypes
import hashlib
import os
from pathlib import Path
import shutil
import subprocess
import tempfile
import time
from typing import Any

# Bytes read between two timed calls of ``best_cold``: more than the last-level cache of the hosts we
# get (32 MB an EPYC CCD), so the weights a call reads come from memory, as in a decode step
EVICT_BYTES = 64 << 20


# What the kernels' C sources share: bf16 <-> float32, rounding to nearest even as torch does (a NaN
# stays a NaN), a float32 dot product in 8 partial sums (a loop the compiler vectorizes without
# reordering one sum), an RMSNorm's scale, and a softmax's exponentials (a polynomial exp of the scores
# less their maximum)
HELPERS_C = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
static inline uint16_t to_bf16(float f) {
  uint32_t b; memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return (uint16_t)(b >> 16);
}
static inline float from_bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
/* exp(x) for x <= 0 (scores less their maximum): 2^n * 2^f, f in [-1/2, 1/2], Cephes' exp2f polynomial */
static inline float exp_le0(float x) {
  x = x < -87.f ? -87.f : x;
  float t = x * 1.44269504088896341f;
  float n = (t + 12582912.f) - 12582912.f;  /* t rounded to the nearest integer (1.5 * 2^23 trick) */
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  int32_t e = ((int32_t)n + 127) << 23;
  float s; memcpy(&s, &e, 4);
  return p * s;
}
static inline float dot(const float* a, const float* b, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float s = 0;
  for (; i < d; i++) s += a[i] * b[i];
  for (int j = 0; j < 8; j++) s += acc[j];
  return s;
}
/* 1 / the root mean square of v (plus eps): an RMSNorm's scale */
static inline float inv_rms(const float* v, int d, float eps) { return 1.f / sqrtf(dot(v, v, d) / (float)d + eps); }
/* s[0..T) <- exp(s - max(s)); returns 1 / their sum */
static inline float softmax_exp(float* s, int T) {
  float m = s[0];
  for (int t = 1; t < T; t++) m = s[t] > m ? s[t] : m;
  for (int t = 0; t < T; t++) s[t] = exp_le0(s[t] - m);
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0;
  int t = 0;
  for (; t + 8 <= T; t += 8)
    for (int j = 0; j < 8; j++) part[j] += s[t + j];
  for (; t < T; t++) sum += s[t];
  for (int j = 0; j < 8; j++) sum += part[j];
  return 1.f / sum;
}
"""


def labelled(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` while torch's profiler runs, else nothing: a ctypes call is no
    torch operator, so without it the diagnosis would count a kernel's time as Python between
    operators. Named so ``analysis.diagnosis.family_of`` files it (``*_gemm`` matmul, ``rms_norm*``
    norm, ``*attention*`` attention)."""
    import torch

    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def disabled(switch: str) -> str | None:
    """Why kernels are off by the environment (``switch`` or the global one), or None."""
    for name in ("VARIANTBENCH_NATIVE_KERNELS", switch):
        if os.environ.get(name, "1") == "0":
            return f"off ({name}=0)"
    return None


def vector_flags() -> tuple[str, ...]:
    """The flags for plain C loops the compiler vectorizes: AVX2 and FMA where the CPU has them (every
    host class we get), else the compiler's x86-64 baseline (SSE2)."""
    from variantbench.environment import cpu_flags

    return ("-mavx2", "-mfma") if {"avx2", "fma"} <= set(cpu_flags()) else ()


def load(name: str, source: str, flags: tuple[str, ...], switch: str) -> tuple[ctypes.CDLL | None, str]:
    """The kernel's library, built once (``build``), unless the environment turns it off (``switch``)."""
    off = disabled(switch)
    return (None, off) if off else build(name, source, flags)


def build(name: str, source: str, flags: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, its file name) or (None, why not): compiled once per source and flags."""
    from variantbench.paths import cache_root

    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{name}-{key}.so"
    if not target.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None, "no C compiler (cc) to build it"
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            done = subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True, text=True,
                                  check=False)  # fmt: skip
            if done.returncode != 0:
                return None, f"the compiler failed: {(done.stderr.strip().splitlines() or ['?'])[0][:160]}"
            os.replace(out, target)  # atomic: a concurrent build leaves one whole file
    try:
        return ctypes.CDLL(str(target)), target.name
    except OSError as exc:
        return None, f"could not load it: {exc}"


def best_cold(fn: Callable[[], Any], repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after a warm one), each after reading
    ``EVICT_BYTES`` of other memory: a decode step streams 30 layers' weights through the caches, so a
    product meets its weights cold. Timed warm, FBGEMM's int8 product won the 3072x576 and 49152x576
    shapes against the q8 kernel on an AVX-512 VNNI EPYC, while over weights streamed from memory the
    kernel took 64 against 103 us (3072x576) and 943 against 1,112 us (49152x576)."""
    import torch

    evict = torch.ones(EVICT_BYTES // 4)
    fn()
    best = float("inf")
    for _ in range(repeats):
        evict.sum()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
