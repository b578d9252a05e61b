"""A gateway's per-request objectives (controller/engine/frontend/objectives.py): a TTFT header only
tightens the request's class's bound in the gate (early refusal and queue deadline), a malformed one
is answered 400 before the gate, a TPOT header is checked and kept, and a refusal names its reason in
our header and llm-d's."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityBounds, PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock
from controller.engine.frontend import context
from controller.engine.frontend.objectives import from_headers, refusal_headers
from tests.unit.test_admission_middleware import make_app, make_gate

INTERACTIVE = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=5.0)
BATCH = PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=60.0)


def raw(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]


async def gate_at_rate(per_s: float) -> tuple[AdmissionGate, FakeClock]:
    """A gate of limit 1 with ``per_s`` completions measured and its one slot held."""
    clock = FakeClock()
    gate = AdmissionGate(1, 1000, (INTERACTIVE, BATCH), clock=clock)
    for _ in range(round(10 * per_s)):
        gate.release(await gate.acquire(0, from_pending=False))
        clock.advance(1.0 / per_s)
    await gate.acquire(0, from_pending=False)
    return gate, clock


# -- the headers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["x-autopilot-ttft-ms", "X-Autopilot-TTFT-Ms", "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"]
)
def test_each_ttft_header_name_is_read_in_milliseconds(name: str) -> None:
    assert from_headers([(name.encode(), b"250")]).ttft_s == 0.25


def test_the_tightest_of_several_ttft_headers_holds_and_tpot_is_kept() -> None:
    asks = from_headers(raw(x_slo_ttft_ms="900", x_llm_d_slo_ttft_ms="400.5", x_llm_d_slo_tpot_ms="50"))
    assert (asks.ttft_s, asks.tpot_s, asks.error) == (0.4005, 0.05, None)
    assert from_headers(raw(x_autopilot_ttft_ms="0", x_slo_tpot_ms=" ")) == from_headers([])  # none asked
    request = context.for_request(raw(x_autopilot_tpot_ms="20"), PriorityBounds())
    assert (request.objectives.ttft_s, request.objectives.tpot_s) == (None, 0.02)


@pytest.mark.parametrize("value", ["fast", "-5", "1e3", "nan", "inf", "500ms", "0x10", "1_000", "9" * 400])
def test_a_value_that_is_not_milliseconds_is_an_error_naming_its_header(value: str) -> None:
    asks = from_headers(raw(x_autopilot_ttft_ms="500", x_llm_d_slo_tpot_ms=value))
    assert asks.error is not None and asks.error.header == "x-llm-d-slo-tpot-ms"
    assert asks.ttft_s is None  # nothing of a refused request reaches the gate


def test_a_refusal_names_the_gates_reason_and_llm_ds() -> None:
    assert refusal_headers("deadline") == [
        (b"x-autopilot-refusal", b"deadline"),
        (b"x-llm-d-request-dropped-reason", b"rejected-ttl-expired"),
    ]
    assert (
        dict(refusal_headers("engine_unavailable"))[b"x-llm-d-request-dropped-reason"]
        == b"rejected-no-endpoints"
    )
    assert refusal_headers(None) == []


# -- the gate -------------------------------------------------------------------------------------


async def test_a_tighter_header_refuses_a_request_its_class_would_queue() -> None:
    gate, _ = await gate_at_rate(10.0)
    for _ in range(3):  # positions 1..3: 0.1 .. 0.3 s of expected wait, within 0.35 s
        gate.check_admission(0, ttft_bound_s=0.35)
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, ttft_bound_s=0.35)  # position 4: 0.4 s
    assert (exc.value.status, exc.value.reason) == (429, "expected_wait")
    assert "queue deadline of 0.35s (its own TTFT bound of 0.35s)" in exc.value.message
    gate.check_admission(0)  # the class's own 5 s deadline queues it
    assert gate.stats().pending == 4


async def test_a_header_looser_than_the_class_bound_changes_nothing() -> None:
    gate, _ = await gate_at_rate(10.0)
    gate.set_ttft(TtftBounds({"interactive": 1.0}, wait_share=0.75))
    assert gate.ttft.bound_s("interactive", 30.0) == 1.0
    for _ in range(7):  # up to 0.75 s, the class's share of its 1 s bound
        gate.check_admission(0, ttft_bound_s=30.0)
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, ttft_bound_s=30.0)
    assert "queue deadline of 0.75s; retry later" in exc.value.message  # the class's, not the header's


async def test_under_a_class_bound_the_header_takes_the_same_share_of_its_own() -> None:
    gate, _ = await gate_at_rate(10.0)
    gate.set_ttft(TtftBounds({"interactive": 1.0}, wait_share=0.75))
    assert gate.ttft.bound_s("interactive", 0.5) == 0.5
    assert gate.ttft.queue_deadline_s(gate.classes[0], 0.5) == 0.375
    for _ in range(3):
        gate.check_admission(0, ttft_bound_s=0.5)
    with pytest.raises(GateRejected):
        gate.check_admission(0, ttft_bound_s=0.5)  # 0.4 s of wait > 0.75 x 0.5 s


async def test_a_queued_request_expires_at_its_own_bound_counted_from_its_arrival() -> None:
    gate, clock = await gate_at_rate(10.0)
    arrived = clock() - 0.1
    bound = asyncio.ensure_future(gate.acquire(0, arrived_mono=arrived, ttft_bound_s=0.3))
    unbound = asyncio.ensure_future(gate.acquire(0, arrived_mono=arrived))
    await asyncio.sleep(0)
    clock.advance(0.25)  # 0.35 s since it arrived, 0.25 s in the queue
    assert gate.expire_overdue() == 1
    with pytest.raises(GateRejected) as exc:
        await bound
    assert (exc.value.status, exc.value.reason) == (429, "deadline")
    assert "interactive deadline of 0.3s since it reached the server" in exc.value.message
    assert "(its own TTFT bound of 0.3s)" in exc.value.message
    assert not unbound.done()  # the class's 5 s deadline, counted from its enqueue
    unbound.cancel()


# -- through the data plane ------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["x-autopilot-ttft-ms", "x-llm-d-slo-tpot-ms"])
async def test_a_malformed_header_is_answered_400_before_the_gate(header: str) -> None:
    gate, events = make_gate()
    async with make_app(gate) as http:
        r = await http.post("/v1/completions", json={}, headers={header: "soon"})
    assert r.status_code == 400 and r.json()["param"] == header
    assert "'soon' is not a number of milliseconds" in r.json()["error"]
    assert gate.stats().arrivals_total == 0 and events.rejected == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_header_bound_refuses_in_the_queue_and_the_answer_names_why(stream: bool) -> None:
    gate, events = make_gate()  # interactive: 5 s queue deadline
    held = await gate.acquire(0)
    async with make_app(gate) as http:
        body = {"priority": 0, "stream": stream}
        r = await http.post("/v1/completions", json=body, headers={"x-llm-d-slo-ttft-ms": "50"})
    error = r.json()["error"]["message"] if stream else r.json()["error"]  # vLLM's body for a stream
    assert r.status_code == 429 and "its own TTFT bound of 0.05s" in error
    assert r.headers["x-autopilot-refusal"] == "deadline"
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert int(r.headers["retry-after"]) >= 1
    assert [cls for cls, _ in events.timed_out] == ["interactive"]
    gate.release(held)


async def test_an_early_refusal_names_why_and_a_served_request_names_nothing() -> None:
    gate, events = make_gate()
    async with make_app(gate) as http:
        served = await http.post("/v1/completions", json={}, headers={"x-slo-ttft-ms": "50"})
        held = await gate.acquire(0)  # the only slot is busy: batch (max_queue 0) cannot wait
        refused = await http.post("/v1/completions", json={"priority": 3})
    assert served.status_code == 200 and "x-autopilot-refusal" not in served.headers
    assert refused.status_code == 429
    assert refused.headers["x-autopilot-refusal"] == "queue_full" == events.rejected[0][1]
    assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    gate.release(held)
