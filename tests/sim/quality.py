"""Control-quality figures of a simulated run: settling time, overshoot, knob changes per minute."""

from __future__ import annotations

from collections.abc import Sequence

from controller.control.loop import Change
from controller.results.records import SeriesPoint


def settling(
    series: Sequence[SeriesPoint], field: str, t_step: float, t_end: float, band: float
) -> tuple[float, float]:
    """(settling time after ``t_step``, overshoot) of ``field`` over ``(t_step, t_end]``.

    The final value is the mean over the last third of the interval; the signal has settled once it
    stays within ``band`` (relative) of it; overshoot is how far its maximum goes above the final value,
    relative to it."""
    points = [(p.t_s, float(getattr(p, field))) for p in series if t_step < p.t_s <= t_end]
    tail = [v for t, v in points if t > t_end - (t_end - t_step) / 3]
    final = sum(tail) / len(tail)
    outside = [t for t, v in points if abs(v - final) > band * final]
    settled_at = max(outside, default=t_step)
    peak = max(v for _, v in points)
    return settled_at - t_step, max(0.0, (peak - final) / final)


def changes_per_minute(changes: Sequence[Change], t_from: float, t_to: float, knob: str) -> list[int]:
    """Moves of ``knob`` in each whole minute of ``[t_from, t_to)``."""
    minutes = int((t_to - t_from) // 60)
    counts = [0] * minutes
    for c in changes:
        k = int((c.t_mono - t_from) // 60)
        if c.knob == knob and 0 <= k < minutes:
            counts[k] += 1
    return counts
