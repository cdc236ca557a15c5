"""The plan reference page, generated from the plan's own fields so it cannot drift from them.

``mkdocs build`` runs ``docs/gen_plan_reference.py`` (mkdocs-gen-files), which writes this module's
``render()`` as ``reference/plan.md``: one table a section, each key path with its type, its default,
its flag (``cli_args.FLAGS``) and its description, as ``plan.py`` declares them. The scenario
section (``load``) has one table a scenario, as the plan's union has one model a scenario.
"""

from __future__ import annotations

import enum
from pathlib import Path
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from variantbench.cli_args import FLAGS
from variantbench.plan import SCENARIO_TYPES, Plan

INTRO = """# Plan reference

Every setting of a plan, generated from `src/variantbench/plan.py` when the docs are built. A plan is
a YAML file of these sections; `--set KEY.PATH=VALUE` changes one setting, and the flags in the
third column are shortcuts for `--set` (`variantbench run --help` lists them too).
`variantbench plan PLAN.yaml --show` prints a plan with every default spelled out.
"""


def _type(annotation: Any) -> str:
    """A field's type as a reader of YAML needs it."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type(get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type(a) for a in get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in get_args(annotation) if a is not Ellipsis]
        return f"list of {_type(inner[0])}" if inner else "list"
    if origin is dict:
        key, value = get_args(annotation) or (str, Any)
        return f"map of {_type(key)} to {_type(value)}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is not None:
            value = field.default_factory()
            return f"`{value!r}`" if not isinstance(value, BaseModel) else "(section)"
        return "required"
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    return f"`{value!r}`" if value is not None else "`null`"


def _rows(model: type[BaseModel], prefix: tuple[str, ...]) -> list[str]:
    flags = {loc: flag for flag, loc in FLAGS.items()}
    rows = []
    for name, field in model.model_fields.items():
        loc = (*prefix, name)
        annotation = field.annotation
        nested = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if nested is not None:
            rows += _rows(nested, loc)
            continue
        text = (field.description or "").replace("|", "\\|").replace("\n", " ")
        flag = f"`{flags[loc]}`" if loc in flags else ""
        rows.append(f"| `{'.'.join(loc)}` | {_type(annotation)} | {_default(field)} | {flag} | {text} |")
    return rows


def _table(rows: list[str]) -> list[str]:
    return ["| key | type | default | flag | what it sets |", "| --- | --- | --- | --- | --- |", *rows, ""]


def render() -> str:
    """The whole page: the top-level settings, then a section a table (``load`` a scenario a table)."""
    out = [INTRO]
    top, sections = [], []
    for name, field in Plan.model_fields.items():
        annotation = field.annotation
        if name == "load":
            sections.append(("load", None))
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.append((name, annotation))
        else:
            top.append(name)
    out += ["## Top-level settings", ""]
    flags = {loc: flag for flag, loc in FLAGS.items()}
    out += _table([
        f"| `{n}` | {_type(Plan.model_fields[n].annotation)} | {_default(Plan.model_fields[n])} | "
        f"{'`' + flags[(n,)] + '`' if (n,) in flags else ''} | "
        f"{(Plan.model_fields[n].description or '').replace('|', chr(92) + '|')} |"
        for n in top
    ])  # fmt: skip
    for name, model in sections:
        doc = (model.__doc__ or "").strip() if model is not None else ""
        out += [f"## `{name}`", ""] + ([doc, ""] if doc else [])
        if model is not None:
            out += _table(_rows(model, (name,)))
            continue
        out += ["The scenario chooses the section's shape: `load.scenario` is one of "
                + ", ".join(f"`{s}`" for s in SCENARIO_TYPES) + ", and each takes the settings below.", ""]  # fmt: skip
        for scenario, scenario_model in SCENARIO_TYPES.items():
            out += [f"### `load` for `{scenario}`", ""]
            out += _table(_rows(scenario_model, ("load",)))
    return "\n".join(out)


def leaf_paths() -> set[str]:
    """Every settable key path (what the page must list)."""
    paths: set[str] = set()

    def walk(model: type[BaseModel], prefix: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            a = field.annotation
            if isinstance(a, type) and issubclass(a, BaseModel):
                walk(a, (*prefix, name))
            else:
                paths.add(".".join((*prefix, name)))

    for name, field in Plan.model_fields.items():
        if name == "load":
            for m in SCENARIO_TYPES.values():
                walk(m, ("load",))
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            walk(field.annotation, (name,))
        else:
            paths.add(name)
    return paths
