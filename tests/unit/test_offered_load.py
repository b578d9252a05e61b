"""The capacity meter's offered load over the real gate: each request counts once when it reaches
admission, so queued clients that leave do not read negative, and one request refused for its
``n`` reads one arrival."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock
from controller.control.capacity import CapacityMeter
from controller.control.telemetry import TelemetryWindow
from tests.helpers import settle

ONE_CLASS = (PriorityClass("all", max_queue=1000, queue_deadline_s=1e6),)


def meter_of(gate: AdmissionGate, clock: FakeClock) -> CapacityMeter:
    return CapacityMeter(TelemetryWindow(10.0, clock), gate)


async def test_queued_clients_that_leave_are_not_negative_arrivals() -> None:
    clock = FakeClock()
    gate = AdmissionGate(1, 1000, ONE_CLASS, clock=clock)
    held = await gate.acquire()
    waiting = []
    for _ in range(50):
        gate.check_admission()
        waiting.append(asyncio.create_task(gate.acquire()))
    await settle()
    meter = meter_of(gate, clock)
    assert meter._offered_rps(clock()) is None  # one tick: no rate yet
    for task in waiting:  # every client leaves while queued
        task.cancel()
    await settle()
    clock.advance(1.0)
    assert meter._offered_rps(clock()) == 0.0
    gate.release(held)


def test_one_request_refused_for_its_n_is_one_arrival() -> None:
    clock = FakeClock()
    gate = AdmissionGate(1, 4, ONE_CLASS, clock=clock)
    meter = meter_of(gate, clock)
    meter._offered_rps(clock())
    gate.check_admission(0, 1)  # the free slot's place
    with pytest.raises(GateRejected):
        gate.check_admission(0, 5)  # 5 sequences behind it: past the queue limit of 4
    clock.advance(1.0)
    assert meter._offered_rps(clock()) == 2.0
