"""Why a variant is slower: where its prefill and decode time go, against the machine's ceilings.

Profile (PyTorch engine): ``torch.profiler`` over one prefill and a few decode steps, which the
engine labels as ``prefill`` and ``decode_step`` regions (NVTX ranges on CUDA come from the same
labels through ``torch.autograd.profiler.emit_nvtx`` when run under Nsight Systems). Each operator
directly inside a region is put in a family by its name: matmul, attention, quantize/dequantize
(quantize, dequantize and dtype conversions, also when nested inside a matmul of a quantized tensor
subclass), norm, or other (including the Python time between operators). Caveat, stated in the
report: FBGEMM's dynamic int8 ``quantized::linear_dynamic`` quantizes its activations inside the
kernel, so that time counts as matmul.

Every backend (ONNX Runtime GenAI and llama.cpp too): decode tokens/s at batch 1, 8 and 32, and the
achieved GFLOP/s (2 x parameters x tokens/s) and GB/s (weight bytes x tokens/s) at batch 1.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
import contextlib
import os
import shutil
import subprocess
import sys
from typing import Any

from variantbench.compute import on_compute

FAMILIES = ("matmul", "attention", "quantize/dequantize", "norm", "other")
STORY = "Write a long story about a small town on a river, its market, its mayor and its people."
_CONVERSIONS = ("aten::to", "aten::_to_copy")


def family_of(name: str) -> str:
    n = name.lower()
    # attention first: the engine's "linear_attention" region (the linear-attn student) is attention
    if "scaled_dot_product" in n or "attention" in n or "softmax" in n:
        return "attention"
    if any(
        k in n
        for k in (
            "linear",
            "matmul",
            "aten::mm",
            "aten::bmm",
            "addmm",
            "baddbmm",
            "gemm",
            "aten::dot",
            "scaled_mm",
            "_int_mm",
        )  # fp8 and int8 products (CUDA's tensor cores)
    ):
        return "matmul"
    if "quantize" in n or "dequant" in n or "qparams" in n or n in _CONVERSIONS:
        return "quantize/dequantize"
    if "rms_norm" in n or "layer_norm" in n or "rsqrt" in n:
        return "norm"
    return "other"


def _is_qdq(name: str) -> bool:
    return family_of(name) == "quantize/dequantize"


def _moved_qdq(event: Any) -> float:
    """Inclusive time of quantize/dequantize events nested under ``event`` (outermost ones only)."""
    total = 0.0
    for child in event.cpu_children:
        total += child.cpu_time_total if _is_qdq(child.name) else _moved_qdq(child)
    return total


PYTHON = "(Python between operators)"


def region_families(
    events: Any, region: str, ops: dict[str, float] | None = None
) -> tuple[dict[str, float], int]:
    """Microseconds per family summed over every ``region`` event, and how many there were.

    ``ops``, when given, also receives the microseconds of each operator directly in the region.
    """
    times: dict[str, float] = defaultdict(float)
    count = 0
    for ev in events:
        if ev.name != region:
            continue
        count += 1
        accounted = 0.0
        for child in ev.cpu_children:
            fam = family_of(child.name)
            moved = 0.0 if fam == "quantize/dequantize" else _moved_qdq(child)
            times[fam] += child.cpu_time_total - moved
            times["quantize/dequantize"] += moved
            accounted += child.cpu_time_total
            if ops is not None:
                ops[child.name] = ops.get(child.name, 0.0) + child.cpu_time_total
        between = max(0.0, ev.cpu_time_total - accounted)
        times["other"] += between
        if ops is not None:
            ops[PYTHON] = ops.get(PYTHON, 0.0) + between
    return {f: times.get(f, 0.0) for f in FAMILIES}, count


def _shares(times: dict[str, float]) -> dict[str, float]:
    total = sum(times.values())
    return {f: round(t / total, 4) for f, t in times.items()} if total > 0 else {}


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Kineto writes a "profiler_start/stop" line to the process's stderr per profile (C++, not logging)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@on_compute  # on the thread that runs the model: the profiler records the calling thread's ops
def profile_decoder(decoder: Any, prompt_len: int = 128, steps: int = 8) -> dict[str, Any]:
    """Profile one prefill of ``prompt_len`` tokens and ``steps`` decode steps at batch 1."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    vocab = int(getattr(decoder.config, "vocab_size", 1000))
    ids = [[(7 * i + 3) % max(1, vocab - 10) + 5 for i in range(prompt_len)]]  # any valid ids do
    decoder.profile_regions = True
    try:
        decoder.generate(ids, steps + 1)  # warm
        activities = [ProfilerActivity.CPU]
        if decoder.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with _native_stderr_silenced(), profile(activities=activities) as prof:
            decoder.generate(ids, steps + 1)
        events = prof.events()
    finally:
        decoder.profile_regions = False
    ops: dict[str, float] = {}
    gpu: dict[str, Any] = {}
    if decoder.device.type == "cuda":  # kernel gaps of the decode steps (after the prefill's region)
        from variantbench.analysis.kernel_gaps import cuda_kernels, idle_share

        prefill_end = max((e.time_range.end for e in events if e.name == "prefill"), default=float("-inf"))
        kernels = cuda_kernels(events, prefill_end)
        gpu = {"gpu_idle_share": idle_share(kernels), "gpu_kernels_per_step": round(len(kernels) / max(1, steps), 1),
               "decode_mode": decoder.decode_mode}  # fmt: skip
    decode_us, n_steps = region_families(events, "decode_step", ops)
    prefill_us, _ = region_families(events, "prefill")
    per_step = {f: round(t / max(1, n_steps) / 1e3, 4) for f, t in decode_us.items()}
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
    return {
        "top_ops": [
            {
                "op": name,
                "ms_per_step": round(us / max(1, n_steps) / 1e3, 4),
                "family": "other" if name == PYTHON else family_of(name),
            }
            for name, us in top
        ],  # fmt: skip
        "op_share": _shares(decode_us),
        "op_ms": per_step,
        "decode_step_ms": round(sum(per_step.values()), 4),
        "prefill_op_share": _shares(prefill_us),
        "prefill_op_ms": {f: round(t / 1e3, 3) for f, t in prefill_us.items()},
        "profiler": f"torch.profiler {torch.__version__}: 1 prefill of {prompt_len} tokens + {n_steps} decode steps",
        **gpu,
    }


def decode_rate(backend: Any, batch: int, new: int = 64, prompt: str = STORY) -> float:
    """Output tokens after the first, over the time from the first token to the last (all requests)."""
    from variantbench.backends.base import GenerationRequest

    results = backend.generate(
        [GenerationRequest(f"d{b}", prompt=prompt, max_new_tokens=new) for b in range(batch)]
    )
    bad = [r.error for r in results if r.status != "ok"]
    if bad:
        raise RuntimeError(bad[0])
    tokens = sum(max(0, r.output_tokens - 1) for r in results)
    span_s = (max(r.end_ns for r in results) - min(r.first_token_ns for r in results)) / 1e9
    return tokens / span_s if span_s > 0 else float("nan")


def cache_counters() -> str:
    """Whether hardware cache-miss counters can be read here (perf stat), in words."""
    if shutil.which("perf") is None:
        return "unavailable: perf is not installed"
    try:
        proc = subprocess.run(["perf", "stat", "-x", ",", "-e", "cache-references,cache-misses", "true"],
                              capture_output=True, text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: perf failed ({exc})"
    lines = [ln for ln in proc.stderr.splitlines() if "cache-" in ln]
    if not lines or any("<not supported>" in ln or "<not counted>" in ln for ln in lines):
        return (
            "unavailable: perf reports cache-references/cache-misses <not supported> (no hardware PMU here)"
        )
    return "available"


def perf_cache_misses(pid: int, work: Any) -> str:
    """Cache references and misses of process ``pid`` while ``work()`` runs (perf stat -p)."""
    proc = subprocess.Popen(["perf", "stat", "-x", ",", "-e", "cache-references,cache-misses", "-p", str(pid)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        work()
    finally:
        proc.send_signal(2)  # SIGINT: perf prints its counts and exits
        _, err = proc.communicate(timeout=10)
    counts = {}
    for line in err.splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[0].strip().isdigit():
            counts[parts[2]] = int(parts[0])
    refs, misses = counts.get("cache-references"), counts.get("cache-misses")
    if not refs or misses is None:
        return "unavailable: perf returned no counts"
    return f"{misses / refs:.1%} of {refs:,} cache references missed during batch-1 decode"


def diagnose_backend(backend: Any, param_bytes: int, parameters: int | None, counters: str,
                     sizes: tuple[int, ...] = (1, 8, 32), new: int = 16,
                     known: dict[int, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """Batch efficiency for any backend, plus the operator profile where the engine is ours.

    ``known``: batch sizes already measured in this session (the batch rounds' median), not
    measured again. Larger batches decode fewer tokens (at least 4, about 256 in all): on the AVX2
    host bf16 at batch 32 took 31 s for 16 tokens each, a run's largest single cost.
    """
    out: dict[str, Any] = {"batch_tokens_per_s": {}}
    holder: dict[str, float] = {}
    for size in sizes:
        tokens = max(4, min(new, 256 // size))
        if known and size in known:
            rate = known[size]
        elif size == 1 and counters == "available":
            out["cache_misses"] = perf_cache_misses(
                os.getpid(), lambda n=tokens: holder.__setitem__("b1", decode_rate(backend, 1, n))
            )
            rate = holder["b1"]
        else:
            rate = decode_rate(backend, size, tokens)
        out["batch_tokens_per_s"][str(size)] = round(rate, 2)
    out.setdefault("cache_misses", counters)
    b1 = out["batch_tokens_per_s"].get("1")
    if b1:
        out["achieved_gbps"] = round(param_bytes * b1 / 1e9, 3)
        if parameters:
            out["achieved_gflops"] = round(2 * parameters * b1 / 1e9, 3)
    from variantbench.backends.base import Profilable

    decoder = backend.decoder if isinstance(backend, Profilable) else None
    if decoder is not None:
        out.update(profile_decoder(decoder))
    else:
        out["profiler"] = f"no operator profile for the {backend.info().get('backend', '?')} engine"
    return out


def explain(variant: str, diag: dict[str, Any], standard: str, base: dict[str, Any],
            decode_ratio: float | None, prefill_ratio: float | None) -> str:  # fmt: skip
    """One or two sentences: which operator family ate the savings, with the numbers.

    ``decode_ratio`` and ``prefill_ratio`` are the variant's tokens/s over the standard's (< 1: slower).
    """
    parts = []
    for phase, ratio, key_ms, key_share in (
        ("decode", decode_ratio, "op_ms", "op_share"),
        ("prefill", prefill_ratio, "prefill_op_ms", "prefill_op_share"),
    ):
        if ratio is None or ratio >= 1.0:
            continue
        mine, theirs = diag.get(key_ms) or {}, base.get(key_ms) or {}
        share = diag.get(key_share) or {}
        if not mine or not theirs:
            parts.append(f"{variant}: {phase} {1 / ratio:.2f}x slower than {standard}; no operator profile "
                         f"for its engine ({diag.get('profiler', 'n/a')})")  # fmt: skip
            continue
        grew = max(FAMILIES, key=lambda f: mine.get(f, 0.0) - theirs.get(f, 0.0))
        mm_mine, mm_theirs = mine.get("matmul", 0.0), theirs.get("matmul", 0.0)
        mm = ""
        if mm_mine > 0 and mm_theirs > 0 and grew != "matmul":
            r = mm_theirs / mm_mine
            mm = f"; matmul {max(r, 1 / r):.2f}x {'faster' if r >= 1 else 'slower'} than {standard}'s"
        if phase == "decode":
            biggest = [o for o in diag.get("top_ops") or [] if o.get("family") == grew][:2]
            if biggest:
                mm += " (largest: " + ", ".join(f"{o['op']} {o['ms_per_step']:.2f} ms" for o in biggest) + ")"
        parts.append(
            f"{variant}: {phase} {1 / ratio:.2f}x slower than {standard}; {share.get(grew, 0):.0%} of its {phase} "
            f"time in {grew} ({mine.get(grew, 0):.2f} ms vs {theirs.get(grew, 0):.2f} ms{' per step' if phase == 'decode' else ''})"
            f"{mm}"
        )
    if not parts:
        return f"{variant}: not slower than {standard} at decode or prefill"
    return ". ".join(parts)
