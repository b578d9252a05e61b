"""engine/runtime/ipc.py: the poll sleep of vLLM's engine processes, asked for through the environment."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from controller.config import load as config_module
from controller.engine.runtime import ipc


@pytest.mark.parametrize(
    ("raw", "want"),
    [(None, None), ("", None), ("0", None), ("0.0005", 0.0005), ("0.01", 0.01)],
)
def test_poll_sleep_from_env(raw: str | None, want: float | None) -> None:
    environ = {} if raw is None else {ipc.ENV: raw}
    assert ipc.poll_sleep_from_env(environ) == want


@pytest.mark.parametrize("raw", ["-1", "0.5", "soon"])
def test_a_bad_value_names_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ipc.ENV):
        ipc.poll_sleep_from_env({ipc.ENV: raw})


def test_set_poll_sleep_sets_and_clears_the_variable() -> None:
    environ: dict[str, str] = {}
    ipc.set_poll_sleep(0.0005, environ)
    assert ipc.poll_sleep_from_env(environ) == 0.0005
    ipc.set_poll_sleep(0.0, environ)
    assert ipc.ENV not in environ


class Reader:
    """The attributes of a reader's SpinCondition that ``wait`` reads."""

    def __init__(self, last_read: float, busy_loop_s: float = 1.0) -> None:
        self.last_read = last_read
        self.busy_loop_s = busy_loop_s


def test_register_without_the_variable_leaves_vllm_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ipc.ENV, raising=False)
    before = shm_broadcast.SpinCondition.wait
    ipc.register()
    assert shm_broadcast.SpinCondition.wait is before


def test_register_sleeps_in_the_busy_window_and_keeps_the_idle_path(monkeypatch: pytest.MonkeyPatch) -> None:
    original_calls: list[Any] = []
    sleeps: list[float] = []

    def vllm_wait(self: Any, timeout_ms: int | None = None) -> None:
        original_calls.append(timeout_ms)

    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", vllm_wait)
    monkeypatch.setattr(ipc.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(ipc.time, "sleep", sleeps.append)
    monkeypatch.setenv(ipc.ENV, "0.0005")
    ipc.register()
    ipc.register()  # loaded twice in one process: wraps vLLM's wait once, not itself
    wait = shm_broadcast.SpinCondition.wait
    assert wait._autopilot_original is vllm_wait  # type: ignore[attr-defined]
    wait(Reader(last_read=99.5), 10)  # read 0.5 s ago, inside vLLM's 1 s busy window: sleep, poll again
    assert (sleeps, original_calls) == ([0.0005], [])
    wait(Reader(last_read=98.0), 10)  # idle for 2 s: vLLM's own path (it sleeps on its socket)
    assert (sleeps, original_calls) == ([0.0005], [10])


def test_the_plugin_is_installed_and_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert ipc.plugin_problem() is None  # `pip install -e .` registered the entry point
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    assert "add it" in (ipc.plugin_problem() or "")
    monkeypatch.setenv("VLLM_PLUGINS", f"someone_else,{ipc.ENTRY_POINT}")
    assert ipc.plugin_problem() is None


def test_default_is_on_only_for_small_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert config_module.default_engine_poll_sleep() == 0.0002
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert config_module.default_engine_poll_sleep() == 0.0
