"""Resources, cost, A/B statistics, diagnosis and the recommendation."""

from __future__ import annotations

import math
from pathlib import Path
import threading

import numpy as np
import pytest

from variantbench.analysis.cost import CostModel, derive
from variantbench.analysis.recommend import PROFILES, Profile, recommend
from variantbench.metrics import significance as sig
from variantbench.report.schema import (
    AB,
    BatchThroughput,
    Cost,
    PairComparison,
    QualityVsStandard,
    Ratio,
    Resources,
    RunReport,
)
from variantbench.trackers.resources import ResourceTracker, rapl_domains, window_resources

# ---- trackers ------------------------------------------------------------------------------------


def test_tracker_stops_its_thread_when_the_body_raises() -> None:
    before = {t.name for t in threading.enumerate()}
    tracker = ResourceTracker(interval_s=0.005, rapl_root="/nonexistent")
    with pytest.raises(RuntimeError, match="boom"), tracker:
        sum(i * i for i in range(200_000))  # some CPU time to see
        raise RuntimeError("boom")
    assert "variantbench-resources" not in {t.name for t in threading.enumerate()} - before
    r = tracker.result
    assert r.peak_rss_bytes > 0 and len(r.samples) >= 2 and r.cpu_s > 0
    # no RAPL here: the energy is an estimate, labelled so, from CPU seconds x watts per core
    assert r.energy_source == "estimate" and r.watts_per_core == 10.0
    assert r.energy_j == pytest.approx(r.cpu_s * 10.0)
    assert r.gpu is None


def test_energy_source_is_what_the_machine_offers() -> None:
    tracker = ResourceTracker(interval_s=0.01)
    with tracker:
        pass
    readable = bool(rapl_domains())
    assert tracker.result.energy_source == ("rapl" if readable else "estimate")


def test_rapl_counter_is_read_and_its_wrap_around_handled(tmp_path: Path) -> None:
    domain = tmp_path / "intel-rapl:0"
    domain.mkdir()
    (domain / "name").write_text("package-0\n")
    (domain / "max_energy_range_uj").write_text("1000000000\n")
    (domain / "energy_uj").write_text("999000000\n")  # 1 J before the wrap
    tracker = ResourceTracker(interval_s=0.01, rapl_root=str(tmp_path))
    with tracker:
        (domain / "energy_uj").write_text("2000000\n")  # wrapped, then 2 J more
    assert tracker.result.energy_source == "rapl"
    assert tracker.result.energy_j == pytest.approx(3.0)


def test_samples_align_to_windows() -> None:
    from variantbench.trackers.resources import ResourceSample

    samples = [ResourceSample(t * 1_000_000_000, 100 + t, cpu_s=0.5 * t) for t in range(11)]
    out = window_resources(samples, [(0, 4_000_000_000), (4_000_000_000, 10_000_000_000)], cores=1)
    assert out[0]["mean_rss_bytes"] == pytest.approx((101 + 102 + 103 + 104) / 4)
    assert out[0]["mean_cpu_util"] == pytest.approx(0.5)
    assert out[1]["mean_rss_bytes"] == pytest.approx(sum(range(105, 111)) / 6)


# ---- statistics ----------------------------------------------------------------------------------


def test_bootstrap_interval_covers_a_known_ratio() -> None:
    rng = np.random.default_rng(1)
    covered = 0
    trials = 40
    for seed in range(trials):
        base = rng.lognormal(3.0, 0.4, 80)
        slow = rng.lognormal(3.0, 0.4, 80) * 1.5  # true median ratio 1.5
        r = sig.bootstrap_ratio(slow, base, 50, seed=seed, resamples=2000)
        covered += r["ci_low"] <= 1.5 <= r["ci_high"]
    assert covered >= 0.85 * trials  # a 95% interval: nearly always


def test_verdict_in_words() -> None:
    rng = np.random.default_rng(2)
    base = rng.lognormal(3.0, 0.2, 100)
    faster = sig.bootstrap_ratio(base * 0.6, base, seed=0, resamples=2000)
    p = sig.mann_whitney(base * 0.6, base)
    assert sig.verdict(faster, p) == "faster" and faster["ci_high"] < 1
    same = rng.lognormal(3.0, 0.2, 100)
    r = sig.bootstrap_ratio(same, base, seed=0, resamples=2000)
    assert sig.verdict(r, sig.mann_whitney(same, base)) == "no significant difference"
    rate = sig.bootstrap_rate_ratio([10] * 20, [2.0] * 20, [10] * 20, [1.0] * 20, resamples=500)
    assert rate["value"] == pytest.approx(0.5)
    across = sig.across_runs([1.0, 1.2, 1.1])
    assert across["ci_low"] < 1.1 < across["ci_high"] and across["n"] == 3


# ---- cost ----------------------------------------------------------------------------------------


def test_cost_numbers_can_be_checked_by_hand() -> None:
    cost = CostModel(cost_per_hour=3.6, energy_price_kwh=0.36)
    out = derive(
        cost, duration_s=100.0, output_tokens=1000, energy_j=400.0, tracked_wall_s=200.0, quality=0.5
    )
    # mean power 2 W over the 100 s span = 200 J; hardware 3.6/h x 100 s = 0.1; energy 200 J = 0.02 (USD)
    assert out["inputs"]["span_energy_j"] == pytest.approx(200.0)
    assert out["per_million_output_tokens"] == pytest.approx((0.1 + 200 / 3.6e6 * 0.36) / 1000 * 1e6)
    assert out["tokens_per_joule"] == pytest.approx(5.0)
    # 0.5 x 10 tok/s / (3.6 USD/h x 0.2 J/token)
    assert out["efficiency"] == pytest.approx(0.5 * 10 / (3.6 * 0.2))
    assert "J/output token" in out["efficiency_units"]


# ---- recommendation ------------------------------------------------------------------------------


def _run(name: str, p99: float, rss_gb: float, quality: float, tok_s: float, price: float,
         build_s: float = 0.0, p99_ratio: tuple[float, float, float] | None = None,
         batch: list[float] | None = None) -> RunReport:  # fmt: skip
    run = RunReport(variant=name)
    run.latency_ms.p99 = p99
    run.resources = Resources(peak_rss_bytes=int(rss_gb * 2**30), build_s=build_s)
    run.quality_vs_standard = QualityVsStandard(standard="fp32", ratio=quality)
    run.throughput.output_tokens_per_s = tok_s
    run.throughput.qps = tok_s / 50
    run.cost = Cost(per_million_output_tokens=price, inputs={"currency": "USD"})
    run.backend = {"device": "cpu", "built": {"build_s": build_s}}
    if p99_ratio is not None:
        value, lo, hi = p99_ratio
        run.ab_vs_standard = AB(standard="fp32", latency_p99_ratio=Ratio(value=value, ci_low=lo, ci_high=hi))
    if batch is not None:
        run.batch_throughput = BatchThroughput(
            batch=8, new_tokens=16, tokens_per_s=sum(batch) / len(batch), values=batch
        )
    return run


def _cmp(a: str, b: str, state: str, ratio: float, lo: float, hi: float, metric: str = "throughput"
         ) -> PairComparison:  # fmt: skip
    return PairComparison(a=a, b=b, metric=metric, ratio=ratio, ci_low=lo, ci_high=hi, confidence=0.95, pairs=40,
                          state=state)  # fmt: skip


RUNS = [
    _run("fp32", p99=1000, rss_gb=1.5, quality=1.0, tok_s=100, price=0.50, batch=[100, 101]),
    _run("int8", p99=1800, rss_gb=0.8, quality=0.93, tok_s=60, price=0.40, p99_ratio=(1.8, 1.6, 2.0),
         batch=[60, 61]),
    _run("drop", p99=600, rss_gb=0.9, quality=0.80, tok_s=180, price=0.20, p99_ratio=(0.6, 0.5, 0.7),
         batch=[180, 181]),
    _run("distilled", p99=650, rss_gb=0.9, quality=0.96, tok_s=170, price=0.25, build_s=900,
         p99_ratio=(0.65, 0.6, 0.7), batch=[170, 171]),
]  # fmt: skip
DECIDED = [
    _cmp("distilled", "int8", "faster", 2.8, 2.5, 3.1),
    _cmp("distilled", "fp32", "faster", 1.7, 1.5, 1.9),
    _cmp("int8", "fp32", "slower", 0.6, 0.55, 0.65),
    _cmp("distilled", "fp32", "faster", 1.69, 1.6, 1.8, "batch throughput"),
    _cmp("drop", "fp32", "faster", 1.79, 1.7, 1.9, "batch throughput"),
    _cmp("int8", "fp32", "slower", 0.6, 0.58, 0.62, "batch throughput"),
]


def test_recommendation_picks_the_cheapest_that_fits_and_says_why_the_others_fail() -> None:
    runs = RUNS
    edge = recommend(runs, "fp32", PROFILES["edge"], DECIDED)
    assert edge["variant"] == "distilled"
    assert "peak memory" in edge["reasons"]["fp32"] and "budget" in edge["reasons"]["fp32"]
    assert "quality 80.0%" in edge["reasons"]["drop"]
    why = edge["reasons"]["distilled"]
    assert "cheapest" in why and "0.25" in why and "faster than int8 on throughput (2.80 [2.50, 3.10])" in why
    cloud = recommend(runs, "fp32", PROFILES["cloud"], DECIDED)
    assert cloud["variant"] == "fp32"  # the only one at 99% quality
    assert "build time 900 s > budget 600 s" in cloud["reasons"]["distilled"]
    latency = recommend(runs, "fp32", PROFILES["latency"], DECIDED)
    assert latency["variant"] == "distilled"
    assert "P99 latency vs the standard's 1.80 [1.60, 2.00]: not shown" in latency["reasons"]["int8"]
    batch = recommend(runs, "fp32", PROFILES["batch"], DECIDED)
    assert batch["variant"] == "distilled" and batch["ranked_by"] == "batch-8 decode tokens/s"
    assert "batch-8 throughput vs the standard's 0.60 [0.58, 0.62]: not shown" in batch["reasons"]["int8"]
    none = recommend(runs, "fp32", Profile(name="x", p99_latency_ms=100))
    assert none["variant"] is None and all("P99" in why for why in none["reasons"].values())
    failed = RunReport(variant="onnx", status="failed", error="no kernel")
    assert "did not run: no kernel" in recommend([*runs, failed], "fp32", PROFILES["edge"])["reasons"]["onnx"]


def test_a_tie_is_called_a_tie_and_broken_by_memory_then_bytes() -> None:
    """Not shown faster beyond the tie band: tied, and the secondary criterion picks, in words."""
    fp32 = _run("fp32", p99=1000, rss_gb=1.0, quality=1.0, tok_s=100, price=0.50)
    bf16 = _run("bf16", p99=870, rss_gb=0.6, quality=1.0, tok_s=115, price=0.45, p99_ratio=(0.87, 0.45, 1.15))
    undecided = [_cmp("bf16", "fp32", "undecided", 1.15, 0.83, 2.11)]
    cloud = recommend([fp32, bf16], "fp32", PROFILES["cloud"], undecided)
    assert cloud["variant"] == "bf16" and cloud["tied"] == ["bf16", "fp32"]
    assert "bf16 and fp32 are not told apart on throughput (1.15 [0.83, 2.11])" in cloud["summary"]
    assert "bf16 needs 40% less memory (644 MB vs 1,074 MB)" in cloud["summary"]
    # the same memory (within the band): fewer weight bytes decide; then nothing does: the standard stays
    same = _run("bf16", p99=870, rss_gb=1.01, quality=1.0, tok_s=115, price=0.45)
    fp32.resources.param_bytes, same.resources.param_bytes = 500_000_000, 250_000_000
    tied = [_cmp("bf16", "fp32", "tied", 1.01, 0.99, 1.02)]
    rec = recommend([fp32, same], "fp32", PROFILES["cloud"], tied)
    assert (
        rec["variant"] == "bf16"
        and "are tied on throughput" in rec["summary"]
        and "weight bytes" in rec["summary"]
    )
    same.resources.param_bytes = 500_000_000
    rec = recommend([fp32, same], "fp32", PROFILES["cloud"], tied)
    assert rec["variant"] == "fp32" and "no secondary criterion separates them" in rec["summary"]
    # the latency profile: bf16's P99 interval reaches 1.15 > 1.03: not shown to meet it
    assert recommend([fp32, bf16], "fp32", PROFILES["latency"], undecided)["variant"] == "fp32"


# ---- diagnosis -----------------------------------------------------------------------------------


def test_diagnosis_finds_a_planted_slow_operator_family(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from variantbench.analysis.diagnosis import explain, profile_decoder
    from variantbench.backends.engine import Decoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = profile_decoder(Decoder(model), prompt_len=32, steps=4)
    slow = Decoder(model)

    class SlowNorm:  # a planted slow norm, in every place the block has one
        def __init__(self, norm) -> None:  # noqa: ANN001
            self.norm = norm

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(40):
                torch.rms_norm(x, (x.shape[-1],), eps=1e-6)
            return self.norm(x)

    for layer in slow.layers:
        layer.attn_in, layer.mlp_in = SlowNorm(layer.attn_in), SlowNorm(layer.mlp_in)
    slow.final_norm = SlowNorm(slow.final_norm)
    diag = profile_decoder(slow, prompt_len=32, steps=4)
    assert max(diag["op_share"], key=diag["op_share"].get) == "norm"
    assert diag["op_ms"]["norm"] > 5 * base["op_ms"]["norm"]
    assert math.isclose(sum(diag["op_share"].values()), 1.0, abs_tol=0.01)
    text = explain("slow", diag, "fp32", base, decode_ratio=0.5, prefill_ratio=None)
    assert "in norm" in text and "2.00x slower" in text and "rms_norm" in text


def test_paired_intervals_are_scipys_bca_bootstrap_on_the_same_data() -> None:
    from scipy.stats import bootstrap

    rng = np.random.default_rng(3)
    base = rng.lognormal(7, 1, 60)  # samples of very different lengths: most of the spread
    slow = base * 1.2 * rng.lognormal(0, 0.05, 60)  # the same samples, 20% slower each
    r = sig.paired_ratio(slow, base, seed=11, resamples=3000)
    logs = np.log(slow / base)
    want = bootstrap((logs,), np.mean, n_resamples=3000, method="BCa", rng=np.random.default_rng(11))
    assert r["value"] == pytest.approx(float(np.exp(logs.mean())))
    assert r["ci_low"] == pytest.approx(float(np.exp(want.confidence_interval.low)))
    assert r["ci_high"] == pytest.approx(float(np.exp(want.confidence_interval.high)))
    q = sig.paired_quantile_ratio(slow, base, 99, seed=5, resamples=3000)
    want = bootstrap((slow, base), lambda u, v, axis=-1: np.percentile(u, 99, axis=axis) / np.percentile(v, 99, axis=axis),
                     n_resamples=3000, paired=True, method="BCa", rng=np.random.default_rng(5))  # fmt: skip
    assert (q["ci_low"], q["ci_high"]) == pytest.approx(tuple(want.confidence_interval))
    # pairing finds the 20% that the samples' own spread hides from an unpaired comparison
    assert 1.15 < r["ci_low"] < r["ci_high"] < 1.25 and sig.wilcoxon(slow, base) < 1e-6
    unpaired = sig.bootstrap_ratio(slow, base, 50, seed=0, resamples=3000)
    assert unpaired["ci_low"] < 1 < unpaired["ci_high"]
    assert sig.verdict(r, sig.wilcoxon(slow, base)) == "slower"


def test_pairs_match_the_kth_occurrence_of_each_sample() -> None:
    a = [("s1", 1), ("s2", 2), ("s1", 3)]
    b = [("s1", 10), ("s3", 30), ("s1", 11), ("s2", 20)]
    assert sig.pairs(a, b, key=lambda x: x[0]) == [(("s1", 1), ("s1", 10)), (("s2", 2), ("s2", 20)),
                                                   (("s1", 3), ("s1", 11))]  # fmt: skip


def test_placeholder_prices_and_estimated_energy_are_said_in_the_recommendation() -> None:
    default = derive(CostModel(placeholder_prices=True), duration_s=10.0, output_tokens=100, energy_j=50.0,
                     tracked_wall_s=10.0, quality=0.5)  # fmt: skip
    assert default["inputs"]["prices"] == "placeholder"
    run = _run("fp32", p99=1000, rss_gb=0.5, quality=1.0, tok_s=100, price=0.5)
    run.cost = Cost(per_million_output_tokens=0.5, inputs=default["inputs"])
    run.resources.energy_source = "estimate"
    reason = recommend([run], "fp32", PROFILES["edge"])["reasons"]["fp32"]
    assert "at placeholder prices" in reason and "energy estimated" in reason
    given = derive(CostModel(cost_per_hour=0.4), duration_s=10.0, output_tokens=100, energy_j=50.0,
                   tracked_wall_s=10.0, quality=0.5)  # fmt: skip
    run.cost = Cost(per_million_output_tokens=0.5, inputs=given["inputs"])
    run.resources.energy_source = "rapl"
    reason = recommend([run], "fp32", PROFILES["edge"])["reasons"]["fp32"]
    assert "placeholder" not in reason and "estimated" not in reason


def test_operator_families_of_the_new_recipes_regions() -> None:
    from variantbench.analysis.diagnosis import family_of

    assert family_of("linear_attention") == "attention"  # the linear-attn student's region
    assert family_of("quantize_per_token") == "quantize/dequantize"  # int8:act=token's row scaling
    assert family_of("quantized::linear_dynamic") == "matmul"  # FBGEMM quantizes inside the kernel
    assert family_of("aten::_scaled_mm") == family_of("aten::_int_mm") == "matmul"  # fp8 and int8 (CUDA)
    assert family_of("aten::linear") == family_of("aten::bmm") == "matmul"
    assert family_of("aten::scaled_dot_product_attention") == "attention"
