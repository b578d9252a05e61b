"""A reload is all or nothing, and runs one at a time: every part it swaps in is built before the
first live table changes, so a failure late in the reload leaves the daemon as it was."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from controller.admin.server import make_admin_app
from controller.config.load import load_config
from controller.control import build as build_module
from controller.control.samplers import FakeHostSource
from controller.lifecycle.parts import Parts, build_parts
from controller.lifecycle.reload import Reloader
from controller.profiles.load import ProfileError
from tests.helpers import settle, write_config


def parts_for(tmp_path: Path, **tables: dict[str, Any]) -> Parts:
    path = write_config(tmp_path / "config.toml", **tables)
    return build_parts(load_config(path), host_source=FakeHostSource(16 << 30))


def rewrite(p: Parts, **tables: dict[str, Any]) -> None:
    """A new config file for ``p`` that keeps its listeners (a port change would be a pending change)."""
    ports = {"server": {"port": p.config.server.port}, "admin": {"port": p.config.admin.port}}
    write_config(p.config.path, **{**ports, **tables})


def live_tables(p: Parts) -> dict[str, Any]:
    """What a reload may change, read from the parts themselves."""
    return {
        "config": p.config,
        "limit": p.gate.stats().limit,
        "classes": p.gate.classes,
        "aging_s": p.gate.aging_s,
        "max_queue": p.gate.max_queue,
        "ttft": p.gate.ttft,
        "window_s": p.window.window_s,
        "policy": p.loop.policy,
        "normalizer": p.loop.normalizer,
        "history": p.loop.history.maxlen,
        "slo": p.core.slo,
        "guard": p.guard.s,
        "stall_timeout_s": p.guard.stall.timeout_s,
        "cost_prior": p.cost.model.prior if p.cost is not None else None,
    }


async def test_a_reload_whose_cost_profile_fails_to_build_changes_no_live_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = parts_for(tmp_path, control={"policy": "static", "cost_profile": "cpu-tiny"})
    before = live_tables(p)
    rewrite(
        p,
        admission={"limit": 5, "max_queue": 9, "aging_s": 2.0},
        control={"policy": "static", "cost_profile": "cpu-smollm2", "window_s": 3.0, "history": 7},
        guard={"stall_timeout_s": 10.0},
    )

    def vanished(name: str) -> Any:  # the profile went away between validation and its use
        raise ProfileError(f"no profile named {name!r}")

    monkeypatch.setattr(build_module, "load_profile", vanished)
    result = await Reloader(p).reload()
    assert result["ok"] is False and "cpu-smollm2" in str(result["errors"])
    assert live_tables(p) == before
    assert p.registry.get_sample_value("autopilot_config_reloads_total", {"result": "error"}) == 1.0


async def test_a_reload_whose_policy_fails_to_build_changes_no_live_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = parts_for(tmp_path, control={"policy": "static"})
    before = live_tables(p)
    rewrite(p, admission={"limit": 5}, control={"policy": "static", "history": 7}, guard={"cooldown_s": 1.0})

    def fails(*_args: Any) -> Any:
        raise ValueError("the policy refused its parameters")

    monkeypatch.setattr(build_module, "policy_for", fails)
    result = await Reloader(p).reload()
    assert result["ok"] is False
    assert live_tables(p) == before


async def test_a_reload_that_builds_swaps_every_live_table_in(tmp_path: Path) -> None:
    p = parts_for(tmp_path, control={"policy": "static", "cost_profile": "cpu-tiny"})
    rewrite(
        p,
        admission={"limit": 5, "max_queue": 9, "aging_s": 2.0},
        control={"policy": "static", "cost_profile": "", "window_s": 3.0, "history": 7},
        guard={"stall_timeout_s": 10.0},
    )
    result = await Reloader(p).reload()
    assert result["ok"] is True
    after = live_tables(p)
    assert (after["limit"], after["max_queue"], after["aging_s"]) == (5, 9, 2.0)
    assert (after["window_s"], after["history"], after["stall_timeout_s"]) == (3.0, 7, 10.0)
    assert after["cost_prior"] is None and p.config.control.cost_profile == ""


# -- one reload at a time, none while the daemon starts or drains ----------------------------------

KV = 64 << 20


class FakeEngine:
    """An ``EngineControl`` whose restarts wait to be released one by one; it counts how many run
    at once."""

    memory_knob = "kv_cache_memory_bytes"
    died_out_of_memory = False
    dead = False

    def __init__(self) -> None:
        self.kv = KV
        self.restarts: list[dict[str, Any]] = []
        self.running = self.most_at_once = 0
        self.release: asyncio.Queue[None] = asyncio.Queue()

    def memory_settings(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": self.kv}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.restarts.append(overrides)
        try:
            await self.release.get()
        finally:
            self.running -= 1
        self.kv = int(overrides.get("kv_cache_memory_bytes", self.kv))

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


def with_fake_engine(tmp_path: Path) -> tuple[Parts, FakeEngine]:
    p = parts_for(tmp_path, engine={"restart_on_reload": True})
    engine = FakeEngine()
    p.guard.engine = engine
    return p, engine


def engine_file(p: Parts, kv: int) -> None:
    rewrite(p, engine={"restart_on_reload": True, "kv_cache_memory_bytes": kv})


async def until(predicate: Any) -> None:
    for _ in range(200):
        if predicate():
            return
        await settle()
    raise AssertionError("the condition never held")


async def test_two_quick_reloads_end_on_the_second_files_engine(tmp_path: Path) -> None:
    p, engine = with_fake_engine(tmp_path)
    reloader = Reloader(p)
    engine_file(p, KV * 2)
    first = await reloader.reload()
    assert first["engine_restart"] == {"kv_cache_memory_bytes": KV * 2}
    await until(lambda: engine.running == 1)
    engine_file(p, KV)  # back to the value the engine ran before the first reload
    second = await reloader.reload()
    assert second["ok"] is True and second["deferred"] is True
    engine.release.put_nowait(None)
    await until(lambda: engine.running == 1 and len(engine.restarts) == 2)
    engine.release.put_nowait(None)
    await until(lambda: engine.running == 0 and not p.guard.restarting)
    assert engine.restarts == [{"kv_cache_memory_bytes": KV * 2}, {"kv_cache_memory_bytes": KV}]
    assert engine.kv == KV and p.config.engine["kv_cache_memory_bytes"] == KV
    assert "engine" not in p.pending_changes


async def test_reloads_during_a_reload_restart_make_one_more_restart_to_the_newest_file(
    tmp_path: Path,
) -> None:
    p, engine = with_fake_engine(tmp_path)
    reloader = Reloader(p)
    engine_file(p, KV * 2)
    assert (await reloader.reload())["ok"] is True
    await until(lambda: engine.running == 1)
    for kv in (KV * 3, KV * 4):
        engine_file(p, kv)
        answer = await reloader.reload()
        assert answer["ok"] is True and answer["deferred"] is True
    engine.release.put_nowait(None)
    await until(lambda: len(engine.restarts) == 2 and engine.running == 1)
    engine.release.put_nowait(None)
    await until(lambda: engine.running == 0 and not p.guard.restarting)
    assert engine.most_at_once == 1
    assert engine.restarts == [{"kv_cache_memory_bytes": KV * 2}, {"kv_cache_memory_bytes": KV * 4}]
    assert engine.kv == KV * 4 and p.config.engine["kv_cache_memory_bytes"] == KV * 4


async def test_concurrent_reloads_are_answered_in_order(tmp_path: Path) -> None:
    p = parts_for(tmp_path, control={"policy": "static"})
    reloader = Reloader(p)
    rewrite(p, admission={"limit": 5}, control={"policy": "static"})
    first = asyncio.create_task(reloader.reload())
    await settle()
    rewrite(p, admission={"limit": 7}, control={"policy": "static"})
    second = asyncio.create_task(reloader.reload())
    assert (await first)["ok"] and (await second)["ok"]
    assert p.gate.stats().limit == 7 and p.config.admission.limit == 7


@pytest.mark.parametrize("phase", ["starting", "draining"])
async def test_a_reload_while_the_daemon_starts_or_drains_is_refused_with_the_reason(
    tmp_path: Path, phase: str
) -> None:
    p, engine = with_fake_engine(tmp_path)
    before = live_tables(p)
    setattr(p, phase, True)
    engine_file(p, KV * 2)
    rewrite(p, admission={"limit": 5}, engine={"restart_on_reload": True, "kv_cache_memory_bytes": KV * 2})
    result = await Reloader(p).reload()
    assert result["ok"] is False and result["unavailable"] == phase and result["errors"]
    await settle()
    assert live_tables(p) == before and engine.restarts == [] and not p.guard.restarting


async def test_the_daemon_refuses_reloads_until_its_startup_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller.lifecycle.daemon import Daemon

    d = Daemon(load_config(write_config(tmp_path / "config.toml")), install_signals=False)
    building = asyncio.Event()

    async def first_build() -> None:
        building.set()
        await asyncio.Event().wait()  # the first engine builds until the test ends startup

    async def no_admin() -> None:
        return None

    monkeypatch.setattr(d.parts.host, "start", first_build)
    monkeypatch.setattr(d, "_start_admin", no_admin)
    startup = asyncio.create_task(d.startup())
    await building.wait()
    result = await d.reloader.reload()
    assert result["unavailable"] == "starting"
    startup.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await startup
    await d.shutdown()
    assert (await d.reloader.reload())["unavailable"] == "draining"


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        ({"ok": True, "changed": {}}, 200),
        ({"ok": False, "errors": ["[admission] limit = 0: out of range"]}, 400),
        ({"ok": False, "unavailable": "starting", "errors": ["reload refused"]}, 503),
    ],
)
async def test_the_reload_endpoint_answers_503_while_the_daemon_starts_or_drains(
    answer: dict[str, Any], status: int
) -> None:
    async def reload_fn() -> dict[str, Any]:
        return answer

    app = make_admin_app(CollectorRegistry(), dict, lambda: (True, "serving"), reload_fn)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/reload", headers={"Content-Type": "application/json"})
        assert response.status == status
        assert await response.json() == answer
        assert (response.headers.get("Retry-After") is not None) == (status == 503)


# -- the live tables go through the control core's one door ------------------------------------------


async def test_a_reloaded_slo_is_the_one_the_ledger_the_meter_and_the_policy_read(tmp_path: Path) -> None:
    p = parts_for(tmp_path, control={"policy": "slo"}, slo={"ttft_s": 2.0, "tpot_s": 0.1})
    p.outcomes.started("before", "interactive", before_engine_s=0.0)
    assert p.outcomes.served("before", engine_ttft_s=1.5, tpot_s=0.01) == "good"  # within 2 s
    rewrite(p, control={"policy": "slo"}, slo={"ttft_s": 1.0, "tpot_s": 0.05})
    assert (await Reloader(p).reload())["ok"] is True
    slo = p.config.slo
    assert slo is not None and slo.default.ttft_s == 1.0
    assert p.core.slo is slo and p.capacity.slo is slo and p.loop.policy.slo is slo
    p.outcomes.started("after", "interactive", before_engine_s=0.0)
    assert p.outcomes.served("after", engine_ttft_s=1.5, tpot_s=0.01) == "ttft_missed"  # past 1 s


async def test_a_reload_that_leaves_the_policys_tables_alone_keeps_the_policy(tmp_path: Path) -> None:
    p = parts_for(tmp_path, control={"policy": "slo"}, slo={"ttft_s": 2.0, "tpot_s": 0.1})
    policy, normalizer = p.loop.policy, p.loop.normalizer
    rewrite(p, control={"policy": "slo"}, slo={"ttft_s": 2.0, "tpot_s": 0.1}, guard={"cooldown_s": 1.0})
    assert (await Reloader(p).reload())["ok"] is True
    assert p.loop.policy is policy and p.loop.normalizer is normalizer  # what it learnt stays
    assert p.guard.s.cooldown_s == 1.0 and p.core.settings.control == p.config.control
    rewrite(p, admission={"limit": 5}, control={"policy": "slo"}, slo={"ttft_s": 2.0, "tpot_s": 0.1})
    assert (await Reloader(p).reload())["ok"] is True
    assert p.loop.policy is not policy and p.gate.stats().limit == 5  # started at the new limit
