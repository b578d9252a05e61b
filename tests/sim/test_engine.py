"""The twin's scheduler follows vLLM V1's rules (vllm/v1/core/sched/scheduler.py), step by step."""

from __future__ import annotations

import dataclasses

import pytest

from controller.control.steps import StepCost
from controller.profiles.load import EngineLimits
from controller.sim.engine import SimEngine, SimRequest
from policies.cost import StepCoefficients

COST = StepCoefficients(
    a_s=0.01, b_s_per_prefill_token=0.001, c_s_per_decode_seq=0.002, d_s_per_kv_token=1e-5
)


def engine(**limits: object) -> SimEngine:
    base = EngineLimits(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=4, kv_cache_tokens=256, max_model_len=128
    )
    return SimEngine(dataclasses.replace(base, **limits), COST)  # type: ignore[arg-type]


def req(i: int, prompt: int, out: int, priority: int = 0, t: float = 0.0) -> SimRequest:
    return SimRequest(i, prompt, out, priority, arrival_t=t if t else float(i))


def run_step(e: SimEngine, t: float) -> tuple[dict[int, int], list[SimRequest]]:
    plan = e.plan()
    _, done = e.finish_step(plan, t)
    return {r.request_id: n for r, n in plan.scheduled}, done


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget() -> None:
    e = engine()
    e.add(req(1, 100, 2))
    assert run_step(e, 1.0)[0] == {1: 64}
    r = e.running[0]
    assert r.output_tokens == 0 and r.first_token_t is None  # a chunk emits nothing
    assert run_step(e, 2.0)[0] == {1: 36}
    assert r.output_tokens == 1 and r.first_token_t == 2.0
    scheduled, done = run_step(e, 3.0)
    assert scheduled == {1: 1} and done == [r] and r.finish_t == 3.0


def test_without_chunked_prefill_a_prompt_that_does_not_fit_the_budget_left_waits() -> None:
    e = engine(enable_chunked_prefill=False, max_num_batched_tokens=128)
    e.add(req(1, 100, 4))
    e.add(req(2, 40, 4))
    assert run_step(e, 1.0)[0] == {1: 100}  # 28 left: request 2 (40) waits, nothing is split
    assert run_step(e, 2.0)[0] == {1: 1, 2: 40}


def test_running_requests_come_first_then_admissions_fill_the_budget() -> None:
    e = engine()
    e.add(req(1, 10, 5))
    run_step(e, 1.0)
    e.add(req(2, 100, 5))
    assert run_step(e, 2.0)[0] == {1: 1, 2: 63}


def test_the_batch_cap_stops_admission_and_lowering_it_preempts_nobody() -> None:
    e = engine()
    for i in range(4):
        e.add(req(i, 4, 10))
    assert e.set_batch_cap(2) == 2
    assert set(run_step(e, 1.0)[0]) == {0, 1}
    e.set_batch_cap(1)
    assert set(run_step(e, 2.0)[0]) == {0, 1}  # both keep running
    assert e.set_batch_cap(100) == 8  # clamped to max_num_seqs
    assert set(run_step(e, 3.0)[0]) == {0, 1, 2, 3}


def test_kv_shortage_preempts_the_newest_request_under_fcfs_and_it_recomputes() -> None:
    # 16 blocks of 4 tokens. Two requests of 28 prompt tokens hold 7 blocks each; decoding, they
    # need an 8th block each at token 33; only 2 are free, then none. Prefix caching off: the victim
    # recomputes everything (with it on, it would find part of its own freed blocks still cached).
    e = engine(kv_cache_tokens=64, max_model_len=64, enable_prefix_caching=False)
    e.add(req(1, 28, 20))
    e.add(req(2, 28, 20))
    run_step(e, 1.0)
    assert e.kv.free == 2
    t = 2.0
    while e.total_preemptions == 0:
        run_step(e, t)
        t += 1
    victim = next(r for r in e.waiting.drain())
    assert victim.request_id == 2 and victim.num_computed_tokens == 0 and victim.blocks == 0
    assert victim.num_preemptions == 1 and victim.output_tokens > 0
    e.add(victim)
    before = victim.output_tokens
    scheduled: dict[int, int] = {}
    while 2 not in scheduled:
        scheduled, _ = run_step(e, t)
        t += 1
    # The recompute prefills the prompt and the output so far in one go (vLLM's recompute
    # preemption), then samples the next token.
    assert scheduled[2] == 28 + before
    assert victim.output_tokens == before + 1


def test_priority_policy_preempts_the_least_urgent_request() -> None:
    e = engine(kv_cache_tokens=64, max_model_len=64, scheduling_policy="priority")
    e.add(req(1, 28, 20, priority=5, t=1.0))
    e.add(req(2, 28, 20, priority=0, t=2.0))
    t = 1.0
    while e.total_preemptions == 0:
        run_step(e, t)
        t += 1
    assert [r.request_id for r in e.waiting.drain()] == [1]  # the older but less urgent one


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    e = engine(scheduling_policy="priority", max_num_seqs=1)
    e.add(req(1, 4, 1, priority=1, t=1.0))
    e.add(req(2, 4, 1, priority=0, t=2.0))
    e.add(req(3, 4, 1, priority=0, t=3.0))
    order = [next(iter(run_step(e, float(k))[0])) for k in range(1, 4)]
    assert order == [2, 3, 1]


def test_a_step_reports_what_vllms_stat_logger_and_the_step_meter_report() -> None:
    e = engine()
    e.add(req(1, 8, 3, t=0.5))
    plan = e.plan()
    assert (plan.prefill_tokens, plan.decode_seqs, plan.kv_tokens_read) == (8, 0, 8)
    assert e.step_s(plan) == pytest.approx(0.01 + 0.008 + 8e-5)
    step, _ = e.finish_step(plan, 1.0)
    assert step.t_mono == 1.0 and step.stats is not None and step.cost is not None
    assert step.stats.ttft_s == (0.5,) and step.stats.generated_tokens == 1 and step.stats.running == 1
    assert step.stats.kv_usage == pytest.approx(2 / 64)
    assert step.cost == StepCost(8, 0, 8, e.step_s(plan))
    plan = e.plan()
    assert (plan.prefill_tokens, plan.decode_seqs, plan.kv_tokens_read) == (0, 1, 9)
    step, _ = e.finish_step(plan, 1.25)
    assert step.stats is not None and step.stats.itl_s == (0.25,)
