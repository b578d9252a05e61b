"""The invariants of ``bench chaos``, checked on what the run recorded (pure, so tested on made-up runs).

1. Every request ends with a response or a clear error within its deadline: completed, vLLM's error
   event mid-stream, or a 4xx/5xx with a JSON error (and Retry-After with a 429). A stalled reader the
   daemon cut off (``[server] send_timeout_s``) is allowed; any other cut connection or hang is not.
2. Every fault did what it must (``faults``).
3. The gate's counters return to zero when the load stops (nothing in flight, queued or pending).
4. The daemon's resident memory does not grow (a least-squares line after the warm-up).
5. The daemon serves at the end (one more request completes).
6. A streamed completion with more prompts than the admission limit does not hold the gate: the
   plain streams sent while one was in flight are not all refused with 429 (some are served).
7. After the daemon stops nothing is left: no EngineCore process it started, no ``/dev/shm`` file
   that no process holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controller.bench.chaos.faults import FaultRecord
from controller.bench.chaos.load import ChaosOutcome
from controller.bench.experiments.soak import line_rise


@dataclass
class EndState:
    """What was found once the load stopped, and after the daemon stopped."""

    gate: dict[str, Any] = field(default_factory=dict)
    """The gate's counters in /state when they settled (or at the timeout)."""
    served_at_end: bool = False
    final_detail: str = ""
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, the daemon process's resident bytes)."""
    exit_code: int | None = None
    killed_leftovers: bool = False
    """The stop had to SIGKILL what was left of the daemon's process group."""
    engine_cores_alive: list[int] = field(default_factory=list)
    shm_orphans: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ChaosVerdictLimits:
    """What a chaos soak tolerates of the daemon's memory before its verdict fails."""

    warmup_s: float = 60.0
    """RSS before this is left out of the fit (imports, the first engine's build)."""
    max_rss_growth: float = 0.10
    """Largest rise of the fitted RSS line over the run, relative to its start."""


def bad_ending(o: ChaosOutcome) -> str | None:
    """Why an outcome breaks invariant 1, or None."""
    if o.end == "hung":
        return f"{o.kind} request (priority {o.priority}) at {o.start_s:.0f} s: {o.detail}"
    if o.elapsed_s > o.deadline_s:
        return f"{o.kind} request at {o.start_s:.0f} s ended after its deadline ({o.elapsed_s:.0f} s)"
    if o.end == "cut":
        if o.kind == "stall" and o.status == 200:
            return None  # [server] send_timeout_s ended a reader that stopped taking the stream
        return f"{o.kind} request at {o.start_s:.0f} s: connection cut without an error ({o.detail})"
    if not o.clear:
        return f"{o.kind} request at {o.start_s:.0f} s: an unclear error ({o.detail})"
    return None


@dataclass(frozen=True)
class HeldGate:
    """The plain streams sent while a ``stream_over_limit`` request was in flight (after its 200)."""

    sent: int
    served: int
    refused_429: int

    @property
    def held(self) -> bool:
        """Refused en masse: none served while some were refused, as when the wide stream holds the
        slots it has while it waits for ones that never free. Not a share: while a stream that takes
        the whole limit runs, the gate may rightly refuse an interactive request that cannot start
        within its class's deadline or TTFT bound. An engine rebuild's 503s are the kill's, not the
        gate's, so they count on neither side."""
        return self.refused_429 > 0 and self.served == 0


def held_gate(outcomes: Sequence[ChaosOutcome]) -> HeldGate:
    spans = [
        (o.start_s, o.start_s + o.elapsed_s)
        for o in outcomes
        if o.kind == "stream_over_limit" and o.status == 200
    ]
    during = [o for o in outcomes if o.kind == "stream" and any(a <= o.start_s < b for a, b in spans)]
    served = sum(o.end == "completed" for o in during)
    refused = sum(o.end == "http_error" and o.status == 429 for o in during)
    return HeldGate(len(during), served, refused)


def verdict(
    outcomes: Sequence[ChaosOutcome], faults: Sequence[FaultRecord], end: EndState, limits: ChaosVerdictLimits
) -> tuple[bool, list[str], dict[str, Any]]:
    """(passed, reasons for failing, the figures checked)."""
    reasons: list[str] = []
    bad = [why for o in outcomes if (why := bad_ending(o)) is not None]
    reasons += bad[:10] + ([f"... and {len(bad) - 10} more bad endings"] if len(bad) > 10 else [])
    reasons += [
        f"fault {f.fault} at {f.at_s:.0f} s: expected {f.expected}; {f.observed}" for f in faults if not f.ok
    ]
    busy = {k: end.gate.get(k) for k in ("in_flight", "queue_depth", "pending") if end.gate.get(k)}
    if busy or not end.gate:
        reasons.append(f"the gate's counters did not return to zero after the load: {busy or 'no /state'}")
    points = [(t, float(v)) for t, v in end.rss if t >= limits.warmup_s]
    growth = line_rise(points)
    if growth is not None and growth > limits.max_rss_growth:
        reasons.append(f"the daemon's resident memory grew {growth:.1%} (limit {limits.max_rss_growth:.0%})")
    beside = held_gate(outcomes)
    if beside.held:
        reasons.append(
            f"a stream over the admission limit held the gate: of {beside.sent} plain streams sent "
            f"while one was in flight, {beside.refused_429} were refused with 429, {beside.served} served"
        )
    if not end.served_at_end:
        reasons.append(f"the daemon did not serve a request at the end: {end.final_detail}")
    if end.exit_code != 0:
        reasons.append(f"the daemon exited with {end.exit_code} on SIGTERM")
    if end.killed_leftovers:
        reasons.append("processes of the daemon's group were left after it exited (SIGKILLed)")
    if end.engine_cores_alive:
        reasons.append(f"EngineCore processes left running: {end.engine_cores_alive}")
    if end.shm_orphans:
        reasons.append(f"/dev/shm files left that no process holds: {end.shm_orphans[:5]}")
    endings = Counter(
        f"{o.kind}:{o.end}" + (f":{o.status}" if o.end == "http_error" else "") for o in outcomes
    )
    figures = {
        "requests": len(outcomes),
        "bad_endings": len(bad),
        "endings": dict(sorted(endings.items())),
        "faults": dict(Counter(f.fault for f in faults)),
        "faults_failed": sum(not f.ok for f in faults),
        "beside_stream_over_limit": asdict(beside),
        "longest_s": max((o.elapsed_s for o in outcomes), default=0.0),
        "gate_at_end": end.gate,
        "rss_growth": growth,
        "rss_first_mib": points[0][1] / 2**20 if points else None,
        "rss_last_mib": points[-1][1] / 2**20 if points else None,
        "served_at_end": end.served_at_end,
        "exit_code": end.exit_code,
        "engine_cores_seen_left": end.engine_cores_alive,
        "shm_orphans": end.shm_orphans,
    }
    return not reasons, reasons, figures
