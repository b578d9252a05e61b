"""A gateway's per-request objectives (controller/engine/frontend/objectives.py): a TTFT header only
tightens the request's class's bound in the gate (early refusal and queue deadline) and in the
outcome ledger, a malformed one is answered 400 before the gate, a TPOT header is checked and kept,
a class header (ours or llm-d's) moves the request into that class within the priority bounds, and a
refusal names its reason in our header and llm-d's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from controller.admission.classes import PriorityBounds, PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock
from controller.control.outcomes import OutcomeLedger
from controller.engine.frontend import context
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.objectives import from_headers, refusal_headers
from controller.engine.frontend.priority import resolve_priorities
from policies.slo_targets import SloBound, SloTargets
from tests.helpers import FakeHost
from tests.unit import test_priority_bounds as bounds_app
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
        gate.release(await gate.acquire(0))
        clock.advance(1.0 / per_s)
    await gate.acquire(0)
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
    assert (exc.value.status, exc.value.reason) == (
        429,
        "own_ttft_bound",
    )  # its own bound refused it, not its class's
    assert "queue deadline of 0.35s (its own TTFT bound of 0.35s)" in exc.value.message
    gate.check_admission(0)  # the class's own 5 s deadline queues it
    assert gate.stats().pending == 4


async def test_a_header_looser_than_the_class_bound_changes_nothing() -> None:
    gate, _ = await gate_at_rate(10.0)
    gate.configure(ttft=TtftBounds({"interactive": 1.0}, wait_share=0.75))
    assert gate.ttft.bound_s("interactive", 30.0) == 1.0
    for _ in range(7):  # up to 0.75 s, the class's share of its 1 s bound
        gate.check_admission(0, ttft_bound_s=30.0)
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, ttft_bound_s=30.0)
    assert "queue deadline of 0.75s; retry later" in exc.value.message  # the class's, not the header's


async def test_under_a_class_bound_the_header_takes_the_same_share_of_its_own() -> None:
    gate, _ = await gate_at_rate(10.0)
    gate.configure(ttft=TtftBounds({"interactive": 1.0}, wait_share=0.75))
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


# -- the class by header ---------------------------------------------------------------------------

CLASSES = (INTERACTIVE, BATCH)


@pytest.mark.parametrize(
    "name",
    [
        "x-autopilot-class",
        "X-Autopilot-Class",
        "x-llm-d-inference-objective",
        "x-gateway-inference-objective",
    ],
)
def test_each_class_header_name_names_a_class_of_the_table(name: str) -> None:
    asks = from_headers([(name.encode(), b" Batch ")], CLASSES)
    assert (asks.cls, asks.cls_header, asks.error) == (BATCH, name.lower(), None)


def test_ours_decides_over_llm_ds_and_llm_ds_current_name_over_its_older() -> None:
    both = raw(x_gateway_inference_objective="interactive", x_llm_d_inference_objective="batch")
    assert from_headers(both, CLASSES).cls == BATCH
    assert from_headers([*both, *raw(x_autopilot_class="interactive")], CLASSES).cls == INTERACTIVE
    # llm-d reads its current name first, whatever its value: an unknown one there is not looked past
    unknown_first = raw(x_llm_d_inference_objective="food-review", x_gateway_inference_objective="batch")
    assert from_headers(unknown_first, CLASSES) == from_headers([])
    assert from_headers(raw(x_autopilot_class=" "), CLASSES) == from_headers([])  # empty: none named


def test_an_unknown_class_is_an_error_under_ours_and_ignored_under_llm_ds() -> None:
    ours = from_headers(raw(x_autopilot_class="gold", x_llm_d_inference_objective="batch"), CLASSES)
    assert ours.error is not None and ours.error.header == "x-autopilot-class"
    assert str(ours.error) == (
        "x-autopilot-class: 'gold' is not a class of this server; send one of: interactive, batch"
    )
    assert ours.cls is None
    llmd = from_headers(raw(x_llm_d_inference_objective="food-review", x_slo_ttft_ms="300"), CLASSES)
    assert (llmd.cls, llmd.cls_header, llmd.error, llmd.ttft_s) == (None, None, None, 0.3)


@pytest.mark.parametrize(
    ("cls", "asked", "most_urgent", "priority", "refused"),
    [
        (BATCH, 0, 0, 1, False),  # the nearest priority of batch's range
        (BATCH, 7, 0, 7, False),  # already in it: kept
        (INTERACTIVE, 5, 0, 0, False),
        (INTERACTIVE, -3, -10, -3, False),
        (BATCH, 1, 3, 3, False),  # most_urgent_priority 3 wins over batch's lower end
        (INTERACTIVE, 5, 1, 1, True),  # interactive lies wholly below most_urgent_priority 1
        (None, -7, -10, -7, False),  # no class: the priority as it is, within the bounds
    ],
)  # fmt: skip
def test_a_named_class_moves_the_priority_into_its_range_within_the_bounds(
    cls: PriorityClass | None, asked: int, most_urgent: int, priority: int, refused: bool
) -> None:
    asks = from_headers(raw(x_autopilot_class=cls.name) if cls else [], CLASSES)
    assert asks.within_class(asked, most_urgent) == priority
    assert (asks.class_refusal(most_urgent) is not None) == refused


@pytest.mark.parametrize(
    ("body", "headers", "priority", "cls"),
    [
        ({}, {"x-autopilot-class": "batch"}, 5, "batch"),  # the default, in batch's range
        ({}, {"x-autopilot-class": "interactive"}, 0, "interactive"),  # the default moved to 0
        ({"priority": 9}, {"x-llm-d-inference-objective": "interactive"}, 0, "interactive"),
        ({}, {"X-Vllm-Priority": "0", "x-gateway-inference-objective": "batch"}, 1, "batch"),
        ({"priority": 0}, {"x-llm-d-inference-objective": "food-review"}, 0, "interactive"),  # ignored
    ],
)
async def test_the_class_a_header_names_reaches_gate_and_engine_as_its_priority(
    body: dict[str, Any], headers: dict[str, str], priority: int, cls: str
) -> None:
    http, _, events = bounds_app.make_app(PriorityBounds(most_urgent=0, default=5))
    async with http:
        r = await http.post("/v1/completions", json=body, headers=headers)
    assert (r.status_code, r.json()) == (200, {"priority": [priority]})
    assert [c for c, _ in events.admitted] == [cls]


@pytest.mark.parametrize(
    ("headers", "most_urgent", "says"),
    [
        ({"x-autopilot-class": "gold"}, 0, "'gold' is not a class of this server; send one of: interactive"),
        ({"x-autopilot-class": "interactive"}, 1, "class 'interactive' runs at priorities up to 0, more"),
        ({"x-llm-d-inference-objective": "interactive"}, 1, "this server accepts (1 is the most urgent"),
    ],
)  # fmt: skip
async def test_an_unknown_class_of_ours_or_one_past_most_urgent_priority_is_answered_400_before_the_gate(
    headers: dict[str, str], most_urgent: int, says: str
) -> None:
    http, gate, events = bounds_app.make_app(PriorityBounds(most_urgent=most_urgent, default=5))
    async with http:
        r = await http.post("/v1/completions", json={}, headers=headers)
    assert r.status_code == 400 and r.json()["param"] == next(iter(headers))
    assert says in r.json()["error"]
    assert events.admitted == [] and events.rejected == [] and gate.stats().arrivals_total == 0


async def test_a_class_header_moves_a_request_into_that_class_whose_bound_its_ttft_header_tightens() -> None:
    gate, events = make_gate()  # interactive: 5 s deadline, 1 may queue; batch: none may queue
    held = await gate.acquire(0)
    async with make_app(gate) as http:
        headers = {"x-autopilot-class": "interactive", "x-llm-d-slo-ttft-ms": "50"}
        r = await http.post("/v1/completions", json={"priority": 3}, headers=headers)
    assert r.status_code == 429 and "its own TTFT bound of 0.05s" in r.json()["error"]
    assert r.headers["x-autopilot-refusal"] == "deadline"  # queued in interactive, not refused as batch
    assert [cls for cls, _ in events.timed_out] == ["interactive"] and events.rejected == []
    gate.release(held)


# -- the outcome ledger ----------------------------------------------------------------------------


class FirstTokenLLM:
    """An engine whose first output came 0.3 s after the request entered it (vLLM's own figure)."""

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        yield SimpleNamespace(metrics=SimpleNamespace(first_token_latency=0.3), finished=False)


class CountingServing(bounds_app.FakeServing):
    async def create_completion(self, request: Any, raw_request: Request | None = None) -> Any:
        if (error := await self._check_model(request)) is not None:
            return error
        self._preflight()
        return {"outputs": len([x async for x in self.client.generate("p", None, "id")])}


async def test_the_ledger_judges_a_request_by_its_own_ttft_bound_where_it_is_tighter() -> None:
    """interactive's [slo] TTFT bound is 1 s: a first token 0.3 s into the engine is good by it, and
    missed by a header's 200 ms; a header's looser 5 s changes nothing."""
    slo = SloTargets(SloBound(2.0, 0.1), (("interactive", SloBound(1.0, 0.05)),))
    ledger = OutcomeLedger(lambda cls, outcome: None, clock=FakeClock(), slo=lambda: slo)
    host = FakeHost(FirstTokenLLM())
    host.outcomes = ledger  # type: ignore[attr-defined]
    gate = AdmissionGate(4, 100, CLASSES)
    app = FastAPI()
    app.state.serving = CountingServing(GovernedEngineClient(host, gate, lambda: None))  # type: ignore[arg-type]
    resolve_priorities(app.state)

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        body = bounds_app.CompletionRequest.model_validate(await raw_request.json())
        return await app.state.serving.create_completion(body, raw_request)

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate))  # type: ignore[arg-type]
    outcomes = []
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for headers in ({}, {"x-llm-d-slo-ttft-ms": "200"}, {"x-autopilot-ttft-ms": "5000"}):
            assert (await http.post("/v1/completions", json={}, headers=headers)).status_code == 200
            outcomes.append(ledger.served("id", engine_ttft_s=9.0, tpot_s=0.04))  # 0.3 s judges, not 9
    assert outcomes == ["good", "ttft_missed", "good"]
