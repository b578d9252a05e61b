"""Per-step figures inside the EngineCore: the scheduler subclass's accounting, its ring and drain,
and the live token budget's clamp, on stand-ins for vLLM's scheduler, requests and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from controller.clock import FakeClock
from controller.engine.runtime.scheduler import _drain_steps, _LiveKnobsMixin
from controller.engine.runtime.stepmeter import StepMeter


@dataclass
class Req:
    num_prompt_tokens: int
    num_computed_tokens: int = 0


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())


class BaseScheduler:
    """vLLM's ``Scheduler`` as the mixin sees it: ``schedule()`` hands out the next planned output and
    advances each request's computed tokens (``_update_after_schedule``); the clock moves per call."""

    def __init__(self, clock: FakeClock, plans: list[dict[str, int]], requests: dict[str, Req]) -> None:
        self.clock, self.plans, self.requests = clock, plans, requests
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=2048, enable_chunked_prefill=True)
        self.max_num_scheduled_tokens, self.max_model_len, self.num_spec_tokens = 2048, 4096, 0
        self.max_num_running_reqs = self.max_num_active_reqs = 8
        self.running: list[Req] = []
        self.budgets_seen: list[int] = []

    def schedule(self) -> Out:
        self.budgets_seen.append(self.max_num_scheduled_tokens)
        out = Out(self.plans.pop(0))
        for req_id, n in out.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        self.clock.advance(0.001)
        return out

    def update_from_output(self, scheduler_output: Out, model_runner_output: Any) -> dict[int, Any]:
        return {}


class Scheduler(_LiveKnobsMixin, BaseScheduler):
    def __init__(self, clock: FakeClock, plans: list[dict[str, int]], requests: dict[str, Req]) -> None:
        super().__init__(clock, plans, requests)
        self.step_meter = StepMeter(clock=clock)


def test_a_step_counts_prefill_tokens_decodes_and_kv() -> None:
    clock = FakeClock(100.0)
    # "a" decodes (20 computed of a 10-token prompt), "b" prefills its first chunk, "c" its last one
    requests = {"a": Req(10, 20), "b": Req(500), "c": Req(300, 256)}
    s = Scheduler(clock, [{"a": 1, "b": 200, "c": 44}], requests)
    out = s.schedule()
    clock.advance(0.05)
    s.update_from_output(out, None)
    [(t, prefill, decode, kv, step_s, gap_s)] = _drain_steps(SimpleNamespace(scheduler=s))
    assert (prefill, decode, kv) == (244, 1, (20 + 1) + (0 + 200) + (256 + 44))
    assert t == clock() and abs(step_s - 0.051) < 1e-9
    assert gap_s == 0.0  # the first step: no step before it
    assert s.step_meter.drain() == []  # a drain empties the ring


def test_a_long_prompt_adds_up_over_its_chunks() -> None:
    clock, requests = FakeClock(0.0), {"p": Req(1000)}
    s = Scheduler(clock, [{"p": 400}, {"p": 400}, {"p": 200}, {"p": 1}], requests)
    for _ in range(4):
        out = s.schedule()
        clock.advance(0.01)
        s.update_from_output(out, None)
    steps = s.step_meter.drain()
    assert [(p, d) for _, p, d, *_ in steps] == [(400, 0), (400, 0), (200, 0), (0, 1)]
    assert sum(p for _, p, *_ in steps) == 1000


def test_async_scheduling_counts_each_step_from_the_previous_ones_end() -> None:
    """vLLM's batch queue schedules step 2 while step 1 runs: step 2 is charged from step 1's end."""
    clock, requests = FakeClock(0.0), {"a": Req(4, 10), "b": Req(4, 10)}
    s = Scheduler(clock, [{"a": 1}, {"b": 1}], requests)
    first = s.schedule()  # t 0 -> 0.001
    second = s.schedule()  # t 0.001 -> 0.002
    clock.advance(0.098)  # first's forward pass ends at 0.1
    s.update_from_output(first, None)
    clock.advance(0.1)
    s.update_from_output(second, None)
    [(t1, *_, s1, g1), (t2, *_, s2, g2)] = s.step_meter.drain()
    assert (round(t1, 6), round(s1, 6), round(t2, 6), round(s2, 6)) == (0.1, 0.1, 0.2, 0.1)
    assert g1 == g2 == 0.0  # step 2 was scheduled before step 1 ended: no time between them


def test_empty_steps_are_not_recorded_and_the_ring_is_bounded() -> None:
    clock = FakeClock(0.0)
    meter = StepMeter(maxlen=3, clock=clock)
    empty = Out({})
    meter.scheduled(empty, {}, 0.0)
    meter.finished(empty)
    requests = {"a": Req(2, 0)}
    for i in range(5):
        out = Out({"a": 1})
        requests["a"].num_computed_tokens += 1
        meter.scheduled(out, requests, float(i))
        clock.advance(1.0)
        meter.finished(out)
    assert [t for t, *_ in meter.drain()] == [3.0, 4.0, 5.0]  # the newest three, oldest first


def test_the_live_token_budget_is_clamped_to_what_the_engine_takes() -> None:
    s = Scheduler(FakeClock(0.0), [], {})
    assert s.set_token_budget(512) == 512 == s.max_num_scheduled_tokens
    assert s.set_token_budget(1) == 16
    assert s.set_token_budget(10**6) == 2048  # max_num_batched_tokens sizes the buffers
    s.num_spec_tokens = 40
    assert s.set_token_budget(1) == 41  # one decode and its drafts still fit a step
    s.scheduler_config.enable_chunked_prefill = False  # a whole prompt must fit: max_model_len,
    assert s.set_token_budget(100) == 2048  # here past the ceiling, so the ceiling
    assert s.set_batch_cap(100) == 8 and s.set_batch_cap(0) == 1


def test_the_budget_bounds_a_step_with_a_decode_and_a_prefill_alone_takes_the_ceiling() -> None:
    stream, prompt = Req(8, 9), Req(600, 64)  # one decodes (past its prompt), one is mid-prefill
    s = Scheduler(FakeClock(0.0), [{"p": 64}, {"s": 1, "p": 63}], {"s": stream, "p": prompt})
    s.set_token_budget(64)
    s.running = [prompt]
    s.schedule()
    s.running = [stream, prompt]
    s.schedule()
    assert s.budgets_seen == [2048, 64]  # no stream to stall, then one
    assert s.max_num_scheduled_tokens == 64  # the budget in force is kept


def test_the_time_between_two_decoding_steps_is_the_gap_before_the_second() -> None:
    """A sequence runs on from one step to the next: the time from the first's end to the second's
    schedule start (the engine loop's own work, or a wait for a core) is the second's gap."""
    clock, requests = FakeClock(0.0), {"a": Req(4, 0)}
    s = Scheduler(clock, [{"a": 4}, {"a": 1}, {"a": 1}], requests)
    for wait in (0.0, 0.003, 0.0005):
        clock.advance(wait)  # between the previous step's end and this schedule()
        out = s.schedule()
        clock.advance(0.002)
        s.update_from_output(out, None)
    steps = s.step_meter.drain()
    assert [round(gap, 6) for *_, gap in steps] == [0.0, 0.003, 0.0005]  # the prefill's gap is 0
    assert [round(step, 6) for *_, step, _ in steps] == [0.003, 0.003, 0.003]
