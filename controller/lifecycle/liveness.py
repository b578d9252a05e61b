"""Liveness: an engine that is alive but makes no progress is a failed engine.

vLLM notices an EngineCore that died (``errored``), not one that hangs: a deadlocked worker, a wedged
collective or a process stopped by a signal keeps every request inside it waiting for ever, their
slots held. The progress signal is the stat logger's step record (``TelemetryWindow``'s
``last_step_age_s``: every step that produced output). An engine is stalled when requests hold slots
in it and no step was seen for ``[guard] stall_timeout_s``, counted from the later of its last step
and the moment work arrived (an engine idle for an hour is not stalled the instant a request comes).
The guard then recovers it as it recovers a crash (``Guard.watch``).
"""

from __future__ import annotations

import math

from controller.admission.errors import GateRejected


class StallWatch:
    """Pure apart from its one timestamp: when the current busy spell began."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        """0 turns the check off."""
        self._busy_since: float | None = None

    def reset(self) -> None:
        """Forget the busy spell (a restart, or the guard busy with the engine itself)."""
        self._busy_since = None

    def check(self, now: float, in_engine: int, last_step_age_s: float | None) -> str | None:
        """The reason the engine counts as stalled now, or None."""
        if in_engine <= 0 or self.timeout_s <= 0:
            self._busy_since = None
            return None
        if self._busy_since is None:
            self._busy_since = now
        last_step = now - last_step_age_s if last_step_age_s is not None else -math.inf
        quiet_s = now - max(self._busy_since, last_step)
        if quiet_s < self.timeout_s:
            return None
        self._busy_since = None
        return (
            f"{in_engine} requests inside the engine and no engine step for {quiet_s:.1f}s "
            f"(stall_timeout_s = {self.timeout_s:g})"
        )


def no_engine(retry_after_s: float, why: str) -> GateRejected:
    """The 503 a new request gets while no engine can serve (queued requests keep waiting)."""
    retry = max(1, min(60, math.ceil(retry_after_s)))
    return GateRejected(f"no engine can serve now ({why}); retry later", 503, retry, "engine_unavailable")
