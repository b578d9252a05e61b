"""The GPU memory guard watches the most loaded of the engine's GPUs: summed over
tensor-parallel GPUs, one near OOM hid behind the others' free memory. The engine's devices are those
CUDA_VISIBLE_DEVICES names (indices, GPU and MIG UUIDs, unique prefixes), resolved to NVML handles.
NVML is a fake of several devices with the functions ``NvmlSource`` calls."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from controller.config.load import GuardConfig, load_config
from controller.control.samplers import EngineDevices, NvmlSource
from controller.engine.runtime.parallel import engine_devices
from controller.lifecycle.memory import MemoryWatch
from controller.lifecycle.parts import build_parts
from tests.helpers import obs, write_config

GIB = 1 << 30


@dataclass
class Dev:
    uuid: str
    total: int
    free: int
    migs: list[Dev] = field(default_factory=list)


class FakeNvml:
    """pynvml's functions over a list of GPUs (handles are the ``Dev`` objects)."""

    def __init__(self, gpus: list[Dev]) -> None:
        self.gpus = gpus

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Dev:
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: Dev) -> str:
        return h.uuid

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Dev) -> int:
        if not h.migs:
            raise RuntimeError("NVMLError_NotSupported")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Dev, i: int) -> Dev:
        if i >= len(h.migs):
            raise RuntimeError("NVMLError_NotFound")
        return h.migs[i]

    def nvmlDeviceGetMemoryInfo(self, h: Dev) -> Any:
        return SimpleNamespace(total=h.total, free=h.free, used=h.total - h.free)

    def nvmlDeviceGetUtilizationRates(self, h: Dev) -> Any:
        if h.uuid.startswith("MIG-"):
            raise RuntimeError("NVMLError_NotSupported")
        return SimpleNamespace(gpu=50)


def four_gpus() -> FakeNvml:
    return FakeNvml([Dev(f"GPU-{c}{c}{c}-{i}", 80 * GIB, 40 * GIB) for i, c in enumerate("abcd")])


def read(nv: FakeNvml, visible: str | None) -> Any:
    reading = NvmlSource(nv, visible, use_env=False).read()
    assert reading is not None
    return reading


def test_one_tensor_parallel_gpu_near_oom_is_seen_though_the_others_have_memory_free() -> None:
    nv = four_gpus()
    nv.gpus[2].free = GIB // 2  # 120.5 GiB free in all: far above any margin when summed
    reading = read(nv, "0,1,2,3")
    assert (reading.free_bytes, reading.total_bytes, reading.devices) == (GIB // 2, 80 * GIB, 4)
    watch = MemoryWatch(GuardConfig(consecutive_samples=1))
    risk = watch.observe(
        obs(gpu_memory_free_bytes=reading.free_bytes, gpu_memory_total_bytes=reading.total_bytes)
    )
    assert risk is not None and risk.reason == "gpu_memory_low"


def test_only_the_engines_visible_gpus_are_read_in_their_cuda_order() -> None:
    nv = four_gpus()
    nv.gpus[0].free = GIB // 2  # not the engine's: CUDA_VISIBLE_DEVICES leaves it out
    reading = read(nv, "3,1")
    assert [d.name for d in reading.per_device] == ["3", "1"] and reading.free_bytes == 40 * GIB


def test_gpu_uuids_and_unique_prefixes_name_devices() -> None:
    nv = four_gpus()
    nv.gpus[1].free = 2 * GIB
    reading = read(nv, "GPU-bbb-1,GPU-ddd")
    assert [d.name for d in reading.per_device] == ["GPU-bbb-1", "GPU-ddd"]
    assert reading.free_bytes == 2 * GIB


def test_a_mig_slice_is_guarded_by_its_own_memory() -> None:
    mig = Dev("MIG-1111-2222", 10 * GIB, GIB // 4)
    nv = FakeNvml([Dev("GPU-aaa", 80 * GIB, 60 * GIB, migs=[Dev("MIG-9999", 10 * GIB, 9 * GIB), mig])])
    reading = read(nv, "MIG-1111-2222")
    assert (reading.free_bytes, reading.total_bytes, reading.devices) == (GIB // 4, 10 * GIB, 1)


def test_the_old_mig_form_names_its_gpu() -> None:
    nv = four_gpus()
    reading = read(nv, "MIG-GPU-ccc-2/1/0")
    assert [d.name for d in reading.per_device] == ["MIG-GPU-ccc-2/1/0"]
    assert reading.total_bytes == 80 * GIB


def test_entries_after_one_cuda_cannot_use_are_ignored_as_cuda_does() -> None:
    reading = read(four_gpus(), "1,GPU-nope,2")
    assert [d.name for d in reading.per_device] == ["1"]


def test_an_ambiguous_uuid_prefix_names_no_device() -> None:
    assert NvmlSource(four_gpus(), "GPU-", use_env=False).read() is None


def test_without_nvml_there_is_no_reading() -> None:
    class NoNvml(FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVMLError_LibraryNotFound")

    source = NvmlSource(NoNvml([]), None, use_env=False)
    assert source.read() is None and source.unavailable_reason is not None


def test_with_cuda_visible_devices_unset_a_co_tenants_busy_gpu_is_not_watched() -> None:
    nv = four_gpus()
    nv.gpus[3].free = GIB // 2  # a co-tenant's GPU: the engine (tensor parallel 2) runs on 0 and 1
    tp2 = engine_devices(argparse.Namespace(tensor_parallel_size=2))
    reading = NvmlSource(nv, None, use_env=False, engine=lambda: tp2).read()
    assert reading is not None
    assert [d.name for d in reading.per_device] == ["0", "1"] and reading.free_bytes == 40 * GIB
    watch = MemoryWatch(GuardConfig(consecutive_samples=1))
    free, total = reading.free_bytes, reading.total_bytes
    assert watch.observe(obs(gpu_memory_free_bytes=free, gpu_memory_total_bytes=total)) is None


def test_the_engines_gpus_are_the_first_of_the_visible_ones_or_its_device_ids() -> None:
    def names(visible: str | None, **args: Any) -> list[str]:
        engine = engine_devices(argparse.Namespace(**args))
        reading = NvmlSource(four_gpus(), visible, use_env=False, engine=lambda: engine).read()
        assert reading is not None
        return [d.name for d in reading.per_device]

    assert names(None) == ["0"]
    assert names("3,2,1", tensor_parallel_size=2) == ["3", "2"]
    assert names(None, tensor_parallel_size=2, pipeline_parallel_size=2) == ["0", "1", "2", "3"]
    assert names(None, data_parallel_size=2) == ["0", "1"]
    assert names(None, data_parallel_size=2, data_parallel_rank=1) == ["0"]  # one external rank
    assert names(None, tensor_parallel_size=2, device_ids=[2, 3]) == ["2", "3"]
    assert names("3,2,1", device_ids=[1]) == ["2"]  # an index into CUDA_VISIBLE_DEVICES
    assert names(None, device_ids=["GPU-ddd-3"]) == ["GPU-ddd-3"]
    assert names(None, tensor_parallel_size=2, device_ids=[2, 3], distributed_executor_backend="ray") == [
        "0",
        "1",
    ]


def test_the_source_follows_the_engine_in_force_across_a_restart() -> None:
    engine = [EngineDevices(1)]
    source = NvmlSource(four_gpus(), None, use_env=False, engine=lambda: engine[0])
    first = source.read()
    engine[0] = EngineDevices(2)  # rebuilt with tensor parallel 2
    second = source.read()
    assert first is not None and second is not None and (first.devices, second.devices) == (1, 2)


def test_the_daemon_reads_the_gpus_of_its_engine(tmp_path: Path) -> None:
    parts = build_parts(load_config(write_config(tmp_path / "config.toml")))
    assert isinstance(parts.gpu_source, NvmlSource)
    parts.gpu_source._nvml = four_gpus()
    reading = parts.gpu_source.read()
    assert reading is not None and [d.name for d in reading.per_device] == ["0"]
