"""An EngineCore that dies of a CUDA out-of-memory error gets a memory restart, not the same setting.

vLLM's EngineCore sends its client only the bare bytes ``ENGINE_CORE_DEAD``; the scheduler module
(inside the EngineCore) has it write why it died first (``engine/runtime/death.py``). The guard reads
that as a plain fact (``EngineControl.died_out_of_memory``), or where the engine left no word, the
last GPU reading before the death below the margin, and recovers with the memory restart's own
mechanism (``MemoryRestarts``: the smaller setting, the floor, the back-off). The engine and NVML are
fakes; the note is written by vLLM's own ``EngineCoreProc._send_engine_dead`` as the module patches it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.config.load import GuardConfig
from controller.engine.runtime import death
from controller.lifecycle.guard import Guard
from tests.helpers import obs

GIB = 1 << 30
TOTAL = 80 * GIB
TORCH_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (torch.OutOfMemoryError(TORCH_OOM), death.CUDA_OOM),  # one GPU: the model runs in the EngineCore
        (
            RuntimeError(f"Worker failed with error '{TORCH_OOM}', please check the stack trace"),
            death.CUDA_OOM,
        ),
        (RuntimeError("CUDA error: out of memory"), death.CUDA_OOM),  # outside torch's allocator
        (RuntimeError("shape mismatch"), death.OTHER),
        (None, death.OTHER),
    ],
)
def test_a_cuda_out_of_memory_error_is_told_from_other_deaths(
    error: BaseException | None, cause: str
) -> None:
    assert death.cause_of(error) == cause


def test_an_oom_raised_during_another_error_still_counts() -> None:
    try:
        try:
            raise torch.OutOfMemoryError(TORCH_OOM)
        except torch.OutOfMemoryError:
            raise RuntimeError("step failed")  # noqa: B904 (vLLM's own wrappers chain by context)
    except RuntimeError as exc:
        assert death.cause_of(exc) == death.CUDA_OOM


def test_the_engine_core_writes_why_it_died_before_its_death_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    import controller.engine.runtime.scheduler  # noqa: F401  (vLLM imports it inside the EngineCore)

    environ: dict[str, str] = {}
    notes = death.DeathNotes(environ)
    notes.arm()
    monkeypatch.setenv(death.ENV, environ[death.ENV])  # the EngineCore inherits the daemon's environment
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    core = SimpleNamespace(output_queue=queue.Queue(), output_thread=finished)
    try:
        raise torch.OutOfMemoryError(TORCH_OOM)
    except torch.OutOfMemoryError:  # run_engine_core calls it inside its ``except`` block
        EngineCoreProc._send_engine_dead(core)  # type: ignore[arg-type]
    try:
        assert core.output_queue.get_nowait() == EngineCoreProc.ENGINE_CORE_DEAD  # vLLM's message still goes
        assert notes.causes() == [death.CUDA_OOM]
        notes.clear()  # a new engine is in force
        assert notes.causes() == []
    finally:
        notes.close()
    assert death.ENV not in environ


class GpuEngine:
    """An ``EngineControl`` on one GPU that can die, with or without its word that it ran out of
    memory; its builds below ``smallest`` fail (a KV cache that holds no sequence)."""

    memory_knob = "gpu_memory_utilization"

    def __init__(self, util: float, smallest: float = 0.0) -> None:
        self.util, self.smallest = util, smallest
        self.dead = False
        self.died_out_of_memory = False
        self.builds: list[float] = []

    def die(self, out_of_memory: bool) -> None:
        self.dead, self.died_out_of_memory = True, out_of_memory

    def memory_settings(self) -> dict[str, Any]:
        return {"gpu_memory_utilization": self.util, "kv_cache_memory_bytes": None}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        new = float(overrides.get("gpu_memory_utilization", self.util))
        self.builds.append(new)
        if new < self.smallest:
            raise ValueError(f"no sequence fits at gpu_memory_utilization {new}")
        self.util, self.dead, self.died_out_of_memory = new, False, False

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


def recover_after(engine: GpuEngine, out_of_memory: bool, free_before: int = 7 * GIB) -> list[str]:
    """Two readings while the engine serves (what vLLM left free at its start, then ``free_before``),
    its death, then recovery (each try, failed or not, until an engine serves); returns the restart
    reasons that built."""
    reasons: list[str] = []

    async def no_sleep(_s: float) -> None:
        await asyncio.sleep(0)

    def gpu_free() -> tuple[int, int]:
        return TOTAL - (0 if engine.dead else int(engine.util * TOTAL)), TOTAL  # a dead engine holds none

    async def run() -> Guard:
        clock = FakeClock()
        gate = AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)
        s = GuardConfig(consecutive_samples=3, backoff_initial_s=0.0, backoff_max_s=0.0)
        guard = Guard(
            s, gate, engine, lambda r, _d: reasons.append(r), clock, lambda: None, no_sleep, gpu_free=gpu_free
        )
        for free in (7 * GIB, free_before):
            clock.advance(1.0)
            reading = obs(now_mono=clock(), gpu_memory_free_bytes=free, gpu_memory_total_bytes=TOTAL)
            assert guard.on_observation(reading) is None  # fewer than 3 low readings: no confirmed risk
        engine.die(out_of_memory)
        await guard.recover()
        return guard

    guard = asyncio.run(run())
    assert not guard.given_up.is_set()
    return reasons


def test_a_cuda_oom_death_rebuilds_smaller_not_at_the_same_setting() -> None:
    engine = GpuEngine(0.90)
    assert recover_after(engine, out_of_memory=True) == ["cuda_oom"]
    assert engine.builds == [0.81]  # memory_step_fraction 0.1, as a memory restart shrinks


def test_an_ordinary_death_rebuilds_at_the_same_setting() -> None:
    engine = GpuEngine(0.90)
    assert recover_after(engine, out_of_memory=False) == ["engine_died"]
    assert engine.builds == [0.90]


def test_a_death_right_after_a_reading_below_the_margin_is_a_cuda_oom_without_the_engines_word() -> None:
    engine = GpuEngine(0.90)  # a worker killed outright leaves no note
    assert recover_after(engine, out_of_memory=False, free_before=GIB // 2) == ["cuda_oom"]
    assert engine.builds == [0.81]


def test_a_cuda_oom_rebuild_that_fails_is_the_floor_the_next_try_stays_above() -> None:
    engine = GpuEngine(0.90, smallest=0.85)
    assert recover_after(engine, out_of_memory=True) == ["cuda_oom"]
    # 0.81 failed (MemoryRestarts.failed): the next try stops halfway above it, as a memory restart's
    assert engine.builds == [0.81, 0.855]
