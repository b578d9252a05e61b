"""An engine that hangs never freezes the control loop (engine/runtime/calls.py, host.py, control/loop.py).

vLLM's utility calls wait on a future that only the EngineCore's answer resolves. The fake engine
client here behaves so: while ``hung``, a call's future stays pending for ever. The control core is
the daemon's own (``ControlCore``) around the real ``EngineHost``; the deadline's timer is a fake the
test lets pass, so no wall-clock time goes by.
"""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace
from typing import Any

from controller.admin.status import health, loop_stall
from controller.clock import FakeClock
from controller.config.load import AdmissionConfig, ControlConfig
from controller.control.build import ControlCore
from controller.control.loop import ControlLoop
from controller.control.normalize import Normalizer
from controller.control.steps import StepFeed
from controller.engine.runtime.calls import CALL_DEADLINE_MIN_S, EngineCalls, EngineUnanswered
from controller.engine.runtime.host import EngineHost
from controller.engine.runtime.scheduler import UTILITY_DRAIN, UTILITY_SET
from policies.static import StaticPolicy
from tests.helpers import idle_obs, settle, until


class Core:
    """vLLM's engine client as the host calls it: an answer per utility call, none while hung."""

    def __init__(self, rows: list[list[float]] | None = None) -> None:
        self.hung = False
        self.rows = rows or []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.pending: list[asyncio.Future[Any]] = []

    async def _answer(self, method: str, args: tuple[Any, ...]) -> Any:
        self.calls.append((method, args))
        if self.hung:  # vLLM's utility_results: only the EngineCore's answer resolves it
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.pending.append(future)
            return await future
        if method == UTILITY_DRAIN:
            rows, self.rows = self.rows, []
            return rows
        return args[0]

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await self._answer(method, args)

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        return [await self._answer(method, args)]

    def answer(self, value: Any) -> None:
        """The EngineCore resumes and answers what it was asked."""
        self.hung = False
        for future in self.pending:
            if not future.done():
                future.set_result(value)
        self.pending.clear()

    def shutdown(self, timeout: float | None = None) -> None:  # kills the process; futures untouched
        pass

    def asked(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)


def llm(core: Core) -> Any:
    return SimpleNamespace(
        engine_core=core,
        errored=False,
        vllm_config=SimpleNamespace(shutdown_timeout=1.0, cache_config=None),
        output_processor=SimpleNamespace(request_states={}, abort_requests=lambda *_a, **_k: None),
        renderer=SimpleNamespace(shutdown=lambda: None),
        shutdown=lambda timeout=None: None,
    )


class Deadlines:
    """The deadline's timer: each wait ends when the test lets the deadlines pass."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self._waiting: list[asyncio.Future[None]] = []

    async def wait(self, seconds: float) -> None:
        self.asked.append(seconds)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        await future

    def running(self) -> int:
        """Deadlines being waited out now (a call answered in time cancels its own)."""
        return sum(1 for future in self._waiting if not future.done())

    def pass_all(self) -> None:
        for future in self._waiting:
            if not future.done():
                future.set_result(None)
        self._waiting.clear()


def control_core(cores: list[Core], deadlines: Deadlines) -> tuple[ControlCore[EngineHost], list[float]]:
    """The daemon's control core around the real engine host over ``cores`` (one a build), and the
    times a subscriber (as the memory guard is) saw a tick."""
    queue = [llm(core) for core in cores]
    args = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=256, model="m")
    tables = SimpleNamespace(
        control=ControlConfig(policy="hysteresis"), admission=AdmissionConfig(limit=8), slo=None
    )
    core = ControlCore(
        tables,
        engine=lambda steps, _outcomes: EngineHost(
            args, steps, builder=lambda _a: queue.pop(0), two_engines_fit=True, call_timer=deadlines.wait
        ),
    )
    seen: list[float] = []
    core.loop.subscribe(lambda obs, _changes: seen.append(obs.now_mono))
    return core, seen


async def test_a_tick_waiting_on_a_hung_engine_ends_when_the_guard_counts_it_failed_and_ticks_go_on() -> None:
    """The review's case: the EngineCore hangs under a tick's step pull; the guard's stall check
    counts it failed and recovery builds a new engine. The tick ends then (no deadline passed), and
    every later tick reaches its subscribers, the memory guard among them."""
    old, new = Core(), Core()
    core, seen = control_core([old, new], Deadlines())
    host, loop = core.engine, core.loop
    await host.start()
    await loop.tick()
    old.hung = True
    stuck = asyncio.create_task(loop.tick())
    await until(lambda: old.pending != [])
    host.mark_failed("no engine step for 60s")
    await until(stuck.done)
    assert stuck.result() == [] and len(seen) == 2  # it ran on to its subscribers, without steps
    await host.restart({}, build_first=True)  # dead: the old one goes, then the new one builds
    assert host.generation == 2 and not host.dead
    for _ in range(3):
        await loop.tick()
    assert len(seen) == 5 and loop.ticks_total == 5 and new.asked(UTILITY_DRAIN) == 3


async def test_a_tick_waiting_on_the_engine_a_config_restart_replaces_ends_when_the_new_one_serves() -> None:
    old, new = Core(), Core()
    core, seen = control_core([old, new], Deadlines())
    host, loop = core.engine, core.loop
    await host.start()
    old.hung = True
    stuck = asyncio.create_task(loop.tick())
    await until(lambda: old.pending != [])
    await host.restart({"max_num_seqs": 8}, build_first=True)  # built first, then swapped in
    await until(stuck.done)
    assert len(seen) == 1 and host.generation == 2
    await loop.tick()
    assert len(seen) == 2 and new.asked(UTILITY_DRAIN) == 1


async def test_a_call_past_its_deadline_frees_the_tick_and_later_ticks_skip_the_silent_engine() -> None:
    """The engine hangs and nothing retires it (no request inside: the stall check has nothing to
    see). The tick waits one deadline; while the engine stays silent, later ticks run at once and
    ask it nothing; when it answers again, ticks drain it again."""
    engine, deadlines = Core(), Deadlines()
    core, seen = control_core([engine], deadlines)
    host, loop = core.engine, core.loop
    await host.start()
    deadlines.asked.clear()
    engine.hung = True
    tick = asyncio.create_task(loop.tick())
    await until(lambda: deadlines.running() == 1)
    assert deadlines.asked == [CALL_DEADLINE_MIN_S] and not tick.done()
    deadlines.pass_all()
    await until(tick.done)
    assert len(seen) == 1 and (host.calls.silence() or {}).get("method") == UTILITY_DRAIN
    for _ in range(3):
        await asyncio.wait_for(loop.tick(), 1.0)  # a bound on the test, never reached
    assert len(seen) == 4 and engine.asked(UTILITY_DRAIN) == 1 and deadlines.asked == [CALL_DEADLINE_MIN_S]
    engine.answer([])  # the EngineCore resumes: its late answer says it is back
    await settle()
    assert host.calls.silence() is None
    await loop.tick()
    assert engine.asked(UTILITY_DRAIN) == 2 and len(seen) == 5


async def test_a_setting_for_a_silent_engine_is_sent_without_waiting_and_the_newest_stands() -> None:
    engine, deadlines = Core(), Deadlines()
    host = EngineHost(
        argparse.Namespace(max_num_seqs=8, model="m"),
        StepFeed(),
        builder=lambda _a: llm(engine),
        call_timer=deadlines.wait,
    )
    await host.start()
    deadlines.asked.clear()
    engine.hung = True
    asking = asyncio.create_task(host.set_batch_cap(4))
    await until(lambda: deadlines.running() == 1)
    deadlines.pass_all()
    assert await asking == 4  # sent: it applies when the engine steps again
    assert await host.set_batch_cap(3) == 3 and await host.set_batch_cap(2) == 2
    await settle()
    # 8 at the start; 3 was replaced by 2 before it went: the EngineCore runs them in order
    assert [args for method, args in engine.calls if method == UTILITY_SET] == [(8,), (4,), (2,)]
    assert host.batch_cap == 2 and len(deadlines.asked) == 1  # only the first waited


async def test_every_call_into_a_retired_engine_fails_at_once_with_its_reason() -> None:
    calls = EngineCalls(Core(), 1)
    calls.close("the engine was retired")
    try:
        await calls.ask(UTILITY_DRAIN)
    except EngineUnanswered as exc:
        assert exc.reason == "engine_retired"
    else:
        raise AssertionError("a retired engine's call must fail")
    assert await calls.put(UTILITY_SET, 5) == 5  # kept by the host for the next engine


def test_the_deadline_covers_the_longest_step_the_engine_took() -> None:
    calls = EngineCalls(Core(), 1)
    assert calls.deadline_s == CALL_DEADLINE_MIN_S
    calls.saw_step(8.0)
    calls.saw_step(0.5)
    assert calls.deadline_s == 24.0


# -- the loop's progress: /healthz and the systemd watchdog read it -----------------------------------


def bare_loop(clock: FakeClock) -> ControlLoop:
    class Knobs:
        def set_admission_limit(self, limit: int) -> None:
            pass

        async def set_batch_cap(self, cap: int) -> int:
            return cap

        async def set_token_budget(self, budget: int) -> int:
            return budget

    policy = StaticPolicy(max_num_seqs=64, initial_limit=100)  # what is in force: no change to apply
    observe = lambda: idle_obs(admission_limit=100, batch_cap=64, max_num_seqs=64)  # noqa: E731
    return ControlLoop(policy, Normalizer(limit_max=1000), observe, Knobs(), clock=clock)


async def test_the_loop_counts_as_stalled_only_when_no_tick_ended_for_longer_than_a_tick_can_take() -> None:
    clock = FakeClock()
    loop = bare_loop(clock)
    assert loop.stalled(clock(), 1.0, 10.0) is None  # the daemon starts: no tick expected yet
    await loop.tick()
    clock.advance(31.0)  # a tick every second, each waiting on the engine three deadlines at most
    assert loop.stalled(clock(), 1.0, 10.0) is None
    clock.advance(0.5)
    assert loop.stalled(clock(), 1.0, 10.0) is not None
    await loop.tick()
    assert loop.stalled(clock(), 1.0, 10.0) is None and loop.ticks_total == 2


async def test_a_tick_that_never_ends_is_a_stalled_loop_and_the_ticks_after_it_are_counted_skipped() -> None:
    clock, gate = FakeClock(), asyncio.Event()
    loop = bare_loop(clock)
    await loop.tick()

    async def hang() -> list[Any]:
        await gate.wait()
        return []

    loop.steps = SimpleNamespace(pull=hang)  # type: ignore[assignment]
    running = asyncio.create_task(loop.tick())
    await settle()
    clock.advance(30.5)
    assert await loop.tick() == [] and loop.skipped_total == 1
    assert loop.stalled(clock(), 1.0, 10.0) is not None  # running for 30.5 s, past 3 x 10 s
    gate.set()
    await running
    assert loop.stalled(clock(), 1.0, 10.0) is None


async def test_healthz_reports_a_stalled_control_loop() -> None:
    clock = FakeClock()
    loop = bare_loop(clock)
    await loop.tick()
    parts = SimpleNamespace(
        draining=False,
        guard=SimpleNamespace(unavailable_reason=None, restarting=False),
        host=SimpleNamespace(ready=True, generation=1, call_deadline_s=10.0),
        data_plane_up=True,
        loop=loop,
        config=SimpleNamespace(control=SimpleNamespace(tick_s=1.0)),
    )
    assert health(parts) == (True, "serving")  # type: ignore[arg-type]
    clock.advance(60.0)
    assert health(parts) == (False, "control_loop_stalled")  # type: ignore[arg-type]
    assert loop_stall(parts) is not None  # type: ignore[arg-type]
