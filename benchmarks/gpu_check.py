"""The prepared device check (issue 43): every GPU path of the engine, measured, in under 8 minutes.

    PYTHONPATH=src python benchmarks/gpu_check.py --out $OUT [--device cuda] [--model DIR] [--quick]

Runs with what a GPU machine has (its torch and transformers) and this package carried as source;
``wheels/`` beside it (``benchmarks/gpu_wheels.sh`` fills it here, the device tool carries it) is
installed offline first where pydantic or psutil are missing. Each section stands alone: one that
fails or lacks a module says so and the others run. Sections:

  device     name, compute capability, torch; the device's read bandwidth and bf16/fp32 FLOP/s,
             measured now with CUDA events (analysis/ceilings.py); NVML or nvidia-smi samples
  parity     greedy tokens of every registered family's tiny random model, fp32: CPU against
             CUDA eager and CUDA graphs (two prompts, left-padded, 24 tokens)
  variants   the default model's architecture (SmolLM2-135M, random weights, or ``--model``): fp32,
             fp16, bf16, int8 (torchao dynamic), int8-wo, int4-wo and fp8 where the device has them
             (else their one-line refusal); batch-1 decode with CUDA graphs and eager, batch-32
             decode, KL against fp32, achieved bandwidth as a share of the measured one, and the
             kernel idle share of a profiled decode (eager and graphs); GPU samples beside each
  paged      benchmarks/cuda_parity.py: the served paged batch's tokens, CPU against CUDA
  serving    benchmarks/serving.py --systems a: goodput at rising rates on the device
  priority   benchmarks/priority.py: interactive p99 TTFT with priorities under the mixed load

It prints a table per section and writes ``gpu_check.json`` (and the nvidia-smi samples it read, as
``nvidia_smi.csv``, a recording for the tests) under ``--out``. ``--device cpu --quick`` runs the
same code on the CPU (sizes cut) for a dry run before device time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
from pathlib import Path
import subprocess
import sys
import time
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SMOLLM2 = {  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json, the shape that matters here
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
RUNTIME = {
    "pydantic": "pydantic",
    "psutil": "psutil",
    "typer": "typer",
    "rich": "rich",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httpx": "httpx",
    "yaml": "pyyaml",
}  # module -> package (gpu_wheels.sh)
VARIANTS = ("fp32", "fp16", "bf16", "int8:act=token", "int8-wo", "int4-wo", "fp8")


def preflight() -> list[str]:
    """Install what is missing of our runtime from ./wheels (no network on a device machine)."""
    missing = [m for m in RUNTIME if importlib.util.find_spec(m) is None]
    wheels = ROOT / "wheels"
    if missing and wheels.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                        *(RUNTIME[m] for m in missing)], check=False)  # fmt: skip
        importlib.invalidate_caches()
        missing = [m for m in missing if importlib.util.find_spec(m) is None]
    return missing


def section(results: dict[str, Any], name: str, fn: Any, *args: Any) -> None:
    t0 = time.perf_counter()
    print(f"\n== {name}", flush=True)
    try:
        results[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a section's failure is its result; the others run
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        results[name] = {"error": f"{type(exc).__name__}: {first}"}
        print(f"   failed: {results[name]['error']}")
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_section(device: str, quick: bool) -> dict[str, Any]:
    import torch

    from variantbench.analysis import ceilings

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda"):
        from variantbench.device_probe import device_info

        out.update(device_info(device).to_json())
        out["ceilings"] = ceilings.cuda_probe(device, nbytes=(1 << 28) if quick else (1 << 30))
    else:
        out["ceilings"] = ceilings.probe("cpu", nbytes=1 << 26)
    for k, v in out.items():
        print(f"   {k}: {v}")
    return out


def family_parity(device: str, tokens: int) -> dict[str, Any]:
    from variantbench.backends.engine import Decoder
    from variantbench.families import registered_types
    from variantbench.models.tiny import TINY, tiny_config, tiny_model

    prompts = [[5, 6, 7, 8, 9, 10, 11, 40, 50, 60, 70, 80], [7, 8, 9, 3, 4]]
    rows = {}
    for family in sorted(TINY):
        model = tiny_model(tiny_config(family, 400))
        want = Decoder(copy.deepcopy(model)).generate(prompts, tokens).token_ids
        decoder = Decoder(model.to(device))
        eager = decoder.generate(prompts, tokens).token_ids
        why = decoder.use_cuda_graphs(True, static_on_cpu=True)
        graphs = decoder.generate(prompts, tokens).token_ids
        rows[family] = {"eager": agree(want, eager), "graphs": agree(want, graphs), "of": sum(len(x) for x in want),
                        "mode": decoder.decode_mode, "eager_why": why}  # fmt: skip
        print(f"   {family:10s} eager {rows[family]['eager']}/{rows[family]['of']}  "
              f"{decoder.decode_mode} {rows[family]['graphs']}/{rows[family]['of']}  {why or ''}")  # fmt: skip
    return {"families": rows, "registered": sorted(registered_types())}


def agree(want: list[list[int]], got: list[list[int]]) -> int:
    """Tokens equal at the same place, row by row."""
    return sum(a == b for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=False))


def default_architecture(model_dir: str | None, quick: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LlamaConfig(**{**SMOLLM2, **({"num_hidden_layers": 4} if quick else {})})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def decode_rate(decoder: Any, bsz: int, new: int, device: str) -> float:
    prompts = [[(13 * i + 7 * b) % 4000 + 10 for i in range(64)] for b in range(bsz)]
    decoder.generate(prompts, 4)  # warm (and capture)
    sync(device)
    out = decoder.generate(prompts, new)
    times = out.timings
    first, last = min(t.token_ns[0] for t in times), max(t.token_ns[-1] for t in times)
    return sum(len(t.token_ns) - 1 for t in times) / ((last - first) / 1e9)


def variants_section(
    device: str, model_dir: str | None, quick: bool, bandwidth: float | None
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from variantbench.analysis.diagnosis import profile_decoder
    from variantbench.backends.engine import Decoder
    from variantbench.device_probe import device_info
    from variantbench.devices import CPU, refusals
    from variantbench.trackers.gpu import open_gpu, summarize
    from variantbench.variants.base import apply_recipes, parse_variant
    from variantbench.variants.measure import streamed_bytes

    info = device_info(device) if device.startswith("cuda") else CPU
    base = default_architecture(model_dir, quick)
    probe = [[(31 * i) % 4000 + 10 for i in range(64)]]
    new = 16 if quick else 64
    rows: dict[str, Any] = {}
    reference = None
    for name in VARIANTS:
        recipes = parse_variant(name)
        refused = refusals(recipes, info)
        if refused:
            rows[name] = {"refused": refused[0]}
            print(f"   {name:16s} refused: {refused[0]}")
            continue
        try:
            model = apply_recipes(copy.deepcopy(base).to(device), recipes)
            nbytes = streamed_bytes(model)
            decoder = Decoder(model)
            del model
        except Exception as exc:  # noqa: BLE001 - a recipe without its kernel here: its row says why
            rows[name] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
            print(f"   {name:16s} {rows[name]['error']}")
            continue
        row: dict[str, Any] = {"weight_bytes": nbytes}
        logp = decoder.log_probs(probe[0]).float().cpu()
        if reference is None:
            reference = logp
        row["kl_vs_fp32"] = round(F.kl_div(logp, reference, log_target=True, reduction="batchmean").item(), 4)
        gpu = open_gpu(info.index or 0) if info.type == "cuda" else None
        samples = []
        try:
            row["b1_eager"] = round(decode_rate(decoder, 1, new, device), 1)
            if gpu:
                samples.append(gpu.sample())
            why = decoder.use_cuda_graphs(True)
            row["graphs"] = decoder.decode_mode if why is None else f"eager: {why}"
            row["b1_graphs"] = round(decode_rate(decoder, 1, new, device), 1) if why is None else None
            if gpu:
                samples.append(gpu.sample())
            row["b32"] = round(decode_rate(decoder, 1 if quick else 32, new, device), 1)
            if gpu:
                samples.append(gpu.sample())
            best = max(v for v in (row["b1_eager"], row["b1_graphs"]) if v)
            row["b1_gbps"] = round(nbytes * best / 1e9, 1)
            row["b1_bandwidth_share"] = round(nbytes * best / 1e9 / bandwidth, 3) if bandwidth else None
            row["b32_gbps_weights"] = round(nbytes * row["b32"] / 32 / 1e9, 1)
            if name in ("bf16", "fp32") or quick:
                for mode in ("eager", "graphs"):
                    decoder.use_cuda_graphs(mode == "graphs")
                    prof = profile_decoder(decoder, prompt_len=64, steps=8)
                    row[f"profile_{mode}"] = {k: prof.get(k) for k in ("decode_step_ms", "gpu_idle_share",
                                                                       "gpu_kernels_per_step", "op_share")}  # fmt: skip
        finally:
            if gpu:
                row["gpu"] = summarize(samples)
                gpu.close()
        rows[name] = row
        print(f"   {name:16s} b1 eager {row['b1_eager']:8.1f}  graphs {row.get('b1_graphs') or '-':>8}  "
              f"b32 {row['b32']:8.1f} tok/s  {row['b1_gbps']} GB/s ({row['b1_bandwidth_share']})  KL {row['kl_vs_fp32']}")  # fmt: skip
        del decoder
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    fp8, int8, bf16 = rows.get("fp8", {}), rows.get("int8:act=token", {}), rows.get("bf16", {})
    faster = [
        n
        for n, r in (("fp8", fp8), ("int8", int8))
        if r.get("b32") and bf16.get("b32") and r["b32"] > bf16["b32"]
    ]
    return {
        "rows": rows,
        "faster_than_bf16_at_b32": faster,
        "weights": "random" if not model_dir else model_dir,
    }


def tiny_folder(work: Path) -> Path:
    from variantbench.models.tiny import build_tiny

    return build_tiny("llama", work / "tiny-smollm2-shape", hidden_size=576, intermediate_size=1536,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=30)  # fmt: skip


def script(name: str, args: list[str], timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    print("   $ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-3000:]
        return {
            "error": f"timed out after {timeout} s",
            "tail": tail.decode() if isinstance(tail, bytes) else tail,
        }
    tail = (proc.stdout + proc.stderr)[-4000:]
    print("\n".join("   " + line for line in tail.splitlines()[-25:]))
    return {"rc": proc.returncode, "tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M's shape, random)"
    )
    ap.add_argument("--quick", action="store_true", help="cut sizes (a dry run on the CPU)")
    ap.add_argument("--sections", default="device,parity,variants,paged,serving,priority")
    ap.add_argument("--serving-timeout", type=int, default=150)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.sections.split(","))
    results: dict[str, Any] = {"missing_modules": preflight(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    smi = None
    if args.device.startswith("cuda"):
        from variantbench.devices import parse_device
        from variantbench.trackers.gpu import smi_command

        cmd = smi_command(parse_device(args.device)[1] or 0, 200)
        if cmd is not None:
            smi = subprocess.Popen(cmd, stdout=(out / "nvidia_smi.csv").open("w"), stderr=subprocess.DEVNULL)
    try:
        if "device" in wanted:
            section(results, "device", device_section, args.device, args.quick)
        bandwidth = ((results.get("device") or {}).get("ceilings") or {}).get("memory_gbps")
        if "parity" in wanted:
            section(results, "parity", family_parity, args.device, 8 if args.quick else 24)
        if "variants" in wanted:
            section(results, "variants", variants_section, args.device, args.model, args.quick, bandwidth)
        folder = tiny_folder(out / "models") if wanted & {"paged", "serving", "priority"} else None
        if "paged" in wanted:
            section(results, "paged", script, "cuda_parity.py",
                    ["--model", str(folder), "--devices", f"cpu,{args.device}", "--tokens", "24"], 240)  # fmt: skip
        if "serving" in wanted:
            section(results, "serving", script, "serving.py",
                    ["--systems", "a", "--device", args.device, "--model", str(folder), "--queries", "20",
                     "--max-points", "4", "--ceiling-requests", "8", "--start-rate", "2"], args.serving_timeout)  # fmt: skip
        if "priority" in wanted:
            section(results, "priority", script, "priority.py",
                    ["--model", str(folder), "--variant", "fp32", "--duration-s", "20", "--phases", "priorities",
                     "--interactive-rate", "2", "--batch-rate", "2", "--slo-ms", "100",
                     "--serve-args", f"--device {args.device}"], args.serving_timeout)  # fmt: skip
    finally:
        if smi is not None:
            smi.terminate()
        with contextlib.suppress(OSError):
            (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out / 'gpu_check.json'}; seconds per section: {results.get('seconds')}")


if __name__ == "__main__":
    main()
