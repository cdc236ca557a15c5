"""How many bytes a variant's weights take, whatever form the recipe left them in."""

from __future__ import annotations

import torch
from torch import nn


def _tensor_bytes(t: torch.Tensor) -> int:
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t.detach()) is not torch.Tensor:
        # a tensor subclass (torchao's quantized weights): the bytes of the tensors it holds
        names, _ctx = flatten()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    if t.is_quantized:
        # int8 payload plus its scale/zero-point (per tensor or per channel)
        extra = 0
        if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            extra = t.q_per_channel_scales().numel() * 8 + t.q_per_channel_zero_points().numel() * 8
        else:
            extra = 16
        return t.numel() * t.element_size() + extra
    return t.numel() * t.element_size()


def param_bytes(model: nn.Module) -> int:
    """Bytes of every distinct weight: parameters, buffers that persist, and packed quantized weights."""
    seen: set[object] = set()
    total = 0

    def add(t: torch.Tensor | None, owner: object = None) -> None:
        nonlocal total
        if t is None:
            return
        # Packed quantized weights are unpacked into a fresh tensor on each call: key them by their
        # (live) module. Plain tensors are keyed by memory, so tied weights count once.
        if owner is None and type(t.detach()) is not torch.Tensor:
            owner = ("subclass", id(t))  # a wrapper has no storage of its own
        key = owner if owner is not None else (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return
        seen.add(key)
        total += _tensor_bytes(t)

    for module in model.modules():
        weight_fn = getattr(module, "weight", None)
        if callable(weight_fn) and hasattr(module, "_packed_params"):
            add(weight_fn(), owner=("weight", id(module)))
            bias_fn = getattr(module, "bias", None)
            add(bias_fn() if callable(bias_fn) else None, owner=("bias", id(module)))
        for p in module.parameters(recurse=False):
            add(p)
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module.named_buffers(recurse=False):
            if name not in non_persistent:
                add(b)
    return total


def streamed_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads from memory: every weight once, less an embedding table that the
    output projection does not share (a token looks up one row of it). int8 gives a tied head its own
    int8 copy, so its fp32 table (113 MB of SmolLM2-135M's 251) is not read per token; counting it
    halved int8's roofline in ``benchmarks/decode.py``."""
    total = param_bytes(model)
    embed = getattr(model.get_input_embeddings(), "weight", None)
    head = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(embed, torch.Tensor) or head is embed:
        return total
    return total - embed.numel() * embed.element_size()
