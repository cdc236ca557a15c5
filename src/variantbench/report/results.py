"""A measured variant's raw result: what a measure job returns, what ``raw/*.json`` holds, and what the
assembly, the charts, the history and the search read by attribute.

One typed, versioned model from the job to the page. Before it, a job returned a dict with 19
top-level keys, read back by 62 string-key accesses in five modules (b689722): a key renamed in
one place was silently ``None`` in another. ``migrate`` reads the results earlier versions wrote.

A result is written as it grows (``status: "partial"``), once the variant has loaded, at each look
of an interleaved run and after each later phase, atomically (write then rename), so a run killed
halfway keeps every phase that finished; ``done`` lists them. The final write says ``"ok"`` (or
``"failed"``, with its one-line error).
"""

from __future__ import annotations

from collections.abc import Iterable
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from variantbench.records import QueryRecord
from variantbench.report.schema import Diagnosis, Likelihood, LmEvalReport, PeakTrial, Resources

RESULT_VERSION = 2  # 1: the untyped dicts written up to bd8b7ab (no "version" key)

# The phases of a variant's measurement, in the order they run; ``done`` names those that finished.
# "load" and "scenario" always run; the others where the plan asks for them.
PHASES = ("load", "scenario", "batch", "fidelity", "likelihood", "lm_eval", "diagnosis", "cold_start")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadFacts(_Model):
    """What loading the variant said: its time to ready, its weights' bytes, the backend's details."""

    startup_s: float = 0.0
    param_bytes: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)  # open: each backend says what it has


class BuildFacts(_Model):
    built_now: bool = False
    build_wall_s: float | None = None


class BatchDecode(_Model):
    """Decode tokens/s with ``size`` requests at once, one value a measurement."""

    size: int
    new_tokens: int
    tokens_per_s: list[float] = Field(default_factory=list)


class ServerScrape(_Model):
    """A served variant's ``/metrics``, scraped while its queries ran."""

    url: str
    interval_s: float
    samples: list[list[Any]] = Field(default_factory=list)
    error: str | None = None
    latency_histograms: dict[str, dict[str, float]] = Field(default_factory=dict)


class Fidelity(_Model):
    """Logit fidelity on a held-out text against the standard (``metrics/fidelity.py``)."""

    text: str | None = None
    tokens_scored: int | None = None
    perplexity: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None


class VariantResult(_Model):
    version: int = RESULT_VERSION
    variant: str
    repeat: int = 0
    # "ok": every phase ran; "partial": written while it ran (a run that stopped there was killed);
    # "failed": the job failed (``error``); "log-only": no result file, rebuilt from its queries alone
    status: Literal["ok", "partial", "failed", "log-only"] = "ok"
    error: str | None = None
    done: list[str] = Field(default_factory=list)  # the phases that finished (``PHASES``)
    expected: list[str] = Field(default_factory=list)  # the phases the plan asked of it
    interim: bool = False  # a search's look at a trial still loaded
    is_standard: bool = False
    # the run id of the records summarized: under find-peak, the best trial's ("RID@Xqps")
    run_id: str | None = None
    scenario: str | None = None
    name: str | None = None  # the backend's name (an endpoint's model)
    target_qps: float | None = None  # the server scenario's rate
    seeds: dict[str, int] = Field(default_factory=dict)
    senders: list[dict[str, Any]] = Field(default_factory=list)  # open: Ray senders' node and clock offset
    load: LoadFacts | None = None
    build: BuildFacts | None = None
    resources: Resources = Field(default_factory=Resources)
    resource_samples: list[list[Any]] = Field(
        default_factory=list
    )  # [t_ns, rss, cpu_s(, resources.GPU_FIELDS)]
    server_metrics: ServerScrape | None = None
    phases_s: dict[str, float] = Field(default_factory=dict)
    peak_search: list[PeakTrial] = Field(default_factory=list)
    batch_decode: BatchDecode | None = None
    fidelity: Fidelity | None = None
    likelihood: Likelihood | None = None
    lm_eval: LmEvalReport | None = None
    diagnosis: Diagnosis | None = None
    wall_s: float | None = None
    node: dict[str, Any] | None = None  # where a Ray job ran (open: the node's fingerprint)
    retried: list[str] = Field(default_factory=list)
    # the job's query records on their way back (a Ray node's, a session's); never written to raw/
    records: list[dict[str, Any]] | None = Field(default=None, exclude=True)

    @property
    def measured(self) -> bool:
        """Queries were measured (a failed or never-started variant has none)."""
        return self.status != "failed" and self.run_id is not None

    def missing(self) -> list[str]:
        """The phases asked of it that did not finish."""
        return [p for p in self.expected if p not in self.done]

    def mark(self, phase: str) -> None:
        if phase not in self.done:
            self.done.append(phase)

    def write(self, path: Path) -> None:
        """Atomic: a kill mid-write leaves the previous version, never a truncated file."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(), encoding="utf-8")
        tmp.replace(path)


def counted(records: Iterable[QueryRecord], raws: Iterable[VariantResult]) -> dict[str, list[QueryRecord]]:
    """The records a report counted, by variant: each result's run id (a find-peak search's losing
    trials and an earlier run's leftovers in the log are not counted); failed results none."""
    keys = {
        (raw.run_id, name): raw.variant for raw in raws if raw.measured for name in (raw.variant, raw.name)
    }
    by_variant: dict[str, list[QueryRecord]] = {}
    for r in records:
        variant = keys.get((r.run_id, r.variant))
        if variant is not None:
            by_variant.setdefault(variant, []).append(r)
    return by_variant


def failed(variant: str, repeat: int, error: str) -> VariantResult:
    return VariantResult(variant=variant, repeat=repeat, status="failed", error=error)


def read_result(path: Path) -> VariantResult:
    """A ``raw/*.json`` of any version; a file that is not a result raises ``ValueError``."""
    try:
        return migrate(json.loads(Path(path).read_text(encoding="utf-8")))
    except (ValidationError, json.JSONDecodeError) as exc:
        raise ValueError(f"{Path(path).name}: not a variant result ({str(exc).splitlines()[0]})") from None


def migrate(data: dict[str, Any]) -> VariantResult:
    """A result as any version wrote it, as this version's model. Version 1 (no ``version`` key) was
    the job's dict: ``load_settings.rate_qps`` for the rate, the likelihood as ``{samples, summary,
    unavailable}``, resources with a few keys the report does not keep, a diagnosis with extra keys."""
    if data.get("version") == RESULT_VERSION:
        return VariantResult.model_validate(data)
    old = dict(data)
    old.pop("records", None)
    if old.get("status") == "failed":
        return failed(old.get("variant", "?"), int(old.get("repeat", 0)), str(old.get("error") or "failed"))
    out: dict[str, Any] = {k: v for k, v in old.items() if k in VariantResult.model_fields}
    out["version"] = RESULT_VERSION
    out["status"] = "ok"
    out["target_qps"] = (old.get("load_settings") or {}).get("rate_qps")
    out["resources"] = {k: v for k, v in (old.get("resources") or {}).items() if k in Resources.model_fields}
    if isinstance(out["resources"].get("gpu"), dict) and not out["resources"]["gpu"]:
        out["resources"]["gpu"] = None
    lk = old.get("likelihood")
    if lk:
        out["likelihood"] = {**lk.get("summary", {}), "per_sample": lk.get("samples", []),
                             "unavailable": lk.get("unavailable")}  # fmt: skip
    if old.get("diagnosis"):
        out["diagnosis"] = {k: v for k, v in old["diagnosis"].items() if k in Diagnosis.model_fields}
    if old.get("fidelity"):
        out["fidelity"] = {k: v for k, v in old["fidelity"].items() if k in Fidelity.model_fields}
    for key in ("peak_search", "senders", "retried"):
        out[key] = old.get(key) or []
    if isinstance(out.get("node"), str):
        out["node"] = {"name": out["node"]}
    done = ["load", "scenario"]
    done += [p for p, key in (("batch", "batch_decode"), ("fidelity", "fidelity"), ("likelihood", "likelihood"),
                              ("lm_eval", "lm_eval"), ("diagnosis", "diagnosis")) if old.get(key)]  # fmt: skip
    if (old.get("resources") or {}).get("startup_cold_s") is not None:
        done.append("cold_start")
    out["done"] = out["expected"] = done
    return VariantResult.model_validate(out)
