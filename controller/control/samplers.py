"""Readings from outside the engine: NVML (GPU memory and utilisation) and psutil (host).

NVML sits behind ``GpuSource`` with a fake for tests. On a machine without a GPU ``nvmlInit`` raises
``NVMLError_LibraryNotFound``: that is the CPU case, not an error; the readings are then None.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    """One of the engine's GPUs (or MIG slices)."""

    name: str
    """Its CUDA_VISIBLE_DEVICES entry (an index, a GPU-/MIG- UUID)."""
    used_bytes: int
    total_bytes: int
    free_bytes: int

    @property
    def free_fraction(self) -> float:
        return self.free_bytes / self.total_bytes if self.total_bytes else 1.0


@dataclass(frozen=True)
class GpuReading:
    """The memory of the engine's most loaded GPU (the least free memory for its size): with tensor
    parallelism one GPU near OOM fails the engine however much the others have free, so a sum would
    hide it. Every device is in ``per_device``."""

    used_bytes: int
    total_bytes: int
    free_bytes: int
    utilization: float
    """Mean GPU utilisation over the devices, 0..1."""
    devices: int
    per_device: tuple[DeviceMemory, ...] = ()


class GpuSource(Protocol):
    def read(self) -> GpuReading | None:
        """The current reading, or None where no GPU is present."""


@dataclass(frozen=True)
class EngineDevices:
    """Which of the host's GPUs the engine runs on, as vLLM picks them for its local ranks: the first
    ``count`` of ``device_ids`` (vLLM's ``--device-ids``) where given, else of the visible devices
    (CUDA_VISIBLE_DEVICES' entries, or every device in index order when it is unset)."""

    count: int
    """The engine's GPUs on this host: tensor x pipeline x prefill-context parallel x local data
    parallel ranks."""
    device_ids: tuple[str, ...] | None = None
    """vLLM's ``--device-ids``: indices into CUDA_VISIBLE_DEVICES where it is set (else physical
    indices), or GPU UUIDs."""


def engine_entries(visible: str | None, engine: EngineDevices | None, device_count: int) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES-style entries of the engine's devices, in its rank order; None: every
    visible device (no engine named)."""
    entries = visible_devices(visible)
    if engine is None:
        return entries
    if entries is None:
        entries = [str(i) for i in range(device_count)]
    if engine.device_ids is not None:
        ids = list(engine.device_ids)
        if visible_devices(visible) is not None and all(i.isdigit() for i in ids):
            ids = [entries[int(i)] for i in ids if int(i) < len(entries)]
        entries = ids
    return entries[: engine.count]


def visible_devices(visible: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated indices, ``GPU-<uuid>`` or ``MIG-<uuid>``
    (also the older ``MIG-GPU-<uuid>/<gi>/<ci>``) entries, unique UUID prefixes allowed; CUDA stops at
    the first entry it cannot use. None: unset (every device)."""
    if visible is None:
        return None
    return [item.strip() for item in visible.split(",") if item.strip()]


def _mig_handles(nv: Any, parent: Any) -> list[Any]:
    try:
        count = int(nv.nvmlDeviceGetMaxMigDeviceCount(parent))
    except Exception:  # not a MIG-capable GPU
        return []
    out = []
    for i in range(count):
        try:
            out.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i))
        except Exception:  # an empty slot
            continue
    return out


def _uuid(nv: Any, handle: Any) -> str:
    uuid = nv.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def resolve_devices(
    nv: Any, visible: str | None, engine: EngineDevices | None = None
) -> list[tuple[str, Any]]:
    """NVML handles of the engine's devices (``engine_entries``), in its order, with their entries."""
    gpus = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(int(nv.nvmlDeviceGetCount()))]
    entries = engine_entries(visible, engine, len(gpus))
    if entries is None:
        return [(str(i), h) for i, h in enumerate(gpus)]
    by_uuid = {_uuid(nv, h): h for h in gpus}
    if any(e.startswith("MIG-") for e in entries):
        by_uuid.update({_uuid(nv, m): m for g in gpus for m in _mig_handles(nv, g)})
    out: list[tuple[str, Any]] = []
    for entry in entries:
        handle = _lookup(entry, gpus, by_uuid)
        if handle is None:
            log.warning("cuda_visible_device_unknown", entry=entry, visible=visible)
            break  # as CUDA: the entries after an invalid one are ignored
        out.append((entry, handle))
    return out


def _lookup(entry: str, gpus: list[Any], by_uuid: dict[str, Any]) -> Any:
    if entry.isdigit():
        return gpus[int(entry)] if int(entry) < len(gpus) else None
    if entry.startswith("MIG-GPU-"):  # MIG-GPU-<uuid>/<gi>/<ci>: no MIG UUID to match; its GPU
        entry = entry[len("MIG-") :].split("/", 1)[0]
    matches = [h for uuid, h in by_uuid.items() if uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


class NvmlSource:
    """nvidia-ml-py (module ``pynvml``, or a fake with the same functions). Initialised on first
    read; None for good once absent. The devices are the engine's (``engine``, asked at each read, so
    a restart with other parallel settings is followed) among those of CUDA_VISIBLE_DEVICES; with no
    ``engine``, every visible device: a co-tenant's GPU the engine never uses would trip the guard."""

    def __init__(
        self,
        nvml: Any = None,
        visible: str | None = None,
        use_env: bool = True,
        engine: Callable[[], EngineDevices] | None = None,
    ) -> None:
        self._nvml: Any = nvml
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if use_env and visible is None else visible
        self._engine = engine
        self._handles: list[tuple[str, Any]] | None = None
        self._resolved_for: EngineDevices | None = None
        self.unavailable_reason: str | None = None

    def _init(self) -> bool:
        engine = self._engine() if self._engine is not None else None
        if self._handles is not None and engine == self._resolved_for:
            return True
        if self.unavailable_reason is not None:
            return False
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            if self._handles is None:
                self._nvml.nvmlInit()
            self._handles = resolve_devices(self._nvml, self._visible, engine)
            self._resolved_for = engine
        except Exception as exc:  # NVMLError_LibraryNotFound on CPU hosts, ImportError without the package
            self.unavailable_reason = f"{type(exc).__name__}: {exc}"
            log.info("nvml_unavailable", reason=self.unavailable_reason)
            return False
        return True

    def read(self) -> GpuReading | None:
        if not self._init() or not self._handles:
            return None
        nv = self._nvml
        devices, util = [], 0.0
        for name, h in self._handles:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            devices.append(DeviceMemory(name, int(mem.used), int(mem.total), int(mem.free)))
            with contextlib.suppress(Exception):  # MIG slices report no utilisation
                util += nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        tightest = min(devices, key=lambda d: (d.free_fraction, d.free_bytes))
        n = len(devices)
        return GpuReading(
            tightest.used_bytes, tightest.total_bytes, tightest.free_bytes, util / n, n, tuple(devices)
        )


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
