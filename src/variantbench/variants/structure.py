"""Structural recipes for Llama-architecture models: attention-head pruning and layer reduction.

Both measure importance on calibration prompts drawn from the workload generator (seeded), rebuild
a smaller model of the same class from an edited config, and copy the kept weights into it, so the
result saves and loads as a normal Hugging Face folder.

**prune-heads:RATIO[,groups]**. The importance of a query head is the mean L2 norm, over every
calibration token, of what that head writes into the residual stream (its slice of ``o_proj``'s
input times its columns of ``o_proj``). Grouped-query attention ties query heads to key/value
heads in equal groups (SmolLM2-135M: 9 query heads over 3 KV heads), and transformers' attention
needs equal group sizes, so:

- by default, ``round(RATIO * group size)`` query heads are removed *inside every group* (the least
  important of that group), keeping order by group: 0.3 of groups of 3 removes one head per group;
- with ``groups``, ``round(RATIO * KV heads)`` whole groups go (a group's importance is the sum of
  its query heads'), with their key and value heads.

The same number is removed in every layer (a config has one head count). ``head_dim`` is written
into the new config explicitly, or transformers would re-derive it from hidden size / heads.

**drop-layers:N**. ShortGPT's block influence: 1 - cosine similarity of a decoder layer's input and
output hidden states, averaged over calibration tokens; the N layers of least influence go. Kept
layers are renumbered (``self_attn.layer_idx``, without which cached generation breaks).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from pydantic import Field
import torch
from torch import nn

from variantbench.errors import UserError
from variantbench.variants.base import EVERY_FAMILY, Recipe, register, split_args


def _layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model.config, "num_key_value_heads"):
        raise UserError(f"structural recipes need a Llama-style model, got {type(model).__name__}")
    return layers


def _calibration(ctx: Any, model: nn.Module) -> list[torch.Tensor]:
    if ctx is None or not getattr(ctx, "calibration", None):
        raise UserError("this recipe needs calibration prompts (build it through variantbench)")
    device = next(model.parameters()).device
    return [torch.tensor([ids], device=device) for ids in ctx.calibration]


def _rebuild(model: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh model of the same class from ``config``, holding exactly ``state``."""
    fresh = type(model)(config)  # on the CPU: its non-persistent buffers (RoPE tables) are computed
    fresh.load_state_dict(state, assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh.eval()


# ---- prune-heads ------------------------------------------------------------------------------------


class PruneHeads(Recipe):
    stage: ClassVar[str] = "build"
    # a fused qkv_proj (phi3) or q/k norms over the whole projection (olmo2) are not split by head
    families: ClassVar[frozenset[str] | None] = frozenset(
        {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "qwen2_moe", "mixtral"}
    )
    ratio: float = Field(gt=0, lt=1)
    groups: bool = False  # remove whole key/value groups instead of query heads inside groups

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> PruneHeads:
        positional, named = split_args(args)
        if not positional:
            raise UserError("prune-heads needs a ratio, e.g. prune-heads:0.3")
        try:
            ratio = float(positional[0])
        except ValueError:
            raise UserError(f"prune-heads: ratio must be a number, got {positional[0]!r}") from None
        extra = set(positional[1:]) - {"groups"}
        if extra or named:
            raise UserError(f"prune-heads takes RATIO[,groups], got {args!r}")
        return cls(kind=kind, ratio=ratio, groups="groups" in positional[1:])

    def written(self) -> str:
        return f"prune-heads:{self.ratio:g}" + (",groups" if self.groups else "")


def head_importance(model: nn.Module, prompts: list[torch.Tensor]) -> torch.Tensor:
    """[layers, query heads]: mean L2 norm of each head's write into the residual stream."""
    layers = _layers(model)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nq = cfg.num_attention_heads
    totals = torch.zeros(len(layers), nq, dtype=torch.float64)
    count = 0
    hooks = []
    for li, layer in enumerate(layers):
        o_proj = layer.self_attn.o_proj

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], li: int = li) -> None:
            x = inputs[0].float()  # [B, S, nq*d]
            w = module.weight.float()  # [hidden, nq*d]
            per_head = x.view(*x.shape[:-1], nq, d)
            w_heads = w.view(w.shape[0], nq, d)
            contrib = torch.einsum("bshd,ohd->bsho", per_head, w_heads)  # [B, S, nq, hidden]
            totals[li] += contrib.norm(dim=-1).sum(dim=(0, 1)).double()

        hooks.append(o_proj.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for ids in prompts:
                model(ids)
                count += ids.numel()
    finally:
        for h in hooks:
            h.remove()
    return (totals / max(count, 1)).float()


def choose_heads(importance: torch.Tensor, n_kv: int, ratio: float, groups: bool) -> list[list[int]]:
    """Per layer, the query heads to keep (ascending), equal group sizes in every layer."""
    n_layers, nq = importance.shape
    size = nq // n_kv
    keep: list[list[int]] = []
    if groups:
        drop = round(ratio * n_kv)
        if not 1 <= drop <= n_kv - 1:
            raise UserError(
                f"prune-heads:{ratio},groups removes {drop} of {n_kv} key/value groups; "
                f"a ratio must remove between 1 and {n_kv - 1}"
            )
        for li in range(n_layers):
            score = importance[li].view(n_kv, size).sum(-1)
            kept_groups = sorted(score.argsort(descending=True)[: n_kv - drop].tolist())
            keep.append([g * size + j for g in kept_groups for j in range(size)])
        return keep
    drop = round(ratio * size)
    if not 1 <= drop <= size - 1:
        raise UserError(
            f"prune-heads:{ratio} removes {drop} of {size} query heads per key/value group; grouped-query "
            f"attention needs between 1 and {size - 1} (or prune whole groups with prune-heads:RATIO,groups)"
        )
    for li in range(n_layers):
        kept = []
        for g in range(n_kv):
            score = importance[li, g * size : (g + 1) * size]
            kept += sorted((g * size + j) for j in score.argsort(descending=True)[: size - drop].tolist())
        keep.append(kept)
    return keep


def prune_heads_to(model: nn.Module, keep: list[list[int]], groups: bool) -> nn.Module:
    """Structurally remove every query head not in ``keep`` (and whole KV groups when ``groups``)."""
    layers = _layers(model)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    size = nq // nkv
    new_nq = len(keep[0])
    state = {k: v for k, v in model.state_dict().items()}
    for li, layer in enumerate(layers):
        heads = keep[li]
        kv = sorted({h // size for h in heads})
        q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
        kv_rows = torch.cat([torch.arange(g * d, (g + 1) * d) for g in kv])
        prefix = f"model.layers.{li}.self_attn."
        attn = layer.self_attn
        state[prefix + "q_proj.weight"] = attn.q_proj.weight.detach()[q_rows].clone()
        state[prefix + "k_proj.weight"] = attn.k_proj.weight.detach()[kv_rows].clone()
        state[prefix + "v_proj.weight"] = attn.v_proj.weight.detach()[kv_rows].clone()
        state[prefix + "o_proj.weight"] = attn.o_proj.weight.detach()[:, q_rows].clone()
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            bias = getattr(getattr(attn, name), "bias", None)
            if bias is not None:
                state[prefix + f"{name}.bias"] = bias.detach()[rows].clone()
    config = copy.deepcopy(cfg)
    config.num_attention_heads = new_nq
    config.num_key_value_heads = len({h // size for h in keep[0]}) if groups else nkv
    config.head_dim = d  # explicit: hidden_size // heads would now be wrong
    return _rebuild(model, config, state)


@register("prune-heads", PruneHeads, "remove ~RATIO of attention heads by importance (RATIO[,groups])")
def prune_heads(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, PruneHeads)
    _layers(model)
    cfg = model.config
    # impossible ratios fail before any calibration work
    choose_heads(torch.ones(1, cfg.num_attention_heads), cfg.num_key_value_heads, recipe.ratio, recipe.groups)
    keep = choose_heads(
        head_importance(model, _calibration(ctx, model)), cfg.num_key_value_heads, recipe.ratio, recipe.groups
    )
    if ctx is not None:
        ctx.notes["prune-heads"] = {
            "importance": "mean L2 norm of each head's o_proj contribution over calibration tokens",
            "kept_heads": keep,
            "heads_before": cfg.num_attention_heads,
            "heads_after": len(keep[0]),
        }
    return prune_heads_to(model, keep, recipe.groups)


# ---- drop-layers -----------------------------------------------------------------------------------


class DropLayers(Recipe):
    stage: ClassVar[str] = "build"
    families: ClassVar[frozenset[str] | None] = EVERY_FAMILY
    count: int = Field(ge=1)

    @classmethod
    def from_args(cls, kind: str, args: str | None) -> DropLayers:
        positional, named = split_args(args)
        if len(positional) != 1 or named or not positional[0].isdigit():
            raise UserError(
                f"drop-layers takes the number of layers to remove, e.g. drop-layers:15 (got {args!r})"
            )
        return cls(kind=kind, count=int(positional[0]))

    def written(self) -> str:
        return f"drop-layers:{self.count}"


def block_influence(model: nn.Module, prompts: list[torch.Tensor]) -> list[float]:
    """Per layer: 1 - mean cosine similarity of its input and output hidden states (ShortGPT)."""
    layers = _layers(model)
    sims = [0.0] * len(layers)
    count = 0
    with torch.inference_mode():
        for ids in prompts:
            hidden = model(ids, output_hidden_states=True).hidden_states  # embeddings, then each layer
            for li in range(len(layers)):
                a, b = hidden[li][0].float(), hidden[li + 1][0].float()
                sims[li] += torch.nn.functional.cosine_similarity(a, b, dim=-1).sum().item()
            count += ids.shape[1]
    return [1 - s / count for s in sims]


def keep_layers(model: nn.Module, kept: list[int]) -> nn.Module:
    _layers(model)  # a Llama-style model, or a clear error
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index in kept:
                rest = key.split(".", 3)[3]
                state[f"model.layers.{kept.index(index)}.{rest}"] = value
        else:
            state[key] = value
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]
    fresh = _rebuild(model, config, state)
    for new_index, layer in enumerate(_layers(fresh)):
        layer.self_attn.layer_idx = new_index  # what the KV cache is indexed by
    return fresh


@register("drop-layers", DropLayers, "remove the N decoder layers of least block influence (ShortGPT)")
def drop_layers(model: nn.Module, recipe: Recipe, ctx: Any = None) -> nn.Module:
    assert isinstance(recipe, DropLayers)
    n = len(_layers(model))
    if recipe.count >= n:
        raise UserError(f"drop-layers:{recipe.count} would keep no layer of {n}; remove at most {n - 1}")
    influence = block_influence(model, _calibration(ctx, model))
    order = sorted(range(n), key=lambda i: influence[i])
    kept = sorted(order[recipe.count :])
    if ctx is not None:
        ctx.notes["drop-layers"] = {"block_influence": [round(x, 6) for x in influence], "kept_layers": kept}
    return keep_layers(model, kept)
