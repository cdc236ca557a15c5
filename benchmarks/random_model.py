"""A Hugging Face folder with random weights in the shape of a larger model of the default's family.

    python benchmarks/random_model.py OUT [--shape smollm2-360m|smollm2-1.7b] [--seed 0]

No network at run time, so a larger model for the memory and speed benchmarks is built here: the
default model's tokenizer and chat template, a ``LlamaConfig`` with the published shape of the named
SmolLM2 model (hidden size, layers, heads, MLP width; tied embeddings as theirs), weights drawn by
transformers' own initialiser. Timings and memory depend on the shape, not on the weights' values;
answers do not (random weights decode noise, up to ``max_tokens``). Then e.g.

    python benchmarks/paged_kv.py --model OUT --parts idle --idle-caches paged
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from variantbench.models import parse_model, prepare_model

# the published configs of HuggingFaceTB/SmolLM2-360M-Instruct and -1.7B-Instruct (config.json)
SHAPES = {
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, rope_theta=100000.0),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, rope_theta=130000.0),
}  # fmt: skip


def build(out: Path, shape: str, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    base = prepare_model(parse_model(None), status=print)
    config = AutoConfig.from_pretrained(base)
    shape_of = dict(SHAPES[shape])
    theta = shape_of.pop("rope_theta")
    for key, value in shape_of.items():
        setattr(config, key, value)
    config.rope_parameters = {"rope_theta": theta, "rope_type": "default"}  # transformers 5's field
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: {shape} with random weights, {params / 1e6:.0f} M parameters, {params * 4 / 2**20:.0f} MiB fp32"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-360m")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build(args.out, args.shape, args.seed)


if __name__ == "__main__":
    main()
