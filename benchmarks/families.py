"""Every registered family end to end, and its parity with transformers: the issue's "done means".

For each family: a tiny random folder (``variantbench.models.tiny``), the parity figures (max
|logit difference| against transformers on prefill and on 32 decode steps, greedy agreement, the
paged batch's tokens), then ``variantbench run --model DIR --variants fp32,bf16,int8,smooth+int8:act=token
--tasks 4``; where a recipe does not apply to the family the run's one-line refusal is printed and
the run repeated with the variants that do. An unregistered architecture (GPT-2) runs last, on the
transformers fallback. Prints a table; run folders under --out.

    python benchmarks/families.py [--out DIR] [--families qwen3,gemma2] [--no-runs]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import subprocess
import sys
import time

import torch

VARIANTS = ["fp32", "bf16", "int8", "smooth+int8:act=token"]


def parity(family: str) -> tuple[float, float, int, bool]:
    from variantbench.backends.engine import Decoder
    from variantbench.models.tiny import tiny_config, tiny_model
    from variantbench.serving.paged import PagedBatch

    model = tiny_model(tiny_config(family, 400), seed=3)
    prompt = list(range(3, 17))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        reference = model(torch.tensor([prompt])).logits[0]
    want = out.sequences[0, len(prompt) :].tolist()
    dec = Decoder(model)
    prefill_logits, steps = dec.teacher_forced_logits(prompt, want)
    prefill = (prefill_logits - reference).abs().max().item()
    decode = max((a - b[0]).abs().max().item() for a, b in zip(steps, out.logits, strict=True))
    got = dec.generate([prompt], 32).token_ids[0]
    agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), 32)
    batch = PagedBatch(dec, max_batch=2, max_len=96, prefill_chunk=5)
    first, _ = batch.join("x", [40, 41, 42, 7, 8, 9, 10], 20)
    batch.begin("y", prompt, 32)
    tokens: dict[str, list[int]] = {"x": [first]}
    while batch.active:
        for key, token, done in batch.step():
            tokens.setdefault(key, []).append(token)
            if done:
                batch.leave(key)
    paged = tokens["y"] == want and tokens["x"] == dec.generate([[40, 41, 42, 7, 8, 9, 10]], 20).token_ids[0]
    return prefill, decode, agree, paged


def run(folder: Path, out: Path, variants: list[str]) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "variantbench.cli", "run", "--model", str(folder), "--variants",
                           ",".join(variants), "--tasks", "4", "--out", str(out)], capture_output=True, text=True)  # fmt: skip
    last = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return proc.returncode, (last[-1] if last else ""), time.perf_counter() - t0


def main() -> None:
    from variantbench.environment import cpu_summary
    from variantbench.models.tiny import TINY, build_tiny

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("families-out"))
    ap.add_argument("--families", default=",".join(sorted(TINY)))
    ap.add_argument("--no-runs", action="store_true")
    args = ap.parse_args()
    print(cpu_summary(), flush=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    rows = []
    for family in args.families.split(","):
        prefill, decode, agree, paged = parity(family)
        status = ""
        if not args.no_runs:
            folder = build_tiny(family, args.out / "models" / family)
            code, line, took = run(folder, args.out / family, VARIANTS)
            status = f"exit {code} in {took:.0f} s"
            if code != 0:
                print(f"{family}: {line}", flush=True)
                from variantbench.variants.base import recipe_type
                from variantbench.variants.support import applies

                kept = [
                    v
                    for v in VARIANTS
                    if all(applies(recipe_type(p.split(":")[0]), family) for p in v.split("+"))
                ]
                code, line, took = run(folder, args.out / family, kept)
                status += f"; refused in one line, then {','.join(kept)}: exit {code} in {took:.0f} s"
        rows.append((family, prefill, decode, agree, paged, status))
        print(f"{family:10s} prefill {prefill:.1e}  decode {decode:.1e}  greedy {agree}/32  paged {'yes' if paged else 'NO'}  {status}",
              flush=True)  # fmt: skip
    if not args.no_runs:
        from transformers import GPT2Config, GPT2LMHeadModel

        from variantbench.models.tiny import tiny_tokenizer

        tok = tiny_tokenizer()
        torch.manual_seed(0)
        folder = args.out / "models" / "gpt2"
        GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=2048, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)).save_pretrained(folder)  # fmt: skip
        tok.save_pretrained(folder)
        code, line, took = run(folder, args.out / "gpt2", ["fp32", "bf16", "int8"])
        print(f"gpt2 (unregistered: transformers fallback) exit {code} in {took:.0f} s", flush=True)
    print(
        "\n| family | prefill max abs dlogit | decode max abs dlogit (32 steps) | greedy agreement | paged batch agrees |"
    )
    print("| --- | --- | --- | --- | --- |")
    for family, prefill, decode, agree, paged, _ in rows:
        print(f"| {family} | {prefill:.1e} | {decode:.1e} | {agree}/32 | {'yes' if paged else 'no'} |")


if __name__ == "__main__":
    main()
