"""Dynamic int8: int8 weights, activations quantized at run time, on every Linear layer.

``int8[:act=tensor|token]``. API choice, by measurement on this project's CPU (AVX2, no VNNI):
FBGEMM's ``quantized::linear_dynamic`` (the kernel of ``torch.ao.quantization.quantize_dynamic``,
deprecated but shipped) was the only PyTorch int8 path faster than fp32: a 512x576 by 576x1536
matmul took 3.2 ms against 5.7 ms in fp32, and the 49,152-row output projection at 8 rows 1.9 ms
against 23 ms. ``torch._int_mm`` (which torchao's int8 dynamic configs run on) took 330 ms and
420 ms for the same two: a reference loop on this CPU. Weights are quantized per output channel.

Why ``act=token``: FBGEMM quantizes a whole activation tensor with one scale (7-bit, ``reduce_range``),
so a few outlier tokens and channels set the step for every other value. On SmolLM2-135M, plain
``int8`` measured KL 1.10 nats against fp32 and 47% top-1 agreement on 512 tokens of held-out text.
``act=token`` divides each row by its own absolute maximum before the kernel and multiplies the
output rows back: per-token scales at FBGEMM's speed (KL 0.14, top-1 79%; prefill 0.95 s against
0.83 s for ``int8`` and 1.24 s for fp32 at 512 tokens). The channel outliers are ``smooth``'s job
(``smooth+int8:act=token``: KL 0.03, top-1 91%).

On CUDA (issue 43) the same recipe is torchao's ``Int8DynamicActivationInt8WeightConfig`` over bf16
activations: int8 x int8 products on the tensor cores (compute capability 8.0), activations per token
whatever ``act`` says (torchao offers no other), weights per channel. Without torchao it is one line.

Layers named in the model config's ``variantbench_float_layers`` (written by ``keep-fp32``) stay
float32. The embedding table stays float32; a tied output projection gets its own int8 copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal
import warnings

import torch
from torch import nn

from variantbench import native
from variantbench.devices import DeviceNeed
from variantbench.variants import q8_kernel
from variantbench.variants.base import Recipe, keyword_args, register

# model.config attribute: names of Linear layers that int8 leaves in float32 (see keep-fp32)
FLOAT_LAYERS = "variantbench_float_layers"


class Int8Dynamic(Recipe):
    weight_format: ClassVar[str] = "int8"
    act: Literal["tensor", "token"] = "tensor"
    devices: ClassVar[DeviceNeed] = DeviceNeed(
        min_capability=(8, 0), for_what="int8 tensor-core products (torch._int_mm), Ampere and newer"
    )

    def caveat(self, device: Any) -> str | None:
        if device.type == "cuda" and self.act == "tensor":
            return "int8 on CUDA: torchao quantizes activations per token (act=token), not per tensor"
        return None

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> Int8Dynamic:
        return cls(kind=kind, **keyword_args(kind, args, ("act",)))


def _dynamic(linear: nn.Linear) -> nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    linear.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notices
        return DynamicLinear.from_float(linear)


def joined_biases(biases: list[torch.Tensor | None], modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """The biases of fused modules end to end (zeros for one without); None when none has one."""
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(m.out_features)
            for b, m in zip(biases, modules, strict=True)
        ]
    )


class Int8Linear(nn.Module):
    """One FBGEMM dynamic int8 Linear, its activations quantized per tensor or per token.

    Per token: each row is divided by its absolute maximum, so the kernel's one scale per tensor
    is a scale per row, and the output rows are multiplied back; the bias is added after, in float.
    ``fuse`` concatenates several (q/k/v, gate/up) into one kernel call with the same int8 values.
    """

    def __init__(self, inner: nn.Module, per_token: bool, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.per_token = per_token
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self._q8: bool | None = None
        self._q8_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def q8_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 weights [N, K], their float32 scales, the float32 bias added after): the q8 kernel's
        copy of the weights, made once (the fused decode step reads it too)."""
        if self._q8_copy is None:
            bias = self.bias if self.per_token else self.inner.bias()
            self._q8_copy = (*q8_weights(self), None if bias is None else bias.detach().float())
        return self._q8_copy

    def _q8_path(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``q8_arrays`` where the q8 kernel is chosen for this shape (``q8_choice``), decided on the
        first few-row call; None: FBGEMM."""
        if self._q8 is None:
            self._q8 = q8_choice(self) == "q8"
        return self.q8_arrays() if self._q8 else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_token: bool) -> Int8Linear:
        bias = linear.bias.detach().float().clone() if linear.bias is not None and per_token else None
        if per_token:
            linear.bias = None
        return cls(_dynamic(linear), per_token, bias)

    @classmethod
    def fuse(cls, modules: Sequence[Int8Linear]) -> Int8Linear:
        """One module computing ``cat([m(x) for m in modules], -1)`` in one kernel call."""
        if len(modules) == 1:
            return modules[0]
        weights = [m.inner.weight() for m in modules]
        ints = torch.cat([w.int_repr() for w in weights])
        scales = torch.cat([w.q_per_channel_scales() for w in weights])
        zeros = torch.cat([w.q_per_channel_zero_points() for w in weights])
        qweight = torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)
        inner_bias = joined_biases([m.inner.bias() for m in modules], modules)
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        inner = DynamicLinear(ints.shape[1], ints.shape[0], bias_=inner_bias is not None, dtype=torch.qint8)
        inner.set_weight_bias(qweight, inner_bias)
        bias = joined_biases([m.bias for m in modules], modules)
        return cls(inner, modules[0].per_token, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        # a decode step's few rows through the q8 kernel (per-row scales: for act=tensor, one row only)
        if rows <= (q8_kernel.MAX_ROWS if self.per_token else 1) and (q8 := self._q8_path()) is not None:
            run, _ = q8_kernel.kernel()
            assert run is not None
            with native.labelled("q8_gemm"):
                y = run(x.reshape(rows, self.in_features).float().contiguous(), q8[0], q8[1])
            y = y.view(*x.shape[:-1], self.out_features)
            return y if q8[2] is None else y.add_(q8[2])
        if not self.per_token:
            return self.inner(x)
        if x.numel() == self.in_features:
            # One row (a decode step at batch 1): the kernel's one scale per tensor is that row's own,
            # and quantizing is scale-invariant, so the division and the multiplication back (five
            # small ops of ~15 us each here, 121 projections a token) would change nothing but time.
            y = self.inner(x)
            return y if self.bias is None else y.add_(self.bias)
        # labelled for the diagnosis (quantize/dequantize family) only while a profiler runs
        label = native.labelled("quantize_per_token")
        with label:
            scale = x.abs().amax(-1, keepdim=True).clamp_(min=1e-12)
            scaled = x / scale
        y = self.inner(scaled)
        with label:
            y = y.mul_(scale)
        return y if self.bias is None else y.add_(self.bias)


# (N, K) -> "q8" | "fbgemm": which product this process chose for a decode step of that shape
Q8_CHOICES: dict[tuple[int, int], str] = {}


def q8_weights(module: Int8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's int8 weights [N, K] in [-127, 127] and their float32 scales, as the q8 kernel reads
    them (-128 -> -127: the kernel negates weights by the activations' signs, and -(-128) wraps)."""
    weight = module.inner.weight()
    return weight.int_repr().clamp(min=-127).contiguous(), weight.q_per_channel_scales().float().contiguous()


def q8_choice(module: Int8Linear) -> str:
    """The faster of the q8 kernel and FBGEMM for one row of ``module``'s shape, measured once per shape
    and process (5 calls each after a warm one, the weights out of cache as a decode step meets them:
    ``native.best_cold``); "fbgemm" where the kernel is unavailable or K is not a multiple of 32."""
    key = (module.out_features, module.in_features)
    if key not in Q8_CHOICES:
        run, _ = q8_kernel.kernel()
        if run is None or module.in_features % 32:
            Q8_CHOICES[key] = "fbgemm"
            return Q8_CHOICES[key]

        x = torch.randn(1, module.in_features)
        ints, scales = q8_weights(module)
        with torch.inference_mode():
            q8 = native.best_cold(lambda: run(x, ints, scales))
            fbgemm = native.best_cold(lambda: module.inner(x))
        Q8_CHOICES[key] = "q8" if q8 < fbgemm else "fbgemm"
    return Q8_CHOICES[key]


def kernel_summary() -> str | None:
    """What this process's int8 products ran on at a decode step's rows, for the variant's info."""
    if not Q8_CHOICES:
        return None
    _, how = q8_kernel.kernel()
    chosen = sorted(f"{n}x{k}: {c}" for (n, k), c in Q8_CHOICES.items())
    return (
        f"int8 at <= {q8_kernel.MAX_ROWS} rows, chosen per shape by a timing at first use ({how}): "
        + ", ".join(chosen)
    )


def quantize_linears(model: nn.Module, per_token: bool, keep: set[str] = frozenset()) -> nn.Module:  # type: ignore[assignment]
    """Every Linear not named in ``keep`` becomes an :class:`Int8Linear` (in place)."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and full not in keep:
                setattr(parent, child_name, Int8Linear.from_linear(child, per_token))
    return model


@register(
    "int8", Int8Dynamic, "dynamic int8 weights and activations on Linear layers (CPU, FBGEMM; act=token)"
)
def to_int8(model: nn.Module, recipe: Recipe) -> nn.Module:
    assert isinstance(recipe, Int8Dynamic)
    device = next(model.parameters()).device
    keep = set(getattr(model.config, FLOAT_LAYERS, None) or ())
    if device.type == "cuda":
        return _int8_cuda(model, keep)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    model = model.to(torch.float32)
    return quantize_linears(model, recipe.act == "token", keep)


def _int8_cuda(model: nn.Module, keep: set[str]) -> nn.Module:
    from variantbench.variants.weight_only import _torchao

    q = _torchao("int8 on CUDA")
    model = model.to(torch.bfloat16)
    q.quantize_(model, q.Int8DynamicActivationInt8WeightConfig(),
                filter_fn=lambda m, name: type(m) is nn.Linear and name not in keep)  # fmt: skip
    return model
