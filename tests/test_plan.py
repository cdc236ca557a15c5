"""Plans: one model holds every default; files, --set and flags map onto it; errors name the key and line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from variantbench.cli_args import FLAGS, flag_help, parse_run_args
from variantbench.errors import UserError
from variantbench.plan import Plan, Server, SingleStream
from variantbench.plan_file import dump_plan, load_plan, parse_override

PLANS = Path(__file__).resolve().parents[1] / "plans"
HINTS = {loc: flag for flag, loc in FLAGS.items()}


def _plan(*tokens: str) -> Plan:
    args = parse_run_args(list(tokens))
    return load_plan(args.plan_file, args.overrides, args.flag_of, HINTS)


def _error(*tokens: str) -> str:
    with pytest.raises(UserError) as info:
        _plan(*tokens)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_default_plan_file_is_the_plans_defaults() -> None:
    assert load_plan(PLANS / "default.yaml") == Plan()


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_plan_is_valid_and_replays_to_itself(path: Path, tmp_path: Path) -> None:
    plan = load_plan(path)
    resolved = tmp_path / "plan.yaml"
    resolved.write_text(dump_plan(plan))
    assert load_plan(resolved) == plan
    # fully resolved: every field of every section is written out
    data = yaml.safe_load(resolved.read_text())
    assert set(data) == set(Plan.model_fields)
    assert set(data["limits"]) == set(type(plan.limits).model_fields)
    assert set(data["load"]) == set(type(plan.load).model_fields)


def test_flags_are_shortcuts_for_key_paths() -> None:
    plan = _plan("--variants", "fp32,int8", "--tasks", "4", "--scenario", "server", "--rate", "2.5",
                 "--no-fidelity", "--no-isolate", "--latency-target-ms", "800", "--profile", "edge")  # fmt: skip
    assert plan.variants == ("fp32", "int8")
    assert isinstance(plan.load, Server) and plan.load.rate_qps == 2.5 and plan.load.tasks == 4
    assert plan.quality.fidelity is False and plan.execution.executor == "inline"
    assert plan.targets.latency_ms == 800 and plan.decision.profile == "edge"
    same = _plan("--set", "variants=[fp32, int8]", "--set", "load.tasks=4", "--set", "load.scenario=server",
                 "--set", "load.rate_qps=2.5", "--set", "quality.fidelity=false", "--set",
                 "execution.executor=inline", "--set", "targets.latency_ms=800", "--set", "decision.profile=edge")  # fmt: skip
    assert same == plan


def test_every_flag_names_a_real_setting_and_takes_its_help_from_the_plan() -> None:
    rows = flag_help()
    assert len(rows) == len(FLAGS) + 2  # + --isolate, --no-history
    for flag, key, desc in rows:
        assert desc, f"{flag} ({key}) has no description in the plan"
    from variantbench.plan import SCENARIO_TYPES

    defaults = Plan().model_dump()
    for flag, loc in FLAGS.items():  # every key path is a field of the plan (of some scenario, for load)
        if loc[0] == "load":
            assert any(loc[1] in t.model_fields for t in SCENARIO_TYPES.values()), flag
        else:
            node = defaults
            for part in loc:
                assert isinstance(node, dict) and part in node, flag
                node = node[part]


def test_override_values_are_read_as_yaml() -> None:
    assert parse_override("load.rate_qps=2") == (("load", "rate_qps"), 2)
    assert parse_override("quality.fidelity=false") == (("quality", "fidelity"), False)
    assert parse_override("variants=[fp32, bf16]") == (("variants",), ["fp32", "bf16"])
    assert parse_override("model.source=") == (("model", "source"), None)
    with pytest.raises(UserError, match="key.path=value"):
        parse_override("load.rate_qps")


def test_a_bad_key_in_a_plan_file_names_its_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("variants: [fp32]\nload:\n  scenario: server\n  rate_qps: 2\n  ratee: 3\n")
    with pytest.raises(UserError) as info:
        load_plan(path)
    assert str(info.value) == f"{path}:5: load.ratee: not a setting of the server scenario"


def test_a_bad_value_in_a_plan_file_names_its_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "workload:\n  input_lengths: uniform:128-2048\nlimits:\n  warmup: 1\n  max_duration_s: -4\n"
    )
    with pytest.raises(UserError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}:5: limits.max_duration_s: ")
    path.write_text("load:\n  scenario: burst\n")
    with pytest.raises(UserError, match=r"p.yaml:2: load.scenario: unknown scenario; known: single-stream"):
        load_plan(path)
    path.write_text("variants: [fp32\n")
    with pytest.raises(UserError, match=r"p.yaml:\d+: not valid YAML"):
        load_plan(path)


def test_flag_errors_name_the_flag_and_the_key() -> None:
    assert _error("--tasks", "0") == "--tasks (load.tasks): Input should be greater than 0"
    assert _error("--scenario", "server").startswith(
        "load.rate_qps: required by the server scenario (set it with --rate"
    )
    assert _error("--rate", "2") == "--rate (load.rate_qps): not a setting of the single-stream scenario"
    assert "unknown option --ratez" in _error("--ratez", "2")
    assert _error("--set", "workload.taskz=3") == "workload.taskz: unknown setting"
    assert "find_peak needs targets.latency_ms" in _error(
        "--scenario", "server", "--rate", "1", "--find-peak"
    )
    assert "standard 'int8' is not among the variants" in _error("--variants", "fp32", "--standard", "int8")


def test_changing_the_scenario_drops_the_files_knobs_of_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("load:\n  scenario: server\n  rate_qps: 2\n  tasks: 7\n")
    plan = _plan(str(path), "--scenario", "single-stream")
    assert plan.load == SingleStream(tasks=7)
    assert "not a setting of the offline scenario" in _error(
        str(path), "--scenario", "offline", "--rate", "3"
    )


def test_plan_command_prints_the_resolved_plan(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "variantbench", "plan", str(PLANS / "server-sweep.yaml"),
                           "--set", "load.rate_qps=0.5", "--show"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["load"]["rate_qps"] == 0.5 and shown["load"]["find_peak"] is True
    assert shown["limits"]["drain_timeout_s"] == 600.0  # a default, spelled out
    bad = tmp_path / "bad.yaml"
    bad.write_text("cost:\n  per_hour: -1\n")
    proc = subprocess.run([sys.executable, "-m", "variantbench", "plan", str(bad)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{bad}:2: cost.per_hour" in lines[0], proc.stderr
