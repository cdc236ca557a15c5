"""Interleaved execution: every variant loaded at once, each in its own process, measured in turns.

A machine's speed drifts by 10-40% within minutes on the hosts we run on. Measured one after the
other (AAA BBB CCC), a drift lands on one variant; measured in turns, it lands on all alike. Each
variant is a resident session (``VariantSession`` in its own process on the local executor): it
loads once, then runs the blocks it is handed, while the others wait idle in their own processes.

* single-stream and multi-stream: a block is one query; round ``r`` hands query ``r`` to every
  variant, in an order rotated by one each round (ABC, BCA, CAB, ...);
* server: a block is ``block_s`` seconds of arrivals (the same arrivals for every variant, drawn
  from the schedule seed and the block's place), rounds in a seeded random order;
* offline: a block is the whole offline batch; rounds in a seeded random order.

The run looks at its data each time every variant has answered one more pass (``min_queries``
queries, or ``rate x min_duration_s`` in the server scenario). Without ``until_decided`` it stops
at the first look; with it, it goes on until every pairwise comparison is decided
(``metrics/sequential.py``), the looks run out, or a budget (``max_queries``, ``max_duration_s``
per variant) ends. A variant whose process fails is recorded as failed; the others go on.

Quality joins the looks: at each look every session scores the pass's samples by likelihood (the
standard first: the others' KL reads its distributions), and each variant's quality gate against
the standard is computed at the look's confidence (``metrics/quality_compare.py``). The run stops
when speed *and* quality are decided, at every profile's floor. Quality waits for a further pass
only where that pass brings samples not yet answered (a synthetic workload built with one pass a
look): greedy decoding answers a repeated sample the same way, so a repeated pass cannot narrow it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
import math
import random
import time
from typing import Any

from variantbench.faults import fault_point
from variantbench.loadgen.harness import LoadSettings
from variantbench.metrics.sequential import Comparison, all_pairs, look_confidence, settled
from variantbench.metrics.windows import active_s
from variantbench.pipeline.executors import JobFailed, Resident, Session
from variantbench.pipeline.jobs import MeasureJob
from variantbench.plan import Plan
from variantbench.records import QueryRecord
from variantbench.report.results import VariantResult
from variantbench.report.schema import Look

OnEvent = Callable[[tuple[Any, ...]], None]


def round_order(names: list[str], round_index: int, scenario: str, seed: int) -> list[str]:
    """The turn order of one round: rotated in the query-at-a-time scenarios, shuffled in the others."""
    if scenario in ("single-stream", "multi-stream"):
        k = round_index % len(names)
        return names[k:] + names[:k]
    order = list(names)
    random.Random(f"interleave-{seed}-{round_index}").shuffle(order)
    return order


def pass_size(load: LoadSettings) -> int:
    """Queries per variant in one pass (the run's minimum): each look comes after one more pass."""
    if load.scenario == "server":
        return max(load.min_queries, math.ceil((load.rate_qps or 0) * load.min_duration_s))
    return load.min_queries


def block_size(load: LoadSettings, block_s: float) -> int:
    if load.scenario in ("single-stream", "multi-stream"):
        return 1
    if load.scenario == "server":
        return max(1, min(pass_size(load), math.ceil((load.rate_qps or 1.0) * block_s)))
    return pass_size(load)  # offline: the whole batch at once


@dataclass
class Outcome:
    """What the rounds produced: every variant's records and raw payload (or its failure)."""

    records: dict[str, list[QueryRecord]] = field(default_factory=dict)
    results: dict[str, VariantResult] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    rounds: int = 0
    looks: list[Look] = field(default_factory=list)
    stopped: str = ""
    comparisons: list[Comparison] = field(default_factory=list)
    likelihood: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # scored at the looks


def _call(
    sessions: dict[str, Session], out: Outcome, name: str, method: str, *args: Any, on_event: OnEvent
) -> Any:
    """One call to a session; a failed one fails the variant, the others go on."""
    try:
        return sessions[name].call(method, *args, on_event=on_event)
    except JobFailed as exc:
        out.failures[name] = str(exc)
        sessions.pop(name).close()
        return None


def unfinished_blocks(records: list[QueryRecord], load: LoadSettings, block_s: float) -> list[QueryRecord]:
    """The records of blocks a killed run left half answered (fewer queries than the block asks):
    a resumed run asks those blocks again, so these are set aside, not counted twice."""
    size, cap = block_size(load, block_s), load.max_queries
    by_block: dict[tuple[str, int], set[int]] = {}
    for r in records:
        by_block.setdefault((r.variant, r.block), set()).add(r.query if r.query >= 0 else r.index)
    short = {key for key, queries in by_block.items()
             if len(queries) < (min(size, cap - key[1] * size) if cap else size)}  # fmt: skip
    return [r for r in records if (r.variant, r.block) in short]


def _no_block_progress(emit: OnEvent) -> OnEvent:
    """A block's own progress (1 of 1) says nothing; the round count is said instead."""
    return lambda event: None if event[0] == "progress" and event[1] == "measure" else emit(event)


def run_interleaved(executor: Resident, jobs: dict[str, MeasureJob], plan: Plan, on_event: Callable[[str], OnEvent],
                    say: Callable[[str], None], kept: dict[str, list[QueryRecord]] | None = None) -> Outcome:  # fmt: skip
    """Open every variant's session, run rounds until the stopping rule says so, finish each.

    ``kept``: a resumed run's records by variant, whole blocks only (``unfinished_blocks`` drops the
    rest): a round whose block a variant already answered is not asked of it again, so the rounds,
    the looks and the samples are the uninterrupted run's."""
    out = Outcome()
    sessions: dict[str, Session] = {}
    try:
        for name, job in jobs.items():  # loaded one at a time: each startup timed on a quiet machine
            try:
                sessions[name] = executor.open(job, on_event(name))
                out.records[name] = list((kept or {}).get(name, []))
            except JobFailed as exc:
                out.failures[name] = str(exc)
        _rounds(sessions, jobs, plan, out, on_event, say)
        for name in list(sessions):  # every round asked: the scenario is whole
            _call(sessions, out, name, "checkpoint", True, on_event=on_event(name))
        _batch_rounds(sessions, jobs, out, on_event)
        for name in list(sessions):
            try:
                out.results[name] = sessions[name].call("finish", on_event=on_event(name))
            except JobFailed as exc:
                out.failures[name] = str(exc)
    finally:
        for session in sessions.values():
            session.close()
    return out


def _batch_rounds(sessions: dict[str, Session], jobs: dict[str, MeasureJob], out: Outcome,
                  on_event: Callable[[str], OnEvent]) -> None:  # fmt: skip
    """The batching-throughput measurements, in turns as well (rotated each round)."""
    from variantbench.pipeline.measure import BATCH_NEW, BATCH_SIZE

    # a resumed variant: the rounds it measured before the kill are not measured again
    measured = {n: len(j.resume.batch_decode.tokens_per_s) if j.resume and j.resume.batch_decode else 0
                for n, j in jobs.items()}  # fmt: skip
    rounds = max((j.batch_rounds for j in jobs.values()), default=0)
    for r in range(rounds):
        if not sessions:  # every variant failed
            return
        for name in round_order(list(sessions), r, "single-stream", 0):
            if r >= measured[name]:
                _call(sessions, out, name, "batch_rate", BATCH_SIZE, BATCH_NEW, on_event=on_event(name))


def _rounds(sessions: dict[str, Session], jobs: dict[str, MeasureJob], plan: Plan, out: Outcome,
            on_event: Callable[[str], OnEvent], say: Callable[[str], None]) -> None:  # fmt: skip
    if not sessions:
        return
    # a resumed run: the blocks each variant answered before the kill (out.records starts with them)
    answered = {name: {r.block for r in records} for name, records in out.records.items()}
    load = next(iter(jobs.values())).load
    a = plan.analysis
    looks = a.looks if a.until_decided else 1
    confidence = look_confidence(a.alpha, looks)
    per_pass, size = pass_size(load), block_size(load, plan.execution.block_s)
    cap = load.max_queries
    deadline = (time.monotonic() + load.max_duration_s * len(sessions)) if load.max_duration_s else None
    began = time.monotonic()
    done, look, next_look = 0, 0, per_pass  # queries per variant so far; when the next look is due
    while sessions:
        n = min(size, cap - done) if cap else size
        if n <= 0:
            out.stopped = "budget: max_queries"
            break
        settings = replace(load, first_query=done, min_queries=n, max_queries=n, min_duration_s=0.0,
                           max_duration_s=None, block=out.rounds)  # fmt: skip
        for name in round_order(list(sessions), out.rounds, load.scenario, plan.seeds.schedule):
            if out.rounds in answered.get(name, ()):
                continue  # a resumed run: answered before the kill
            emit = on_event(name)
            got = _call(sessions, out, name, "block", settings, on_event=_no_block_progress(emit))
            if got is not None:
                out.records[name].extend(QueryRecord.from_json(r) for r in got)
                emit(("status", f"round {out.rounds + 1}: {len(out.records[name])} queries measured"))
        done += n
        out.rounds += 1
        if out.rounds == max(1, per_pass // 2) and look == 0:
            fault_point("first-look")  # halfway to the first look: only the queries are on disk
        alive = {k: v for k, v in out.records.items() if k in sessions}
        long_enough = all(active_s(v) >= load.min_duration_s for v in alive.values())
        if (done >= next_look and long_enough) or (cap and done >= cap):
            look += 1
            next_look = done + per_pass
            out.comparisons = all_pairs(alive, confidence=confidence, band=a.tie_band / 100)
            library = next(iter(jobs.values())).workload
            new_samples_ahead = bool(library.pass_size) and done < len(library)
            quality_open = (_quality_look(sessions, jobs, out, plan, confidence, on_event)
                            if a.until_decided and new_samples_ahead else [])  # fmt: skip
            for name in list(sessions):  # each variant's result so far saved: a kill from here on keeps it
                _call(sessions, out, name, "checkpoint", False, on_event=on_event(name))
            fault_point(f"look-{look}")
            decided = settled(out.comparisons) and not quality_open
            out.looks.append(Look(look=look, queries_per_variant=done, confidence=confidence,
                                  undecided=[f"{c.a} vs {c.b}" for c in out.comparisons if c.state == "undecided"]
                                  + [f"{v}: quality" for v in quality_open]))  # fmt: skip
            if a.until_decided:
                say(f"look {look}/{looks} after {done} queries per variant: "
                    + ("every comparison decided" if decided else
                       f"{len(out.looks[-1].undecided)} comparison(s) undecided"))  # fmt: skip
            if not a.until_decided:
                out.stopped = "one pass (until_decided off)"
                break
            if decided:
                out.stopped = f"decided at look {look}"
                break
            if look >= looks:
                out.stopped = f"looks: all {looks} taken"
                break
            if a.decide_within_s is not None and time.monotonic() - began >= a.decide_within_s:
                out.stopped = f"budget: analysis.decide_within_s ({a.decide_within_s:g} s) after look {look}"
                break
        if deadline is not None and time.monotonic() >= deadline:
            out.stopped = "budget: max_duration_s"
            break


def _quality_look(sessions: dict[str, Session], jobs: dict[str, MeasureJob], out: Outcome, plan: Plan,
                  confidence: float, on_event: Callable[[str], OnEvent]) -> list[str]:  # fmt: skip
    """Score the samples answered so far by likelihood (the standard first), then the variants whose
    quality gate against the standard is still undecided at some profile's floor."""
    from variantbench.metrics.quality_compare import undecided_quality
    from variantbench.report.schema import Likelihood, SampleLikelihood

    standard = next((n for n, j in jobs.items() if j.is_standard), None)
    if standard is None or standard not in sessions:
        return []
    std_records = out.records[standard]
    if not any(r.reference for r in std_records):
        return []  # nothing to score quality by: it cannot hold the run
    ids = list(dict.fromkeys(r.sample_id for r in std_records))
    for name in [standard, *(n for n in sessions if n != standard)]:
        got = _call(sessions, out, name, "likelihood", ids, on_event=on_event(name))
        if got is not None:
            out.likelihood.setdefault(name, []).extend(got)

    if standard not in sessions:  # its scoring failed: nothing to compare with
        return []
    floors = sorted({p.quality_floor for p in plan.decision.profiles().values() if p.quality_floor is not None}
                    | {plan.quality.threshold / 100})  # fmt: skip
    alive = {n: out.records[n] for n in sessions}
    reports = {n: Likelihood(per_sample=[SampleLikelihood(**r) for r in rows])
               for n, rows in out.likelihood.items() if rows}  # fmt: skip
    return undecided_quality(alive, reports, standard, floors, plan.quality.threshold / 100, confidence)
