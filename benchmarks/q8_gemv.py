"""Is a small AVX2 int8 kernel faster than FBGEMM's at one row? The measurement that decides issue
42's next step for int8 decode.

    python benchmarks/q8_gemv.py [--n 3072] [--k 576] [--matrices 40]

FBGEMM's dynamic int8 product (what ``int8`` runs) reads its weights at well under the memory
bandwidth at one row, so int8 decodes no faster than fp32 although it reads a quarter of the bytes.
This times the engine's q8 kernel (``variants/q8_kernel.py``: llama.cpp's Q8_0 dot product on AVX2
in 30 lines of C, compiled on first use) against FBGEMM on ``--matrices`` distinct [N, K]
weights (so they stream from memory, as in a decode step) at one row, and prints GB/s of weights
read and the relative error against fp32.

Measured (2 AVX2 cores, 3072x576, 40 matrices, two interleaved rounds): this kernel 95.5 and 91.6 us
a product (18.5, 19.3 GB/s); FBGEMM 176.8 and 174.1 us (10.0, 10.2 GB/s): 1.85x and 1.90x; relative
error 1.1% (8-bit activations, one scale a row). ``int8`` now runs it for a decode step's rows
where a timing at first use finds it the faster for the shape.
"""

from __future__ import annotations

import argparse
import time

import torch


def timed_us(fn, repeats: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    from variantbench.environment import cpu_flags, cpu_model
    from variantbench.variants import q8_kernel
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
    run, how = q8_kernel.kernel()
    if run is None:
        raise SystemExit(f"no q8 kernel here: {how}")
    print(how)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(args.matrices)]
    packed = []
    for w in weights:
        scale = (w.abs().amax(1) / 127).contiguous()
        packed.append((torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale))
    x = torch.randn(1, k)

    def q8(i: int) -> torch.Tensor:
        wq, scale = packed[i]
        return run(x, wq, scale)

    ref = x @ weights[0].t()
    print(f"relative error against fp32: {float((q8(0) - ref).norm() / ref.norm()):.4f}")
    torch.backends.quantized.engine = "fbgemm"
    mods = []
    for w in weights:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data.copy_(w)
        mod = Int8Linear.from_linear(lin, per_token=True)
        mod._q8 = False  # FBGEMM's product, as int8 ran before the kernel
        mods.append(mod)
    with torch.inference_mode():
        for _ in range(2):  # interleaved
            ours = timed_us(lambda: [q8(i) for i in range(len(packed))]) / len(packed)
            fbgemm = timed_us(lambda: [m(x) for m in mods]) / len(mods)
            print(f"one row, {n}x{k}: q8 kernel {ours:7.1f} us ({n * k / ours / 1e3:5.1f} GB/s)   "
                  f"FBGEMM {fbgemm:7.1f} us ({n * k / fbgemm / 1e3:5.1f} GB/s)   {fbgemm / ours:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
