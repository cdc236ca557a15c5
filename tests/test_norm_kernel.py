"""The engine's RMSNorm kernel (issue 42) against torch's ops, in each order a family rounds in."""

from __future__ import annotations

import pytest
import torch

from variantbench.backends import norm_kernel
from variantbench.backends.engine import Norm


class _Module(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.variance_epsilon = eps


@pytest.mark.parametrize("d", [576, 64, 13])
@pytest.mark.parametrize(
    ("dtype", "upcast", "offset"),
    [
        (torch.float32, False, 0.0),
        (torch.bfloat16, False, 0.0),
        (torch.bfloat16, True, 1.0),
        (torch.float32, True, 1.0),
    ],
)
def test_the_kernel_computes_what_torchs_ops_compute(
    d: int, dtype: torch.dtype, upcast: bool, offset: float
) -> None:
    run, how = norm_kernel.kernel()
    if run is None:
        pytest.skip(f"no norm kernel here: {how}")
    torch.manual_seed(d)
    norm = Norm(_Module(torch.randn(d).to(dtype), 1e-6), offset=offset, upcast=upcast)
    assert norm.kernel is not None
    calls = []
    for rows in (1, 5):
        x = (torch.randn(1, rows, d) * 3).to(dtype)
        assert norm_kernel.applies(x, norm.weight, upcast)
        got, want = run(x, norm.weight, norm.eps, upcast), norm.torch_ops(x)
        calls.append(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:  # the float32 statistics may differ in the last bit: at most one bf16 step apart
            step = want.float().abs() * 2**-7 + 1e-30
            assert bool(((got.float() - want.float()).abs() <= step).all())
            assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(norm(x), got, rtol=0, atol=0)  # Norm takes the kernel
    # a row's result does not depend on the rows beside it
    x = (torch.randn(7, d) * 3).to(dtype)
    assert torch.equal(
        run(x, norm.weight, norm.eps, upcast)[3], run(x[3:4], norm.weight, norm.eps, upcast)[0]
    )


def test_norm_keeps_torchs_ops_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARIANTBENCH_NORM_KERNEL", "0")
    norm_kernel.kernel.cache_clear()
    try:
        assert norm_kernel.kernel() == (None, "off (VARIANTBENCH_NORM_KERNEL=0)")
        norm = Norm(_Module(torch.randn(64), 1e-6))
        assert norm.kernel is None
        x = torch.randn(2, 64)
        torch.testing.assert_close(norm(x), torch.rms_norm(x, (64,), norm.weight, 1e-6), rtol=0, atol=0)
    finally:
        norm_kernel.kernel.cache_clear()
