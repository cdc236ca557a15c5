"""Plans in and out: YAML with line numbers, ``--set key.path=value`` overrides, one-line errors.

A plan file is read as a YAML node tree first, so every key keeps the line it was written on: a bad
key or value is one line naming the key path and that line (``plan.yaml:7: load.rate_qps: ...``).
Overrides are applied to the raw mapping before validation, so ``--set load.scenario=server --set
load.rate_qps=2`` switches the scenario union as a file would. A value is read as YAML
(``2`` -> 2, ``true`` -> True, ``[a, b]`` -> a list, ``null`` -> None).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
import yaml

from variantbench.errors import UserError
from variantbench.plan import SCENARIO_TYPES, SCENARIOS, Plan
from variantbench.redact import redact_plan

Location = tuple[str, ...]


def _line_map(
    node: yaml.Node, path: Location = (), lines: dict[Location, int] | None = None
) -> dict[Location, int]:
    """Key path -> 1-based line, for every mapping key and list item under ``node``."""
    lines = {} if lines is None else lines
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = (*path, str(key.value))
            lines[here] = key.start_mark.line + 1
            _line_map(value, here, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            here = (*path, str(i))
            lines[here] = item.start_mark.line + 1
            _line_map(item, here, lines)
    return lines


def read_plan_file(path: Path) -> tuple[dict[str, Any], dict[Location, int]]:
    """The raw mapping of a plan file and the line of every key in it."""
    if not path.is_file():
        raise UserError(f"plan file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where}: not valid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read plan file {path}: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a plan is a mapping of sections (model, variants, workload, load, ...)")
    return data, _line_map(node) if node is not None else {}


def parse_override(text: str) -> tuple[Location, Any]:
    """``"load.rate_qps=2"`` -> (("load", "rate_qps"), 2)."""
    key, sep, value = text.partition("=")
    path = tuple(p.strip() for p in key.strip().split("."))
    if not sep or not all(path):
        raise UserError(f"--set takes key.path=value (e.g. load.rate_qps=2), got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return path, parsed


def apply_override(data: dict[str, Any], path: Location, value: Any) -> None:
    """Set ``path`` in the nested mapping ``data``, making sections as needed."""
    node: Any = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"--set {'.'.join(path)}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def _clean_loc(loc: Iterable[Any]) -> Location:
    """A pydantic error location as a key path: the scenario union's tag is not a key of the plan."""
    parts = [str(p) for p in loc]
    if len(parts) >= 2 and parts[0] == "load" and parts[1] in SCENARIOS:
        del parts[1]
    return tuple(p for p in parts if not p.startswith("function-"))


def _message(err: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    kind, msg = err["type"], str(err["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        loc = _clean_loc(err["loc"])
        if loc and loc[0] == "load":
            scenario = (data.get("load") or {}).get("scenario", "single-stream")
            return f"not a setting of the {scenario} scenario"
        return "unknown setting"
    if kind == "missing":
        loc = _clean_loc(err["loc"])
        if loc and loc[0] == "load":
            return f"required by the {(data.get('load') or {}).get('scenario')} scenario"
        return "required"
    if kind == "union_tag_invalid":
        return f"unknown scenario; known: {', '.join(SCENARIOS)}"
    return msg


def validate_plan(
    data: dict[str, Any],
    lines: Mapping[Location, int] | None = None,
    source: str | None = None,
    flag_of: Mapping[Location, str] | None = None,
    hints: Mapping[Location, str] | None = None,
) -> Plan:
    """A Plan from a raw mapping, or one line naming the key path (and its line, or its flag).

    ``flag_of``: the flags that set a key (named in its error); ``hints``: every key's flag, named
    when a required key is missing.
    """
    if isinstance(data.get("load"), dict):
        data["load"].setdefault("scenario", "single-stream")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = _clean_loc(err["loc"])
        if err["type"] == "union_tag_invalid" and loc[-1:] != ("scenario",):
            loc = (*loc, "scenario")
        key = ".".join(loc)
        where = key or "plan"
        line = None
        for n in range(len(loc), 0, -1):  # the key's own line, else its nearest section's
            if lines and loc[:n] in lines:
                line = lines[loc[:n]]
                break
        flag = (flag_of or {}).get(loc)
        message = _message(err, data)
        if flag:
            where = f"{flag} ({key})"
        elif source and line:
            where = f"{source}:{line}: {key}" if key else f"{source}:{line}"
        if err["type"] == "missing" and (hints or {}).get(loc):
            message += f" (set it with {hints[loc]} or --set {key}=...)"
        raise UserError(f"{where}: {message}" if key else message) from None


def load_plan(
    path: Path | None = None,
    overrides: Iterable[tuple[Location, Any]] = (),
    flag_of: Mapping[Location, str] | None = None,
    hints: Mapping[Location, str] | None = None,
) -> Plan:
    """The plan file (or the defaults), with the overrides applied, validated."""
    data, lines = read_plan_file(path) if path is not None else ({}, {})
    file_load = dict(data["load"]) if isinstance(data.get("load"), dict) else {}
    overridden: set[Location] = set()
    for loc, value in overrides:
        apply_override(data, loc, value)
        overridden.add(loc)
    _drop_other_scenarios_keys(data, file_load, overridden)
    return validate_plan(data, lines, str(path) if path else None, flag_of, hints)


def _drop_other_scenarios_keys(
    data: dict[str, Any], file_load: dict[str, Any], overridden: set[Location]
) -> None:
    """A plan file's server knobs do not block ``--scenario offline``: when an override changes the
    scenario, the file's settings that the new scenario does not have are dropped (the override's own
    stay, and are errors if the scenario has no such setting)."""
    load = data.get("load")
    if not isinstance(load, dict) or ("load", "scenario") not in overridden:
        return
    kind = SCENARIO_TYPES.get(str(load.get("scenario")))
    if kind is None or load.get("scenario") == file_load.get("scenario", "single-stream"):
        return
    for key in file_load:
        if key not in kind.model_fields and ("load", key) not in overridden:
            load.pop(key, None)


def dump_plan(plan: Plan) -> str:
    """The plan fully resolved (every default spelled out), as YAML in the models' field order."""
    header = (
        "# variantbench plan, fully resolved: every default is spelled out.\n"
        "# Replay with: variantbench run THIS_FILE   (change a value with --set key.path=value)\n"
    )
    data = redact_plan(plan.model_dump(mode="json"))  # no literal header, key, URL user-info or query
    data["load"] = {"scenario": data["load"].pop("scenario"), **data["load"]}  # the union's tag first
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def write_plan(plan: Plan, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dump_plan(plan), encoding="utf-8")
    tmp.replace(path)
