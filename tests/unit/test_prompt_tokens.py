"""The prompt length admission sees (client.py ``_prompt_len``): read off the input vLLM has already
rendered when it calls ``generate()``, so a prompt is tokenized once, by vLLM, even when the gate
refuses it; under SLO steering it adds the request's own prefill to its predicted TTFT."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import Admission, AdmissionGate, Call
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock
from controller.engine.frontend import context
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from tests.helpers import FakeHost


class SlowPrefill:
    def prefill_s(self, prompt_tokens: int, uncached: int | None = None) -> float:
        return 0.1 * (prompt_tokens if uncached is None else uncached)

    def uncached_tokens(self, prompt_tokens: int) -> int:
        return prompt_tokens

    def backlog_s(self) -> float:
        return 0.0


def client_of(gate: AdmissionGate) -> GovernedEngineClient:
    llm = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=False))
    return GovernedEngineClient(FakeHost(llm), gate, lambda: None)  # type: ignore[arg-type]


def call(client: GovernedEngineClient, request: context.RequestContext, prompt: Any) -> Call:
    """One ``generate()`` call of ``request`` as vLLM's handler makes it (never iterated here, and
    the request still open: its call holds its place)."""
    return admitted(client, request, prompt).calls[-1]


def admitted(client: GovernedEngineClient, request: context.RequestContext, prompt: Any) -> Admission:
    """The ``Admission`` of ``request`` after its ``generate()`` call (or its refusal)."""
    admission = client.gate.enter(request.arrived_mono, request.objectives.ttft_s, request.request_id)
    tokens = context.current.set(request), context.admission.set(admission)
    try:
        client.generate(prompt, SimpleNamespace(n=1), "id")
    finally:
        context.current.reset(tokens[0])
        context.admission.reset(tokens[1])
    return admission


def rendered(tokens: int) -> dict[str, Any]:
    """A decoder-only input as vLLM's renderer hands it to ``generate()``."""
    return {"type": "token", "prompt_token_ids": list(range(tokens))}


async def test_a_long_prompt_is_refused_by_its_predicted_ttft_and_a_short_one_waits() -> None:
    """Without its length the long prompt would queue: its wait alone (0.5 s) is within the 2 s
    bound; its own prefill (4 s) is not."""
    clock = FakeClock()
    interactive = PriorityClass("interactive", max_priority=0, max_queue=10, queue_deadline_s=30.0)
    gate = AdmissionGate(1, 100, (interactive,), clock=clock)
    for _ in range(20):  # 2 completions a second measured
        gate.release(await gate.acquire(0))
        clock.advance(0.5)
    held = await gate.acquire(0)  # the one slot is busy: a new request queues
    gate.configure(ttft=TtftBounds({"interactive": 2.0}, SlowPrefill()))
    client = client_of(gate)
    long, short = context.RequestContext(arrived_mono=clock()), context.RequestContext(arrived_mono=clock())
    with pytest.raises(GateRefusal) as refused:
        call(client, long, rendered(40))
    assert "expected wait 0.5s + 4.00s to its first token" in str(refused.value.message)
    assert long.refusal is not None and long.refusal.status == 429 and gate.stats().pending == 0
    assert call(client, short, rendered(2)).prompt_tokens == 2
    assert gate.stats().pending == 1
    gate.release(held)


async def test_without_slo_steering_no_length_is_read() -> None:
    """The prefill term is SLO steering's alone."""
    gate = AdmissionGate(1, 100, (PriorityClass("interactive", max_priority=0),))
    client = client_of(gate)
    assert call(client, context.RequestContext(), rendered(3)).prompt_tokens is None
    gate.configure(ttft=TtftBounds({"interactive": 2.0}, SlowPrefill()))
    assert call(client, context.RequestContext(), rendered(3)).prompt_tokens == 3


async def test_an_input_without_token_ids_has_no_prefill_term() -> None:
    gate = AdmissionGate(1, 100, (PriorityClass("interactive", max_priority=0),))
    gate.configure(ttft=TtftBounds({"interactive": 2.0}, SlowPrefill()))
    client = client_of(gate)
    assert call(client, context.RequestContext(), {"prompt": "raw text"}).prompt_tokens is None
    assert call(client, context.RequestContext(), "raw text").prompt_tokens is None
