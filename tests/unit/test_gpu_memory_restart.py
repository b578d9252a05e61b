"""A GPU memory restart whose smaller build fails because a co-tenant holds the memory recovers.

vLLM refuses to start with less than ``gpu_memory_utilization`` x total free. When a co-tenant takes
the memory the retired engine freed, the smaller setting fails that check, and so does the engine
host's fallback to the settings that built last (larger still): the guard then rebuilds at what the
free memory holds, where it rebuilt with the larger settings until the crash budget was spent. A
smaller build that fails with the memory free (too small, not too large) is the floor, as on the
CPU. The engine is a fake with vLLM's start check and the engine host's fallback."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.config.load import GuardConfig
from controller.lifecycle.guard import Guard
from controller.lifecycle.memory import fitting_utilization
from policies.base import Observation
from tests.helpers import obs

GIB = 1 << 30
TOTAL = 80 * GIB
CONTEXTS = GIB * 9 // 10


class SharedGpu:
    """One GPU: the engine holds util x total while it runs; a co-tenant holds ``co_tenant``."""

    def __init__(self) -> None:
        self.co_tenant = 0
        self.grows_to: int | None = None
        """What the co-tenant takes once the engine is retired (it grows into the freed memory)."""


class GpuEngine:
    """An ``EngineControl`` as the engine host behaves on a GPU: a memory restart retires the engine,
    builds the new settings, and on failure builds the settings that built last."""

    memory_knob = "gpu_memory_utilization"
    died_out_of_memory = False

    def __init__(self, gpu: SharedGpu, util: float, smallest: float = 0.0) -> None:
        self.gpu, self.util, self.smallest = gpu, util, smallest
        self.running = True
        self.builds: list[tuple[float, bool]] = []

    @property
    def dead(self) -> bool:
        return not self.running

    def free(self) -> int:
        held = int(self.util * TOTAL) if self.running else 0
        return TOTAL - self.gpu.co_tenant - CONTEXTS - held

    def _build(self, util: float) -> bool:
        """vLLM's start check (free >= util x total), and a KV cache too small below ``smallest``."""
        ok = self.free() >= util * TOTAL and util >= self.smallest
        self.builds.append((util, ok))
        return ok

    def memory_settings(self) -> dict[str, Any]:
        return {"gpu_memory_utilization": self.util, "kv_cache_memory_bytes": None}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.running = False
        if self.gpu.grows_to is not None:
            self.gpu.co_tenant = self.gpu.grows_to
        new = float(overrides.get("gpu_memory_utilization", self.util))
        if self._build(new):
            self.util, self.running = new, True
            return
        if new != self.util and self._build(self.util):
            self.running = True
        raise ValueError(f"the engine at gpu_memory_utilization {new} did not start")

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.running = False


def run_memory_restart(engine: GpuEngine) -> Guard:
    """The co-tenant takes what the engine left free; the guard confirms the risk, restarts the engine
    and, where none is left, recovers it."""

    async def no_sleep(_s: float) -> None:
        await asyncio.sleep(0)

    async def run() -> Guard:
        clock = FakeClock()
        gate = AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)
        s = GuardConfig(consecutive_samples=1, backoff_initial_s=0.0, backoff_max_s=0.0)
        gpu_free = lambda: (engine.free(), TOTAL)  # noqa: E731
        guard = Guard(s, gate, engine, lambda _r, _d: None, clock, lambda: None, no_sleep, gpu_free=gpu_free)

        def reading() -> Observation:
            return obs(now_mono=clock(), gpu_memory_free_bytes=engine.free(), gpu_memory_total_bytes=TOTAL)

        assert guard.on_observation(reading()) is None  # what vLLM left free at its start
        engine.gpu.co_tenant = engine.free() - GIB  # 1 GiB left free: below the 2.4 GiB margin
        clock.advance(1.0)
        task = guard.on_observation(reading())
        assert task is not None
        await asyncio.gather(task, return_exceptions=True)
        if engine.dead:
            await guard.recover()
        return guard

    return asyncio.run(run())


def test_a_co_tenant_holding_the_freed_memory_is_built_around_not_retried_until_the_budget_is_spent() -> None:
    gpu = SharedGpu()
    gpu.grows_to = 30 * GIB  # takes the retired engine's memory: 0.81 x 80 GiB no longer fits
    engine = GpuEngine(gpu, 0.90)
    guard = run_memory_restart(engine)
    assert not guard.given_up.is_set() and not engine.dead
    assert engine.util == fitting_utilization(GuardConfig(), TOTAL - 30 * GIB - CONTEXTS, TOTAL)
    assert guard.memory_restarts.failed_floor == {}  # a smaller setting may build
    assert [ok for _, ok in engine.builds] == [False, False, True]  # smaller, fallback, what fits


def test_a_smaller_setting_that_fails_with_the_memory_free_is_the_floor() -> None:
    engine = GpuEngine(SharedGpu(), 0.90, smallest=0.85)  # 0.81 holds no sequence: the fallback serves
    guard = run_memory_restart(engine)
    assert not engine.dead and engine.util == 0.90
    (tried, _), _ = engine.builds
    assert guard.memory_restarts.failed_floor == {"gpu_memory_utilization": tried}
    assert guard.memory_restarts.retry is None


WEIGHTS = 16 * GIB


class KvGpuEngine(GpuEngine):
    """The same host with ``kv_cache_memory_bytes`` set: the engine holds its weights and that cache,
    and vLLM's start check still asks for ``gpu_memory_utilization`` x total free."""

    memory_knob = "kv_cache_memory_bytes"
    died_out_of_memory = False

    def __init__(self, gpu: SharedGpu, kv: int) -> None:
        super().__init__(gpu, 0.90)
        self.kv = kv

    def free(self) -> int:
        held = WEIGHTS + self.kv if self.running else 0
        return TOTAL - self.gpu.co_tenant - CONTEXTS - held

    def memory_settings(self) -> dict[str, Any]:
        return {"gpu_memory_utilization": self.util, "kv_cache_memory_bytes": self.kv}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.running = False
        if self.gpu.grows_to is not None:
            self.gpu.co_tenant = self.gpu.grows_to
        util = float(overrides.get("gpu_memory_utilization", self.util))
        kv = int(overrides.get("kv_cache_memory_bytes", self.kv))
        for try_util, try_kv in ((util, kv), (self.util, self.kv)):
            ok = self.free() >= try_util * TOTAL  # request_memory: util x total, the cache set or not
            self.builds.append((try_util, ok))
            if ok:
                self.util, self.kv, self.running = try_util, try_kv, True
                if (try_util, try_kv) == (util, kv):
                    return
                break
        raise ValueError(f"the engine at gpu_memory_utilization {util} did not start")


def test_with_kv_cache_memory_bytes_set_a_smaller_cache_passes_the_start_check_at_a_lower_util() -> None:
    gpu = SharedGpu()
    gpu.grows_to = 20 * GIB  # 59.1 GiB free once the engine is retired: below 0.9 x 80 = 72
    engine = KvGpuEngine(gpu, 40 * GIB)
    guard = run_memory_restart(engine)
    assert not guard.given_up.is_set() and not engine.dead
    assert engine.kv == 36 * GIB  # the shrink (10 %), built
    assert engine.util == fitting_utilization(GuardConfig(), TOTAL - 20 * GIB - CONTEXTS, TOTAL)
    assert guard.memory_restarts.failed_floor == {}
    assert [ok for _, ok in engine.builds] == [False, False, True]  # smaller, fallback, the util that fits
