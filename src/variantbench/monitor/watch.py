"""``variantbench monitor``: a live server watched, probe after probe, with change-point alerts.

Every ``every_s`` seconds (start to start; a probe longer than that starts the next at once):
a probe run (``probe.py``) into ``OUT/probes/NNNN``, recorded in the history like any run; a
scrape of the server's ``/metrics`` (``scrape.py``); one CUSUM per metric (``detect.py``). Each
probe appends a line to ``OUT/monitor.jsonl`` (its values, the scrape, the detectors' state, any
alert), so a watch that is stopped keeps everything it saw. The monitor's own ``/metrics`` (with
``metrics_port``) exports probes, failures, the last values and an alert counter per metric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import datetime as dt
import json
from pathlib import Path
import time
from typing import Any

from rich.console import Console

from variantbench.errors import UserError
from variantbench.monitor.detect import Alert, Cusum, detectors
from variantbench.monitor.probe import probe_plan, probe_values
from variantbench.plan import Plan
from variantbench.trackers.server_metrics import scrape

WARMUP_PROBES = 1
UNREACHABLE_AFTER = 3  # consecutive failed probes before the server is reported unreachable


@dataclass
class MonitorSettings:
    """The monitor as it runs, built from the plan's ``monitor`` section (``settings_from_plan``)."""

    url: str
    model: str | None
    out: Path
    every_s: float
    probes: int | None  # None: until stopped
    probe_file: Path | None
    thresholds: dict[str, float]
    baseline_probes: int
    history: Path | None
    record_history: bool
    metrics_port: int | None
    api: str | None


def settings_from_plan(plan: Plan) -> MonitorSettings:
    """The plan's ``monitor`` section (and ``output.history``) as the monitor's settings."""
    from variantbench.compare import parse_thresholds
    from variantbench.monitor.detect import DIRECTIONS

    m = plan.monitor
    if not m.url:
        raise UserError(
            "monitor needs the server's URL: variantbench monitor http://HOST:PORT/v1 (monitor.url)"
        )
    if m.probe is not None and not m.probe.is_file():
        raise UserError(f"probe plan not found: {m.probe}")
    return MonitorSettings(url=m.url, model=m.model, out=m.out, every_s=m.every_s, probes=m.probes,
                           probe_file=m.probe, thresholds=parse_thresholds(m.threshold, known=DIRECTIONS,
                                                                           option="--threshold"),
                           baseline_probes=m.baseline, history=plan.output.history,
                           record_history=plan.output.record_history, metrics_port=m.metrics_port, api=m.api)  # fmt: skip


class _Exporter:
    """The monitor's own Prometheus metrics, in a registry of its own, served on 127.0.0.1."""

    def __init__(self, port: int | None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry()
        self.probes = Counter("variantbench_monitor_probes", "Probes run", registry=r)
        self.failures = Counter("variantbench_monitor_probe_failures", "Probes that failed", registry=r)
        self.alerts = Counter("variantbench_monitor_alerts", "Change points alerted", ["metric"], registry=r)
        self.value = Gauge("variantbench_monitor_value", "The last probe's value", ["metric"], registry=r)
        self.cusum = Gauge("variantbench_monitor_cusum", "The detector's statistic (alert above its h)",
                           ["metric"], registry=r)  # fmt: skip
        self.port = None
        self.server: Any = None
        if port is not None:
            from prometheus_client import start_http_server

            started = start_http_server(port, addr="127.0.0.1", registry=r)
            self.server = started[0] if isinstance(started, tuple) else None
            self.port = self.server.server_port if self.server is not None else port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()


class Monitor:
    def __init__(self, settings: MonitorSettings, console: Console | None = None,
                 on_probe: Callable[[dict[str, Any]], None] | None = None) -> None:  # fmt: skip
        self.s = self.settings = settings
        self.console = console or Console(stderr=True)
        self.on_probe = on_probe
        self.detectors: dict[str, Cusum] = detectors(settings.thresholds, settings.baseline_probes)
        self.alerts: list[Alert] = []
        self.failed_in_a_row = 0
        self.log = settings.out / "monitor.jsonl"
        try:
            settings.out.mkdir(parents=True, exist_ok=True)
            # a restarted monitor appends: its earlier probes stay, numbering goes on after them
            self.first = 1 + (sum(1 for line in self.log.open(encoding="utf-8") if line.strip())
                              if self.log.exists() else 0)  # fmt: skip
            self.log.touch()
        except OSError as exc:
            raise UserError(
                f"cannot write the monitor's folder {settings.out}: {exc.strerror or exc}"
            ) from None
        self.exporter = _Exporter(settings.metrics_port)

    @classmethod
    def from_plan(cls, plan: Plan) -> Monitor:
        return cls(settings_from_plan(plan))

    def probe(self, n: int) -> dict[str, Any]:
        """Probe number ``n``: run, scrape, detect, log; never raises for a failing server."""
        from variantbench.pipeline.run import execute

        at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        folder = self.s.out / "probes" / f"{n:04d}"
        line: dict[str, Any] = {"probe": n, "time_utc": at, "folder": str(folder)}
        started = time.perf_counter()
        try:
            plan = probe_plan(self.s.url, self.s.model, folder, self.s.probe_file, self.s.history,
                              self.s.record_history, self.s.api)  # fmt: skip
            report = execute(plan, Console(stderr=True, quiet=True))
            values = probe_values(report)
            failed = [r.error for r in report.runs if r.status != "ok"]
            line["error"] = failed[0] if failed else None
        except UserError as exc:
            values, line["error"] = probe_values(None), str(exc)
        line["probe_s"] = round(time.perf_counter() - started, 3)
        line["values"] = values
        line["server_metrics"] = scrape(self.s.url)
        self.exporter.probes.inc()
        if line["error"]:
            self.exporter.failures.inc()
            self.failed_in_a_row += 1
        else:
            self.failed_in_a_row = 0
        alerts = []
        for metric, det in self.detectors.items():
            # the first probe warms the server and our client up (on the tiny test model its P99 ran
            # 66 ms against 47 ms later): logged, never part of the baseline
            alert = det.update(n, at, values.get(metric)) if n - self.first + 1 > WARMUP_PROBES else None
            if values.get(metric) is not None:
                self.exporter.value.labels(metric).set(values[metric])
            self.exporter.cusum.labels(metric).set(det.s)
            if alert is not None:
                alerts.append(alert)
                self.exporter.alerts.labels(metric).inc()
        if self.failed_in_a_row == UNREACHABLE_AFTER:
            line["unreachable"] = True
        line["detectors"] = {m: d.state() for m, d in self.detectors.items()}
        line["alerts"] = [a.to_json() for a in alerts]
        self.alerts += alerts
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
        self._say(line, alerts)
        if self.on_probe is not None:
            self.on_probe(line)
        return line

    def _say(self, line: dict[str, Any], alerts: list[Alert]) -> None:
        v = line["values"]
        if line["error"]:
            self.console.print(f"probe {line['probe']}: [red]failed[/red]: {line['error']}", soft_wrap=True)
        else:
            self.console.print(
                f"probe {line['probe']} ({line['probe_s']:.1f} s): P99 {_n(v['p99_ms'])} ms, TTFT P99 "
                f"{_n(v['ttft_p99_ms'])} ms, {_n(v['tokens_per_s'], '.1f')} tokens/s, quality {_n(v['quality'], '.3f')}"
                + ("" if "error" not in line["server_metrics"] else " (no /metrics)")
            )  # fmt: skip
        if line.get("unreachable"):
            self.console.print(
                f"[bold red]ALERT unreachable: {UNREACHABLE_AFTER} probes in a row failed[/bold red]"
            )
        for a in alerts:
            self.console.print(f"[bold red]{a.line()}[/bold red]", soft_wrap=True)

    def watch(self) -> list[Alert]:
        """Probe every ``every_s`` until ``probes`` are done (or Ctrl-C, which the caller catches)."""
        t0 = time.monotonic()
        n = 0
        try:
            while self.s.probes is None or n < self.s.probes:
                n += 1
                self.probe(self.first + n - 1)
                if self.s.probes is not None and n >= self.s.probes:
                    break
                time.sleep(max(0.0, t0 + n * self.s.every_s - time.monotonic()))
        finally:
            self.exporter.close()
        return self.alerts


def _n(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)
