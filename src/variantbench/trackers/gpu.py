"""GPU samples beside every measured block (issue 43): utilization, memory-bandwidth utilization,
memory used, SM clock, power and energy, the seeds' "GPU utilization" and "memory bandwidth"
columns measured by the driver, not derived.

Two sources, the same fields:

* NVML in this process (``nvidia-ml-py``, the ``gpu`` extra): ``nvmlDeviceGetUtilizationRates``
  (``.gpu``: the share of the last sample period a kernel ran; ``.memory``: the share the memory
  was being read or written), memory info, the SM clock, power and the cumulative energy counter
  (Volta and newer).
* ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits -lms N``, a child process streaming
  one CSV line per period: what a machine with the driver but without ``nvidia-ml-py`` has (the
  device check runs on such a machine). ``parse_smi`` reads its lines, ``[N/A]`` fields as None.

``summarize`` makes the block's numbers: means of the utilizations, clock and power, the peak of
memory, and the energy from the counter where there is one, else the power integrated over time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
import shutil
import subprocess
import threading
import time
from typing import Any

SMI_FIELDS = ("utilization.gpu", "utilization.memory", "memory.used", "clocks.sm", "power.draw")


@dataclass
class GpuSample:
    t_ns: int
    util: float | None = None  # percent of time a kernel ran
    mem_bw_util: float | None = None  # percent of time device memory was read or written
    mem_bytes: int | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    energy_mj: int | None = None  # the driver's cumulative counter (NVML only)


def smi_command(index: int, period_ms: int) -> list[str] | None:
    """``nvidia-smi`` streaming ``SMI_FIELDS`` of device ``index`` every ``period_ms``; None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    return [exe, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", f"-i={index}",
            f"-lms={period_ms}"]  # fmt: skip


def _number(text: str) -> float | None:
    text = text.strip()
    if not text or text.startswith("[") or text.upper() in ("N/A", "NOT SUPPORTED"):
        return None
    for unit in (" MiB", " MHz", " W", " %"):  # present when ``nounits`` was not asked
        text = text.removesuffix(unit)
    try:
        return float(text)
    except ValueError:
        return None


def parse_smi_line(line: str, t_ns: int) -> GpuSample | None:
    """One line of ``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader[,nounits]``; None for a
    header or a line of another shape."""
    parts = line.strip().split(",")
    if len(parts) != len(SMI_FIELDS) or parts[0].strip().startswith("utilization"):
        return None
    util, mem_bw, mem_mib, clock, power = (_number(p) for p in parts)
    if all(v is None for v in (util, mem_bw, mem_mib, clock, power)):
        return None
    return GpuSample(t_ns, util, mem_bw, None if mem_mib is None else int(mem_mib * 2**20), clock, power)


def parse_smi(lines: Iterable[str], period_ns: int, t0_ns: int = 0) -> list[GpuSample]:
    """Every sample of a recorded ``nvidia-smi`` stream, the i-th timed ``t0_ns + i * period_ns``."""
    out: list[GpuSample] = []
    for line in lines:
        sample = parse_smi_line(line, t0_ns + len(out) * period_ns)
        if sample is not None:
            out.append(sample)
    return out


def summarize(samples: list[GpuSample]) -> dict[str, Any]:
    """A block's GPU numbers from its samples (None where no sample had the field)."""

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def field(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    counters = [(s.t_ns, s.energy_mj) for s in samples if s.energy_mj is not None]
    if len(counters) >= 2:
        energy, how = (counters[-1][1] - counters[0][1]) / 1000.0, "counter"
    else:
        pts = [(s.t_ns, s.power_w) for s in samples if s.power_w is not None]
        energy = sum((b[0] - a[0]) / 1e9 * (a[1] + b[1]) / 2 for a, b in zip(pts, pts[1:], strict=False))
        energy, how = (energy, "power integrated") if len(pts) >= 2 else (None, None)
    mems = field("mem_bytes")
    return {
        "util": mean(field("util")),
        "mem_bw_util": mean(field("mem_bw_util")),
        "mem_bytes": int(max(mems)) if mems else None,
        "sm_clock_mhz": mean(field("sm_clock_mhz")),
        "power_w": mean(field("power_w")),
        "energy_j": energy,
        "energy_from": how,
        "samples": len(samples),
    }


class NvmlSource:
    """One device through NVML in this process."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    @classmethod
    def open(cls, index: int) -> NvmlSource | None:
        try:
            import pynvml as nvml

            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no library, no driver
            return None
        try:
            return cls(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:  # noqa: BLE001
            nvml.nvmlShutdown()
            return None

    def _try(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(self.handle, *args)
        except Exception:  # noqa: BLE001 - a field this device or driver lacks
            return None

    def sample(self) -> GpuSample:
        n = self.nvml
        rates = self._try(n.nvmlDeviceGetUtilizationRates)
        mem = self._try(n.nvmlDeviceGetMemoryInfo)
        power = self._try(n.nvmlDeviceGetPowerUsage)
        return GpuSample(
            time.perf_counter_ns(),
            None if rates is None else float(rates.gpu),
            None if rates is None else float(rates.memory),
            None if mem is None else int(mem.used),
            self._try(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
            None if power is None else power / 1000.0,
            self._try(n.nvmlDeviceGetTotalEnergyConsumption),
        )

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class SmiSource:
    """``nvidia-smi`` streaming CSV lines every ``period_ms``; ``sample`` returns the latest line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.latest: GpuSample | None = None
        self._thread = threading.Thread(target=self._read, name="variantbench-nvidia-smi", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, index: int, period_ms: int = 100) -> SmiSource | None:
        cmd = smi_command(index, period_ms)
        if cmd is None:
            return None
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return None
        return cls(proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sample = parse_smi_line(line, time.perf_counter_ns())
            if sample is not None:
                self.latest = sample

    def sample(self) -> GpuSample:
        latest = self.latest
        if latest is None:
            return GpuSample(time.perf_counter_ns())
        return GpuSample(time.perf_counter_ns(), latest.util, latest.mem_bw_util, latest.mem_bytes,
                         latest.sm_clock_mhz, latest.power_w)  # fmt: skip

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def open_gpu(index: int) -> NvmlSource | SmiSource | None:
    """NVML where ``nvidia-ml-py`` and the driver are there, else ``nvidia-smi``, else None."""
    return NvmlSource.open(index) or SmiSource.open(index)
