"""The gate's TTFT bounds under SLO steering (controller/admission/ttft.py): queue deadlines cut to a
share of each class's TTFT bound, and early refusal by predicted TTFT (expected wait + own prefill)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.ttft import NO_BOUNDS, TtftBounds
from controller.clock import FakeClock
from controller.control.build import ttft_for
from controller.control.stepcost import CostPrior, CostReader, StepCostModel
from controller.control.steps import EngineStep
from policies.base import build_policy
from policies.slo import SloBound, SloTargets

ROOMY = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=5.0)
BATCH = PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=60.0)


class Prefill:
    """1 ms per 10 prompt tokens."""

    def prefill_s(self, prompt_tokens: int) -> float:
        return prompt_tokens * 1e-4


async def gate_at_rate(per_s: float) -> tuple[AdmissionGate, FakeClock]:
    """A gate of limit 1 with ``per_s`` completions measured and its one slot held."""
    clock = FakeClock()
    gate = AdmissionGate(1, 1000, (ROOMY, BATCH), clock=clock)
    for _ in range(round(10 * per_s)):
        gate.release(await gate.acquire(0, from_pending=False))
        clock.advance(1.0 / per_s)
    await gate.acquire(0, from_pending=False)
    return gate, clock


def test_bounds_cut_the_deadlines_to_the_share_of_the_ttft_bound() -> None:
    ttft = TtftBounds({"interactive": 1.0, "batch": 90.0}, wait_share=0.8)
    assert [c.queue_deadline_s for c in ttft.bounded((ROOMY, BATCH))] == [0.8, 60.0]
    assert NO_BOUNDS.bounded((ROOMY,)) == [ROOMY]
    gate = AdmissionGate(1, 10, (ROOMY, BATCH))
    gate.set_ttft(ttft)
    assert [c.queue_deadline_s for c in gate.classes] == [0.8, 60.0]
    gate.configure((ROOMY, BATCH), 0.0, 10)  # a reload keeps the bounds
    assert [c.queue_deadline_s for c in gate.classes] == [0.8, 60.0]
    gate.set_ttft(NO_BOUNDS)
    assert [c.queue_deadline_s for c in gate.classes] == [5.0, 60.0]


async def test_the_own_prefill_counts_in_the_predicted_ttft() -> None:
    gate, _ = await gate_at_rate(10.0)
    gate.set_ttft(TtftBounds({"interactive": 1.0}, Prefill(), wait_share=0.8))
    for _ in range(5):  # positions 1..5: 0.1 .. 0.5 s of wait
        gate.check_admission(0, prompt_tokens=2000)  # + 0.2 s prefill: at most 0.7 s <= 0.8 s
    gate.check_admission(0)  # position 6: 0.6 s, no prompt length known: no prefill term
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, prompt_tokens=2500)  # position 7: 0.7 s + 0.25 s > 0.8 s
    assert (exc.value.status, exc.value.reason) == (429, "expected_wait")
    assert (
        "expected wait 0.7s + prefill 0.25s exceeds the interactive queue deadline of 0.8s"
        in exc.value.message
    )
    gate.check_admission(0, prompt_tokens=500)  # 0.7 s + 0.05 s: within
    assert gate.stats().pending == 7


async def test_a_queue_behind_long_requests_is_predicted_at_their_pace_not_the_arrivals() -> None:
    """At light load the completions of the last 10 s follow the arrivals (one each 2 s here), not
    what the engine can serve: two requests that each hold their slot 1 s free a slot every 0.5 s."""
    clock = FakeClock()
    gate = AdmissionGate(2, 100, (dataclasses.replace(ROOMY, queue_deadline_s=1.5),), clock=clock)
    for _ in range(6):
        slot = await gate.acquire(0, from_pending=False)
        clock.advance(1.0)
        gate.release(slot)
        clock.advance(1.0)
    assert gate.completion_rate() == pytest.approx(5 / 9)  # completions at 3, 5, .., 11 s; now 12 s
    for _ in range(2):
        await gate.acquire(0, from_pending=False)
    assert gate.service_rate() == pytest.approx(2.0)  # 2 in flight / 1 s held
    gate.check_admission(0)  # position 1: 0.5 s (the completion rate alone: 1.8 s > 1.5 s)
    gate.check_admission(0)  # position 2: 1.0 s
    gate.check_admission(0)  # position 3: 1.5 s
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0)  # position 4: 2.0 s
    assert "expected wait 2.0s exceeds" in exc.value.message
    assert exc.value.retry_after_s == 1  # one request past the deadline drains in 0.5 s


async def test_a_queued_request_past_its_share_of_the_bound_gets_429() -> None:
    gate, clock = await gate_at_rate(10.0)
    gate.set_ttft(TtftBounds({"interactive": 1.0}, wait_share=0.8))
    waiter = asyncio.ensure_future(gate.acquire(0, from_pending=False))
    await asyncio.sleep(0)
    clock.advance(0.79)
    assert gate.expire_overdue() == 0
    clock.advance(0.02)
    assert gate.expire_overdue() == 1
    with pytest.raises(GateRejected) as exc:
        await waiter
    assert (exc.value.status, exc.value.reason) == (429, "deadline")


def test_only_a_policy_that_steers_to_the_slo_bounds_the_gate() -> None:
    slo = SloTargets(
        SloBound(2.0, 0.05), (("interactive", SloBound(1.0, 0.05)), ("batch", SloBound(2.0, 0.05)))
    )
    steering = build_policy("slo", {"ttft_wait_share": 0.5}, max_num_seqs=64, initial_limit=64, slo=slo)
    static = build_policy("static", {}, max_num_seqs=64, initial_limit=64, slo=slo)
    bounds = ttft_for(steering, slo, (ROOMY, BATCH), Prefill())
    assert (dict(bounds.bounds), bounds.wait_share) == ({"interactive": 1.0, "batch": 2.0}, 0.5)
    assert ttft_for(static, slo, (ROOMY, BATCH), Prefill()) is NO_BOUNDS
    assert ttft_for(steering, None, (ROOMY, BATCH), Prefill()) is NO_BOUNDS


def test_the_cost_models_prefill_term_waits_for_its_samples() -> None:
    model = StepCostModel()
    reader = CostReader(model, lambda: 0.0)
    assert reader.prefill_s(1000) == 0.0  # no fit: no guess refuses anyone
    steps = [EngineStep(i * 0.01, p, 4, 4000, 0.002 + 1e-5 * p) for i, p in enumerate([100, 200, 400] * 30)]
    model.update(steps)
    assert reader.prefill_s(1000) == pytest.approx(0.002 + 1e-5 * 1000, rel=0.05)


def test_beside_decoding_streams_a_prompt_is_predicted_in_budget_sized_chunks() -> None:
    """The engine gives a prompt ``T - D`` tokens a step beside ``D`` decodes, and each step pays the
    base and the decodes again: on a CPU (75 ms a step) that, not the prefill, is most of a long
    prompt's time under a small budget."""
    model = StepCostModel(prior=CostPrior((0.074, 0.008, 0.0075, 0.0), name="cpu"))
    budget = [20]
    reader = CostReader(model, lambda: 0.0, lambda: budget[0])
    model.update([EngineStep(0.0, 0, 4, 400, 0.104)])  # four streams decode
    a, b, c, _ = model.coefficients
    assert reader.prefill_s(100) == pytest.approx(7 * (a + 4 * c) + 100 * b)  # ceil(100 / 16) steps
    budget[0] = 2048
    assert reader.prefill_s(100) == pytest.approx(a + 4 * c + 100 * b)  # one chunk
    model.update([EngineStep(0.1, 100, 0, 100, 0.874)])  # nothing decodes: the prompt alone
    a, b, c, _ = model.coefficients
    assert reader.prefill_s(100) == pytest.approx(a + 100 * b)


async def test_the_daemon_bounds_its_gate_under_slo_and_a_reload_lifts_it(tmp_path: Path) -> None:
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts
    from controller.lifecycle.reload import Reloader
    from tests.helpers import write_config

    slo = {"ttft_s": 1.0, "tpot_s": 0.05}
    path = write_config(tmp_path / "config.toml", control={"policy": "slo"}, slo=slo)
    parts = build_parts(load_config(path))
    deadlines = {c.name: c.queue_deadline_s for c in parts.gate.classes}
    assert deadlines["interactive"] == pytest.approx(0.8) and deadlines["batch"] == pytest.approx(0.8)
    ports = {"server": {"port": parts.config.server.port}, "admin": {"port": parts.config.admin.port}}
    write_config(path, **ports, control={"policy": "static"}, slo=slo)
    assert (await Reloader(parts)._reload())["ok"]
    assert {c.name: c.queue_deadline_s for c in parts.gate.classes} == {"interactive": 5.0, "batch": 60.0}
