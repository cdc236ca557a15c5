"""The results history: every variant run of every ``variantbench run``, one row each, in SQLite.

Why SQLite (the standard library's ``sqlite3``) and not DuckDB: the history is a few rows per run,
written by several processes (two runs at once on one machine, a CI matrix on a shared disk) and
read rarely; SQLite's transactions lock the file across processes (``BEGIN IMMEDIATE``, a 60 s busy
timeout), its write-ahead log survives a writer killed mid-transaction (the transaction is simply
not there), and it needs no dependency. DuckDB's columnar engine would buy speed on millions of
rows we do not have, while it allows one writing process per file: a second concurrent run would
fail to open the history.

A row holds what makes runs comparable and what they measured: the plan's hash (without its
output folder), the model's identity (a SHA-256 of its weight files), the variant's spec, the
machine's fingerprint (CPU model, flags, cores, memory, GPU, library versions) and the code's
version, the time, every headline metric with its 95% interval, and the run folder. The schema has
a version in the ``meta`` table: an older one is migrated in a transaction, a newer one refused.
"""

from __future__ import annotations

from collections.abc import Iterable
import hashlib
import json
import os
from pathlib import Path
import sqlite3
import subprocess
from typing import Any

from variantbench import __version__
from variantbench.errors import UserError
from variantbench.paths import cache_root
from variantbench.records import QueryRecord
from variantbench.report.schema import BatchThroughput, Report, RunReport

SCHEMA_VERSION = 1
MIGRATIONS: dict[int, str] = {
    # version reached -> the statements that reach it from the one before
    1: """
    CREATE TABLE IF NOT EXISTS runs (
        id INTEGER PRIMARY KEY,
        run_key TEXT NOT NULL UNIQUE,
        created_utc TEXT NOT NULL,
        folder TEXT NOT NULL,
        plan_hash TEXT NOT NULL,
        model_name TEXT,
        model_hash TEXT,
        variant TEXT NOT NULL,
        variant_spec TEXT,
        scenario TEXT,
        status TEXT NOT NULL,
        machine_fingerprint TEXT NOT NULL,
        machine TEXT NOT NULL,
        code_version TEXT NOT NULL,
        metrics TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS runs_model_variant ON runs (model_name, variant, created_utc);
    CREATE TABLE IF NOT EXISTS file_hashes (
        path TEXT NOT NULL, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, sha256 TEXT NOT NULL,
        PRIMARY KEY (path, size, mtime_ns)
    );
    """,
}
MACHINE_KEYS = ("cpu_model", "cpu_flags", "cpu_logical_cores", "cpu_physical_cores", "memory_bytes", "gpu",
                "python", "torch", "transformers")  # fmt: skip


def default_path() -> Path:
    """``$VARIANTBENCH_HISTORY``, else ``<cache>/history.db`` (the tests point it into their temp folder)."""
    explicit = os.environ.get("VARIANTBENCH_HISTORY")
    return Path(explicit).expanduser() if explicit else cache_root() / "history.db"


def machine_fingerprint(environment: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    machine = {k: environment.get(k) for k in MACHINE_KEYS}
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    return digest, machine


def plan_hash(plan: dict[str, Any]) -> str:
    """The plan without its output folder: two runs of one plan into two folders hash the same."""
    body = {k: v for k, v in plan.items() if k != "out"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_version() -> str:
    """The package version, and the git commit when it runs from a checkout."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return __version__
    return (
        f"{__version__}+g{done.stdout.strip()}"
        if done.returncode == 0 and done.stdout.strip()
        else __version__
    )


def headline(run: RunReport, records: list[QueryRecord]) -> dict[str, dict[str, float | None]]:
    """Every headline metric of one run with its 95% interval (None where it has none)."""
    from variantbench.metrics import significance as sig

    ok = [r for r in records if r.status == "ok"]
    lat = [r.latency_from_scheduled_ms for r in ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tput = sig.rate_interval([r.output_tokens for r in ok], [r.latency_ms / 1e3 for r in ok])
    cost = run.cost
    cost_ci = (cost.per_million_output_tokens_ci if cost else None) or [None, None]
    batch = run.batch_throughput or BatchThroughput(batch=0, new_tokens=0)

    def plain(value: float | None) -> dict[str, float | None]:
        return {"value": value, "ci_low": None, "ci_high": None}

    return {
        "latency_p50_ms": {**sig.quantile_interval(lat, 50), "value": run.latency_ms.p50},
        "latency_p99_ms": {**sig.quantile_interval(lat, 99), "value": run.latency_ms.p99},
        "ttft_p50_ms": {**sig.quantile_interval(ttft, 50), "value": run.ttft_ms.p50},
        # per query, in series: what one stream of requests gets (single-stream's own figure)
        "tokens_per_s_per_query": tput,
        "output_tokens_per_s": plain(run.throughput.output_tokens_per_s),
        "batch8_decode_tokens_per_s": {
            "value": batch.tokens_per_s,
            "ci_low": batch.ci_low,
            "ci_high": batch.ci_high,
        },  # fmt: skip
        "quality_composite": plain(run.quality.composite),
        "quality_vs_standard": plain(run.quality_vs_standard.ratio if run.quality_vs_standard else None),
        "kl_mean_nats": plain(run.quality.kl_mean),
        "peak_rss_bytes": plain(run.resources.peak_rss_bytes),
        "startup_cold_s": plain(run.resources.startup_cold_s),
        "energy_j": plain(run.resources.energy_j),
        "cost_per_million_output_tokens": {
            "value": cost.per_million_output_tokens if cost else None,
            "ci_low": cost_ci[0],
            "ci_high": cost_ci[1],
        },  # fmt: skip
    }


class History:
    """One SQLite file; every write is one transaction."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise UserError(f"cannot use the history at {self.path}: {exc}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _migrate(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise UserError(
                    f"the history at {self.path} has schema version {version}, newer than this variantbench "
                    f"reads ({SCHEMA_VERSION}): upgrade variantbench or pass --history with another file"
                )
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[target].split(";"):
                    if statement.strip():
                        self.db.execute(statement)
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                            (str(SCHEMA_VERSION),))  # fmt: skip
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def file_hash(self, files: Iterable[Path]) -> str | None:
        """SHA-256 over the files' contents (in name order), each file's hash cached by size and mtime."""
        parts = []
        for f in sorted(Path(x) for x in files):
            if not f.is_file():
                continue
            st = f.stat()
            key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
            row = self.db.execute(
                "SELECT sha256 FROM file_hashes WHERE path=? AND size=? AND mtime_ns=?", key
            ).fetchone()
            if row is None:
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                digest = h.hexdigest()
                self.db.execute("INSERT OR REPLACE INTO file_hashes VALUES (?, ?, ?, ?)", (*key, digest))
            else:
                digest = row[0]
            parts.append(f"{f.name}:{digest}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16] if parts else None

    def record(
        self, report: Report, folder: Path, records: Iterable[QueryRecord], model_hash: str | None
    ) -> list[int]:
        """Every variant run of the report, in one transaction; recording the same run again replaces it."""
        by_variant: dict[str, list[QueryRecord]] = {}
        for r in records:
            by_variant.setdefault(r.variant, []).append(r)
        fingerprint, machine = machine_fingerprint(report.environment)
        version, phash = code_version(), plan_hash(report.plan)
        folder_s = str(Path(folder).resolve())
        ids = []
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for run in report.runs:
                metrics = headline(run, by_variant.get(run.variant, [])) if run.status == "ok" else {}
                key = f"{folder_s}|{report.created_utc}|{run.variant}"
                cur = self.db.execute(
                    "INSERT OR REPLACE INTO runs (run_key, created_utc, folder, plan_hash, model_name, model_hash, "
                    "variant, variant_spec, scenario, status, machine_fingerprint, machine, code_version, metrics) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, report.created_utc, folder_s, phash, report.model.get("name"), model_hash, run.variant,
                     run.variant, run.scenario, run.status, fingerprint, json.dumps(machine), version,
                     json.dumps(metrics)),
                )  # fmt: skip
                ids.append(int(cur.lastrowid or 0))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return ids

    def relocate(self, old: Path, new: Path) -> int:
        """Rows recorded from ``old`` now point at ``new`` (a run folder moved aside); how many."""
        cur = self.db.execute("UPDATE runs SET folder = ? WHERE folder = ?",
                              (str(Path(new).resolve()), str(Path(old).resolve())))  # fmt: skip
        self.db.commit()
        return int(cur.rowcount or 0)

    def get(self, run_id: int) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else {**dict(row), "metrics": json.loads(row["metrics"])}

    def rows(
        self, model: str | None = None, variant: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        where, args = [], []
        if model:
            where.append("model_name = ?")
            args.append(model)
        if variant:
            where.append("variant = ?")
            args.append(variant)
        sql = (
            "SELECT * FROM runs"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + " ORDER BY created_utc, id"
        )
        if limit:
            sql += f" LIMIT {int(limit)}"
        out = []
        for row in self.db.execute(sql, args):
            item = dict(row)
            item["metrics"] = json.loads(item["metrics"])
            item["machine"] = json.loads(item["machine"])
            out.append(item)
        return out
