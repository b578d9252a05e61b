"""Fault injection for the daemon's lifecycle: reload, the guard's restarts and recovery, the engine
host's swap and shutdown. Fakes stand in for the engine (an ``EngineControl`` that fails or stalls, an
engine builder that raises), the clock is a fake one, and the back-off sleep is injected; no vLLM
engine starts here (the parts are built, nothing is started)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.config.load import GuardConfig, load_config
from controller.control.samplers import FakeHostSource
from controller.lifecycle import tasks as tasks_module
from controller.lifecycle.guard import Guard, read_oom_kills
from controller.lifecycle.parts import Parts
from controller.lifecycle.tasks import BackgroundTasks
from tests.helpers import settle, until, write_config

KV = 64 << 20


# -- fakes ----------------------------------------------------------------------------------------


class FakeEngine:
    """An ``EngineControl`` whose restart can fail (staying alive or dying) or wait to be released."""

    memory_knob = "kv_cache_memory_bytes"
    died_out_of_memory = False

    def __init__(self) -> None:
        self.dead = False
        self.kv = KV
        self.restarts: list[tuple[dict[str, Any], bool]] = []
        self.fail: Exception | None = None
        self.die_on_failure = False
        self.hold: asyncio.Event | None = None

    def memory_settings(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": self.kv, "gpu_memory_utilization": None}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append((overrides, build_first))
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            self.dead = self.dead or self.die_on_failure
            raise self.fail
        self.kv = int(overrides.get("kv_cache_memory_bytes", self.kv))
        self.dead = False

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


def fake_gate() -> AdmissionGate:
    return AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)


def guard_with(engine: FakeEngine, clock: FakeClock | None = None, **settings: Any) -> Guard:
    async def no_sleep(_s: float) -> None:
        await asyncio.sleep(0)

    s = GuardConfig(**{"backoff_initial_s": 0.0, "backoff_max_s": 0.0, **settings})
    return Guard(s, fake_gate(), engine, lambda _r, _d: None, clock or FakeClock(), lambda: None, no_sleep)


def parts_for(tmp_path: Path, **engine: Any) -> Parts:
    from controller.lifecycle.parts import build_parts

    path = write_config(tmp_path / "config.toml", engine=engine)
    return build_parts(load_config(path), host_source=FakeHostSource(16 << 30))


def rewrite(p: Parts, **tables: dict[str, Any]) -> None:
    """A new config file for ``p`` that keeps its listeners (a port change would be a pending change)."""
    ports = {"server": {"port": p.config.server.port}, "admin": {"port": p.config.admin.port}}
    write_config(p.config.path, **{**ports, **tables})


def reloads(p: Parts, result: str) -> float:
    return p.registry.get_sample_value("autopilot_config_reloads_total", {"result": result}) or 0.0


async def drain_tasks(p: Parts) -> None:
    for _ in range(20):
        await settle()


# -- one unexpected error must not end reloads or skip shutdown -------------------------------------


async def test_a_config_file_that_is_not_utf8_is_a_reload_error_and_keeps_the_old_config(
    tmp_path: Path,
) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path)
    before = p.config
    p.config.path.write_bytes(b"[admission]\nlimit = 3\n# \xff\xfe not UTF-8\n")
    result = await Reloader(p).reload()
    assert result["ok"] is False and result["errors"]
    assert p.config is before
    assert reloads(p, "error") == 1


async def test_a_plugin_that_raises_on_import_is_a_reload_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller.lifecycle.reload import Reloader

    (tmp_path / "broken_policy_plugin.py").write_text("raise RuntimeError('plug-in is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = parts_for(tmp_path)
    before = p.config
    rewrite(p, control={"policy": "broken_policy_plugin:Policy"})
    result = await Reloader(p).reload()
    assert result["ok"] is False and "plug-in is broken" in str(result["errors"])
    assert p.config is before
    assert reloads(p, "error") == 1


async def test_an_error_in_the_tick_after_a_reload_does_not_fail_the_reload(tmp_path: Path) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path)

    async def nvml_error() -> None:
        raise RuntimeError("NVMLError_Unknown")

    p.loop.tick = nvml_error  # type: ignore[method-assign]
    rewrite(p, admission={"limit": 7})
    result = await Reloader(p).reload()
    assert result["ok"] is True
    assert p.config.admission.limit == 7


async def test_the_sighup_loop_survives_a_reload_that_raises(tmp_path: Path) -> None:
    from controller.lifecycle.daemon import Daemon

    d = Daemon(load_config(write_config(tmp_path / "config.toml")), install_signals=False)
    calls: list[int] = []

    async def flaky_reload() -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unexpected")
        return {"ok": True}

    d.reloader.reload = flaky_reload  # type: ignore[method-assign]
    task = asyncio.create_task(d._reload_on_hup())
    for _ in range(2):
        d._hup.set()
        await settle()
    assert len(calls) == 2 and not task.done()
    task.cancel()


async def test_shutdown_closes_gate_engine_and_control_plane_when_a_background_task_failed(
    tmp_path: Path,
) -> None:
    from controller.lifecycle.daemon import Daemon

    d = Daemon(load_config(write_config(tmp_path / "config.toml")), install_signals=False)
    p, closed = d.parts, []

    async def failing_restart() -> None:
        raise RuntimeError("engine build failed")

    p.tasks.spawn(failing_restart())
    await settle()

    class Admin:
        async def cleanup(self) -> None:
            closed.append("admin")

    d._admin = Admin()
    p.gate.close = lambda: closed.append("gate")  # type: ignore[method-assign]
    p.host.stop = lambda timeout_s=10.0: closed.append("engine")  # type: ignore[method-assign]
    await d.shutdown()
    assert closed == ["gate", "engine", "admin"]


async def test_a_failed_background_task_is_logged_and_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        def error(self, event: str, **fields: Any) -> None:
            logged.append((event, fields))

    monkeypatch.setattr(tasks_module, "log", Recorder())
    tasks = BackgroundTasks()

    async def boom() -> None:
        raise RuntimeError("boom")

    failed = tasks.spawn(boom())
    await settle()
    assert failed.done()
    assert logged == [("background_task_failed", {"task": failed.get_name(), "error": "RuntimeError: boom"})]
    assert tasks._tasks == set()  # forgotten: shutdown has nothing of it left to cancel
    await tasks.cancel_all()  # must not raise, nor log the failure a second time
    assert len(logged) == 1


# -- the OOM killer's counter is the service's own cgroup's -----------------------------------------


def test_oom_kills_are_read_from_the_services_own_cgroup_on_cgroup_v2(tmp_path: Path) -> None:
    proc = tmp_path / "proc" / "self" / "cgroup"
    proc.parent.mkdir(parents=True)
    proc.write_text("0::/system.slice/vllm-autopilot.service\n")
    root = tmp_path / "sys" / "fs" / "cgroup"
    events = root / "system.slice" / "vllm-autopilot.service" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert not (root / "memory.events").exists()  # the root cgroup has none on cgroup v2
    assert read_oom_kills(proc, root) == 2


def test_oom_kills_are_unknown_without_a_cgroup_v2_entry(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/system.slice/x.service\n")
    assert read_oom_kills(proc, tmp_path) is None
    assert read_oom_kills(tmp_path / "missing", tmp_path) is None


# -- only crashes spend the crash budget ------------------------------------------------------------


async def test_operator_and_memory_restarts_do_not_spend_the_crash_budget() -> None:
    engine = FakeEngine()
    guard = guard_with(engine, max_restarts_per_hour=2)
    for reason in ("config_reload", "host_memory_low", "config_reload"):
        await guard.restart(reason, {"kv_cache_memory_bytes": KV // 2}, drain=False)
    engine.dead = True
    await guard.recover()
    assert not engine.dead and guard.unavailable_reason is None


async def test_the_crash_budget_counts_crashes_per_hour() -> None:
    engine, clock = FakeEngine(), FakeClock()
    guard = guard_with(engine, clock, max_restarts_per_hour=2)
    for _ in range(2):
        engine.dead = True
        await guard.recover()
    engine.dead = True
    await guard.recover()
    assert guard.unavailable_reason == "restart_budget_spent"
    clock.advance(3601.0)
    guard.unavailable_reason = None
    await guard.recover()
    assert not engine.dead


# -- a bad engine setting must not destroy the working engine ---------------------------------------


class FakeCore:
    def __init__(self) -> None:
        self.shut = False

    def shutdown(self, timeout: float = 0.0) -> None:
        self.shut = True

    async def call_utility_async(self, _name: str, cap: int) -> int:
        return cap


class FakeLLM:
    """What the host touches on an AsyncLLM."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.errored = False
        self.output_handler = None
        self.engine_core = FakeCore()
        self.vllm_config = argparse.Namespace(shutdown_timeout=1.0, cache_config=None)
        self.renderer = argparse.Namespace(shutdown=lambda: None)
        self.output_processor = argparse.Namespace(request_states={}, abort_requests=lambda *_a, **_k: None)

    def shutdown(self, timeout: float = 0.0) -> None:
        self.engine_core.shutdown()


BAD_KV = 3


def host_with(two_fit: bool) -> tuple[Any, list[FakeLLM]]:
    from controller.control.steps import StepFeed
    from controller.engine.runtime.host import EngineHost

    built: list[FakeLLM] = []

    def build(args: argparse.Namespace) -> Any:
        if args.kv_cache_memory_bytes == BAD_KV:
            raise ValueError("kv_cache_memory_bytes is too small for one block")
        built.append(FakeLLM(args))
        return built[-1]

    args = argparse.Namespace(max_num_seqs=8, kv_cache_memory_bytes=KV, model="m")
    host = EngineHost(args, StepFeed(), builder=build, two_engines_fit=two_fit)
    return host, built


async def test_a_config_restart_that_fails_to_build_keeps_serving_on_the_old_engine() -> None:
    host, built = host_with(two_fit=True)
    await host.start()
    with pytest.raises(ValueError):
        await host.restart({"kv_cache_memory_bytes": BAD_KV}, build_first=True)
    assert host.llm is built[0] and not built[0].engine_core.shut
    assert host.args.kv_cache_memory_bytes == KV and not host.dead and host.generation == 1
    await host.restart({"kv_cache_memory_bytes": KV // 2}, build_first=True)
    assert host.llm is built[1] and built[0].engine_core.shut and host.args.kv_cache_memory_bytes == KV // 2


async def test_a_memory_restart_that_fails_to_build_falls_back_to_the_last_good_args() -> None:
    host, built = host_with(two_fit=False)
    await host.start()
    with pytest.raises(ValueError):
        await host.restart({"kv_cache_memory_bytes": BAD_KV}, build_first=False)
    assert built[0].engine_core.shut  # the old engine went first: two may not fit
    assert host.llm is built[1] and built[1].args.kv_cache_memory_bytes == KV
    assert host.args.kv_cache_memory_bytes == KV and not host.dead


async def test_a_config_restart_builds_first_only_where_two_engines_fit() -> None:
    host, built = host_with(two_fit=False)
    await host.start()
    with pytest.raises(ValueError):
        await host.restart({"kv_cache_memory_bytes": BAD_KV}, build_first=True)
    assert built[0].engine_core.shut and host.llm is built[1] and not host.dead


async def test_a_failed_config_restart_keeps_the_gate_open_and_spends_no_budget() -> None:
    engine = FakeEngine()
    engine.fail = ValueError("bad value")
    guard = guard_with(engine, max_restarts_per_hour=1)
    with pytest.raises(ValueError):
        await guard.restart("config_reload", {"kv_cache_memory_bytes": BAD_KV}, drain=False)
    assert not guard.gate.paused and guard.unavailable_reason is None
    assert engine.restarts == [({"kv_cache_memory_bytes": BAD_KV}, True)]


async def test_a_bad_reload_value_then_the_fixed_file_leaves_the_daemon_serving(tmp_path: Path) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path, restart_on_reload=True)
    engine = FakeEngine()
    p.guard.engine = engine
    reloader = Reloader(p)
    engine.fail = ValueError("bad value")
    rewrite(p, engine={"restart_on_reload": True, "kv_cache_memory_bytes": BAD_KV})
    assert (await reloader.reload())["engine_restart"] == {"kv_cache_memory_bytes": BAD_KV}
    await drain_tasks(p)
    assert p.config.engine["kv_cache_memory_bytes"] == KV and not p.gate.paused
    engine.fail = None
    rewrite(p, engine={"restart_on_reload": True})
    result = await reloader.reload()
    assert result["ok"] and not result["pending"] and result["engine_restart"] is None
    assert reloads(p, "error") == 0


# -- a memory shrink is in the config in force; only a file that changes the key moves it -----------


async def test_a_reload_of_an_unchanged_engine_table_keeps_the_guards_memory_shrink(tmp_path: Path) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path, restart_on_reload=True)
    engine = FakeEngine()
    p.guard.engine = engine
    await p.guard.restart("host_memory_low", {"kv_cache_memory_bytes": KV // 2}, drain=False)
    assert p.config.engine["kv_cache_memory_bytes"] == KV // 2
    rewrite(p, engine={"restart_on_reload": True}, admission={"limit": 3})  # a live change only
    result = await Reloader(p).reload()
    await drain_tasks(p)
    assert result["changed"] == {"admission": ["limit"]}
    assert result["engine_restart"] is None and not result["pending"]
    assert engine.kv == KV // 2 and len(engine.restarts) == 1
    assert p.config.engine["kv_cache_memory_bytes"] == KV // 2


async def test_after_a_memory_shrink_a_file_that_changes_the_setting_raises_it(tmp_path: Path) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path, restart_on_reload=True)
    engine = FakeEngine()
    p.guard.engine = engine
    reloader = Reloader(p)
    await p.guard.restart("host_memory_low", {"kv_cache_memory_bytes": KV // 2}, drain=False)
    rewrite(p, engine={"restart_on_reload": True, "kv_cache_memory_bytes": KV * 2})
    result = await reloader.reload()
    assert result["engine_restart"] == {"kv_cache_memory_bytes": KV * 2}
    await drain_tasks(p)
    assert engine.kv == KV * 2 and p.config.engine["kv_cache_memory_bytes"] == KV * 2
    rewrite(p, engine={"restart_on_reload": True, "kv_cache_memory_bytes": KV * 2})
    again = await reloader.reload()  # the same file again: nothing left to do
    assert again["engine_restart"] is None and not again["pending"]


# -- reload, memory restarts and recovery never run side by side ------------------------------------


async def test_restarting_is_true_during_recoverys_back_off_sleep() -> None:
    engine, asleep, wake = FakeEngine(), asyncio.Event(), asyncio.Event()

    async def sleep(_s: float) -> None:
        asleep.set()
        await wake.wait()

    guard = Guard(GuardConfig(), fake_gate(), engine, lambda _r, _d: None, FakeClock(), lambda: None, sleep)
    engine.dead = True
    task = asyncio.create_task(guard.recover())
    await asleep.wait()
    assert guard.restarting
    wake.set()
    await task
    assert not guard.restarting and not engine.dead


async def test_a_reload_during_a_restart_is_deferred_and_applied_after(tmp_path: Path) -> None:
    from controller.lifecycle.reload import Reloader

    p = parts_for(tmp_path, restart_on_reload=True)
    engine = FakeEngine()
    engine.hold = asyncio.Event()
    p.guard.engine = engine
    memory = asyncio.create_task(
        p.guard.restart("host_memory_low", {"kv_cache_memory_bytes": KV // 2}, False)
    )
    await settle()
    rewrite(p, engine={"restart_on_reload": True, "kv_cache_memory_bytes": KV * 2})
    result = await Reloader(p).reload()
    assert result["engine_restart"] == {"kv_cache_memory_bytes": KV * 2} and result["deferred"] is True
    engine.hold.set()
    await memory
    await drain_tasks(p)
    assert [o for o, _ in engine.restarts] == [
        {"kv_cache_memory_bytes": KV // 2},
        {"kv_cache_memory_bytes": KV * 2},
    ]
    assert engine.kv == KV * 2 and p.config.engine["kv_cache_memory_bytes"] == KV * 2


async def test_after_a_build_that_leaves_no_engine_the_gate_stays_paused_and_recovery_starts() -> None:
    engine = FakeEngine()
    engine.fail, engine.die_on_failure = RuntimeError("build failed"), True
    guard = guard_with(engine)
    with pytest.raises(RuntimeError):
        await guard.restart("host_memory_low", {"kv_cache_memory_bytes": KV // 2}, drain=False)
    assert guard.gate.paused  # requests wait for the recovery instead of entering a dead engine
    engine.fail = None
    watcher = asyncio.create_task(guard.watch())
    for _ in range(5):
        await settle()
    watcher.cancel()
    assert not engine.dead and not guard.gate.paused


# -- a pause no restart holds ends; a spent budget ends the daemon ----------------------------------


async def test_a_pause_left_by_a_late_death_notice_ends_when_no_restart_runs() -> None:
    """A death noticed after the engine was replaced (a slow stream's) paused the gate; the guard's
    watch finds the engine alive and no restart running, and resumes it."""
    engine = FakeEngine()
    guard = guard_with(engine)
    guard.notice_dead()  # also wakes the watch at once
    assert guard.gate.paused
    watcher = asyncio.create_task(guard.watch())
    await until(lambda: not guard.gate.paused)
    watcher.cancel()
    assert engine.restarts == []  # the engine in force was not restarted for it


async def test_a_spent_restart_budget_ends_the_daemons_run_with_a_non_zero_status(tmp_path: Path) -> None:
    from controller.lifecycle.daemon import EXIT_ENGINE_UNRECOVERABLE, Daemon

    d = Daemon(load_config(write_config(tmp_path / "config.toml", guard={"max_restarts_per_hour": 0})))
    engine = FakeEngine()
    d.parts.guard.engine = engine
    d._server_task = asyncio.create_task(asyncio.Event().wait())  # the data plane serving
    run = asyncio.create_task(d.run())
    engine.dead = True
    await d.parts.guard.recover()
    assert d.parts.guard.given_up.is_set()
    assert await asyncio.wait_for(run, 2.0) == EXIT_ENGINE_UNRECOVERABLE
    d._server_task.cancel()


# -- a memory restart that cannot build backs off, and the value that failed is the floor -----------

NEEDED = 16 << 20  # the smallest KV cache the fake engine builds (one max_model_len sequence)


class FloorEngine(FakeEngine):
    """Refuses a KV cache below ``NEEDED``, as vLLM refuses one that cannot hold a sequence; the
    engine on the old setting serves on."""

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append((overrides, build_first))
        if overrides["kv_cache_memory_bytes"] < NEEDED:
            raise ValueError("insufficient KV cache for max_model_len")
        self.kv = int(overrides["kv_cache_memory_bytes"])


async def test_a_memory_restart_that_fails_to_build_backs_off_and_never_retries_the_failed_value() -> None:
    from tests.helpers import obs

    engine, clock = FloorEngine(), FakeClock()
    guard = guard_with(
        engine, clock, consecutive_samples=1, cooldown_s=10.0, min_kv_cache_memory_bytes=1 << 20
    )
    tried: list[tuple[float, int]] = []
    for _ in range(60):  # a minute of 1 s ticks, host memory far below the margin throughout
        clock.advance(1.0)
        task = guard.on_observation(obs(now_mono=clock(), host_memory_available_bytes=0))
        if task is not None:
            tried.append((clock(), engine.restarts[-1][0]["kv_cache_memory_bytes"] if engine.restarts else 0))
            with contextlib.suppress(ValueError):
                await task
            tried[-1] = (tried[-1][0], engine.restarts[-1][0]["kv_cache_memory_bytes"])
    values = [kv for _, kv in tried]
    failed = [kv for kv in values if kv < NEEDED]
    assert values[0] == 1 << 20 and len(tried) <= 4  # was: every tick, at the 1 MiB floor
    assert tried[1][0] - tried[0][0] >= 20.0  # cooldown_s doubled after the failure
    for i, kv in enumerate(values):
        assert all(kv > earlier for earlier in values[:i] if earlier < NEEDED)  # above what failed
    assert len(failed) <= 2 and engine.kv >= NEEDED and not guard.gate.paused
    assert guard.memory_restarts.failed_floor["kv_cache_memory_bytes"] == max(failed)
