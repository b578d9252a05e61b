"""Memory of a server under test: resident memory of its process tree (psutil) and GPU memory (NVML)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil


def tree_rss(pid: int) -> int | None:
    """Resident bytes of ``pid`` and all its descendants; None once the process is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue  # a child that just exited
    return total


@dataclass
class Nvml:
    """GPU memory in use over all devices; ``available`` is False on a machine without NVML (a CPU host)."""

    available: bool = False
    _handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = True
        except Exception:  # NVMLError_LibraryNotFound on a CPU host, or no driver: no GPU figures
            self.available = False

    def used_bytes(self) -> int | None:
        if not self.available:
            return None
        import pynvml

        try:
            return sum(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)
        except Exception:
            return None


@dataclass
class MemoryProbe:
    """Per-sample memory fields for :class:`~controller.bench.scrape.Scraper` (``pid`` None: GPU only)."""

    pid: int | None
    nvml: Nvml = field(default_factory=Nvml)

    def __call__(self) -> dict[str, int | None]:
        return {
            "rss_bytes": tree_rss(self.pid) if self.pid is not None else None,
            "gpu_mem_bytes": self.nvml.used_bytes(),
        }
