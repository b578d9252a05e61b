"""Each request's outcome against its class's SLO (controller/control/outcomes.py): good, ttft_missed,
tpot_missed from vLLM's finished-request figures plus the time before the engine; refused and failed
from the gate's refusals; counted in ``autopilot_requests_by_outcome_total`` and the window's goodput,
on a fake clock."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.admin.metrics import GateMetrics, Metrics
from controller.admission.gate import GateRejected
from controller.clock import FakeClock
from controller.control.outcomes import (
    GateOutcomes,
    OutcomeLedger,
    judged_bound,
    refusal_outcome,
    served_outcome,
)
from controller.control.steps import EngineStep, StepFeed, StepStats
from policies.slo_targets import SloBound, SloTargets
from tests.helpers import write_config

BOUND = SloBound(ttft_s=2.0, tpot_s=0.1)
SLO = SloTargets(BOUND, (("interactive", SloBound(1.0, 0.05)), ("batch", BOUND)))


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "outcome"),
    [(2.0, 0.1, "good"), (1.0, None, "good"), (2.01, 0.05, "ttft_missed"), (2.5, 0.5, "ttft_missed"),
     (0.5, 0.11, "tpot_missed")],
)  # fmt: skip
def test_a_served_request_is_judged_by_ttft_first_then_tpot(
    ttft_s: float, tpot_s: float | None, outcome: str
) -> None:
    assert served_outcome(ttft_s, tpot_s, BOUND) == outcome


def test_without_slo_every_served_request_is_good() -> None:
    assert served_outcome(100.0, 10.0, None) == "good"


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [("queue_full", "refused"), ("expected_wait", "refused"), ("shed", "refused"),
     ("shutting_down", "failed"), ("engine_unavailable", "failed"), ("restart_wait", "failed")],
)  # fmt: skip
def test_a_429_is_refused_and_a_503_failed(reason: str, outcome: str) -> None:
    assert refusal_outcome(reason) == outcome


def _ledger(
    clock: FakeClock, slo: Callable[[], SloTargets | None] = lambda: SLO
) -> tuple[OutcomeLedger, list[tuple[str, str]]]:
    counted: list[tuple[str, str]] = []
    ledger = OutcomeLedger(lambda cls, outcome: counted.append((cls, outcome)), 10.0, clock, slo)
    return ledger, counted


def test_the_time_before_the_engine_counts_toward_the_ttft() -> None:
    """interactive's bound is 1 s: 0.3 s in the engine is good alone, missed after 0.8 s queued."""
    ledger, counted = _ledger(FakeClock())
    ledger.started("a", "interactive", before_engine_s=0.1)
    ledger.started("b", "interactive", before_engine_s=0.8)
    ledger.started("c", "batch", before_engine_s=0.8)  # batch's bound is 2 s
    assert ledger.served("a", engine_ttft_s=0.3, tpot_s=0.04) == "good"
    assert ledger.served("b", engine_ttft_s=0.3, tpot_s=0.04) == "ttft_missed"
    assert ledger.served("c", engine_ttft_s=0.3, tpot_s=0.06) == "good"
    assert counted == [("interactive", "good"), ("interactive", "ttft_missed"), ("batch", "good")]
    assert (ledger.served_total, ledger.missed_total) == (3, 1)  # what steers the slo policy's margin
    assert ledger.queued_missed_total == 1  # b: 0.8 s of its 1.1 s before the engine
    ledger.started("d", "interactive", before_engine_s=0.4)
    assert ledger.served("d", engine_ttft_s=0.7, tpot_s=0.04) == "ttft_missed"
    assert (ledger.missed_total, ledger.queued_missed_total) == (2, 1)  # d: most of it in the engine


def test_the_first_token_the_engine_client_saw_judges_the_ttft() -> None:
    """vLLM's finished stats put the first token at ``e2e_latency - decode_time``, which carries the
    front end's backlog at the last output: the engine client's own first token judges instead."""
    ledger, counted = _ledger(FakeClock())
    ledger.started("a", "interactive", before_engine_s=0.1)
    ledger.first_token("a", 0.5)
    ledger.first_token("a", 3.0)  # a later output is not the first token
    assert ledger.served("a", engine_ttft_s=2.5, tpot_s=0.04) == "good"  # 0.1 + 0.5 s, not 0.1 + 2.5 s
    ledger.started("b", "interactive", before_engine_s=0.1)  # no first token seen (one output, at its end)
    assert ledger.served("b", engine_ttft_s=2.5, tpot_s=0.04) == "ttft_missed"
    ledger.first_token("never-started", 0.1)  # not a request of ours: nothing to judge
    assert counted == [("interactive", "good"), ("interactive", "ttft_missed")]
    assert (ledger.served_total, ledger.missed_total) == (2, 1)


def _firsts(t: float, n: int) -> EngineStep:
    """A step in which ``n`` requests got their first token (the stat logger's record)."""
    return EngineStep(t, stats=StepStats(4, 0, 0.1, 0, 4, (0.2,) * n, (), 0))


def test_the_prompts_awaiting_their_first_token_are_the_backlog_oldest_first() -> None:
    """The engine's steps say how many requests got a first token, not which: the oldest do (vLLM
    serves its queue in order), which holds where a client does not stream and the engine client
    learns its first token only at its end; a streaming client names its own."""
    clock = FakeClock()
    ledger, _ = _ledger(clock)
    assert ledger.awaiting_first_token() == (math.inf, ())
    ledger.started("a", "interactive", before_engine_s=0.5, prompt_tokens=100)
    clock.advance(1.0)
    ledger.started("b", "interactive", before_engine_s=0.0, prompt_tokens=200)
    clock.advance(0.25)
    ledger.started("c", "interactive", before_engine_s=0.2, prompt_tokens=300)
    ledger.started("d", "interactive", before_engine_s=0.0)  # no prompt length known: not counted
    clock.advance(0.25)
    assert ledger.awaiting_first_token() == (math.inf, ((1.5, 100), (0.5, 200), (0.25, 300)))
    ledger.on_steps([_firsts(1.5, 1)])  # one first token: the oldest's
    clock.advance(0.5)
    assert ledger.awaiting_first_token() == (0.5, ((1.0, 200), (0.75, 300)))
    ledger.first_token("a", 0.25)  # a's client does not stream: told at its end, 1.75 s ago
    assert ledger.awaiting_first_token() == (0.5, ((1.0, 200), (0.75, 300)))
    ledger.first_token("c", 0.5)  # c's client streams: its own, which came 0.25 s ago
    assert ledger.awaiting_first_token() == (0.25, ((1.0, 200),))
    ledger.on_steps([EngineStep.measured(2.0, 50, 4, 400, 0.01), _firsts(2.0, 3)])  # more than wait
    assert ledger.awaiting_first_token() == (0.0, ())
    ledger.started("e", "interactive", before_engine_s=0.0, prompt_tokens=400)
    ledger.served("a", engine_ttft_s=0.3, tpot_s=0.01)
    clock.advance(0.5)
    assert ledger.awaiting_first_token() == (0.5, ((0.5, 400),))


@pytest.mark.parametrize(
    ("cls_bound", "own_ttft_s", "judged"),
    [(SloBound(1.0, 0.05), 0.4, SloBound(0.4, 0.05)),  # a tighter header TTFT holds
     (SloBound(1.0, 0.05), 2.0, SloBound(1.0, 0.05)),  # a looser one changes nothing
     (SloBound(1.0, 0.05), None, SloBound(1.0, 0.05)),
     (None, 0.4, SloBound(0.4, math.inf)),  # no [slo]: its own TTFT alone, no TPOT bound
     (None, None, None)],
)  # fmt: skip
def test_a_request_is_judged_by_the_tighter_of_its_own_ttft_and_its_classs(
    cls_bound: SloBound | None, own_ttft_s: float | None, judged: SloBound | None
) -> None:
    assert judged_bound(cls_bound, own_ttft_s) == judged


def test_the_ledger_counts_a_miss_of_the_requests_own_ttft_bound() -> None:
    """interactive's bound is 1 s TTFT, 50 ms TPOT; the header's TPOT is not the ledger's to judge."""
    in_force: list[SloTargets | None] = [SLO]  # [slo] as the control core holds it
    ledger, counted = _ledger(FakeClock(), lambda: in_force[0])
    ledger.started("a", "interactive", before_engine_s=0.1, ttft_s=0.5)
    ledger.started("b", "interactive", before_engine_s=0.1)
    ledger.started("c", "interactive", before_engine_s=0.1, ttft_s=5.0)
    ledger.started("d", "interactive", before_engine_s=0.1, ttft_s=0.5)
    assert ledger.served("a", engine_ttft_s=0.6, tpot_s=0.04) == "ttft_missed"  # 0.7 s > its 0.5 s
    assert ledger.served("b", engine_ttft_s=0.6, tpot_s=0.04) == "good"  # 0.7 s within the class's 1 s
    assert ledger.served("c", engine_ttft_s=1.2, tpot_s=0.04) == "ttft_missed"  # 1.3 s: the class's 1 s holds
    assert ledger.served("d", engine_ttft_s=0.3, tpot_s=0.06) == "tpot_missed"  # the class's TPOT still holds
    assert counted == [("interactive", o) for o in ("ttft_missed", "good", "ttft_missed", "tpot_missed")]
    # "a" missed its own bound only: its outcome, not the loop's count (``test_own_bounds_steer_...``)
    assert (ledger.served_total, ledger.missed_total, ledger.queued_missed_total) == (4, 2, 0)
    in_force[0] = None  # without [slo] (a reload removed it), a request's own TTFT bound is its only one
    ledger.started("e", "batch", before_engine_s=0.0, ttft_s=0.2)
    ledger.started("f", "batch", before_engine_s=0.0, ttft_s=0.2)
    ledger.started("g", "batch", before_engine_s=0.0)
    assert ledger.served("e", engine_ttft_s=0.3, tpot_s=0.01) == "ttft_missed"
    assert ledger.served("f", engine_ttft_s=0.1, tpot_s=10.0) == "good"
    assert ledger.served("g", engine_ttft_s=30.0, tpot_s=10.0) == "good"


def test_each_of_n_sequences_ends_once_and_an_error_is_failed() -> None:
    ledger, counted = _ledger(FakeClock())
    ledger.started("a", "batch", before_engine_s=0.0, n=2)
    assert ledger.served("a", 0.1, 0.2) == "tpot_missed"
    assert ledger.served("a", 0.1, 0.05, error=True) == "failed"
    assert ledger.served("a", 0.1, 0.05) is None  # both sequences ended: a third is not this request
    assert counted == [("batch", "tpot_missed"), ("batch", "failed")]
    assert ledger.unmatched == 1
    assert (ledger.served_total, ledger.missed_total) == (1, 1)  # an engine error is not served


def test_a_request_never_started_is_unmatched_not_counted() -> None:
    ledger, counted = _ledger(FakeClock())
    assert ledger.served("unknown", 0.1, 0.01) is None
    assert counted == [] and ledger.unmatched == 1


def test_the_window_gives_goodput_and_attainment() -> None:
    clock = FakeClock(100.0)
    ledger, _counted = _ledger(clock)
    for i in range(6):  # 6 interactive requests over 6 s: 4 good, 2 late
        ledger.started(str(i), "interactive", before_engine_s=0.0 if i < 4 else 2.0)
        ledger.served(str(i), 0.2, 0.01)
        clock.advance(1.0)
    ledger.ended("batch", "refused")
    ledger.ended("batch", "failed")
    state = ledger.state()
    assert state["goodput_rps"] == 0.4 and state["attainment"] == 0.5  # 4 good / 10 s; 4 of 8
    assert state["by_class"]["interactive"] == {
        "good": 4, "ttft_missed": 2, "tpot_missed": 0, "refused": 0, "failed": 0,
    }  # fmt: skip
    assert state["by_class"]["batch"]["refused"] == 1 and state["by_class"]["batch"]["failed"] == 1
    clock.advance(7.0)  # now 113: the good ones (100-103) left the 10 s window, the rest (104-106) stay
    state = ledger.state()
    assert state["goodput_rps"] == 0.0 and state["attainment"] == 0.0
    clock.advance(10.0)
    assert ledger.state()["attainment"] is None and ledger.state()["by_class"] == {}


def _outcome(registry: CollectorRegistry, cls: str, outcome: str) -> float | None:
    labels = {"priority_class": cls, "outcome": outcome}
    return registry.get_sample_value("autopilot_requests_by_outcome_total", labels)


def test_the_gates_refusals_and_served_requests_are_counted_by_class_and_outcome() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    ledger = OutcomeLedger(metrics.count_outcome)
    events = GateOutcomes(ledger, GateMetrics(metrics))  # as ControlCore wires them
    events.rejected("batch", "queue_full")
    events.rejected("batch", "shed")
    events.timed_out("interactive", 5.0)
    events.rejected("interactive", "engine_unavailable")
    ledger.started("r1", "interactive", 0.2)
    ledger.served("r1", 0.3, None)
    assert _outcome(registry, "batch", "refused") == 2
    assert _outcome(registry, "interactive", "refused") == 1
    assert _outcome(registry, "interactive", "failed") == 1
    assert _outcome(registry, "interactive", "good") == 1  # no [slo] configured: served is good


def test_vllms_finished_request_stats_feed_the_ledger() -> None:
    """vLLM's own stats types in: the engine's TTFT is e2e latency less decode time, TPOT its mean
    time per output token (none below two tokens), an abort is failed."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from controller.engine.runtime.stats import stat_logger_factory

    ledger, counted = _ledger(FakeClock())
    for rid in ("late", "slow", "one", "gone"):
        ledger.started(rid, "interactive", before_engine_s=0.5)
    it = IterationStats()
    it.finished_requests = [
        # TTFT 0.5 + (1.4 - 0.8) = 1.1 s > 1 s
        FinishedRequestStats(FinishReason.LENGTH, "late", e2e_latency=1.4, decode_time=0.8,
                             num_generation_tokens=20, mean_time_per_output_token=0.8 / 19),
        # TTFT 0.5 + 0.3 = 0.8 s; TPOT 0.06 > 0.05
        FinishedRequestStats(FinishReason.STOP, "slow", e2e_latency=1.5, decode_time=1.2,
                             num_generation_tokens=21, mean_time_per_output_token=0.06),
        FinishedRequestStats(FinishReason.LENGTH, "one", e2e_latency=0.2, num_generation_tokens=1),
        FinishedRequestStats(FinishReason.ABORT, "gone", e2e_latency=0.2, num_generation_tokens=3),
    ]  # fmt: skip
    logger = stat_logger_factory(StepFeed(clock=FakeClock()), ledger)(None, 0)  # type: ignore[arg-type]
    logger.record(SchedulerStats(num_running_reqs=1), it)
    assert counted == [
        ("interactive", "ttft_missed"), ("interactive", "tpot_missed"), ("interactive", "good"),
        ("interactive", "failed"),
    ]  # fmt: skip


def test_state_shows_the_windows_outcomes(tmp_path: Path) -> None:
    """/state's ``outcomes`` block reads the daemon's ledger (loading a config imports vLLM)."""
    from controller.admin.status import state
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts

    parts = build_parts(load_config(write_config(tmp_path / "config.toml")))
    GateOutcomes(parts.outcomes).rejected("interactive", "queue_full")
    shown = state(parts)["outcomes"]
    assert shown["by_class"]["interactive"]["refused"] == 1 and shown["attainment"] == 0.0
    assert shown["goodput_rps"] == 0.0 and shown["unmatched"] == 0


def test_each_observation_carries_the_served_missed_and_refused_totals(tmp_path: Path) -> None:
    """The loop's observer reads the daemon's ledger: the slo policy steers its mean margin by them."""
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts

    path = write_config(tmp_path / "config.toml", slo={"ttft_s": 1.0, "tpot_s": 0.05})
    parts = build_parts(load_config(path))
    ledger = parts.outcomes
    for rid, tpot in (("a", 0.01), ("b", 0.2)):
        ledger.started(rid, "interactive", before_engine_s=0.0)
        ledger.served(rid, engine_ttft_s=0.1, tpot_s=tpot)
    events = GateOutcomes(ledger)  # the ledger's part of the gate's events
    events.rejected("batch", "queue_full")  # a 429
    events.rejected("batch", "engine_unavailable")  # a 503: not a refusal the margin could avoid
    seen = parts.observer.observe()
    assert (seen.served_total, seen.missed_total, seen.refused_total) == (2, 1, 1)
    # and each one's pace as a share of its class's TPOT bound, by when it was served
    assert seen.tpot_shares == (pytest.approx((1, 0.2)), pytest.approx((2, 4.0)))


def test_the_daemons_gate_counts_its_refusals_in_the_ledger_and_the_metrics(tmp_path: Path) -> None:
    """``ControlCore`` puts the ledger's ``GateOutcomes`` before the daemon's metrics on the gate: a
    refusal is counted once in each, by the gate itself."""
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts

    parts = build_parts(load_config(write_config(tmp_path / "config.toml")))
    parts.gate.refuse_new(GateRejected("no engine", 503, 1, "engine_unavailable"))
    with pytest.raises(GateRejected):
        parts.gate.check_admission(0)
    assert parts.outcomes.state()["by_class"]["interactive"]["failed"] == 1
    assert _outcome(parts.registry, "interactive", "failed") == 1


def test_own_bounds_steer_no_margin_misses_and_refusals_by_them_count_for_that_request_only() -> None:
    """The third review's finding 4: one client's ``x-autopilot-ttft-ms: 1`` judged its requests
    misses in ``missed_total``, and the slo policy cut every client's margin for them."""
    ledger, counted = _ledger(FakeClock())
    for i in range(10):
        ledger.started(f"h{i}", "interactive", before_engine_s=0.0, ttft_s=0.001)
        assert ledger.served(f"h{i}", engine_ttft_s=0.3, tpot_s=0.04) == "ttft_missed"  # its own 0.1 s floor
    ledger.started("late", "interactive", before_engine_s=0.0, ttft_s=0.001)
    assert ledger.served("late", engine_ttft_s=1.5, tpot_s=0.04) == "ttft_missed"  # the class's 1 s too
    ledger.started("fast", "interactive", before_engine_s=0.0, ttft_s=0.001)
    assert ledger.served("fast", engine_ttft_s=0.05, tpot_s=0.04) == "good"  # within the 0.1 s floor
    assert (ledger.served_total, ledger.missed_total) == (12, 1)
    events = GateOutcomes(ledger)
    events.rejected("interactive", "own_ttft_bound")
    events.rejected("interactive", "expected_wait")
    assert ledger.refused_total == 1
    assert counted[-2:] == [("interactive", "refused"), ("interactive", "refused")]


def test_the_answer_lengths_are_a_short_answers_served_else_the_max_tokens_asked() -> None:
    ledger, _ = _ledger(FakeClock())
    assert ledger.answer_tokens() is None
    for i, asked in enumerate((100, 200, 300, 400)):
        ledger.started(f"r{i}", "batch", before_engine_s=0.0, max_tokens=asked)
    assert ledger.answer_tokens() == 100  # the 10th percentile of what was asked, nothing served yet
    for i in range(4):
        ledger.served(f"r{i}", engine_ttft_s=0.1, tpot_s=0.01, output_tokens=10 * (i + 1))
    assert ledger.answer_tokens() == 100  # 4 served < 10
    for i in range(8):
        ledger.started(f"s{i}", "batch", before_engine_s=0.0, max_tokens=500)
        ledger.served(f"s{i}", engine_ttft_s=0.1, tpot_s=0.01, output_tokens=50 + i)
    ledger.served("failed", engine_ttft_s=0.1, tpot_s=None, error=True, output_tokens=1)  # not an answer
    # served: 10, 20, 30, 40, 50..57: nearest rank of the 10th percentile of 12 is the 2nd
    assert ledger.answer_tokens() == 20
    # a change of load: the last 32 started ask for 8 tokens; the served still say 20
    for i in range(32):
        ledger.started(f"c{i}", "batch", before_engine_s=0.0, max_tokens=8)
    assert ledger.answer_tokens() == 8
    for i in range(31):  # the last 32 ask 500 but one: their 10th percentile is 500, the served rule
        ledger.started(f"l{i}", "batch", before_engine_s=0.0, max_tokens=500)
    assert ledger.answer_tokens() == 20


def test_the_asked_mix_counts_every_prompt_token_over_max_tokens() -> None:
    ledger, _ = _ledger(FakeClock())
    assert ledger.asked_prefill_per_decode() is None
    ledger.started("a", "batch", before_engine_s=0.0, max_tokens=50, prompt_tokens=500)
    ledger.started("b", "batch", before_engine_s=0.0, max_tokens=150, prompt_tokens=100)
    ledger.started("c", "batch", before_engine_s=0.0, prompt_tokens=9000)  # no max_tokens: not counted
    assert ledger.asked_prefill_per_decode() == 3.0  # 600 / 200


def test_the_tpot_shares_are_each_served_requests_pace_over_its_classs_bound() -> None:
    slo: list[SloTargets | None] = [SLO]
    ledger, _ = _ledger(FakeClock(), lambda: slo[0])
    for rid, cls, tpot in (("a", "interactive", 0.04), ("b", "batch", 0.04), ("c", "batch", None)):
        ledger.started(rid, cls, before_engine_s=0.0)
        ledger.served(rid, engine_ttft_s=0.1, tpot_s=tpot)
    # interactive's bound is 50 ms, batch's 100 ms; a one-token answer has no TPOT and no share
    assert ledger.tpot_shares() == (pytest.approx((1, 0.8)), pytest.approx((2, 0.4)))
    slo[0] = None  # without [slo] there is no bound to share
    ledger.started("d", "batch", before_engine_s=0.0)
    ledger.served("d", engine_ttft_s=0.1, tpot_s=0.04)
    assert len(ledger.tpot_shares()) == 2
