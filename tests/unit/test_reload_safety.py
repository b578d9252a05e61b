"""A reload is all or nothing, and runs one at a time: every part it swaps in is built before the
first live table changes, so a failure late in the reload leaves the daemon as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.config.load import load_config
from controller.control.samplers import FakeHostSource
from controller.lifecycle import parts as parts_module
from controller.lifecycle.parts import Parts, build_parts
from controller.lifecycle.reload import Reloader
from controller.sim.profile import ProfileError
from tests.helpers import write_config


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
        control={"policy": "static", "cost_profile": "cpu-smollm2", "window_seconds": 3.0, "history": 7},
        guard={"stall_timeout_s": 10.0},
    )

    def vanished(name: str) -> Any:  # the profile went away between validation and its use
        raise ProfileError(f"no profile named {name!r}")

    monkeypatch.setattr(parts_module, "load_profile", vanished)
    result = await Reloader(p).reload()
    assert result["ok"] is False and "cpu-smollm2" in str(result["errors"])
    assert live_tables(p) == before
    assert p.registry.get_sample_value("autopilot_config_reloads_total", {"result": "error"}) == 1.0


async def test_a_reload_whose_policy_fails_to_build_changes_no_live_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller.lifecycle import reload as reload_module

    p = parts_for(tmp_path, control={"policy": "static"})
    before = live_tables(p)
    rewrite(p, admission={"limit": 5}, control={"policy": "static", "history": 7}, guard={"cooldown_s": 1.0})

    def fails(_config: Any) -> Any:
        raise ValueError("the policy refused its parameters")

    monkeypatch.setattr(reload_module, "policy_for", fails)
    result = await Reloader(p).reload()
    assert result["ok"] is False
    assert live_tables(p) == before


async def test_a_reload_that_builds_swaps_every_live_table_in(tmp_path: Path) -> None:
    p = parts_for(tmp_path, control={"policy": "static", "cost_profile": "cpu-tiny"})
    rewrite(
        p,
        admission={"limit": 5, "max_queue": 9, "aging_s": 2.0},
        control={"policy": "static", "cost_profile": "", "window_seconds": 3.0, "history": 7},
        guard={"stall_timeout_s": 10.0},
    )
    result = await Reloader(p).reload()
    assert result["ok"] is True
    after = live_tables(p)
    assert (after["limit"], after["max_queue"], after["aging_s"]) == (5, 9, 2.0)
    assert (after["window_s"], after["history"], after["stall_timeout_s"]) == (3.0, 7, 10.0)
    assert after["cost_prior"] is None and p.config.control.cost_profile == ""
