"""What a reload changes, and which of it can apply live.

Reload parses and validates the whole new file first (``load_config``); only then is it compared with
the config in force, its ``[engine]`` with the file values the engine runs (``diff_config``'s
``engine_from``): the memory guard's own shrink is in the config in force, and a file that did not
touch the key must not undo it. ``[admission]``, ``[control]``, ``[guard]`` and ``[slo]`` apply at
once, without failing any request in flight (the SLO never needs an engine restart). ``[engine]``,
``[server]`` and ``[admin]`` need a new engine or new listeners: they are reported as pending and keep
their old values until the daemon restarts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from controller.config.load import Config, describe

LIVE_TABLES = ("admission", "control", "guard", "slo")
RESTART_TABLES = ("engine", "server", "admin")


@dataclass(frozen=True)
class ConfigDiff:
    live: dict[str, list[str]]
    """Changed keys per live table."""
    pending: dict[str, list[str]]
    """Changed keys per table that needs a restart."""

    @property
    def empty(self) -> bool:
        return not self.live and not self.pending


def diff_config(old: Config, new: Config, engine_from: dict[str, Any] | None = None) -> ConfigDiff:
    """What changed from ``old`` to ``new``; ``[engine]`` is compared with ``engine_from`` where given
    (the [engine] of the file the engine runs, before the guard's changes), else with ``old``'s."""
    if engine_from is not None:
        old = dataclasses.replace(old, engine=engine_from)
    a, b = describe(old, secrets=True), describe(new, secrets=True)  # a changed key is a change
    changed: dict[str, list[str]] = {}
    for table in (*LIVE_TABLES, *RESTART_TABLES):
        was, now = a[table] or {}, b[table] or {}  # [slo] is None when the file has none
        keys = sorted(set(was) | set(now))
        moved = [k for k in keys if was.get(k) != now.get(k)]
        if moved:
            changed[table] = moved
    return ConfigDiff(
        live={t: k for t, k in changed.items() if t in LIVE_TABLES},
        pending={t: k for t, k in changed.items() if t in RESTART_TABLES},
    )


def merge_live(current: Config, new: Config) -> Config:
    """The config in force after a reload: the new live tables, the current restart-only ones."""
    return dataclasses.replace(
        current,
        admission=new.admission,
        control=new.control,
        guard=new.guard,
        slo=new.slo,
        restart_on_reload=new.restart_on_reload,
    )


def engine_overrides(current: Config, new: Config, diff: ConfigDiff) -> dict[str, Any] | None:
    """The engine arguments a guarded restart would change, or None when a changed key was removed
    (its vLLM default is not ours to guess: that change waits for a service restart)."""
    keys = [k for k in diff.pending.get("engine", []) if k != "restart_on_reload"]
    if not keys or any(k not in new.engine for k in keys):
        return None
    return {k: new.engine[k] for k in keys}
