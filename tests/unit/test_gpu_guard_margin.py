"""On a GPU the memory guard's margin is relative to what vLLM leaves free at the utilization in force.

vLLM takes ``gpu_memory_utilization`` x total at start, beside the CUDA contexts it made before it
measured; NVML's free memory is then at most (1 - util) x total. A fixed margin of max(1 GiB, 3 %)
sits above that at util 0.97 and restarted the engine seconds after its start, lowering the
operator's setting. The engine here is a fake with vLLM's arithmetic; NVML is the observation's
readings."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.config.load import GuardConfig
from controller.lifecycle.guard import Guard
from controller.lifecycle.memory import VLLM_FREE_SHARE, gpu_margin_bytes, sizing_utilization
from tests.helpers import obs

GIB = 1 << 30
TOTAL = 80 * GIB  # an H100
CONTEXTS = GIB * 9 // 10  # the CUDA contexts (the engine's, NCCL's, the daemon's) outside vLLM's budget


class GpuEngine:
    """An ``EngineControl`` on one GPU sized by ``gpu_memory_utilization``."""

    memory_knob = "gpu_memory_utilization"
    died_out_of_memory = False

    def __init__(self, util: float) -> None:
        self.util = util
        self.dead = False
        self.restarts: list[dict[str, Any]] = []

    def memory_settings(self) -> dict[str, Any]:
        return {"gpu_memory_utilization": self.util, "kv_cache_memory_bytes": None}

    def free_bytes(self, co_tenant: int = 0) -> int:
        """NVML's free memory once vLLM took util x total."""
        return int((1 - self.util) * TOTAL) - CONTEXTS - co_tenant

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append(overrides)
        self.util = float(overrides["gpu_memory_utilization"])

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


def restarts_in_a_minute(engine: GpuEngine, co_tenant: int = 0) -> list[dict[str, Any]]:
    """A minute of 1 s ticks against the engine's NVML free memory, less a co-tenant's share from
    the tenth tick on."""

    async def run() -> list[dict[str, Any]]:
        clock = FakeClock()
        gate = AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)
        guard = Guard(GuardConfig(), gate, engine, lambda _r, _d: None, clock, lambda: None)
        for tick in range(60):
            clock.advance(1.0)
            free = engine.free_bytes(co_tenant if tick >= 10 else 0)
            task = guard.on_observation(
                obs(now_mono=clock(), gpu_memory_free_bytes=free, gpu_memory_total_bytes=TOTAL)
            )
            if task is not None:
                await task
        return engine.restarts

    return asyncio.run(run())


def test_a_high_utilization_does_not_trip_the_guard_on_vllms_own_reservation() -> None:
    for util in (0.96, 0.97, 0.98):
        assert restarts_in_a_minute(GpuEngine(util)) == [], util


def test_a_co_tenant_taking_half_of_what_vllm_left_free_still_trips_it() -> None:
    engine = GpuEngine(0.97)
    restarts = restarts_in_a_minute(engine, co_tenant=engine.free_bytes() // 2 + GIB // 16)
    assert restarts and restarts[0]["gpu_memory_utilization"] < 0.97


def test_at_a_usual_utilization_the_configured_margin_holds() -> None:
    left = GpuEngine(0.90).free_bytes()  # about 7 GiB: the 2.4 GiB margin is below half of it
    assert restarts_in_a_minute(GpuEngine(0.90), co_tenant=left - 2 * GIB)
    assert restarts_in_a_minute(GpuEngine(0.90), co_tenant=left - 3 * GIB) == []


def test_the_margin_is_the_configured_one_capped_at_a_share_of_what_vllm_leaves() -> None:
    s = GuardConfig()
    fixed = max(s.gpu_free_margin_bytes, int(s.gpu_free_margin_fraction * TOTAL))
    assert gpu_margin_bytes(s, TOTAL) == fixed
    assert gpu_margin_bytes(s, TOTAL, 0.90) == fixed
    assert gpu_margin_bytes(s, TOTAL, 0.97) == int(VLLM_FREE_SHARE * 0.03 * TOTAL)
    assert gpu_margin_bytes(s, TOTAL, 0.97, free_at_start=GIB) == int(VLLM_FREE_SHARE * GIB)
    assert gpu_margin_bytes(s, TOTAL, 1.0) == 0


def test_only_a_utilization_that_sizes_the_engine_moves_the_margin() -> None:
    settings = {"gpu_memory_utilization": 0.97, "kv_cache_memory_bytes": 8 * GIB}
    assert sizing_utilization("gpu_memory_utilization", settings) == 0.97
    assert sizing_utilization("kv_cache_memory_bytes", settings) is None
    assert sizing_utilization("gpu_memory_utilization", {"gpu_memory_utilization": None}) is None
