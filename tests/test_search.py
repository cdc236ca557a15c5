"""variantbench search (issue 20): the space file, the dominance rules, and a search on the tiny model
whose front is non-dominated among its trials, which resumes from its journal and draws its page."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import yaml

from variantbench.errors import UserError
from variantbench.search.objectives import OBJECTIVES, beaten_by, dominates, parse_objectives
from variantbench.search.space import parse_space
from variantbench.variants.base import parse_variant, recipe_type

pytest.importorskip("optuna")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "variantbench", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip


def test_a_recipe_written_back_parses_to_itself() -> None:
    for kind, fields in [("prune-heads", {"ratio": 0.3}), ("prune-heads", {"ratio": 0.25, "groups": True}),
                         ("drop-layers", {"count": 2}), ("distill", {"steps": 30, "lr": 1e-3}), ("int8", {}),
                         ("gguf-q8_0", {})]:  # fmt: skip
        cls = recipe_type(kind)
        assert cls is not None
        recipe = cls(kind=kind, **fields)
        assert parse_variant(recipe.written()) == (recipe,)


def test_the_space_is_checked_whole_and_each_mistake_is_one_line() -> None:
    space = parse_space({"steps": {"drop-layers": {"count": {"low": 1, "high": 3}},
                                   "distill": {"steps": [10, 20], "requires_any": ["drop-layers"]}},
                         "finish": ["fp32", "int8"]})  # fmt: skip
    assert list(space.steps) == ["drop-layers", "distill"] and space.finish == ("fp32", "int8")
    bad = {
        "steps.prune-heads.ratio: Input should be less than 1": {"steps": {"prune-heads": {"ratio": {"low": 0.1, "high": 1.5}}}},
        "not a structural step": {"steps": {"int8": {}}},
        "not a field of prune-heads": {"steps": {"prune-heads": {"ratioo": 0.2}}},
        "must be one precision or engine step": {"finish": ["drop-layers:2"]},
        "give count": {"steps": {"drop-layers": {}}},
        "unknown key": {"stepz": {}},
        "is not a step before it": {"steps": {"distill": {"requires_any": ["drop-layers"]}, "drop-layers": {"count": 1}}},
        "unknown variant kind": {"steps": {"prune-head": {"ratio": 0.2}}},
    }  # fmt: skip
    for expected, raw in bad.items():
        with pytest.raises(UserError) as err:
            parse_space(raw, "space.yaml")
        message = str(err.value)
        assert "\n" not in message and message.startswith(("space.yaml", "search space")), message
        assert expected in message, (expected, message)


def test_a_drawn_chain_is_an_ordinary_variant_name() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = parse_space({"steps": {"prune-heads": {"ratio": {"low": 0.25, "high": 0.5, "step": 0.25}, "groups": True},
                                   "drop-layers": {"count": {"low": 1, "high": 2}},
                                   "distill": {"steps": [5], "requires_any": ["prune-heads", "drop-layers"]}},
                         "finish": ["fp32", "bf16", "int8"]})  # fmt: skip
    study = optuna.create_study(
        directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1)
    )
    names = set()
    for _ in range(40):
        trial = study.ask()
        name = space.suggest(trial)
        names.add(name)
        recipes = parse_variant(name)
        kinds = [r.kind for r in recipes]
        assert "distill" not in kinds or {"prune-heads", "drop-layers"} & set(kinds)  # requires_any
        assert kinds == ["fp32"] or "fp32" not in kinds  # the default dtype: written only alone
        study.tell(trial, [0.0, 0.0])
    assert "fp32" in names and any("+distill:steps=5" in n for n in names) and len(names) > 8


def test_dominance_and_the_clear_margin_of_an_early_stop() -> None:
    o = parse_objectives("quality,tokens_per_s,peak_rss")
    assert [x.direction for x in o] == ["maximize", "maximize", "minimize"]
    assert dominates([1.0, 100, 400], [0.9, 100, 400], o)  # better in one, no worse elsewhere
    assert not dominates([1.0, 100, 400], [1.0, 100, 400], o)  # equal: neither dominates
    assert not dominates([1.0, 90, 400], [0.9, 100, 400], o)
    # the early stop needs a clear margin in every objective
    trial = {"quality": 0.80, "tokens_per_s": 100.0, "peak_rss": 500.0}
    finished = {"a": {"quality": 0.85, "tokens_per_s": 150.0, "peak_rss": 300.0},  # 6% better in quality only
                "b": {"quality": 0.95, "tokens_per_s": 150.0, "peak_rss": 300.0}}  # fmt: skip
    assert beaten_by(trial, finished, o, margin=0.10) == "b"
    assert beaten_by(trial, {"a": finished["a"]}, o, margin=0.10) is None
    assert beaten_by(trial, finished, o, margin=0.0) is None  # off
    assert beaten_by({"quality": 0.8}, finished, o, margin=0.1) is None  # an objective not known yet
    with pytest.raises(UserError, match="unknown objective 'speed'"):
        parse_objectives("quality,speed")
    with pytest.raises(UserError, match="at least two"):
        parse_objectives("quality")
    assert not OBJECTIVES["kl"].interim and OBJECTIVES["tokens_per_s"].interim


SPACE = """
steps:
  prune-heads:
    ratio: 0.5
    groups: true
  drop-layers:
    count: {low: 1, high: 2}
finish: [fp32, bf16, int8]
"""


@pytest.mark.slow  # 33 s: a whole search with its resume; the default pytest was at 9m48 of its 10
def test_a_search_on_the_tiny_model_finds_a_non_dominated_front_and_resumes(
    tmp_path: Path, tiny_model_dir: Path, browser  # noqa: ANN001
) -> None:  # fmt: skip
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = tmp_path / "search"
    common = ["--space", str(space), "--objectives", "tokens_per_s,peak_rss,weights", "--seed", "3",
              "--set", f"model.source={tiny_model_dir}", "--tasks", "4", "--max-new-tokens", "4",
              "--input-lengths", "uniform:32-64", "--no-fidelity", "--no-isolate", "--out", str(out)]  # fmt: skip
    first = _cli("search", "--budget", "5", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads((out / "search.json").read_text())
    trials = data["trials"]
    tried = [t for t in trials if t["state"] != "repeat"]  # a chain drawn again is free
    assert len(tried) == 5 and data["reference"]["variant"] == "fp32"
    assert all(t["note"].startswith(("as trial", "the standard")) for t in trials if t["state"] == "repeat")
    names = [o["name"] for o in data["objectives"]]
    objectives = [OBJECTIVES[n] for n in names]
    measured = [t for t in trials if t["state"] == "measured"]
    assert measured, trials
    points = [[t["values"][n] for n in names] for t in measured] + [
        [data["reference"]["values"][n] for n in names]
    ]
    front = [t for t in measured if t["front"]]
    assert front and data["front"]
    for t in front:  # nothing measured (nor the standard) dominates a front member
        mine = [t["values"][n] for n in names]
        assert not any(dominates(p, mine, objectives) for p in points), t
    for t in measured:  # and every trial off the front is dominated by someone
        mine = [t["values"][n] for n in names]
        if not t["front"] and not any(t["variant"] == f["variant"] for f in front):
            assert any(dominates(p, mine, objectives) for p in points), t
    # each trial measured in two blocks (the early-stop check between them): 2 + 2 of its 4 queries
    log = [json.loads(x) for x in (out / "queries.jsonl").read_text().splitlines()]
    blocks = sorted((q["block"], q["index"]) for q in log if q["variant"] == measured[0]["variant"])
    assert blocks == [(0, 0), (0, 1), (1, 2), (1, 3)], blocks
    # the trials are an ordinary run folder: report.json has every measured trial, and front.yaml is a plan
    report = json.loads((out / "report.json").read_text())
    assert {t["variant"] for t in measured} <= {r["variant"] for r in report["runs"]}
    plan = yaml.safe_load((out / "front.yaml").read_text())
    assert plan["variants"][0] == "fp32" and set(data["front"]) - {"fp32"} <= set(plan["variants"])
    shown = _cli("plan", str(out / "front.yaml"))
    assert shown.returncode == 0, shown.stderr[-1000:]
    assert "Pareto front" in first.stdout and "search.html" in first.stderr.replace("\n", "")

    # resumed: the same arguments and a larger budget run only the new trials; the old are kept as they were
    again = _cli("search", "--budget", "6", *common)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming the search" in again.stderr and "5 trial(s) finished, 1 to go" in again.stderr.replace(
        "\n", ""
    )
    later = json.loads((out / "search.json").read_text())["trials"]
    assert sum(t["state"] != "repeat" for t in later) == 6
    assert later[: len(trials)] == [{**t, "front": later[i]["front"]} for i, t in enumerate(trials)]
    report = json.loads((out / "report.json").read_text())  # the earlier session's trials stay in the report
    assert {t["variant"] for t in later if t["state"] == "measured"} <= {r["variant"] for r in report["runs"]}
    # another space in the same folder is one line, not a mixed search
    space.write_text(SPACE.replace("high: 2", "high: 3"))
    other = _cli("search", "--budget", "8", *common)
    assert other.returncode == 2 and "holds a search with another space" in other.stderr
    assert "Traceback" not in other.stderr

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((out / "search.html").as_uri())
    page.wait_for_function("document.querySelectorAll('#fig-pareto .main-svg').length > 0")
    traces = page.evaluate("document.getElementById('fig-pareto').data.map(t => t.name)")
    page.close()
    assert errors == [] and "Pareto front" in traces and "the standard" in traces


def test_every_shipped_space_reads() -> None:
    from variantbench.search.space import load_space

    spaces = sorted((Path(__file__).resolve().parents[1] / "plans" / "spaces").glob("*.yaml"))
    assert spaces
    for path in spaces:
        assert load_space(path).steps
