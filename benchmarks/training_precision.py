"""Mixed-precision training: distillation steps in fp32 against bf16 autocast (fp32 master weights).

    python benchmarks/training_precision.py [--steps 6] [--repeats 2] [--seq 128] [--batch 2]

The default model distills from itself (the step is what distill, qat-int8 and linear-attn run:
teacher forward, student forward and backward, AdamW) for ``--steps`` steps in each precision,
interleaved and repeated; printed: seconds per step (median), the ratio bf16 / fp32, whether this
machine has bf16 matrix instructions (the recipes' ``precision=auto`` uses bf16 only where it does),
and the last loss in each (mixed precision must still learn).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from variantbench.environment import describe_environment
    from variantbench.models import parse_model, prepare_model
    from variantbench.variants.build import _context
    from variantbench.variants.distill import Distill, train_to_teacher
    from variantbench.variants.mixed_precision import bf16_hardware

    env = describe_environment()
    native, why = bf16_hardware(torch.device("cpu"))
    print(f"CPU: {env.get('cpu_model')} ({', '.join(env.get('cpu_flags') or [])}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; bf16 native: {native} ({why})")  # fmt: skip
    base = str(prepare_model(parse_model(None), status=print))
    ctx = _context(base, AutoTokenizer.from_pretrained(base), 0, tempfile.mkdtemp(), lambda *_: None)
    teacher = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    last: dict[str, float] = {}
    for r in range(args.repeats):
        for precision in ("fp32", "bf16"):
            student = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
            settings = Distill(
                kind="distill", steps=args.steps, seq=args.seq, batch=args.batch, precision=precision
            )
            training = train_to_teacher(student, teacher, ctx, settings, precision)
            times[precision].append(training.seconds_per_step)
            last[precision] = training.losses[-1]
            del student
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    print(f"\nfp32: {fp32:.3f} s/step (last loss {last['fp32']:.4f})")
    print(f"bf16 autocast: {bf16:.3f} s/step (last loss {last['bf16']:.4f})")
    print(f"speed-up bf16 / fp32: {fp32 / bf16:.2f}x")


if __name__ == "__main__":
    main()
