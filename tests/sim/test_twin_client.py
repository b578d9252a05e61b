"""The twin's requests pass the daemon's own engine client (``engine/frontend/client.py``) over the
twin's virtual vLLM (``sim/llm.py``): the client's admission rules, its slot and its part of the
outcome ledger show in the twin with no code of the twin's own."""

from __future__ import annotations

import asyncio

import pytest

from controller.config.load import AdmissionConfig, ControlConfig
from controller.load.workload import RequestSpec
from controller.results.records import RequestRecord
from controller.sim import run
from controller.sim.llm import SimParams
from controller.sim.run import Simulation
from controller.sim.twin import build_simulation
from tests.sim.scenarios import PROFILE


def _twin(limit: int, max_queue: int = 1024) -> Simulation:
    admission = AdmissionConfig(limit=limit, max_queue=max_queue)
    return build_simulation(PROFILE, ControlConfig(policy="static", warmup_s=0.0), admission)


def _at_once(count: int, prompt_tokens: int = 200) -> list[RequestSpec]:
    return [RequestSpec(k, 0.0, prompt_tokens, 200) for k in range(count)]


def _records(sim: Simulation, specs: list[RequestSpec]) -> list[RequestRecord]:
    return asyncio.run(sim.run(specs)).records


@pytest.mark.parametrize("n", [1, 2])
def test_a_request_of_n_sequences_holds_n_of_the_limit(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The twin's handler only passes ``n`` (vLLM's sampling parameter); the client weighs the slot by
    it: under a limit of 2, requests of two sequences run one at a time, of one two at a time."""
    monkeypatch.setattr(run, "SimParams", lambda max_tokens: SimParams(max_tokens, n=n))
    sim = _twin(limit=2)
    first, second, third = _records(sim, _at_once(3))
    assert [r.status for r in (first, second, third)] == ["ok"] * 3
    assert first.output_tokens == 200 * n  # every sequence ran in the engine
    assert second.ttft_s is not None and first.e2e_s is not None
    if n == 2:  # the second got its slot only when the first ended
        assert second.ttft_s > first.e2e_s
    else:
        assert second.ttft_s < first.e2e_s
    assert sim.outcomes.served_total == 3 * n  # vLLM's stats end each sequence; the ledger judges each


def test_the_gates_refusals_are_counted_once_in_the_twins_ledger() -> None:
    """A refusal is the gate's event, counted by the ledger the daemon's way (``GateOutcomes``), and
    every request served is the virtual vLLM's stat logger's to report."""
    sim = _twin(limit=1, max_queue=2)
    records = _records(sim, _at_once(6))
    refused = [r for r in records if r.status == "refused"]
    assert [r.http_status for r in refused] == [429] * 3  # one runs, two wait
    assert sim.outcomes.refused_total == len(refused)
    assert sim.outcomes.served_total == sum(r.status == "ok" for r in records) == 3


def test_a_prompt_too_long_is_vllms_400_after_the_preflight() -> None:
    """vLLM renders the prompt (and answers 400 for one that does not fit ``max_model_len``) after its
    preflight, the gate's early check, has admitted it: no call follows, so it is no arrival (no
    demand), as in the daemon."""
    sim = _twin(limit=4)
    (record,) = _records(sim, _at_once(1, prompt_tokens=PROFILE.engine.max_model_len))
    assert (record.status, record.http_status) == ("failed", 400)
    assert sim.gate.stats().arrivals_total == 0 and sim.outcomes.served_total == 0


def test_the_twin_streams_its_first_token_to_the_engine_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``vllm bench serve``'s requests stream, the twin's give an output at their first token: the
    engine client tells the ledger (and the gate's TTFT check) then, not when the answer is done.
    With one output at the end, the TTFT check learned each residual 3-6 s late on the CPU profile."""
    sim = _twin(limit=4)
    told: list[tuple[str, float]] = []
    ledger_first_token = sim.outcomes.first_token

    def first_token(request_id: str, engine_ttft_s: float) -> None:
        told.append((request_id, sim.clock()))
        ledger_first_token(request_id, engine_ttft_s)

    monkeypatch.setattr(sim.outcomes, "first_token", first_token)
    specs = [RequestSpec(0, 0.0, 200, 200), RequestSpec(1, 0.0, 200, 1)]
    long, one = _records(sim, specs)
    assert long.ttft_s is not None and long.e2e_s is not None and one.ttft_s is not None
    when = dict(told)
    assert set(when) == {"0", "1"}  # once each: a one-token answer's first output is its last
    assert when["0"] == pytest.approx(long.ttft_s) and long.ttft_s < long.e2e_s / 10
    assert when["1"] == pytest.approx(one.ttft_s)
    assert sim.outcomes.awaiting_first_token()[1] == ()
