"""What a run costs the machine: memory, CPU, GPU and energy, sampled in a background thread.

``with ResourceTracker(...) as tracker: ...`` then ``tracker.result``. The sampler stops and every
handle (NVML) is released in ``__exit__``, also when the body raises.

* Memory and CPU: psutil on this process (resident set size; CPU seconds, user + system, so the
  utilization is CPU seconds / (wall seconds x usable cores)).
* GPU (``trackers/gpu.py``): NVML (``nvidia-ml-py``) or ``nvidia-smi`` when a CUDA device is in use:
  utilization, memory-bandwidth utilization, memory, SM clock and power sampled; energy from the
  cumulative counter where the driver has it, else power samples integrated over time.
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

from variantbench.trackers.gpu import GpuSample, NvmlSource, SmiSource, open_gpu, summarize

DEFAULT_WATTS_PER_CORE = 10.0  # a busy server core, roughly; configurable, and labelled an estimate


@dataclass
class ResourceSample:
    t_ns: int
    rss_bytes: int
    cpu_s: float  # cumulative process CPU seconds
    gpu_util: float | None = None  # percent
    gpu_mem_bytes: int | None = None
    gpu_power_w: float | None = None
    gpu_mem_bw_util: float | None = None  # percent of time device memory was busy
    gpu_sm_clock_mhz: float | None = None
    gpu_energy_mj: int | None = None  # the driver's cumulative counter


GPU_FIELDS = (
    "gpu_util",
    "gpu_mem_bytes",
    "gpu_power_w",
    "gpu_mem_bw_util",
    "gpu_sm_clock_mhz",
    "gpu_energy_mj",
)


def sample_row(x: ResourceSample) -> list[Any]:
    """A sample as raw/*.json keeps it: [t_ns, rss_bytes, cpu_s], plus the GPU's fields (``GPU_FIELDS``)
    when a GPU was sampled (rows stay short for the CPU-only runs that are most of them)."""
    row: list[Any] = [x.t_ns, x.rss_bytes, round(x.cpu_s, 4)]
    gpu = [getattr(x, name) for name in GPU_FIELDS]
    if any(v is not None for v in gpu):
        row += gpu
    return row


def sample_from_row(row: list[Any]) -> ResourceSample:
    return ResourceSample(*row[: 3 + len(GPU_FIELDS)])


def gpu_samples(samples: list[ResourceSample]) -> list[GpuSample]:
    return [GpuSample(s.t_ns, s.gpu_util, s.gpu_mem_bw_util, s.gpu_mem_bytes, s.gpu_sm_clock_mhz, s.gpu_power_w,
                      s.gpu_energy_mj) for s in samples if any(getattr(s, n) is not None for n in GPU_FIELDS)]  # fmt: skip


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
    gpu: dict[str, Any] | None = (
        None  # gpu.summarize: util, mem_bw_util, mem_bytes, sm_clock_mhz, power_w, energy_j
    )
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
        self._gpu: NvmlSource | SmiSource | None = None
        self._rapl: _Rapl | None = None
        self._t0 = 0
        self._cpu0 = 0.0
        self.result = ResourceResult()

    def _cpu_s(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def _sample(self) -> None:
        s = ResourceSample(time.perf_counter_ns(), self._process.memory_info().rss, self._cpu_s())
        if self._gpu is not None:
            g = self._gpu.sample()
            s.gpu_util, s.gpu_mem_bytes, s.gpu_power_w = g.util, g.mem_bytes, g.power_w
            s.gpu_mem_bw_util, s.gpu_sm_clock_mhz, s.gpu_energy_mj = (
                g.mem_bw_util,
                g.sm_clock_mhz,
                g.energy_mj,
            )
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
                self._gpu = open_gpu(self.gpu_index)
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
        if self._gpu is not None:
            self._gpu.close()

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
        if self._gpu is not None:
            r.gpu = summarize(gpu_samples(r.samples))
            energy += r.gpu["energy_j"] or 0.0
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
    gpus = [(p.gpu, p.wall_s) for p in parts if p.gpu]
    if gpus:

        def weighted(key: str) -> float | None:
            pts = [(g[key], w) for g, w in gpus if g.get(key) is not None]
            total = sum(w for _, w in pts)
            return sum(v * w for v, w in pts) / total if pts and total else None

        out.gpu = {
            **{k: weighted(k) for k in ("util", "mem_bw_util", "sm_clock_mhz", "power_w")},
            "mem_bytes": max(g.get("mem_bytes") or 0 for g, _ in gpus),
            "energy_j": sum(g.get("energy_j") or 0.0 for g, _ in gpus),
            "energy_from": gpus[0][0].get("energy_from"),
            "samples": sum(g.get("samples") or 0 for g, _ in gpus),
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
