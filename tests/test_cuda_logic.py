"""The GPU paths' logic, on the CPU (issue 43): device selection and capability refusals, the fp8
recipe, the fixed-shape decode step a CUDA graph replays, device-timed phases, the GPU samples'
parser and summary, kernel gaps. Only the CUDA calls themselves (a capture, an event, NVML) need a
device; they are a few lines each and run in benchmarks/gpu_check.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from variantbench.analysis.kernel_gaps import bound_phrase, busy_us, cuda_kernels, idle_share
from variantbench.backends.device_clock import HostClock, event_times_ns
from variantbench.backends.engine import Decoder
from variantbench.devices import CPU, DeviceInfo, check_variant, parse_device, refusals, select
from variantbench.errors import UserError
from variantbench.models.tiny import TINY, tiny_config, tiny_model
from variantbench.trackers.gpu import parse_smi, summarize
from variantbench.trackers.resources import (
    ResourceResult,
    ResourceSample,
    merge_results,
    sample_from_row,
    sample_row,
)
from variantbench.variants.base import apply_recipes, parse_variant
from variantbench.variants.fp8 import Fp8Linear

# torch.cuda.get_device_properties of three cards, as written in their data sheets
T4 = DeviceInfo("cuda", 0, "Tesla T4", (7, 5), 15 * 2**30)
A100 = DeviceInfo("cuda", 0, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * 2**30)
H100 = DeviceInfo("cuda", 1, "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30)


def test_devices_are_parsed_and_checked_against_what_the_machine_has() -> None:
    assert parse_device("cpu") == ("cpu", None) and parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA:0"):
        with pytest.raises(UserError, match="device must be"):
            parse_device(bad)
    with pytest.raises(UserError, match="no CUDA device"):
        select("cuda", 0)
    with pytest.raises(UserError, match="has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        select("cuda:2", 2)
    assert select("cuda:1", 2) == ("cuda", 1)


@pytest.mark.parametrize(
    ("variant", "t4", "a100", "h100"),
    [
        ("fp32", None, None, None),
        ("fp16", None, None, None),
        ("bf16", "8.0", None, None),
        ("mixed-bf16", "8.0", None, None),
        ("int8:act=token", "8.0", None, None),
        ("smooth+int8:act=token", "8.0", None, None),
        ("int8-wo", None, None, None),
        ("int4-wo", "8.0", None, None),
        ("fp8", "8.9", "8.9", None),
        ("drop-layers:1", None, None, None),
        ("onnx-int4", "CPU provider", "CPU provider", "CPU provider"),
        ("gguf-q8_0", "CPU build", "CPU build", "CPU build"),
    ],
)
def test_each_recipe_refuses_in_one_line_where_the_device_lacks_it(variant: str, t4: str | None,
                                                                  a100: str | None, h100: str | None) -> None:  # fmt: skip
    recipes = parse_variant(variant)
    for card, expected in ((T4, t4), (A100, a100), (H100, h100)):
        lines = refusals(recipes, card)
        if expected is None:
            assert lines == [], (variant, card.name)
        else:
            assert len(lines) == 1 and expected in lines[0] and "\n" not in lines[0], lines
            with pytest.raises(UserError, match=f"^{variant.split('+')[0].split(':')[0]}"):
                check_variant(variant, recipes, card)
    assert refusals(recipes, CPU) == []  # everything runs on the CPU (fp8 emulated, with a caveat)


def test_a_cuda_variant_on_a_machine_without_one_is_one_line(tiny_model_dir: Path) -> None:
    from variantbench.backends.registry import make_backend
    from variantbench.variants.spec import VariantSpec

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="no CUDA device"):
        make_backend(VariantSpec.parse("bf16"), None, str(tiny_model_dir), device="cuda")


def test_fp8_keeps_the_tokens_close_and_fuses_to_the_same_values() -> None:
    model = tiny_model(tiny_config("llama", 400))
    bf16 = apply_recipes(copy.deepcopy(model), parse_variant("bf16"))
    fp8 = apply_recipes(copy.deepcopy(model), parse_variant("fp8"))
    attn = fp8.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp8Linear) and attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert type(fp8.lm_head) is torch.nn.Linear  # the output projection stays bf16
    ids = [5, 6, 7, 8, 9, 10, 11, 40, 50, 60]
    ref, got = Decoder(bf16).log_probs(ids), Decoder(fp8).log_probs(ids)
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="batchmean").item()
    assert 0 < kl < 0.1  # e4m3 rounds: close to bf16, not equal
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    fused = Fp8Linear.fuse(parts)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))
    assert Fp8Linear.from_linear(torch.nn.Linear(64, 32), rows=False).scale.dim() == 0  # Ada: one scale


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_graphs_fixed_shape_step_decodes_the_same_tokens(family: str) -> None:
    """What a CUDA graph replays (the slot a tensor, the whole cache under a mask) is the eager step:
    the same greedy tokens for every family, windows, soft-caps and left padding included, and the
    graph's cache reused across calls of another length."""
    decoder = Decoder(tiny_model(tiny_config(family, 400)))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 40, 50, 60], [7, 8, 9, 3, 4]]
    eager = decoder.generate(prompts, 16).token_ids
    assert decoder.use_cuda_graphs(True) is not None and decoder.decode_mode == "eager"  # not on a CPU
    assert decoder.use_cuda_graphs(True, static_on_cpu=True) is None and decoder.decode_mode == "static"
    assert decoder.generate(prompts, 16).token_ids == eager
    assert decoder.generate([prompts[1]], 8).token_ids[0] == decoder.generate([prompts[1]], 8).token_ids[0]
    assert decoder.generate(prompts, 16).token_ids == eager  # the cache of the bucket, used again


def test_what_cannot_be_captured_says_why() -> None:
    from variantbench.backends import cuda_graphs

    decoder = Decoder(tiny_model(tiny_config("llama", 400)))
    assert "CUDA device" in (cuda_graphs.refusal(decoder) or "")
    decoder.device = torch.device("cuda")  # the rules read the decoder's parts, not the device's state
    assert cuda_graphs.refusal(decoder) is None
    decoder.compiled = True
    assert "torch.compile" in (cuda_graphs.refusal(decoder) or "")
    moe = Decoder(tiny_model(tiny_config("mixtral", 400)))
    moe.device = torch.device("cuda")
    assert "mixture-of-experts" in (cuda_graphs.refusal(moe) or "")
    assert [cuda_graphs.bucket(n) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]


def test_phases_resolve_to_host_time_from_device_events() -> None:
    assert event_times_ns(1_000_000, [0.0, 1.5, 2.0000004]) == [1_000_000, 2_500_000, 3_000_000]
    ticks = iter(range(100, 1000, 100))
    clock = HostClock(lambda: next(ticks))
    assert [clock.mark(), clock.mark()] == [0, 1] and clock.resolve() == [100, 200]
    decoder = Decoder(tiny_model(tiny_config("llama", 400)))
    out = decoder.generate([[5, 6, 7], [8, 9]], 5, start_ns=0)
    for t in out.timings:
        assert t.token_ns == sorted(t.token_ns) and t.end_ns == t.token_ns[-1] and len(t.token_ns) == 5
    assert out.prefill_ns == out.timings[0].token_ns[0] > 0


# nvidia-smi --query-gpu=utilization.gpu,utilization.memory,memory.used,clocks.sm,power.draw
# --format=csv,noheader,nounits -lms 100, in the format nvidia-smi writes (a header and units where
# the flags are left out, [N/A] where the driver has no value)
SMI = """\
utilization.gpu [%], utilization.memory [%], memory.used [MiB], clocks.sm [MHz], power.draw [W]
0, 0, 1024, 345, 71.20
87, 64, 2048, 1980, 412.51
91 %, 70 %, 2050 MiB, 1980 MHz, 431.00 W
[N/A], [N/A], 2050, [N/A], [N/A]
garbage line
"""


def test_gpu_samples_from_nvidia_smi_are_parsed_and_summarized() -> None:
    samples = parse_smi(SMI.splitlines(), period_ns=100_000_000)
    assert len(samples) == 4 and samples[1].mem_bytes == 2048 * 2**20 and samples[2].util == 91.0
    assert samples[3].util is None and samples[3].mem_bytes == 2050 * 2**20
    s = summarize(samples)
    assert s["util"] == pytest.approx((0 + 87 + 91) / 3) and s["mem_bw_util"] == pytest.approx(134 / 3)
    assert s["mem_bytes"] == 2050 * 2**20 and s["sm_clock_mhz"] == pytest.approx((345 + 1980 * 2) / 3)
    # power integrated over 0.1 s steps (trapezoids) where there is no energy counter
    assert s["energy_from"] == "power integrated"
    assert s["energy_j"] == pytest.approx(0.1 * (71.2 + 412.51) / 2 + 0.1 * (412.51 + 431.0) / 2)
    for x in samples:
        x.energy_mj = 5_000 + x.t_ns // 1_000_000 * 40  # a counter: 40 mJ per ms, 400 W
    assert summarize(samples)["energy_j"] == pytest.approx(12.0) and summarize([])["util"] is None


def test_gpu_fields_travel_in_the_raw_rows_and_merge_by_wall_time() -> None:
    x = ResourceSample(1, 2, 0.5, 80.0, 3 * 2**30, 300.0, 60.0, 1980.0, 123)
    assert sample_from_row(sample_row(x)) == x
    assert sample_row(ResourceSample(1, 2, 0.5)) == [1, 2, 0.5]
    assert sample_from_row([1, 2, 0.5, 80.0, 10, 300.0]).gpu_mem_bw_util is None  # a row of wave 2
    parts = [ResourceResult(wall_s=1.0, gpu={"util": 90.0, "mem_bw_util": 60.0, "mem_bytes": 5, "energy_j": 2.0}),
             ResourceResult(wall_s=3.0, gpu={"util": 50.0, "mem_bw_util": None, "mem_bytes": 9, "energy_j": 1.0})]  # fmt: skip
    merged = merge_results(parts).gpu
    assert merged is not None and merged["util"] == pytest.approx(60.0) and merged["mem_bw_util"] == 60.0
    assert merged["mem_bytes"] == 9 and merged["energy_j"] == 3.0


class _Event:  # the two fields of torch.autograd.profiler_util.FunctionEvent that are read
    def __init__(self, device: str, start: float, end: float) -> None:
        self.device_type = f"DeviceType.{device}"
        self.time_range = type("Range", (), {"start": start, "end": end})()


def test_kernel_gaps_count_overlaps_once_and_name_the_bound() -> None:
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert idle_share([(0, 10), (5, 12), (20, 25)]) == pytest.approx(1 - 17 / 25)
    assert idle_share([]) is None and idle_share([(3, 3)]) == 0.0
    events = [_Event("CPU", 0, 100), _Event("CUDA", 5, 8), _Event("CUDA", 50, 60), _Event("CUDA", 70, 75)]
    assert cuda_kernels(events, after_us=10) == [(50.0, 60.0), (70.0, 75.0)]
    assert bound_phrase(2400.0, 3350.0, 0.38) == (
        "launch-bound: 72% of the device's measured bandwidth, idle between kernels 38% of the step"
    )
    assert bound_phrase(2400.0, 3350.0, 0.05).startswith("memory-bound: 72%")
    assert bound_phrase(None, None, None) is None


def test_the_bytes_a_token_reads_leave_out_an_embedding_table_the_head_does_not_share() -> None:
    from variantbench.variants.measure import param_bytes, streamed_bytes

    model = tiny_model(tiny_config("llama", 400, tie_word_embeddings=True))
    table = 400 * 64 * 4
    for variant, untied in (("fp32", False), ("bf16", False), ("int8:act=token", True)):
        built = apply_recipes(copy.deepcopy(model), parse_variant(variant))
        assert streamed_bytes(built) == param_bytes(built) - (table if untied else 0), variant
