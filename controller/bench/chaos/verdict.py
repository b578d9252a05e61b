"""The invariants of ``bench chaos``, checked on what the run recorded (pure, so tested on made-up runs).

Each is one :class:`Invariant` (its name, held or not, its figures), in the order of the table the
run prints:

1. ``requests_end``: every request of the load ends with a response or a clear error within its
   deadline: completed, vLLM's error event mid-stream, or a 4xx/5xx with a JSON error (and
   Retry-After with a 429). A stalled reader the daemon cut off (``[server] send_timeout_s``) is
   allowed; any other cut connection or hang is not.
2. ``ordinary_answered``: the service answers ordinary requests throughout: every probe ends with a
   response or a clear error, and of the probes sent outside an engine rebuild (a fault of
   :data:`~controller.bench.chaos.faults.REBUILDS`, to its ``until_s`` and :data:`REBUILD_GRACE_S`)
   at least ``min_probe_served`` are served.
3. ``loop_ticks``: the control loop ticks: the longest stretch without a tick (its count in
   ``/state``), less what of it an engine rebuild covers, is at most ``max_tick_gap_s``, the stretch
   from the last tick to the end of the run included.
4. ``faults``: every fault did what it must (``faults``).
5. ``hostile``: the daemon ended every hostile connection within the client's hold (``hostile``).
6. ``gate_zero``: the gate's counters return to zero when the load stops (nothing in flight, queued
   or pending).
7. ``gate_not_held``: a streamed completion with more prompts than the admission limit does not hold
   the gate: the plain streams sent while one was in flight are not all refused with 429.
8. ``demand_counted``: every request served counts as new demand (the gate's arrivals less its
   retries rose at least by the requests that completed): a reused ``X-Request-Id`` hides none of
   it from ``autopilot_saturation``.
9. ``rss_flat``: the daemon's resident memory does not grow (a least-squares line after the warm-up).
10. ``nothing_grows``: after the load the daemon holds at most ``max_fd_growth`` more file
    descriptors and ``max_thread_growth`` more threads than after the warm-up, and one EngineCore.
11. ``serves_at_end``: one more request completes.
12. ``clean_exit``: the daemon exits 0 on SIGTERM and leaves nothing: no process of its group, no
    EngineCore it started, no ``/dev/shm`` file that no process holds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controller.bench.chaos.faults import REBUILDS, FaultRecord
from controller.bench.chaos.hostile import HostileRecord
from controller.bench.chaos.load import ChaosOutcome
from controller.bench.experiments.soak import line_rise
from controller.percentile import percentile

REBUILD_GRACE_S = 5.0
"""After a new engine serves, requests sent this long still count as sent during the rebuild (the
queue it left drains first)."""
Window = tuple[float, float]


@dataclass
class EndState:
    """What was sampled while the load ran, found once it stopped, and after the daemon stopped."""

    gate: dict[str, Any] = field(default_factory=dict)
    """The gate's counters in /state when they settled (or at the timeout)."""
    served_at_end: bool = False
    final_detail: str = ""
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, the daemon process's resident bytes)."""
    fds: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, the daemon process's open file descriptors)."""
    threads: list[tuple[float, int]] = field(default_factory=list)
    ticks: list[tuple[float, int | None]] = field(default_factory=list)
    """(seconds since the start, the loop's tick count in /state; None when not read)."""
    fds_end: int | None = None
    """The daemon's open file descriptors once the load and the hostile clients ended and the gate
    settled."""
    threads_end: int | None = None
    engine_cores_end: int | None = None
    """EngineCore processes under the daemon at that moment."""
    demand_start: int | None = None
    """The gate's new demand (arrivals less retries) when the load started."""
    demand_end: int | None = None
    """... and after the last request."""
    exit_code: int | None = None
    killed_leftovers: bool = False
    """The stop had to SIGKILL what was left of the daemon's process group."""
    engine_cores_alive: list[int] = field(default_factory=list)
    shm_orphans: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ChaosVerdictLimits:
    """What a chaos soak tolerates before its verdict fails."""

    warmup_s: float = 60.0
    """RSS, file descriptors and threads before this are left out (imports, the first engine's build)."""
    max_rss_growth: float = 0.10
    """Largest rise of the fitted RSS line over the run, relative to its start."""
    min_probe_served: float = 0.8
    """Share of the probes sent outside engine rebuilds that must be served (not refused): the gate
    may refuse an interactive request under the load now and then, never most of them."""
    max_tick_gap_s: float = 15.0
    """Longest stretch without a tick of the control loop, outside engine rebuilds."""
    max_fd_growth: int = 64
    max_thread_growth: int = 16


@dataclass(frozen=True)
class Invariant:
    """One row of the verdict's table."""

    name: str
    claim: str
    held: bool
    figures: str
    reasons: tuple[str, ...] = ()
    """Why it failed, one line each (empty when held)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ChaosVerdict:
    invariants: tuple[Invariant, ...]
    figures: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(i.held for i in self.invariants)

    @property
    def reasons(self) -> list[str]:
        return [r for i in self.invariants for r in i.reasons]

    def table(self) -> str:
        """The invariants as a markdown table (what the run prints and the results page shows)."""
        rows = ["| invariant | verdict | figures |", "| --- | --- | --- |"]
        rows += [
            f"| {i.claim} | **{'held' if i.held else 'FAILED'}** | {i.figures} |" for i in self.invariants
        ]
        return "\n".join(rows)


def bad_ending(o: ChaosOutcome) -> str | None:
    """Why an outcome breaks invariant 1 (or 2, for a probe), or None."""
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


def _capped(lines: list[str], n: int = 10) -> tuple[str, ...]:
    return tuple(lines[:n] + ([f"... and {len(lines) - n} more"] if len(lines) > n else []))


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


def rebuild_windows(faults: Sequence[FaultRecord]) -> list[Window]:
    """From each rebuilding fault to its end, and :data:`REBUILD_GRACE_S` more."""
    return [
        (f.at_s, (f.until_s if f.until_s is not None else f.at_s) + REBUILD_GRACE_S)
        for f in faults
        if f.fault in REBUILDS
    ]


def _covered(a: float, b: float, windows: Sequence[Window]) -> float:
    """How much of [a, b] the (possibly overlapping) windows cover."""
    covered, reach = 0.0, a
    for lo, hi in sorted(windows):
        lo, hi = max(lo, reach), min(hi, b)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


def longest_tick_gap(ticks: Sequence[tuple[float, int | None]], windows: Sequence[Window]) -> float | None:
    """The longest stretch between two samples at which the tick count moved (the first sample and
    the last counting as marks), less what rebuild windows cover; None when no count was read."""
    read = [(t, n) for t, n in ticks if n is not None]
    if not read:
        return None
    marks = [read[0][0]]
    marks += [t for (_, before), (t, n) in itertools.pairwise(read) if n > before]
    marks.append(ticks[-1][0])
    return max(b - a - _covered(a, b, windows) for a, b in itertools.pairwise(marks))


def _requests_end(outcomes: Sequence[ChaosOutcome]) -> Invariant:
    bad = [why for o in outcomes if (why := bad_ending(o)) is not None]
    kinds = Counter(o.kind for o in outcomes)
    longest = max((o.elapsed_s for o in outcomes), default=0.0)
    figures = (
        f"{len(outcomes):,} requests of {len(kinds)} kinds, {len(bad)} bad endings; longest {longest:.1f} s"
    )
    claim = "every request ends with a response or a clear 4xx/5xx within its deadline"
    return Invariant("requests_end", claim, not bad and bool(outcomes), figures, _capped(bad))


def _ordinary_answered(
    probes: Sequence[ChaosOutcome], windows: Sequence[Window], limits: ChaosVerdictLimits
) -> Invariant:
    claim = "the service answers ordinary requests throughout (the probe)"
    bad = [why for o in probes if (why := bad_ending(o)) is not None]
    outside = [o for o in probes if not any(a <= o.start_s <= b for a, b in windows)]
    served = [o for o in outside if o.end == "completed"]
    share = len(served) / len(outside) if outside else 0.0
    latency = [o.elapsed_s for o in served]
    p50, p99 = percentile(latency, 50), percentile(latency, 99)
    endings = Counter(o.end + (f" {o.status}" if o.end == "http_error" else "") for o in outside)
    figures = (
        f"{len(probes)} probes, {len(bad)} without a clear answer; {len(served)} of {len(outside)} outside "
        f"rebuilds served ({share:.0%}, at least {limits.min_probe_served:.0%}), "
        + (f"p50 {p50:.2f} s, p99 {p99:.2f} s" if p50 is not None and p99 is not None else "none served")
        + (
            f"; others: {dict(endings - Counter({'completed': len(served)}))}"
            if len(served) < len(outside)
            else ""
        )
    )
    reasons = list(bad)
    if share < limits.min_probe_served:
        reasons.append(
            f"the probe was served {share:.0%} of the time outside engine rebuilds "
            f"(at least {limits.min_probe_served:.0%}): {dict(endings)}"
        )
    return Invariant("ordinary_answered", claim, not reasons, figures, _capped(reasons))


def _loop_ticks(end: EndState, windows: Sequence[Window], limits: ChaosVerdictLimits) -> Invariant:
    claim = "the control loop ticks"
    gap = longest_tick_gap(end.ticks, windows)
    read = [n for _, n in end.ticks if n is not None]
    if gap is None:
        return Invariant("loop_ticks", claim, False, "no tick count read", ("/state gives no tick count",))
    figures = (
        f"{read[-1] - read[0]:,} ticks in {end.ticks[-1][0] - end.ticks[0][0]:.0f} s; the longest stretch "
        f"without one, outside rebuilds, {gap:.0f} s (at most {limits.max_tick_gap_s:.0f} s)"
    )
    held = gap <= limits.max_tick_gap_s
    reasons = () if held else (f"the control loop did not tick for {gap:.0f} s outside engine rebuilds",)
    return Invariant("loop_ticks", claim, held, figures, reasons)


def _faults(faults: Sequence[FaultRecord]) -> Invariant:
    failed = [
        f"fault {f.fault} at {f.at_s:.0f} s: expected {f.expected}; {f.observed}" for f in faults if not f.ok
    ]
    kinds = Counter(f.fault for f in faults)
    figures = f"{len(faults)} faults of {len(kinds)} kinds, {len(failed)} failed"
    return Invariant("faults", "every fault did what it must", not failed, figures, _capped(failed))


def _hostile(hostile: Sequence[HostileRecord]) -> Invariant:
    claim = "the daemon ends every hostile connection (idle, slow, endless, stalled)"
    failed = [
        f"{h.client} at {h.at_s:.0f} s: {h.ended} of {h.connections} connections ended by the daemon "
        f"{h.answers}{'; ' + h.detail if h.detail else ''}"
        for h in hostile
        if not h.ok
    ]
    longest = max((h.longest_s for h in hostile if h.longest_s is not None), default=None)
    figures = (
        f"{len(hostile)} clients, {sum(h.connections for h in hostile):,} connections, "
        f"{sum(h.ended for h in hostile):,} ended by the daemon"
        + (f", the longest after {longest:.1f} s" if longest is not None else "")
    )
    return Invariant("hostile", claim, not failed, figures, _capped(failed))


def _gate_zero(end: EndState) -> Invariant:
    busy = {k: end.gate.get(k) for k in ("in_flight", "queue_depth", "pending") if end.gate.get(k)}
    held = bool(end.gate) and not busy
    figures = ", ".join(f"{k} {end.gate.get(k, '?')}" for k in ("in_flight", "queue_depth", "pending"))
    reasons = (
        () if held else (f"the gate's counters did not return to zero after the load: {busy or 'no /state'}",)
    )
    return Invariant("gate_zero", "the gate's counters back to zero", held, figures, reasons)


def _gate_not_held(outcomes: Sequence[ChaosOutcome]) -> Invariant:
    beside = held_gate(outcomes)
    figures = (
        f"{beside.sent} plain streams sent while one was in flight: {beside.served} served, "
        f"{beside.refused_429} refused with 429"
    )
    reasons = (
        (
            f"a stream over the admission limit held the gate: of {beside.sent} plain streams sent "
            f"while one was in flight, {beside.refused_429} were refused with 429, {beside.served} served"
        ),
    )
    claim = "a stream over the admission limit does not hold the gate"
    return Invariant("gate_not_held", claim, not beside.held, figures, reasons if beside.held else ())


def _demand_counted(outcomes: Sequence[ChaosOutcome], end: EndState) -> Invariant:
    claim = "every request served counts as demand (a reused X-Request-Id hides none)"
    served = sum(o.end == "completed" for o in outcomes) + end.served_at_end
    reused = sum(o.kind == "reused_id" for o in outcomes)
    if end.demand_start is None or end.demand_end is None:
        return Invariant(
            "demand_counted", claim, False, "gate totals not read", ("no gate totals in /state",)
        )
    counted = end.demand_end - end.demand_start
    figures = (
        f"{served:,} requests served, {counted:,} counted as new demand; {reused} sent with one reused id"
    )
    held = counted >= served
    reasons = () if held else (f"{served - counted} served requests were not counted as demand",)
    return Invariant("demand_counted", claim, held, figures, reasons)


def _rss_flat(end: EndState, limits: ChaosVerdictLimits) -> tuple[Invariant, float | None]:
    points = [(t, float(v)) for t, v in end.rss if t >= limits.warmup_s]
    growth = line_rise(points)
    figures = (
        f"{points[0][1] / 2**20:,.0f} MiB after the warm-up, {points[-1][1] / 2**20:,.0f} MiB at the end: "
        f"a fitted {growth or 0.0:+.1%} (at most {limits.max_rss_growth:.0%})"
        if points
        else "no samples after the warm-up"
    )
    held = growth is None or growth <= limits.max_rss_growth
    reasons = (
        ()
        if held
        else (f"the daemon's resident memory grew {growth:.1%} (limit {limits.max_rss_growth:.0%})",)
    )
    return Invariant("rss_flat", "the daemon's RSS flat", held, figures, reasons), growth


def _after_warmup(series: Sequence[tuple[float, int]], warmup_s: float) -> int | None:
    return next((v for t, v in series if t >= warmup_s), series[-1][1] if series else None)


def _nothing_grows(end: EndState, limits: ChaosVerdictLimits) -> Invariant:
    claim = "nothing else grows: file descriptors, threads, engines"
    fds0, threads0 = _after_warmup(end.fds, limits.warmup_s), _after_warmup(end.threads, limits.warmup_s)
    peak_fds = max((v for _, v in end.fds), default=None)
    reasons = []
    if fds0 is None or end.fds_end is None or end.fds_end - fds0 > limits.max_fd_growth:
        reasons.append(
            f"open files {fds0} after the warm-up, {end.fds_end} after the load "
            f"(at most +{limits.max_fd_growth})"
        )
    if threads0 is None or end.threads_end is None or end.threads_end - threads0 > limits.max_thread_growth:
        reasons.append(
            f"threads {threads0} after the warm-up, {end.threads_end} after the load "
            f"(at most +{limits.max_thread_growth})"
        )
    if end.engine_cores_end != 1:
        reasons.append(f"{end.engine_cores_end} EngineCore processes after the load, not one")
    figures = (
        f"open files {fds0} -> {end.fds_end} (peak {peak_fds}), threads {threads0} -> {end.threads_end}, "
        f"EngineCores {end.engine_cores_end}"
    )
    return Invariant("nothing_grows", claim, not reasons, figures, tuple(reasons))


def _serves_at_end(end: EndState) -> Invariant:
    reasons = (
        () if end.served_at_end else (f"the daemon did not serve a request at the end: {end.final_detail}",)
    )
    figures = "served" if end.served_at_end else end.final_detail
    return Invariant(
        "serves_at_end", "one more request served at the end", end.served_at_end, figures, reasons
    )


def _clean_exit(end: EndState) -> Invariant:
    reasons = []
    if end.exit_code != 0:
        reasons.append(f"the daemon exited with {end.exit_code} on SIGTERM")
    if end.killed_leftovers:
        reasons.append("processes of the daemon's group were left after it exited (SIGKILLed)")
    if end.engine_cores_alive:
        reasons.append(f"EngineCore processes left running: {end.engine_cores_alive}")
    if end.shm_orphans:
        reasons.append(f"/dev/shm files left that no process holds: {end.shm_orphans[:5]}")
    figures = (
        f"exit {end.exit_code}, {len(end.engine_cores_alive)} EngineCore left, "
        f"{len(end.shm_orphans)} orphaned /dev/shm files"
    )
    return Invariant(
        "clean_exit", "clean exit on SIGTERM, nothing left", not reasons, figures, tuple(reasons)
    )


def verdict(
    outcomes: Sequence[ChaosOutcome],
    faults: Sequence[FaultRecord],
    end: EndState,
    limits: ChaosVerdictLimits,
    hostile: Sequence[HostileRecord] = (),
) -> ChaosVerdict:
    """Every invariant over one run: the load's and the probe's ``outcomes`` (told apart by kind),
    the faults, the hostile clients and what was found at the end."""
    load = [o for o in outcomes if o.kind != "probe"]
    probes = [o for o in outcomes if o.kind == "probe"]
    windows = rebuild_windows(faults)
    rss, growth = _rss_flat(end, limits)
    invariants = (
        _requests_end(load),
        _ordinary_answered(probes, windows, limits),
        _loop_ticks(end, windows, limits),
        _faults(faults),
        _hostile(hostile),
        _gate_zero(end),
        _gate_not_held(load),
        _demand_counted(outcomes, end),
        rss,
        _nothing_grows(end, limits),
        _serves_at_end(end),
        _clean_exit(end),
    )
    endings = Counter(
        f"{o.kind}:{o.end}" + (f":{o.status}" if o.end == "http_error" else "") for o in outcomes
    )
    figures = {
        "requests": len(load),
        "probes": len(probes),
        "bad_endings": sum(bad_ending(o) is not None for o in load),
        "endings": dict(sorted(endings.items())),
        "faults": dict(Counter(f.fault for f in faults)),
        "faults_failed": sum(not f.ok for f in faults),
        "hostile": dict(Counter(h.client for h in hostile)),
        "hostile_failed": sum(not h.ok for h in hostile),
        "rebuild_windows": windows,
        "beside_stream_over_limit": asdict(held_gate(load)),
        "longest_s": max((o.elapsed_s for o in load), default=0.0),
        "gate_at_end": end.gate,
        "rss_growth": growth,
        "longest_tick_gap_s": longest_tick_gap(end.ticks, windows),
        "fds_end": end.fds_end,
        "threads_end": end.threads_end,
        "engine_cores_end": end.engine_cores_end,
        "demand": [end.demand_start, end.demand_end],
        "served_at_end": end.served_at_end,
        "exit_code": end.exit_code,
        "engine_cores_seen_left": end.engine_cores_alive,
        "shm_orphans": end.shm_orphans,
    }
    return ChaosVerdict(invariants, figures)
