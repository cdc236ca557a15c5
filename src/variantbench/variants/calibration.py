"""What quantization-aware recipes measure on calibration text: Linear inputs and int8 error.

Shared by ``smooth`` (per-channel input maxima to migrate; the int8 error before and after),
``keep-fp32`` (the ranking of Linear layers by their int8 error) and ``qat-int8`` (held-out KL).
Every measurement runs the layer through the same :class:`~variantbench.variants.int8.Int8Linear`
the ``int8`` recipe builds, so the error reported is the error the variant will have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import copy
import statistics
from typing import Any

import torch
from torch import nn

from variantbench.errors import UserError


def calibration_batch(prompts: list[list[int]], max_rows: int = 8) -> torch.Tensor:
    """The calibration prompts as one ``[rows, tokens]`` batch, cut to the shortest prompt."""
    rows = [p for p in prompts if p][:max_rows]
    if not rows:
        raise UserError("no calibration text to measure on")
    length = min(len(p) for p in rows)
    if length < 8:
        raise UserError(f"calibration prompts of {length} tokens are too short to measure on")
    return torch.tensor([p[:length] for p in rows])


def linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            yield name, module


@contextlib.contextmanager
def _hooks(
    model: nn.Module, fn: Callable[[str, nn.Linear, torch.Tensor, torch.Tensor], None]
) -> Iterator[None]:
    handles = [
        m.register_forward_hook(lambda mod, inp, out, name=name: fn(name, mod, inp[0].detach(), out.detach()))
        for name, m in linears(model)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def input_absmax(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per Linear layer: the absolute maximum of each input channel over the batch."""
    found: dict[str, torch.Tensor] = {}

    def record(name: str, _mod: nn.Linear, x: torch.Tensor, _y: torch.Tensor) -> None:
        a = x.abs().reshape(-1, x.shape[-1]).amax(0).float()
        found[name] = torch.maximum(found[name], a) if name in found else a

    with _hooks(model, record), torch.inference_mode():
        model(batch)
    return found


def _ratio(values: torch.Tensor) -> float:
    return float(values.max() / values.median().clamp(min=1e-12))


def int8_errors(model: nn.Module, batch: torch.Tensor, per_token: bool) -> list[dict[str, Any]]:
    """Per Linear layer, on the batch: the relative output error of its int8 form (activations and
    weights quantized), of its weights alone quantized, and how outlying its inputs are (the largest
    channel's maximum over the median channel's, and the same over tokens). Worst first."""
    from variantbench.variants.int8 import Int8Linear

    rows: list[dict[str, Any]] = []

    def measure(name: str, mod: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        q = Int8Linear.from_linear(copy.deepcopy(mod), per_token)
        w = q.inner.weight().dequantize()
        norm = y.norm().clamp(min=1e-12)
        flat = x.abs().reshape(-1, x.shape[-1])
        rows.append(
            {
                "layer": name,
                "int8_error": round(float((q(x) - y).norm() / norm), 5),
                "weight_error": round(float((nn.functional.linear(x, w, mod.bias) - y).norm() / norm), 5),
                "channel_outliers": round(_ratio(flat.amax(0)), 1),
                "token_outliers": round(_ratio(flat.amax(1)), 1),
            }
        )

    with _hooks(model, measure), torch.inference_mode():
        model(batch)
    rows.sort(key=lambda r: -r["int8_error"])
    return rows


def error_summary(rows: list[dict[str, Any]], worst: int = 8) -> dict[str, Any]:
    """The manifest's view of :func:`int8_errors`: medians per projection kind, the worst layers."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        kinds.setdefault(r["layer"].rsplit(".", 1)[-1], []).append(r)
    return {
        "median_int8_error": round(statistics.median(r["int8_error"] for r in rows), 5) if rows else None,
        "by_kind": {
            kind: {
                key: round(statistics.median(r[key] for r in group), 4)
                for key in ("int8_error", "weight_error", "channel_outliers", "token_outliers")
            }
            for kind, group in sorted(kinds.items())
        },
        "worst": rows[:worst],
    }


def logit_kl(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || logits) in nats per token, top-1 agreement)."""
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    return kl, float((reference.argmax(-1) == logits.argmax(-1)).float().mean())


def int8_kl(
    model: nn.Module,
    reference: torch.Tensor,
    windows: torch.Tensor,
    per_token: bool,
    keep: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[float, float]:
    """(KL, top-1) of the int8 form of ``model`` (a copy; ``keep`` stays float) against ``reference``
    logits on ``windows``: what the int8 step after a recipe will give."""
    from variantbench.variants.int8 import quantize_linears

    with torch.inference_mode():
        return logit_kl(reference, quantize_linears(copy.deepcopy(model), per_token, keep)(windows).logits)


def held_out_windows(ids: list[int], rows: int = 4, length: int = 256) -> torch.Tensor:
    """Consecutive windows from the start of the held-out text (no sampling: the same every build)."""
    length = min(length, max(8, len(ids) // rows))
    if len(ids) < rows * length:
        raise UserError(f"held-out text of {len(ids)} tokens is too short for {rows} windows")
    return torch.tensor([ids[i * length : (i + 1) * length] for i in range(rows)])
