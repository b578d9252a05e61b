"""``gpu-check``'s verdict and what it reads: an engine process forked from the daemon is told from
a spawned one by the kernel's auxiliary vector (vLLM's process titles overwrite the command line and
the environment); the checks that need a GPU (two for TP 2 and DP 2) are skipped with the reason where
NVML finds fewer; each GPU check's judgement, from fake ``/state`` answers and run summaries; any
failure fails the command."""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.synchronize import Event as MpEvent
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from controller.bench.gpucheck import (
    FAIL,
    PASS,
    SKIP,
    Check,
    judge_high_util,
    judge_memory_restart,
    judge_parallel_restarts,
    judge_parity,
    skipped,
    spawned,
    table,
    verdict,
    visible_gpus,
)


def wait_until_released(started: MpEvent, release: MpEvent) -> None:
    started.set()
    release.wait(60.0)


@pytest.mark.parametrize(("method", "expected"), [("fork", False), ("spawn", True)])
def test_a_forked_engine_process_is_told_from_a_spawned_one(method: str, expected: bool) -> None:
    ctx: Any = multiprocessing.get_context(method)
    started, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=wait_until_released, args=(started, release))
    child.start()
    try:
        assert started.wait(60.0)
        assert child.pid is not None
        assert spawned(psutil.Process(child.pid), os.getpid()) is expected
    finally:
        release.set()
        child.join(60.0)


def fake_nvml(monkeypatch: pytest.MonkeyPatch, count: int | None) -> None:
    """pynvml as the host has it: ``count`` GPUs, or None: its library finds no driver."""

    def init() -> None:
        if count is None:
            raise OSError("NVML Shared Library Not Found")

    monkeypatch.setitem(
        sys.modules, "pynvml", SimpleNamespace(nvmlInit=init, nvmlDeviceGetCount=lambda: count)
    )


@pytest.mark.parametrize(
    ("count", "visible", "expected"), [(None, None, None), (4, None, 4), (4, "1,3", 2), (8, "0", 1)]
)
def test_the_gpus_counted_are_those_the_engine_may_use(
    monkeypatch: pytest.MonkeyPatch, count: int | None, visible: str | None, expected: int | None
) -> None:
    fake_nvml(monkeypatch, count)
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpus(environ) == expected


GPU_CHECK_NAMES = {
    "memory_restart_co_tenant",
    "guard_at_util_0_97",
    "parity_with_vllm_serve",
    "tp2_dp2_restarts",
}


def test_without_a_gpu_every_gpu_check_is_skipped_with_the_reason() -> None:
    on_cpu = skipped(None)
    assert {c.name for c in on_cpu} == GPU_CHECK_NAMES
    assert {c.status for c in on_cpu} == {SKIP}
    assert all("NVML found none" in c.detail for c in on_cpu)


def test_with_one_gpu_only_tp2_and_dp2_are_skipped() -> None:
    (tp_dp,) = skipped(1)
    assert tp_dp.name == "tp2_dp2_restarts" and "needs 2 GPUs, 1 visible" in tp_dp.detail
    assert skipped(2) == []


def state(
    generation: int, reason: str | None = None, util: float = 0.9, restarting: bool = False
) -> dict[str, Any]:
    """A ``/state`` answer, the parts the checks read."""
    last = None if reason is None else {"reason": reason, "duration_s": 30.0}
    return {
        "engine": {"generation": generation, "gpu_memory_utilization": util},
        "guard": {"restarting": restarting, "unavailable_reason": None, "last_restart": last},
    }


@pytest.mark.parametrize(
    ("after", "completion", "status"),
    [
        (state(3, "gpu_memory_low", 0.81), 200, PASS),
        (state(3, "cuda_oom", 0.81), 200, PASS),  # the engine ran out before the guard's readings did
        (state(2, "config_reload"), 200, FAIL),  # no restart while the co-tenant held the memory
        (state(3, "engine_died"), 200, FAIL),  # a restart, but not for memory
        (state(3, "gpu_memory_low", 0.81), 503, FAIL),  # restarted, serves nothing after
    ],
)
def test_a_co_tenants_allocation_must_bring_a_memory_restart_and_a_served_request(
    after: dict[str, Any], completion: int, status: str
) -> None:
    check = judge_memory_restart(state(2, "config_reload"), after, completion)
    assert check.status == status
    assert check.figures["util_before"] == 0.9


SERVED = {"ok": 256, "failed": 0, "throughput_tok_s": 1000.0}


@pytest.mark.parametrize(
    ("after", "load", "status"),
    [
        (state(1), SERVED, PASS),
        (state(2, "gpu_memory_low", 0.87), SERVED, FAIL),  # the guard tripped on vLLM's own reservation
        (state(1), {**SERVED, "ok": 250, "failed": 6}, FAIL),
    ],
)
def test_the_guard_at_util_0_97_must_not_restart_under_load(
    after: dict[str, Any], load: dict[str, Any], status: str
) -> None:
    assert judge_high_util(state(1), after, load).status == status


@pytest.mark.parametrize(
    ("daemon_tok_s", "status"), [(1000.0, PASS), (960.0, PASS), (949.0, FAIL), (1200.0, PASS)]
)
def test_parity_is_within_5_percent_of_vllm_serve(daemon_tok_s: float, status: str) -> None:
    check = judge_parity({**SERVED, "throughput_tok_s": daemon_tok_s}, SERVED)
    assert check.status == status
    assert check.figures["ratio"] == round(daemon_tok_s / 1000.0, 3)


def test_parity_fails_where_either_load_failed() -> None:
    assert judge_parity(SERVED, {**SERVED, "failed": 1}).status == FAIL


def test_tp2_and_dp2_pass_only_together() -> None:
    survived = Check("restart_survived", PASS, "new engine in 40 s")
    exited = Check("restart_survived", FAIL, "the daemon exited during the restart")
    assert judge_parallel_restarts({"tp2": survived, "dp2": survived}).status == PASS
    both = judge_parallel_restarts({"tp2": survived, "dp2": exited})
    assert both.status == FAIL and both.figures["dp2"]["status"] == FAIL


def test_any_failed_check_fails_the_command() -> None:
    passed = [Check("engine_path", PASS, "spawned"), *skipped(None)]
    assert verdict(passed) == 0
    assert verdict([*passed, Check("restart_survived", FAIL, "the daemon exited")]) == 1
    assert table(passed).splitlines()[2] == "| engine_path | pass | spawned |"
