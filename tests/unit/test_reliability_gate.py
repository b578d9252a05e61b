"""Reliability of the admission gate and the governed client under refusals, many-prompt requests,
retired engines and reused request ids (issue "Never less reliable"). Fakes only, no engine."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock

ONE_CLASS = (PriorityClass("all", max_queue=100_000, queue_deadline_s=1e6),)


def _depth(exc: BaseException) -> int:
    tb, depth = exc.__traceback__, 0
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


async def test_a_thousand_refusals_leave_no_growing_traceback() -> None:
    """A refusing gate (restart budget spent, shutdown) raises a fresh exception per request: a
    shared instance re-raised would grow its traceback by a frame or two per raise, without bound."""
    gate = AdmissionGate(1, 100, ONE_CLASS, clock=FakeClock())
    error = GateRejected("the engine is unavailable", 503, 60, "engine_unavailable")
    gate.refuse_all(error)
    caught: list[GateRejected] = []
    for _ in range(1000):
        with pytest.raises(GateRejected) as info:
            gate.check_admission(0)
        caught.append(info.value)
        with pytest.raises(GateRejected) as info:
            await gate.acquire(0, from_pending=False)
        caught.append(info.value)
    assert error.__traceback__ is None
    assert max(_depth(exc) for exc in caught) <= 3
    assert len({id(exc) for exc in caught}) == len(caught)  # never the same instance twice
    assert {(e.status, e.reason, e.retry_after_s) for e in caught} == {(503, "engine_unavailable", 60)}


async def test_queued_waiters_refused_together_each_get_their_own_exception() -> None:
    gate = AdmissionGate(1, 100, ONE_CLASS, clock=FakeClock())
    held = await gate.acquire(0)
    waiters = [asyncio.create_task(gate.acquire(0)) for _ in range(50)]
    await asyncio.sleep(0)
    gate.refuse_all(GateRejected("the engine is unavailable", 503, 60, "engine_unavailable"))
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, GateRejected) for r in results)
    assert len({id(r) for r in results}) == 50
    assert max(_depth(r) for r in results if isinstance(r, BaseException)) <= 3
    gate.release(held)
