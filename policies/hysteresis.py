"""The hysteresis policy: step the batch cap up or down when KV usage leaves a deadband."""

from __future__ import annotations

import math
from typing import Any

from policies.base import Decision, Observation, Policy, PolicyError
from policies.common import KV_SOURCES, CapFollower, check_choice, check_float, check_int, kv_signal
from policies.knobs import cap_bounds


class HysteresisPolicy(Policy):
    """Steps the batch cap between two thresholds; cuts it at once on KV exhaustion or preemptions.

    Formula, checked in this order each tick (``cap`` is the batch cap in force, ``kv`` the KV usage
    chosen by ``kv_source``, ``gpu`` the NVML utilisation, ignored unless ``gpu_low``/``gpu_high`` are set):

    1. stats stale while requests are in flight             -> hold, "stale_stats"
       idle (nothing in flight or queued) for ``idle_restore_s`` -> ``max_num_seqs``, "idle_restore"
    2. latest KV usage >= ``critical``                       -> ``floor(cap * cut_factor)``, "kv_critical"
       ``preemptions_per_s > 0``                             -> the same cut, "preemptions"
       (a cut waits ``cut_cooldown_s``, and at least the observation window, after the last cut:
       "cut_cooldown"; the window keeps a preemption for its whole length, so a shorter wait would cut
       again for the same event. Nor does it cut
       while more requests run than the cap allows, "cut_settling": lowering the cap never preempts,
       so the last cut takes effect only as those requests finish)
    3. less than ``cooldown_s`` since the last change        -> hold, "cooldown"
    4. ``kv > high`` or ``gpu > gpu_high``                   -> ``cap - step``, "kv_high" / "gpu_high"
    5. ``kv < low`` and (``gpu < gpu_low`` or unset)         -> ``cap + step``, "kv_low", only with demand
       (requests queued in the gate, or ``running >= demand_fraction * cap``), else hold, "no_demand"
    6. otherwise                                             -> hold, "within_deadband"

    The cap stays in ``[min_cap, max_num_seqs]``; a move that would not change it holds with "at_min" /
    "at_max". The admission limit follows every cap change (``CapFollower``). On a hold both knobs
    are left as they are.

    Parameters (defaults): ``low`` 0.70, ``high`` 0.95, ``critical`` 0.98 (KV usage fractions);
    ``kv_source`` "max" (the window max: a burst's peak is what overflows the cache, and the window
    mean hides it; or "mean", "latest"); ``gpu_low`` / ``gpu_high`` None (off:
    NVML utilisation is the share of time a kernel ran, near 1.0 under any load, so it is opt-in);
    ``step`` ``max(1, max_num_seqs // 16)``; ``cut_factor`` 0.5; ``cooldown_s`` 5.0; ``cut_cooldown_s``
    10.0; and the cap follower's ``min_cap``, ``demand_fraction``, ``limit_factor``,
    ``limit_headroom``, ``stale_after_s``, ``idle_restore_s`` (``policies.common.CapFollower``).

    The cooldowns stay here rather than in the normalize stage: they depend on the reason (a cut
    skips the step cooldown and waits for its own, at least one observation window), which a
    generic stage cannot tell apart.

    States: the time of the last change and of the last cut (None before the first); the cap
    follower's idle clock.
    """

    name = "hysteresis"
    param_names = tuple(
        "low high critical kv_source gpu_low gpu_high step cut_factor cooldown_s cut_cooldown_s".split()
    )

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        low: float = 0.70,
        high: float = 0.95,
        critical: float = 0.98,
        kv_source: str = "max",
        gpu_low: float | None = None,
        gpu_high: float | None = None,
        step: int | None = None,
        cut_factor: float = 0.5,
        cooldown_s: float = 5.0,
        cut_cooldown_s: float = 10.0,
        **follower: Any,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.low = check_float("low", low, 0.0, 1.0)
        self.high = check_float("high", high, 0.0, 1.0)
        self.critical = check_float("critical", critical, 0.0, 1.0)
        if not self.low < self.high <= self.critical:
            raise PolicyError(
                f"low = {low}, high = {high}, critical = {critical}: need low < high <= critical"
            )
        self.kv_source = check_choice("kv_source", kv_source, KV_SOURCES)
        self.gpu_low = None if gpu_low is None else check_float("gpu_low", gpu_low, 0.0, 1.0)
        self.gpu_high = None if gpu_high is None else check_float("gpu_high", gpu_high, 0.0, 1.0)
        if self.gpu_low is not None and self.gpu_high is not None and self.gpu_low >= self.gpu_high:
            raise PolicyError(f"gpu_low = {gpu_low}, gpu_high = {gpu_high}: need gpu_low < gpu_high")
        self.step = max(1, max_num_seqs // 16) if step is None else check_int("step", step, 1)
        self.cut_factor = check_float("cut_factor", cut_factor, 0.0, 0.99, lo_open=True)
        self.cooldown_s = check_float("cooldown_s", cooldown_s, 0.0)
        self.cut_cooldown_s = check_float("cut_cooldown_s", cut_cooldown_s, 0.0)
        self.follower = CapFollower(max_num_seqs=max_num_seqs, **follower)
        self._last_change_mono: float | None = None
        self._last_cut_mono: float | None = None
        self._kv = math.nan
        self._now_mono = math.nan

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self._kv, self._now_mono = kv_signal(obs, self.kv_source), now_mono
        if self.follower.stale(obs):
            return Decision(None, None, "stale_stats")
        if self.follower.restore_due(obs, now_mono):
            return self._move(obs, self.max_num_seqs, "idle_restore", now_mono)
        cut_reason = self._cut_reason(obs)
        if cut_reason is not None:
            if _within(self._last_cut_mono, now_mono, max(self.cut_cooldown_s, obs.window_s)):
                return Decision(None, None, "cut_cooldown")
            if obs.running > obs.batch_cap:
                return Decision(None, None, "cut_settling")
            return self._move(obs, math.floor(obs.batch_cap * self.cut_factor), cut_reason, now_mono)
        if _within(self._last_change_mono, now_mono, self.cooldown_s):
            return Decision(None, None, "cooldown")
        high_reason = self._high_reason(obs)
        if high_reason is not None:
            return self._move(obs, obs.batch_cap - self.step, high_reason, now_mono)
        if self._is_low(obs):
            if not self.follower.has_demand(obs):
                return Decision(None, None, "no_demand")
            return self._move(obs, obs.batch_cap + self.step, "kv_low", now_mono)
        return Decision(None, None, "within_deadband")

    def _cut_reason(self, obs: Observation) -> str | None:
        if obs.kv_usage >= self.critical:
            return "kv_critical"
        return "preemptions" if obs.preemptions_per_s > 0 else None

    def _high_reason(self, obs: Observation) -> str | None:
        if self._kv > self.high:
            return "kv_high"
        gpu = obs.gpu_utilization
        if self.gpu_high is not None and gpu is not None and gpu > self.gpu_high:
            return "gpu_high"
        return None

    def _is_low(self, obs: Observation) -> bool:
        gpu = obs.gpu_utilization
        gpu_low = self.gpu_low is None or gpu is None or gpu < self.gpu_low
        return self._kv < self.low and gpu_low

    def _move(self, obs: Observation, wanted: int, reason: str, now_mono: float) -> Decision:
        cap = cap_bounds(self.max_num_seqs, self.follower.min_cap).clamp(wanted)
        if cap == obs.batch_cap:
            return Decision(None, None, "at_max" if wanted > cap else "at_min")
        self._last_change_mono = now_mono
        if cap < obs.batch_cap and reason in ("kv_critical", "preemptions"):
            self._last_cut_mono = now_mono
        return self.follower.decision(cap, reason)

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.follower.params()}

    def terms(self) -> dict[str, float]:
        """The KV signal and the cooldowns left, as of the last tick."""
        return {
            "kv_signal": self._kv,
            "cooldown_left_s": _left(self._last_change_mono, self._now_mono, self.cooldown_s),
            "cut_cooldown_left_s": _left(self._last_cut_mono, self._now_mono, self.cut_cooldown_s),
        }


def _within(since: float | None, now_mono: float, seconds: float) -> bool:
    return since is not None and now_mono - since < seconds


def _left(since: float | None, now_mono: float, seconds: float) -> float:
    return 0.0 if since is None else max(0.0, seconds - (now_mono - since))
