"""The query log: one JSON line per issued query, appended (and flushed) as each completes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import json
from pathlib import Path
from typing import Any


@dataclass
class QueryRecord:
    run_id: str
    variant: str
    scenario: str
    index: int  # order of issue among counted queries
    sample_id: str
    task: str
    status: str  # "ok" | "error"
    error: str | None
    # Integer perf_counter_ns timestamps of the harness's process.
    scheduled_ns: int
    issued_ns: int
    first_token_ns: int | None
    completed_ns: int
    input_tokens: int
    output_tokens: int
    # When each output token was known, in ms after issue (derived numbers can be recomputed).
    token_ms: list[float] = field(default_factory=list)
    output: str = ""
    reference: str = ""
    query: int = -1  # the query this sample belongs to (multi-stream groups samples; else = index)
    alternatives: list[str] = field(default_factory=list)  # further accepted answers
    scored: bool = True  # in the accuracy log: its output is kept and scored
    # the engine's own account of the query where it keeps one (llama.cpp's perf counters)
    engine_timings: dict[str, float] | None = None
    # CPU work around the model: encode_ms, encode_waited_ms, detokenize_ms (our engine)
    cpu_work: dict[str, float] | None = None
    # the interleaved block it ran in (its variant ran alone during the block); -1: not interleaved
    block: int = -1
    # the sender process that issued it (server scenario over HTTP with several); -1: this process
    sender: int = -1

    @property
    def latency_ms(self) -> float:
        """From issue to completion."""
        return (self.completed_ns - self.issued_ns) / 1e6

    @property
    def latency_from_scheduled_ms(self) -> float:
        """From the scheduled time: includes any lag in issuing it (no coordinated omission)."""
        return (self.completed_ns - self.scheduled_ns) / 1e6

    @property
    def dispatch_lag_ms(self) -> float:
        return (self.issued_ns - self.scheduled_ns) / 1e6

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ns is None else (self.first_token_ns - self.issued_ns) / 1e6

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (the first token is TTFT's, not TPOT's)."""
        if self.output_tokens < 2 or len(self.token_ms) < 2:
            return None
        return (self.token_ms[-1] - self.token_ms[0]) / (len(self.token_ms) - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["latency_ms"] = self.latency_ms
        data["latency_from_scheduled_ms"] = self.latency_from_scheduled_ms
        data["ttft_ms"] = self.ttft_ms
        data["tpot_ms"] = self.tpot_ms
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueryRecord:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})


class QueryLog:
    """Appends records to a JSONL file, one flushed line per completed query."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def append(self, record: QueryRecord) -> None:
        self._fh.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> QueryLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: Path | str) -> list[QueryRecord]:
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                records.append(QueryRecord.from_json(json.loads(line)))
    return records
