"""The space a variant search explores: recipe chains, read from a YAML file.

    steps:                       # structural steps, in chain order; each may be left out
      prune-heads:
        ratio: {low: 0.1, high: 0.5, step: 0.1}     # a range (step: a grid; log: true)
      drop-layers:
        count: {low: 1, high: 8}
      distill:
        steps: [30, 90]                             # a list: one of these
        requires_any: [prune-heads, drop-layers]    # only after a step that changed the model
    finish: [fp32, bf16, int8, gguf-q8_0]           # the chain's last step: a precision or an engine

Every other key under a step is a field of that recipe (``variantbench variants`` lists the kinds);
a plain value is a constant. ``optional: false`` keeps a step in every trial. The space is checked
whole when it is read, each range's ends and each choice built as a recipe, so a typo is one line
before any trial runs. A trial's variant is an ordinary name (``prune-heads:0.3+distill:steps=30+int8``)
that pastes into a plan.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
import yaml

from variantbench.errors import UserError
from variantbench.variants.base import Recipe, known_kinds, parse_variant, recipe_type


class Range(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    low: float
    high: float
    step: float | None = None
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.high < self.low:
            raise ValueError(f"high ({self.high:g}) is below low ({self.low:g})")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError("log: true needs low > 0 and no step")
        return self


class Step(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    optional: bool = True
    requires_any: tuple[str, ...] = ()
    params: dict[str, Range | tuple[Any, ...] | Any] = Field(default_factory=dict)


class SearchSpace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    steps: dict[str, Step] = Field(default_factory=dict)
    finish: tuple[str, ...] = ("fp32",)

    def digest(self) -> str:
        """What a resumed search checks: the same space, or a fresh folder."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[
            :16
        ]

    def suggest(self, trial: Any) -> str:
        """The trial's variant name, its parameters drawn through Optuna's define-by-run ``trial``."""
        parts: list[str] = []
        used: set[str] = set()
        for kind, step in self.steps.items():
            if step.requires_any and not used.intersection(step.requires_any):
                continue
            if step.optional and not trial.suggest_categorical(kind, [False, True]):
                continue
            values = {name: _draw(trial, f"{kind}.{name}", p, _field_type(kind, name))
                      for name, p in step.params.items()}  # fmt: skip
            parts.append(_recipe(kind, values).written())
            used.add(kind)
        last = (
            self.finish[0]
            if len(self.finish) == 1
            else trial.suggest_categorical("finish", list(self.finish))
        )
        if last != "fp32" or not parts:
            parts.append(last)
        return "+".join(parts)

    def size_note(self) -> str:
        return f"{len(self.steps)} structural step(s) ({', '.join(self.steps) or 'none'}); finish: {', '.join(self.finish)}"


def _type(kind: str) -> type[Recipe]:
    found = recipe_type(kind)
    assert found is not None, kind
    return found


def _field_type(kind: str, name: str) -> Any:
    return _type(kind).model_fields[name].annotation


def _draw(trial: Any, key: str, p: Any, annotation: Any) -> Any:
    if isinstance(p, Range):
        if annotation is int:
            return trial.suggest_int(key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        value = trial.suggest_float(key, p.low, p.high, step=p.step, log=p.log)
        return round(value, 6)
    if isinstance(p, tuple):
        return trial.suggest_categorical(key, list(p))
    return p


def _recipe(kind: str, values: dict[str, Any], where: str = "search space") -> Recipe:
    try:
        return _type(kind)(kind=kind, **values)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise UserError(f"{where}: steps.{kind}.{key}: {err['msg']} (got {err.get('input')!r})") from None


def load_space(path: Path) -> SearchSpace:
    """The space file read and checked whole; any mistake is one line naming the key."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read the search space {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    return parse_space(raw, str(path))


def parse_space(raw: Any, where: str = "search space") -> SearchSpace:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping with steps: and finish:")
    unknown = set(raw) - {"steps", "finish"}
    if unknown:
        raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: steps, finish)")
    steps: dict[str, Step] = {}
    for kind, body in (raw.get("steps") or {}).items():
        steps[kind] = _step(kind, body or {}, where)
    for kind, step in steps.items():
        for need in step.requires_any:
            if need not in steps or list(steps).index(need) > list(steps).index(kind):
                raise UserError(f"{where}: steps.{kind}.requires_any: {need!r} is not a step before it")
    finish = raw.get("finish", ["fp32"])
    finish = [finish] if isinstance(finish, str) else finish
    if not isinstance(finish, list) or not finish:
        raise UserError(f"{where}: finish: a list of variant kinds (fp32, bf16, int8, gguf-q8_0, ...)")
    for name in finish:
        recipes = parse_variant(str(name))
        if len(recipes) != 1 or recipes[0].stage == "build":
            raise UserError(
                f"{where}: finish: {name!r} must be one precision or engine step (not a structural one)"
            )
    return SearchSpace(steps=steps, finish=tuple(str(f) for f in finish))


def _step(kind: str, body: Any, where: str) -> Step:
    found = recipe_type(kind)
    if found is None:
        raise UserError(f"{where}: steps: unknown variant kind {kind!r}; known: {', '.join(known_kinds())}")
    if found.stage != "build":
        raise UserError(f"{where}: steps.{kind}: not a structural step; precisions and engines go in finish:")
    if not isinstance(body, dict):
        raise UserError(f"{where}: steps.{kind}: expected a mapping of the recipe's fields")
    options = {k: body[k] for k in ("optional", "requires_any") if k in body}
    params: dict[str, Any] = {}
    fields = found.model_fields
    for name, value in body.items():
        if name in options:
            continue
        if name not in fields or name == "kind":
            known = ", ".join(f for f in fields if f != "kind")
            raise UserError(f"{where}: steps.{kind}.{name}: not a field of {kind} (its fields: {known})")
        try:
            params[name] = (
                Range(**value)
                if isinstance(value, dict)
                else tuple(value)
                if isinstance(value, list)
                else value
            )
        except (ValidationError, TypeError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise UserError(f"{where}: steps.{kind}.{name}: {msg}") from None
    # every end of every range and every choice must make a valid recipe
    for name, p in params.items():
        base = {
            k: (v.low if isinstance(v, Range) else v[0] if isinstance(v, tuple) else v)
            for k, v in params.items()
        }
        tries = [p.low, p.high] if isinstance(p, Range) else list(p) if isinstance(p, tuple) else [p]
        for value in tries:
            if isinstance(p, Range) and fields[name].annotation is int:
                value = int(value)
            _recipe(kind, {**base, name: value}, where)
    required = [n for n, f in fields.items() if n != "kind" and f.is_required() and n not in params]
    if required:
        raise UserError(f"{where}: steps.{kind}: give {required[0]} (a value, a list or a low/high range)")
    try:
        requires = options.get("requires_any", ())
        requires = (requires,) if isinstance(requires, str) else tuple(requires)
        return Step(optional=bool(options.get("optional", True)), requires_any=requires, params=params)
    except ValidationError as exc:
        raise UserError(f"{where}: steps.{kind}: {exc.errors()[0]['msg']}") from None
