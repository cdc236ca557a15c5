"""RMSNorm in one call, where torch takes five to seven (issue 42).

A decode step normalizes twice a layer (61 times a token for SmolLM2's 30 layers). On a vector of
576, ``torch.rms_norm`` cost 9.4 us on 2 AVX-512 cores (its CPU path is the composite: pow, mean,
add, rsqrt, mul), and the bf16 path more (a cast each way); the work itself is under a microsecond.
This kernel computes a row's statistics in float32 and applies the scale as the engine's ``Norm``
does, rounding bf16 where torch rounds it, in 2.4 us a call through ctypes:

* float32: ``x * rsqrt(mean(x^2) + eps) * w``;
* bf16, Llama's order: ``w * bf16(x * r)`` (two roundings, as transformers' LlamaRMSNorm);
* bf16, ``upcast`` (Gemma, OLMo 2): ``bf16(x * r * w)`` with the weight in float32.

Every row count takes it (a prompt's rows too, one after another): a row's result then never
depends on how many rows shared its call, so a prompt prefilled in chunks or in a batch decodes the
same tokens. Compiled once (``variantbench.native``); where it is not (no compiler, the switch
``VARIANTBENCH_NORM_KERNEL=0``), ``Norm`` keeps torch's ops.
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
void rms_f32(const float* x, const float* w, float* y, int rows, int d, float eps) {
  for (int r = 0; r < rows; r++) {
    const float* a = x + (long)r * d;
    float* o = y + (long)r * d;
    float inv = inv_rms(a, d, eps);
    for (int i = 0; i < d; i++) o[i] = a[i] * inv * w[i];
  }
}
/* upcast == 0: w is bf16, y = bf16(w * bf16(x * r)); upcast == 1: w is float32, y = bf16(x * r * w);
   xf: d floats of scratch */
void rms_bf16(const uint16_t* x, const void* w, uint16_t* y, int rows, int d, float eps, int upcast, float* xf) {
  for (int r = 0; r < rows; r++) {
    const uint16_t* a = x + (long)r * d;
    uint16_t* o = y + (long)r * d;
    for (int i = 0; i < d; i++) xf[i] = from_bf16(a[i]);
    float inv = inv_rms(xf, d, eps);
    if (upcast) {
      const float* wf = (const float*)w;
      for (int i = 0; i < d; i++) o[i] = to_bf16(xf[i] * inv * wf[i]);
    } else {
      const uint16_t* wb = (const uint16_t*)w;
      for (int i = 0; i < d; i++) o[i] = to_bf16(from_bf16(wb[i]) * from_bf16(to_bf16(xf[i] * inv)));
    }
  }
}
"""
)
FLAGS = ("-O3", "-shared", "-fPIC")


class Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        f32, bf16 = lib.rms_f32, lib.rms_bf16
        f32.restype = bf16.restype = None
        f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_float]
        bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                  ctypes.c_void_p]  # fmt: skip
        self.f32, self.bf16 = f32, bf16

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, upcast: bool) -> torch.Tensor:
        """``x`` [..., d] contiguous, float32 with a float32 ``weight`` or bf16 with a bf16 one (a
        float32 one where ``upcast``)."""
        d = x.shape[-1]
        rows = x.numel() // d
        y = torch.empty_like(x)
        with native.labelled("rms_norm_kernel"):
            self._run(x, weight, y, rows, d, eps, upcast)
        return y

    def _run(self, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rows: int, d: int, eps: float,
             upcast: bool) -> None:  # fmt: skip
        if x.dtype == torch.float32:
            self.f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, d, eps)
        else:
            scratch = torch.empty(d)
            self.bf16(
                x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, d, eps, int(upcast), scratch.data_ptr()
            )


@functools.cache
def kernel() -> tuple[Kernel | None, str]:
    """(the kernel, how it was had) or (None, why not): compiled once, cached."""

    lib, how = native.load("rmsnorm", SOURCE, FLAGS + native.vector_flags(), "VARIANTBENCH_NORM_KERNEL")
    return (Kernel(lib), f"rmsnorm kernel ({how})") if lib is not None else (None, how)


def applies(x: torch.Tensor, weight: torch.Tensor, upcast: bool) -> bool:
    """Whether the kernel computes this norm: on the CPU, float32 with a float32 weight, or bf16 with
    a bf16 weight (float32 where ``upcast``)."""
    if x.device.type != "cpu" or not x.is_contiguous():
        return False
    if x.dtype == torch.float32:
        return weight.dtype == torch.float32
    if x.dtype == torch.bfloat16:
        return weight.dtype == (torch.float32 if upcast else torch.bfloat16)
    return False
