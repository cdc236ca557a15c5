"""What a run costs the machine: memory, CPU, GPU and energy, sampled in a background thread.

``with ResourceTracker(...) as tracker: ...`` then ``tracker.result``. The sampler stops and every
handle (NVML) is released in ``__exit__``, also when the body raises.

* Memory and CPU: psutil on this process (resident set size; CPU seconds, user + system, so the
  utilization is CPU seconds / (wall seconds x usable cores)).
* GPU: NVML (``nvidia-ml-py``) when a CUDA device is in use: utilization and memory sampled, energy
  from the cumulative counter (``nvmlDeviceGetTotalEnergyConsumption``) where the driver has it, else
  power samples integrated over time.
* CPU energy: Linux RAPL (``/sys/class/powercap/*/energy_uj`` of the package domains) where
  readable, wrap-around handled; otherwise an estimate, CPU seconds x ``watts_per_core``, and every
  output says ``energy_source: "estimate"``.

Every sample carries its ``perf_counter_ns`` time, so samples can be aligned to the 50-query windows
of the query log (same clock, same process).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import glob
import os
from pathlib import Path
import threading
import time
from typing import Any

import psutil

DEFAULT_WATTS_PER_CORE = 10.0  # a busy server core, roughly; configurable, and labelled an estimate


@dataclass
class ResourceSample:
    t_ns: int
    rss_bytes: int
    cpu_s: float  # cumulative process CPU seconds
    gpu_util: float | None = None  # percent
    gpu_mem_bytes: int | None = None
    gpu_power_w: float | None = None


def sample_row(x: ResourceSample) -> list[Any]:
    """A sample as raw/*.json keeps it: [t_ns, rss_bytes, cpu_s], plus the GPU's three fields when a
    GPU was sampled (rows stay short for the CPU-only runs that are most of them)."""
    row: list[Any] = [x.t_ns, x.rss_bytes, round(x.cpu_s, 4)]
    if x.gpu_util is not None or x.gpu_mem_bytes is not None or x.gpu_power_w is not None:
        row += [x.gpu_util, x.gpu_mem_bytes, x.gpu_power_w]
    return row


def sample_from_row(row: list[Any]) -> ResourceSample:
    return ResourceSample(*row[:6])


@dataclass
class ResourceResult:
    peak_rss_bytes: int = 0
    mean_rss_bytes: float = 0.0
    mean_cpu_util: float | None = None  # 0-1 of the usable cores
    cpu_s: float = 0.0
    wall_s: float = 0.0
    cores: int = 1
    energy_j: float | None = None
    energy_source: str = "estimate"  # "rapl" | "estimate", with "+nvml" when a GPU's energy is added
    watts_per_core: float | None = None  # the estimate's assumption, when it is one
    gpu: dict[str, Any] | None = None  # {util, mem_bytes, energy_j}
    samples: list[ResourceSample] = field(default_factory=list)

    def to_json(self, with_samples: bool = True) -> dict[str, Any]:
        out = asdict(self)
        if not with_samples:
            out.pop("samples")
        return out


def rapl_domains(root: str = "/sys/class/powercap") -> list[Path]:
    """Readable RAPL package domains (``intel-rapl:N``; AMD's kernels use the same names)."""
    found = []
    for name_file in sorted(glob.glob(f"{root}/*rapl*:*/name")):
        folder = Path(name_file).parent
        try:
            if Path(name_file).read_text().strip().startswith("package") and os.access(
                folder / "energy_uj", os.R_OK
            ):
                int((folder / "energy_uj").read_text())
                found.append(folder)
        except (OSError, ValueError):
            continue
    return found


class _Rapl:
    def __init__(self, domains: list[Path]) -> None:
        self.domains = domains
        self.start = [self._read(d) for d in domains]

    @staticmethod
    def _read(folder: Path) -> int:
        return int((folder / "energy_uj").read_text())

    def joules(self) -> float:
        total = 0
        for folder, start in zip(self.domains, self.start, strict=True):
            now = self._read(folder)
            if now < start:  # the counter wrapped
                try:
                    span = int((folder / "max_energy_range_uj").read_text())
                except (OSError, ValueError):
                    span = 2**32
                now += span
            total += now - start
        return total / 1e6


class _Nvml:
    """One CUDA device through NVML; ``None`` from ``open`` when NVML or the device is missing."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        try:
            self.energy_start_mj: int | None = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception:  # noqa: BLE001 - older GPUs and drivers lack the counter
            self.energy_start_mj = None

    @classmethod
    def open(cls, index: int = 0) -> _Nvml | None:
        try:
            import pynvml as nvml

            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no library, no driver: no GPU tracking
            return None
        try:
            return cls(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:  # noqa: BLE001
            nvml.nvmlShutdown()
            return None

    def sample(self) -> tuple[float, int, float | None]:
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        try:
            power = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        except Exception:  # noqa: BLE001
            power = None
        return float(util), int(mem), power

    def energy_j(self) -> float | None:
        if self.energy_start_mj is None:
            return None
        return (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self.energy_start_mj) / 1000.0

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class ResourceTracker:
    def __init__(
        self,
        interval_s: float = 0.05,
        watts_per_core: float = DEFAULT_WATTS_PER_CORE,
        gpu_index: int | None = None,
        pid: int | None = None,
        rapl_root: str = "/sys/class/powercap",
    ) -> None:
        self.interval_s = interval_s
        self.watts_per_core = watts_per_core
        self.gpu_index = gpu_index
        self.rapl_root = rapl_root
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: _Nvml | None = None
        self._rapl: _Rapl | None = None
        self._t0 = 0
        self._cpu0 = 0.0
        self.result = ResourceResult()

    def _cpu_s(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def _sample(self) -> None:
        s = ResourceSample(time.perf_counter_ns(), self._process.memory_info().rss, self._cpu_s())
        if self._nvml is not None:
            s.gpu_util, s.gpu_mem_bytes, s.gpu_power_w = self._nvml.sample()
        self.result.samples.append(s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except (psutil.Error, OSError):
                return

    def __enter__(self) -> ResourceTracker:
        try:
            if self.gpu_index is not None:
                self._nvml = _Nvml.open(self.gpu_index)
            domains = rapl_domains(self.rapl_root)
            self._rapl = _Rapl(domains) if domains else None
            self._t0 = time.perf_counter_ns()
            self._cpu0 = self._cpu_s()
            self._sample()
            self._thread = threading.Thread(target=self._loop, name="variantbench-resources", daemon=True)
            self._thread.start()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            try:
                self._sample()
            except (psutil.Error, OSError):
                pass
            self._finish()
        finally:
            self._close()

    def _close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()

    def _finish(self) -> None:
        r = self.result
        rss = [s.rss_bytes for s in r.samples]
        r.peak_rss_bytes = max(rss, default=0)
        r.mean_rss_bytes = sum(rss) / len(rss) if rss else 0.0
        r.wall_s = (time.perf_counter_ns() - self._t0) / 1e9
        r.cpu_s = self._cpu_s() - self._cpu0
        r.cores = len(self._process.cpu_affinity() or []) or (psutil.cpu_count() or 1)
        r.mean_cpu_util = r.cpu_s / (r.wall_s * r.cores) if r.wall_s > 0 else None
        sources, energy = [], 0.0
        if self._rapl is not None:
            energy += self._rapl.joules()
            sources.append("rapl")
        else:
            energy += r.cpu_s * self.watts_per_core
            r.watts_per_core = self.watts_per_core
            sources.append("estimate")
        if self._nvml is not None:
            gpu_energy = self._nvml.energy_j()
            if gpu_energy is None:  # integrate the power samples
                pts = [(s.t_ns, s.gpu_power_w) for s in r.samples if s.gpu_power_w is not None]
                gpu_energy = sum(
                    (b[0] - a[0]) / 1e9 * (a[1] + b[1]) / 2 for a, b in zip(pts, pts[1:], strict=False)
                )
            utils = [s.gpu_util for s in r.samples if s.gpu_util is not None]
            r.gpu = {
                "util": sum(utils) / len(utils) if utils else None,
                "mem_bytes": max((s.gpu_mem_bytes or 0 for s in r.samples), default=0),
                "energy_j": gpu_energy,
            }
            energy += gpu_energy or 0.0
            sources.append("nvml")
        r.energy_j = energy
        r.energy_source = "+".join(sources)


def merge_results(parts: list[ResourceResult]) -> ResourceResult:
    """One result for several tracked spans (an interleaved variant's blocks): sums of time, CPU and
    energy, the highest peak, means weighted by each span's wall time, every sample kept."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return ResourceResult()
    out = ResourceResult()
    out.wall_s = sum(p.wall_s for p in parts)
    out.cpu_s = sum(p.cpu_s for p in parts)
    out.cores = parts[0].cores
    out.peak_rss_bytes = max(p.peak_rss_bytes for p in parts)
    out.mean_rss_bytes = sum(p.mean_rss_bytes * p.wall_s for p in parts) / out.wall_s if out.wall_s else 0.0
    out.mean_cpu_util = out.cpu_s / (out.wall_s * out.cores) if out.wall_s > 0 else None
    energies = [p.energy_j for p in parts]
    out.energy_j = None if any(e is None for e in energies) else sum(e or 0.0 for e in energies)
    out.energy_source, out.watts_per_core = parts[0].energy_source, parts[0].watts_per_core
    gpus = [p.gpu for p in parts if p.gpu]
    if gpus:
        utils = [
            (g["util"], p.wall_s) for p, g in zip(parts, gpus, strict=False) if g.get("util") is not None
        ]
        out.gpu = {
            "util": sum(u * w for u, w in utils) / sum(w for _, w in utils) if utils else None,
            "mem_bytes": max(g.get("mem_bytes") or 0 for g in gpus),
            "energy_j": sum(g.get("energy_j") or 0.0 for g in gpus),
        }
    out.samples = [x for p in parts for x in p.samples]
    return out


def window_resources(
    samples: list[ResourceSample], spans: list[tuple[int, int]], cores: int
) -> list[dict[str, float | None]]:
    """Mean RSS and CPU utilization of the samples within each window's (start_ns, end_ns]."""
    out = []
    for start, end in spans:
        inside = [s for s in samples if start < s.t_ns <= end]
        # CPU utilization from the cumulative counter at the window's edges (nearest samples)
        before = [s for s in samples if s.t_ns <= start]
        edge = before[-1] if before else (inside[0] if inside else None)
        util = None
        if inside and edge is not None and inside[-1].t_ns > edge.t_ns:
            util = (inside[-1].cpu_s - edge.cpu_s) / ((inside[-1].t_ns - edge.t_ns) / 1e9 * cores)
        out.append(
            {
                "mean_rss_bytes": sum(s.rss_bytes for s in inside) / len(inside) if inside else None,
                "mean_cpu_util": util,
            }
        )
    return out
