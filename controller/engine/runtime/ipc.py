"""How vLLM's engine processes wait for each other: a ``vllm.general_plugins`` entry point.

vLLM's EngineCore and its worker process exchange every step over a shared-memory ring buffer
(``vllm/distributed/device_communicators/shm_broadcast.py``). A reader that finds the buffer empty
spins on ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s, hard-coded) after its last read
before it sleeps on a zmq socket. Under load a message comes every few milliseconds, so both
processes spin from the first token to the last: the EngineCore while the worker runs the model,
the worker while the EngineCore schedules. On a GPU server with spare cores that costs nothing;
on a host with two or four cores the spinners take the CPU that the API server (HTTP, tokenizing,
streaming) and the rest of the host need. vLLM issues #19036 and #28836 and the open pull requests
#52814 and #52848 describe the same spin.

Shortening the window instead (so that readers sleep on the socket) is not safe in vLLM 0.32: the
writer's notification socket drops pings (send high-water mark 1), a reader can miss its wake-up
and waits for its poll timeout; measured here, generation fell to ~4 tokens/s. So this plugin keeps
the busy window and the shared-memory polling, and only makes each poll of the busy branch sleep
``poll_sleep_s`` (the approach of #52848): a step is seen at most that much later, and a waiting
process uses a fraction of a core instead of all of it.

vLLM loads general plugins in each process it starts (the EngineCore, each worker). The plugin acts
only when the daemon asks through :data:`ENV` (``[server] engine_poll_sleep_s``), so the entry point
changes nothing for a plain ``vllm serve`` run from the same environment.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

ENV = "VLLM_AUTOPILOT_ENGINE_POLL_SLEEP_S"
"""Seconds; set by the daemon in the environment its engine processes inherit."""


def poll_sleep_from_env(environ: Mapping[str, str] = os.environ) -> float | None:
    """The sleep the daemon asked for, or None (vLLM's own spin) when unset or 0."""
    raw = environ.get(ENV, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 0.01:
        raise ValueError(f"{ENV}={raw!r}: must be seconds in [0, 0.01]")
    return value or None


def set_poll_sleep(seconds: float, environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask the engine processes started from now on to sleep ``seconds`` per poll (0: vLLM's spin)."""
    if seconds:
        environ[ENV] = repr(float(seconds))
    else:
        environ.pop(ENV, None)


ENTRY_POINT = "autopilot_engine_poll_sleep"


def plugin_problem() -> str | None:
    """Why vLLM would not load this plugin in its processes, or None when it will."""
    from importlib.metadata import entry_points

    if not any(ep.name == ENTRY_POINT for ep in entry_points(group="vllm.general_plugins")):
        return "its vllm.general_plugins entry point is not installed: run `pip install -e .`"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} does not name {ENTRY_POINT}: add it"
    return None


def register() -> None:
    """The entry point: every shared-memory reader of this process sleeps between busy polls."""
    sleep_s = poll_sleep_from_env()
    if sleep_s is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    original = getattr(spin.wait, "_autopilot_original", spin.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(sleep_s)  # instead of sched_yield(): the caller polls the buffer again
            return
        original(self, timeout_ms)

    wait._autopilot_original = original  # type: ignore[attr-defined]
    spin.wait = wait  # type: ignore[method-assign]
