"""A secret never leaves the daemon: not through an engine restart's record (/state, the log), not
through a config error (the log, the /reload answer, check-config), not through the command line's
overlay kept for reloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.admin.status import state
from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.config.load import GuardConfig, load_config
from controller.config.secrets import REDACTED
from controller.control.samplers import FakeHostSource
from controller.lifecycle import guard as guard_module
from controller.lifecycle import reload as reload_module
from controller.lifecycle.guard import Guard
from controller.lifecycle.parts import Parts, build_parts
from controller.lifecycle.reload import Reloader
from tests.helpers import settle, write_config

HF_TOKEN = "hf_secret_token_123"


class Recorder:
    """A structlog logger that keeps every event and its fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    info = warning = error = critical = _record

    def text(self) -> str:
        return json.dumps(self.events, default=str)


class FakeEngine:
    """An ``EngineControl`` whose restarts always build; it keeps the overrides it was given."""

    memory_knob = "kv_cache_memory_bytes"
    dead = False

    def __init__(self) -> None:
        self.restarts: list[dict[str, Any]] = []

    def memory_settings(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": 64 << 20}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append(overrides)

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(guard_module, "log", recorder)
    monkeypatch.setattr(reload_module, "log", recorder)
    return recorder


def parts_for(tmp_path: Path, **tables: dict[str, Any]) -> Parts:
    path = write_config(tmp_path / "config.toml", **tables)
    return build_parts(load_config(path), host_source=FakeHostSource(16 << 30))


async def test_a_restarts_record_and_log_show_no_secret_override(logs: Recorder) -> None:
    engine = FakeEngine()
    gate = AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)
    guard = Guard(GuardConfig(), gate, engine, lambda _r, _d: None, FakeClock(), lambda: None)
    await guard.restart("config_reload", {"hf_token": HF_TOKEN, "max_model_len": 1024}, drain=False)
    assert engine.restarts == [{"hf_token": HF_TOKEN, "max_model_len": 1024}]  # the engine gets it
    assert guard.last_restart is not None
    assert guard.last_restart["overrides"] == {"hf_token": REDACTED, "max_model_len": 1024}
    assert HF_TOKEN not in logs.text() and "engine_restarted" in logs.text()


async def test_a_reload_that_changes_the_hf_token_shows_it_nowhere(tmp_path: Path, logs: Recorder) -> None:
    p = parts_for(tmp_path, engine={"restart_on_reload": True})
    engine = FakeEngine()
    p.guard.engine = engine
    ports = {"server": {"port": p.config.server.port}, "admin": {"port": p.config.admin.port}}
    write_config(p.config.path, **ports, engine={"restart_on_reload": True, "hf_token": HF_TOKEN})
    result = await Reloader(p).reload()
    assert result["ok"] is True and result["engine_restart"] == {"hf_token": REDACTED}
    for _ in range(20):
        await settle()
    assert engine.restarts == [{"hf_token": HF_TOKEN}]
    assert p.config.engine["hf_token"] == HF_TOKEN  # the config in force follows the engine
    shown = json.dumps(state(p), default=str)
    assert HF_TOKEN not in shown and HF_TOKEN not in logs.text()
    assert p.guard.last_restart is not None and p.guard.last_restart["overrides"] == {"hf_token": REDACTED}
