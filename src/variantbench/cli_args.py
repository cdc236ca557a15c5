"""The everyday flags of ``run`` and ``plan``: each one is a shortcut for ``--set KEY.PATH=VALUE``.

The table maps a flag to a key path of the plan and nothing else: the default, the type, the range
and the help text all come from the plan's field (``plan.py``), so a flag cannot drift from it.
Errors name the flag and the key path (``--rate (load.rate_qps): ...``). Boolean settings take
``--flag`` / ``--no-flag``; ``--isolate`` / ``--no-isolate`` choose the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from variantbench.errors import UserError
from variantbench.plan import SCENARIO_TYPES, Plan
from variantbench.plan_file import Location, parse_override

# flag -> key path; "bool" flags also take --no-FLAG
FLAGS: dict[str, Location] = {
    "--out": ("out",),
    "--model": ("model", "source"),
    "--variants": ("variants",),
    "--standard": ("standard",),
    "--endpoint": ("model", "endpoint"),
    "--endpoint-model": ("model", "endpoint_model"),
    "--api": ("model", "api"),
    "--request-timeout": ("model", "request_timeout_s"),
    "--tokenizer": ("model", "tokenizer"),
    "--device": ("model", "device"),
    "--threads": ("model", "threads"),
    "--cuda-graphs": ("model", "cuda_graphs"),
    "--build-seed": ("model", "build_seed"),
    "--tasks": ("load", "tasks"),
    "--workload": ("workload", "file"),
    "--skip-bad-lines": ("workload", "skip_bad_lines"),
    "--mix": ("workload", "mix"),
    "--input-lengths": ("workload", "input_lengths"),
    "--max-new-tokens": ("workload", "max_new_tokens"),
    "--scenario": ("load", "scenario"),
    "--rate": ("load", "rate_qps"),
    "--burstiness": ("load", "burstiness"),
    "--max-concurrency": ("load", "max_concurrency"),
    "--senders": ("load", "senders"),
    "--samples-per-query": ("load", "samples_per_query"),
    "--max-batch-size": ("load", "max_batch_size"),
    "--find-peak": ("load", "find_peak"),
    "--warmup": ("limits", "warmup"),
    "--min-queries": ("limits", "min_queries"),
    "--max-queries": ("limits", "max_queries"),
    "--min-duration": ("limits", "min_duration_s"),
    "--max-duration": ("limits", "max_duration_s"),
    "--latency-target-ms": ("targets", "latency_ms"),
    "--ttft-target-ms": ("targets", "ttft_ms"),
    "--tpot-target-ms": ("targets", "tpot_ms"),
    "--latency-percentile": ("targets", "percentile"),
    "--window": ("targets", "window"),
    "--seed": ("seeds", "workload"),
    "--schedule-seed": ("seeds", "schedule"),
    "--quality-threshold": ("quality", "threshold"),
    "--length-tolerance": ("quality", "length_tolerance"),
    "--accuracy-log": ("quality", "accuracy_log"),
    "--accuracy-only": ("quality", "accuracy_only"),
    "--fidelity": ("quality", "fidelity"),
    "--fidelity-text": ("quality", "fidelity_text"),
    "--repeats": ("analysis", "repeats"),
    "--diagnose": ("analysis", "diagnose"),
    "--cold-start": ("analysis", "cold_start"),
    "--until-decided": ("analysis", "until_decided"),
    "--tie-band": ("analysis", "tie_band"),
    "--looks": ("analysis", "looks"),
    "--interleave": ("execution", "interleave"),
    "--block-s": ("execution", "block_s"),
    "--executor": ("execution", "executor"),
    "--ray-address": ("execution", "address"),
    "--csv": ("output", "csv"),
    "--history": ("output", "history"),
    "--record-history": ("output", "record_history"),
    "--overwrite": ("output", "overwrite"),
    "--cost-per-hour": ("cost", "per_hour"),
    "--devices": ("cost", "devices"),
    "--currency": ("cost", "currency"),
    "--energy-price-kwh": ("cost", "energy_price_kwh"),
    "--watts-per-core": ("cost", "watts_per_core"),
    "--profile": ("decision", "profile"),
    "--need-p99-ms": ("decision", "need_p99_ms"),
    "--need-memory-mb": ("decision", "need_memory_mb"),
    "--need-quality": ("decision", "need_quality"),
    "--need-qps": ("decision", "need_qps"),
    "--need-build-s": ("decision", "need_build_s"),
    "--need-no-gpu": ("decision", "need_no_gpu"),
}
# flags that set one key to a fixed value
ALIASES: dict[str, tuple[Location, Any]] = {
    "--no-history": (("output", "record_history"), False),
}
# flags whose on/off choose a value other than true/false
SWITCHES: dict[str, tuple[Location, Any, Any]] = {
    "--isolate": (("execution", "executor"), "local", "inline"),
}


def _field(loc: Location) -> Any:
    """The pydantic field at a key path (``section`` or ``section.key``; for ``load``, the first
    scenario that has the key)."""
    section, *rest = loc
    if not rest:
        return Plan.model_fields[section]
    if section == "load":
        return next(
            (t.model_fields[rest[0]] for t in SCENARIO_TYPES.values() if rest[0] in t.model_fields), None
        )
    return Plan.model_fields[section].annotation.model_fields[rest[0]]


def _is_bool(loc: Location) -> bool:
    info = _field(loc)
    return info is not None and info.annotation is bool


@dataclass(frozen=True)
class FlagTable:
    """One command's flags: each a shortcut for one key path of the plan (``run``'s are ``FLAGS``)."""

    flags: dict[str, Location]
    aliases: dict[str, tuple[Location, Any]] = field(default_factory=dict)
    switches: dict[str, tuple[Location, Any, Any]] = field(default_factory=dict)
    repeated: frozenset[str] = frozenset()  # flags whose values accumulate into a list setting
    url: Location | None = None  # where a positional URL goes (monitor's server), else a plan file
    vllm: bool = False  # vllm bench serve's flags translated (run)


# the model a command loads or measures, shared by every command that loads one
MODEL_FLAGS: dict[str, Location] = {k: FLAGS[k] for k in ("--model", "--device", "--threads")}
ROUTER_FLAGS: dict[str, Location] = {
    "--router": ("router", "tiers"),
    "--standard-share": ("router", "standard_share"),
    "--seed": ("router", "seed"),
}
SERVE_FLAGS = FlagTable(
    {**MODEL_FLAGS, **ROUTER_FLAGS, **{f"--{k.replace('_', '-')}": ("serve", k) for k in (
        "variants", "host", "port", "max_batch_size", "max_wait_ms", "max_queue", "queue_timeout_ms", "max_len",
        "prefill_chunk", "prefix_cache_mb", "queue_policy", "ttft_slo_ms", "kv_cache", "kv_cache_gb",
        "weight_layout", "priority_levels", "max_queue_total", "api_key", "allow_unauthenticated", "allowed_hosts",
        "public_paths", "max_body_mb", "max_prompt_bytes", "max_stop", "max_stop_chars", "max_messages",
        "header_timeout_s", "body_timeout_s", "keep_alive_s", "max_request_s")},
     "--router-name": ("router", "name"), "--calibration-prompts": ("router", "calibration_prompts"),
     "--input-lengths": ("router", "input_lengths")},
    repeated=frozenset({"--queue-policy"}),
)  # fmt: skip
ROUTE_FLAGS = FlagTable({**MODEL_FLAGS, **ROUTER_FLAGS, "--tasks": ("router", "tasks"),
                         "--input-lengths": ("router", "route_input_lengths"),
                         "--cost-per-hour": ("cost", "per_hour")})  # fmt: skip
MONITOR_FLAGS = FlagTable(
    {**{f"--{k.replace('_', '-')}": ("monitor", k) for k in (
        "url", "model", "probes", "probe", "out", "threshold", "baseline", "metrics_port", "api")},
     "--every": ("monitor", "every_s"), "--history": ("output", "history"),
     "--record-history": ("output", "record_history")},
    aliases=ALIASES, url=("monitor", "url"),
)  # fmt: skip
SEARCH_FLAGS = FlagTable(
    {**FLAGS, **{f"--{k.replace('_', '-')}": ("search", k) for k in (
        "space", "objectives", "budget", "sampler", "seed", "population", "prune_margin", "fresh")}},
    aliases=ALIASES, switches=SWITCHES,
)  # fmt: skip
RUN_FLAGS = FlagTable(FLAGS, aliases=ALIASES, switches=SWITCHES, vllm=True)


def _shown_default(info: Any) -> str | None:
    """A field's default as ``--help`` shows it (none for an empty or unset one)."""
    value = info.get_default(call_default_factory=True)
    if value is None or value == "" or value == () or value == {} or value == []:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag_help(table: FlagTable | None = None) -> list[tuple[str, str, str]]:
    """(flag, key path, help) for every flag, from the plan's own field descriptions."""
    table = table or RUN_FLAGS
    rows = []
    for flag, loc in table.flags.items():
        info = _field(loc)
        desc = (info.description or "") if info is not None else ""
        if loc == ("load", "scenario"):
            desc = " | ".join(SCENARIO_TYPES)
        elif info is not None and (default := _shown_default(info)) is not None:
            desc = f"{desc} (default: {default})"
        shown = f"{flag} / --no-{flag[2:]}" if _is_bool(loc) else flag
        rows.append((shown, ".".join(loc), desc))
    for flag, (loc, on, off) in table.switches.items():
        rows.append((f"{flag} / --no-{flag[2:]}", ".".join(loc), f"{on} (on) or {off} (off)"))
    for flag, (loc, fixed) in table.aliases.items():
        rows.append((flag, ".".join(loc), f"sets it to {fixed}"))
    return rows


@dataclass
class RunArgs:
    plan_file: Path | None = None
    overrides: list[tuple[Location, Any]] = field(default_factory=list)
    flag_of: dict[Location, str] = field(default_factory=dict)
    extra: dict[str, bool] = field(default_factory=dict)  # command-specific switches (plan --show)

    def sets(self, loc: Location) -> bool:
        return any(o == loc for o, _ in self.overrides)


# vllm bench serve's flags -> ours (README: "Coming from vllm bench serve"); the same plan either way
VLLM_FLAGS: dict[str, str] = {
    "--base-url": "--endpoint (model.endpoint); then --endpoint is the API path and --model the served name",
    "--endpoint": "with --base-url: the API path, /v1/chat/completions choosing --api chat",
    "--model": "with --base-url: --endpoint-model (model.endpoint_model), the served model's name",
    "--served-model-name": "--endpoint-model (model.endpoint_model)",
    "--backend": "openai-chat: --api chat; vllm, openai and the other OpenAI-style backends: --api completions",
    "--request-rate": "--scenario server --rate R (load.rate_qps); inf: --scenario offline (all at once)",
    "--num-prompts": "--tasks (load.tasks)",
    "--max-concurrency": "--max-concurrency (load.max_concurrency)",
    "--burstiness": "--burstiness (load.burstiness)",
    "--dataset-name": "random: the synthetic workload; sharegpt, jsonl, squad, cnndm: the file of --dataset-path",
    "--dataset-path": "--workload (workload.file)",
    "--random-input-len": "--input-lengths fixed:N (workload.input_lengths)",
    "--random-output-len": "--max-new-tokens (workload.max_new_tokens)",
    "--percentile-metrics": "output.percentile_metrics",
    "--metric-percentiles": "output.metric_percentiles",
    "--goodput": "targets.goodput_ms (NAME:MS pairs, space-separated as in vLLM)",
    "--ignore-eos": "workload.ignore_eos",
    "--save-result": "output.vllm_result (vllm_result.VARIANT.json with vLLM's field names)",
    "--seed": "--seed (seeds.workload)",
}
_VLLM_ONLY = {"--base-url", "--served-model-name", "--backend", "--request-rate", "--num-prompts", "--dataset-name",
              "--dataset-path", "--random-input-len", "--random-output-len", "--percentile-metrics",
              "--metric-percentiles", "--goodput", "--ignore-eos", "--save-result"}  # fmt: skip
DATASETS = ("random", "sharegpt", "jsonl", "squad", "cnndm")


def flag_value(tokens: list[str], at: int, flag: str) -> tuple[str, int]:
    """The value of the flag at ``tokens[at]`` (``--flag=V`` or ``--flag V``) and the index after it."""
    _, eq, inline = tokens[at].partition("=")
    if eq:
        return inline, at + 1
    if at + 1 >= len(tokens):
        raise UserError(f"{flag} needs a value")
    return tokens[at + 1], at + 2


def translate_vllm(tokens: list[str]) -> list[str]:
    """vllm bench serve's flags rewritten as ours (``VLLM_FLAGS``); a command line without any of
    them is returned as it is. ``--endpoint`` and ``--model`` change meaning only with ``--base-url``."""
    names = {t.partition("=")[0] for t in tokens if t.startswith("--")}
    if not names & _VLLM_ONLY:
        return tokens
    vllm_style = "--base-url" in names
    out: list[str] = []
    i = 0

    def take(flag: str) -> str:
        nonlocal i
        value, i = flag_value(tokens, i, flag)
        return value

    dataset = None
    while i < len(tokens):
        name = tokens[i].partition("=")[0]
        if name == "--base-url":
            out += ["--endpoint", take(name)]
        elif name == "--endpoint" and vllm_style:
            path = take(name)
            out += ["--api", "chat" if "chat" in path else "completions"]
        elif name in ("--served-model-name",) or (name == "--model" and vllm_style):
            out += ["--endpoint-model", take(name)]
        elif name == "--backend":
            out += ["--api", "chat" if take(name) == "openai-chat" else "completions"]
        elif name == "--request-rate":
            rate = take(name)
            out += (
                ["--scenario", "offline"]
                if rate.lower() in ("inf", "infinity")
                else ["--scenario", "server", "--rate", rate]
            )
        elif name == "--num-prompts":
            out += ["--tasks", take(name)]
        elif name == "--dataset-name":
            dataset = take(name)
            if dataset not in DATASETS:
                raise UserError(f"--dataset-name {dataset!r}: known here: {', '.join(DATASETS)}")
        elif name == "--dataset-path":
            out += ["--workload", take(name)]
        elif name == "--random-input-len":
            out += ["--input-lengths", f"fixed:{take(name)}"]
        elif name == "--random-output-len":
            out += ["--max-new-tokens", take(name)]
        elif name == "--percentile-metrics":
            out += ["--set", f"output.percentile_metrics={take(name)}"]
        elif name == "--metric-percentiles":
            out += ["--set", f"output.metric_percentiles={take(name)}"]
        elif name == "--goodput":
            i += 1
            slos = []
            while i < len(tokens) and not tokens[i].startswith("--"):
                slos.append(tokens[i])
                i += 1
            if not slos:
                raise UserError("--goodput needs NAME:MS pairs, e.g. --goodput ttft:500 tpot:50")
            out += ["--set", f"targets.goodput_ms={' '.join(slos)}"]
        elif name == "--ignore-eos":
            i += 1
            out += ["--set", "workload.ignore_eos=true"]
        elif name == "--save-result":
            i += 1
            out += ["--set", "output.vllm_result=true"]
        else:
            out.append(tokens[i])
            i += 1
    if dataset not in (None, "random") and "--dataset-path" not in names:
        raise UserError(
            f"--dataset-name {dataset} needs --dataset-path (a local file: no download at run time)"
        )
    return out


def parse_run_args(tokens: list[str], switches: tuple[str, ...] = (), table: FlagTable | None = None,
                   command: str = "run") -> RunArgs:  # fmt: skip
    """``[PLAN.yaml] [--set k=v ...] [--flag value ...]`` -> the plan file and its overrides, in order;
    ``table``: the command's flags (``run``'s by default, where vllm bench serve's flags are accepted
    too: ``translate_vllm``)."""
    table = table or RUN_FLAGS
    if table.vllm:
        tokens = translate_vllm(tokens)
    args = RunArgs()
    repeated: dict[Location, list[str]] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if table.url is not None and not token.startswith("--") and "://" in token:
            args.overrides.append((table.url, token))
            continue
        if not token.startswith("--"):
            if args.plan_file is not None:
                raise UserError(f"one plan file at most; got {args.plan_file} and {token}")
            args.plan_file = Path(token)
            continue
        name, eq, inline = token.partition("=")
        if name in switches:
            args.extra[name] = True
            continue

        def value(name: str = name) -> str:
            nonlocal i
            got, i = flag_value(tokens, i - 1, name)
            return got

        if name == "--set":
            loc, parsed = parse_override(value())
            args.overrides.append((loc, parsed))
            continue
        if name in table.aliases:
            loc, fixed = table.aliases[name]
            args.overrides.append((loc, fixed))
            args.flag_of[loc] = name
            continue
        negated = name.startswith("--no-") and f"--{name[5:]}" in {**table.flags, **table.switches}
        base = f"--{name[5:]}" if negated else name
        if base in table.switches:
            loc, on, off = table.switches[base]
            args.overrides.append((loc, off if negated else on))
            args.flag_of[loc] = name
            continue
        loc = table.flags.get(base)
        if loc is None:
            raise UserError(
                f"unknown option {name}; see 'variantbench {command} --help' (or --set key.path=value)"
            )
        if base in table.repeated:
            repeated.setdefault(loc, []).append(value())
            args.flag_of[loc] = base
            continue
        if _is_bool(loc):
            args.overrides.append((loc, not negated))
        elif negated:
            raise UserError(f"unknown option {name}: {base} takes a value")
        else:
            args.overrides.append((loc, value()))  # a string: pydantic converts it to the field's type
        args.flag_of[loc] = base
    args.overrides += [(loc, values) for loc, values in repeated.items()]
    return args
