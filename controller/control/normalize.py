"""The normalize stage: turn a policy's Decision into the knob moves to apply (Kubernetes HPA style).

Shared work lives here once (STYLE.md practice 2): clamping, a tolerance band, a scale-down
stabilisation window, a maximum step per tick, and "apply only on change". Pure: time comes in as
``now_mono``; the only state is the recent recommendations the stabilisation window needs. After the
apply stage the loop tells the policy which knobs are in force (``Policy.applied``), so a policy
never has to guess what this stage made of its ask.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from policies.base import Decision, Observation

Move = tuple[str, int, int, str]
"""(knob, old, new, reason); knob is "admission_limit" or "batch_cap"."""

KNOBS = ("admission_limit", "batch_cap")
URGENT_REASONS = ("kv_critical", "preemptions")


class Normalizer:
    """Decision + Observation -> moves. Stages, in order, for each knob the decision sets:

    1. clamp to ``[1, max_num_seqs]`` (batch cap; the ceiling is ``obs.max_num_seqs``) or ``[1, limit_max]``
       (admission limit): suffix ":clamped_min" / ":clamped_max". The clamped value is recorded as
       this tick's recommendation for the stabilisation window (a knob the decision leaves None, a hold,
       records nothing).
    2. tolerance: a change of at most ``tolerance * current`` is dropped (outcome ":within_tolerance").
    3. scale-down stabilisation: a decrease goes only down to the highest recommendation of the last
       ``stabilization_s`` seconds (Kubernetes' scale-down window): suffix ":stabilized".
    4. rate limit: a move larger than ``max_step_up`` / ``max_step_down`` is cut to it: ":rate_limited".
    5. apply only on change: a value equal to the one in force gives no move.

    Stages 2-4 are skipped (only the clamp applies) when the knob in force is outside its bounds (it
    moves straight into them) or when the decision's reason is one of ``urgent_reasons``: an emergency
    cut is not delayed. Each stage that alters a value appends its suffix to the policy's reason, so a
    move reads e.g. "kv_low:rate_limited". ``last_outcome`` keeps, per knob, the reason of the last
    tick's result, moves and dropped changes alike (e.g. "kv_low:within_tolerance", "steady:unchanged").

    Parameters (defaults: every stage off, so the stage only clamps and drops non-changes):
    ``limit_max``: ceiling of the admission limit (required).
    ``tolerance`` 0.0: relative band, e.g. 0.1 ignores changes of 10 % of the value in force or less;
    keep ``tolerance * value`` below a policy's step, or the policy's steps are all dropped.
    ``max_step_up`` / ``max_step_down`` 0: the most a knob moves per tick; 0 is no limit, a value below 1
    is a fraction of the value in force (0.5 = 50 %, at least 1), a whole number >= 1 is absolute.
    ``stabilization_s`` 0.0: the scale-down window in seconds.
    ``urgent_reasons`` ("kv_critical", "preemptions"): reasons exempt from stages 2-4.
    """

    def __init__(
        self,
        *,
        limit_max: int,
        tolerance: float = 0.0,
        max_step_up: float = 0.0,
        max_step_down: float = 0.0,
        stabilization_s: float = 0.0,
        urgent_reasons: Iterable[str] = URGENT_REASONS,
    ) -> None:
        if isinstance(limit_max, bool) or not isinstance(limit_max, int) or limit_max < 1:
            raise ValueError(f"limit_max = {limit_max!r}: must be an integer >= 1")
        self.limit_max = limit_max
        self.tolerance = _check_number("tolerance", tolerance)
        self.max_step_up = _check_step("max_step_up", max_step_up)
        self.max_step_down = _check_step("max_step_down", max_step_down)
        self.stabilization_s = _check_number("stabilization_s", stabilization_s)
        self.urgent_reasons = frozenset(urgent_reasons)
        self._recommendations: dict[str, deque[tuple[float, int]]] = {knob: deque() for knob in KNOBS}
        self.last_outcome: dict[str, str] = {}

    def normalize(self, decision: Decision, obs: Observation, now_mono: float) -> list[Move]:
        """The moves to apply this tick, admission limit first."""
        wanted = {
            "admission_limit": (decision.admission_limit, obs.admission_limit, self.limit_max),
            "batch_cap": (decision.batch_cap, obs.batch_cap, obs.max_num_seqs),
        }
        urgent = decision.reason in self.urgent_reasons
        moves = []
        for knob, (want, current, ceiling) in wanted.items():
            if want is None:
                self.last_outcome[knob] = f"{decision.reason}:hold"
                continue
            new, reason = self._one(knob, want, current, ceiling, decision.reason, now_mono, urgent)
            self.last_outcome[knob] = reason
            if new != current:
                moves.append((knob, current, new, reason))
        return moves

    def _one(
        self, knob: str, want: int, current: int, ceiling: int, reason: str, now: float, urgent: bool
    ) -> tuple[int, str]:
        """The value for one knob and its reason with the suffixes of the stages that altered it."""
        if want < 1:
            want, reason = 1, f"{reason}:clamped_min"
        elif want > ceiling:
            want, reason = ceiling, f"{reason}:clamped_max"
        highest = self._record(knob, want, now)
        if want == current:
            return want, f"{reason}:unchanged"
        if urgent or not 1 <= current <= ceiling:
            return want, reason
        if abs(want - current) <= self.tolerance * current:
            return current, f"{reason}:within_tolerance"
        if want < current and highest > want:
            want, reason = min(current, highest), f"{reason}:stabilized"
        step = _step(self.max_step_up if want > current else self.max_step_down, current)
        if step is not None and abs(want - current) > step:
            want, reason = current + (step if want > current else -step), f"{reason}:rate_limited"
        return want, reason

    def _record(self, knob: str, want: int, now: float) -> int:
        """Keep this tick's recommendation; the highest one inside the stabilisation window."""
        window = self._recommendations[knob]
        window.append((now, want))
        while window and window[0][0] <= now - self.stabilization_s and len(window) > 1:
            window.popleft()
        return max(value for _, value in window)

    def reset(self) -> None:
        """Forget the recommendations (a new engine or a new policy starts from nothing)."""
        for window in self._recommendations.values():
            window.clear()
        self.last_outcome.clear()

    def params(self) -> dict[str, Any]:
        return {
            "limit_max": self.limit_max,
            "tolerance": self.tolerance,
            "max_step_up": self.max_step_up,
            "max_step_down": self.max_step_down,
            "stabilization_s": self.stabilization_s,
            "urgent_reasons": sorted(self.urgent_reasons),
        }


def _step(limit: float, current: int) -> int | None:
    """The largest move from ``current``: None (no limit), a fraction of it (at least 1), or absolute."""
    if limit == 0:
        return None
    return max(1, math.ceil(current * limit)) if limit < 1 else int(limit)


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} = {value!r}: must be a number >= 0")
    return float(value)


def _check_step(name: str, value: object) -> float:
    step = _check_number(name, value)
    if step >= 1 and step != int(step):
        raise ValueError(f"{name} = {value!r}: use a whole number of requests, or a fraction below 1")
    return step
