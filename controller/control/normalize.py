"""The normalize stage: turn a policy's Decision into the knob moves to apply (Kubernetes HPA style).

Shared work lives here once (STYLE.md practice 2): clamping, a tolerance band, a hold on quick
reversals, a scale-down stabilisation window, a maximum step per tick, and "apply only on change".
Pure: time comes in as ``now_mono``; the only state is the recent recommendations the stabilisation
window needs and each knob's last move. After the
apply stage the loop tells the policy which knobs are in force (``Policy.applied``), so a policy
never has to guess what this stage made of its ask.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from controller.control.knobs import (
    ADMISSION_LIMIT,
    BATCH_CAP,
    KNOBS,
    TOKEN_BUDGET,
    Bounds,
    budget_bounds,
    cap_bounds,
)
from policies.base import Decision, Observation
from policies.common import check_float, check_int, check_step

Move = tuple[str, int, int, str]
"""(knob, old, new, reason); knob is a ``Knob``'s name (``control/knobs.py``)."""

URGENT_REASONS = ("kv_critical", "preemptions")
FIRST_MOVE_FREE = frozenset({ADMISSION_LIMIT.name, BATCH_CAP.name})
"""The knobs whose first move arms no reversal hold: it takes the concurrency from the engine's
starting value to the policy's first estimate (the slo policy's slow start opens it from one), and
the climb after it is that estimate growing, not churn. The token budget's first move is a halving
step (``BUDGET_STEP_DOWN``) on its way down: an early ask to turn it back is held as any other."""
BUDGET_STEP_UP = 1.0
BUDGET_STEP_DOWN = 0.5
"""The token budget's rate limit, a fraction of the budget in force: at most double or halve it per
tick. The budget counts tokens, not requests, so ``max_step_*`` (whole requests) would not fit it. A
budget move is cheap and preempts nothing, so 8192 -> 512 in four ticks is fast enough, while a noisy
ask cannot swing a whole step's worth of prefill in one tick."""


class Normalizer:
    """Decision + Observation -> moves. Stages, in order, for each knob the decision sets:

    1. clamp to ``[cap_min, max_num_seqs]`` (batch cap; the ceiling is ``obs.max_num_seqs``),
       ``[limit_min, limit_max]`` (admission limit) or ``[obs.token_budget_min,
       obs.max_num_batched_tokens]`` (token budget): suffix ":clamped_min" / ":clamped_max". The
       clamped value is recorded as this tick's recommendation for the stabilisation window (a knob the
       decision leaves None, a hold, records nothing).
    2. tolerance: a change of at most ``tolerance * current`` is dropped (outcome ":within_tolerance").
    3. reversal hold: a move against the knob's last move, sooner than ``reverse_after_s`` after it, is
       dropped (outcome ":reversal_held") unless it halves or doubles the knob (a large swing is a
       real change, not churn). A move is its direction at this stage (the stages after it only
       shorten it) and when, kept for the next ticks; the first move of the admission limit or the
       batch cap (since the start or a ``reset``) holds nothing back (``FIRST_MOVE_FREE``).
    4. scale-down stabilisation: a decrease goes only down to the highest recommendation of the last
       ``stabilization_s`` seconds (Kubernetes' scale-down window): suffix ":stabilized".
    5. rate limit: a move larger than ``max_step_up`` / ``max_step_down`` (the token budget:
       ``BUDGET_STEP_UP`` / ``BUDGET_STEP_DOWN``) is cut to it: ":rate_limited".
    6. apply only on change: a value equal to the one in force gives no move.

    Stages 2-5 are skipped (only the clamp applies) when the knob in force is outside its bounds (it
    moves straight into them) or when the decision's reason is one of ``urgent_reasons``: an emergency
    cut is not delayed. Each stage that alters a value appends its suffix to the policy's reason, so a
    move reads e.g. "kv_low:rate_limited". ``last_outcome`` keeps, per knob, the reason of the last
    tick's result, moves and dropped changes alike (e.g. "kv_low:within_tolerance", "steady:unchanged");
    the token budget has an outcome once a policy has asked for it (the policies that never steer it
    leave it out, rather than a ":hold" every tick for a knob they do not know).

    Parameters (defaults: every stage off, so the stage only clamps and drops non-changes; a policy
    names its own defaults for ``tolerance`` and ``reverse_after_s``, ``Policy.normalize_defaults``,
    which ``[control]`` overrides):
    ``limit_max``: ceiling of the admission limit (required).
    ``limit_min`` 1, ``cap_min`` 1: floors of the admission limit and the batch cap.
    ``tolerance`` 0.0: relative band, e.g. 0.1 ignores changes of 10 % of the value in force or less;
    keep ``tolerance * value`` below a policy's step, or the policy's steps are all dropped.
    ``reverse_after_s`` 0.0: how long after a knob's move a smaller move back is held.
    ``max_step_up`` / ``max_step_down`` 0: the most a knob moves per tick; 0 is no limit, a value below 1
    is a fraction of the value in force (0.5 = 50 %, at least 1), a whole number >= 1 is absolute.
    ``stabilization_s`` 0.0: the scale-down window in seconds.
    ``urgent_reasons`` ("kv_critical", "preemptions"): reasons exempt from stages 2-5.
    A bad parameter raises ``PolicyError`` (a ValueError) from ``policies/common.py``'s checks, the
    ones every policy's parameters pass.

    States: per knob the recommendations inside the stabilisation window, and the direction and time
    of its last move.
    """

    def __init__(
        self,
        *,
        limit_max: int,
        limit_min: int = 1,
        cap_min: int = 1,
        tolerance: float = 0.0,
        reverse_after_s: float = 0.0,
        max_step_up: float = 0.0,
        max_step_down: float = 0.0,
        stabilization_s: float = 0.0,
        urgent_reasons: Iterable[str] = URGENT_REASONS,
    ) -> None:
        self.limit_max = check_int("limit_max", limit_max, 1)
        self.limit_min = check_int("limit_min", limit_min, 1, limit_max)  # a floor under its ceiling
        self.cap_min = check_int("cap_min", cap_min, 1)
        self.tolerance = check_float("tolerance", tolerance, 0.0)
        self.reverse_after_s = check_float("reverse_after_s", reverse_after_s, 0.0)
        self.max_step_up = check_step("max_step_up", max_step_up)
        self.max_step_down = check_step("max_step_down", max_step_down)
        self.stabilization_s = check_float("stabilization_s", stabilization_s, 0.0)
        self.urgent_reasons = frozenset(urgent_reasons)
        self._recommendations: dict[str, deque[tuple[float, int]]] = {knob.name: deque() for knob in KNOBS}
        self._last_move: dict[str, tuple[int, float]] = {}
        """knob -> (direction of its last move past the reversal hold, +1 / -1, and when)."""
        self.last_outcome: dict[str, str] = {}

    def normalize(self, decision: Decision, obs: Observation, now_mono: float) -> list[Move]:
        """The moves to apply this tick, admission limit first, token budget last."""
        wanted = {
            ADMISSION_LIMIT.name: (
                decision.admission_limit,
                obs.admission_limit,
                Bounds(self.limit_min, self.limit_max),
            ),
            BATCH_CAP.name: (decision.batch_cap, obs.batch_cap, cap_bounds(obs.max_num_seqs, self.cap_min)),
            TOKEN_BUDGET.name: (
                decision.token_budget,
                obs.token_budget,
                budget_bounds(obs.max_num_batched_tokens, obs.token_budget_min),
            ),
        }
        urgent = decision.reason in self.urgent_reasons
        moves = []
        for knob, (want, current, bounds) in wanted.items():
            if want is None:
                if knob != TOKEN_BUDGET.name or knob in self.last_outcome:
                    self.last_outcome[knob] = f"{decision.reason}:hold"
                continue
            new, reason = self._one(knob, want, current, bounds, decision.reason, now_mono, urgent)
            self.last_outcome[knob] = reason
            if new != current:
                moves.append((knob, current, new, reason))
        return moves

    def _one(
        self,
        knob: str,
        want: int,
        current: int,
        bounds: Bounds,
        reason: str,
        now: float,
        urgent: bool,
    ) -> tuple[int, str]:
        """The value for one knob and its reason with the suffixes of the stages that altered it."""
        floor, ceiling = bounds
        if want < floor:
            want, reason = floor, f"{reason}:clamped_min"
        elif want > ceiling:
            want, reason = ceiling, f"{reason}:clamped_max"
        highest = self._record(knob, want, now)
        if want == current:
            return want, f"{reason}:unchanged"
        if urgent or not floor <= current <= ceiling:
            return want, reason
        if abs(want - current) <= self.tolerance * current:
            return current, f"{reason}:within_tolerance"
        if self._reverses(knob, want, current, now):
            return current, f"{reason}:reversal_held"
        if want < current and highest > want:
            want, reason = min(current, highest), f"{reason}:stabilized"
        step = self._max_step(knob, want > current, current)
        if step is not None and abs(want - current) > step:
            want, reason = current + (step if want > current else -step), f"{reason}:rate_limited"
        return want, reason

    def _reverses(self, knob: str, want: int, current: int, now: float) -> bool:
        """True: the move turns back the knob's last one sooner than ``reverse_after_s`` and is
        smaller than a halving or a doubling (hold it); else it becomes the knob's last move."""
        direction = 1 if want > current else -1
        last = self._last_move.get(knob)
        small = abs(want - current) <= 0.5 * max(want, current)
        if small and last is not None and last[0] != direction and now - last[1] < self.reverse_after_s:
            return True
        # a concurrency knob's first move: no churn to hold back (FIRST_MOVE_FREE). Armed, it held
        # the slo policy's slow start at an admission limit of 3 for 30 s while its estimate rose to 6
        first = last is None and knob in FIRST_MOVE_FREE
        self._last_move[knob] = (direction, -math.inf if first else now)
        return False

    def _max_step(self, knob: str, up: bool, current: int) -> int | None:
        """The largest move this tick from ``current``; None: no limit."""
        if knob == TOKEN_BUDGET.name:
            return max(1, math.ceil(current * (BUDGET_STEP_UP if up else BUDGET_STEP_DOWN)))
        return _step(self.max_step_up if up else self.max_step_down, current)

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
        self._last_move.clear()
        self.last_outcome.clear()

    def params(self) -> dict[str, Any]:
        return {
            "limit_max": self.limit_max,
            "limit_min": self.limit_min,
            "cap_min": self.cap_min,
            "tolerance": self.tolerance,
            "reverse_after_s": self.reverse_after_s,
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
