"""Readings from outside the engine: NVML (GPU memory and utilisation) and psutil (host).

NVML sits behind ``GpuSource`` with a fake for tests. On a machine without a GPU ``nvmlInit`` raises
``NVMLError_LibraryNotFound``: that is the CPU case, not an error; the readings are then None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """Summed over the engine's GPUs."""

    used_bytes: int
    total_bytes: int
    free_bytes: int
    utilization: float
    """Mean GPU utilisation over the devices, 0..1."""
    devices: int


class GpuSource(Protocol):
    def read(self) -> GpuReading | None:
        """The current reading, or None where no GPU is present."""


def _visible_indices(count: int) -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return list(range(count))
    out = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < count:
            out.append(int(item))
    return out or list(range(count))


class NvmlSource:
    """nvidia-ml-py (module ``pynvml``). Initialised on first read; None for good once absent."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] | None = None
        self.unavailable_reason: str | None = None

    def _init(self) -> bool:
        if self._handles is not None:
            return True
        if self.unavailable_reason is not None:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(count)]
            self._nvml = pynvml
        except Exception as exc:  # NVMLError_LibraryNotFound on CPU hosts, ImportError without the package
            self.unavailable_reason = f"{type(exc).__name__}: {exc}"
            log.info("nvml_unavailable", reason=self.unavailable_reason)
            return False
        return True

    def read(self) -> GpuReading | None:
        if not self._init() or not self._handles:
            return None
        nv = self._nvml
        used = total = free = 0
        util = 0.0
        for h in self._handles:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            used, total, free = used + int(mem.used), total + int(mem.total), free + int(mem.free)
            util += nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        n = len(self._handles)
        return GpuReading(used, total, free, util / n, n)


@dataclass(frozen=True)
class HostReading:
    memory_available_bytes: int
    daemon_cpu_percent: float
    """CPU use of this process since the previous reading, percent of one core."""


class HostReadingSource(Protocol):
    def read(self) -> HostReading: ...


class HostSource:
    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts the measurement

    def read(self) -> HostReading:
        return HostReading(int(psutil.virtual_memory().available), float(self._proc.cpu_percent(None)))


class FakeHostSource:
    """A host whose reading the test sets."""

    def __init__(self, memory_available_bytes: int = 16 << 30, daemon_cpu_percent: float = 0.0) -> None:
        self.reading = HostReading(memory_available_bytes, daemon_cpu_percent)

    def read(self) -> HostReading:
        return self.reading
