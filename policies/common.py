"""Small pieces the built-in policies share: parameter checks, staleness, demand, the cap -> limit map,
and the cap follower (the parameters and steps every cap-moving policy shares).

Parameters arrive from ``[control.params]`` in config.toml, so they may be any TOML value: every check
names the key, the value and what would be accepted (STYLE.md practice 7). The ``check_*`` functions are
the project's one check of a value: constructor parameters (the policies, the normalize stage) call them
and raise their ``PolicyError``; a config table's key (``controller/config/fields.py``'s ``Key``) runs them
and adds the table's name and the key's doc to the message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from policies.base import Decision, Observation, PolicyError

KV_SOURCES = ("mean", "latest", "max")
"""How a policy reads KV usage: the window mean, the last step, or the window max."""


def check_float(name: str, value: object, lo: float, hi: float = math.inf, *, lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with ``lo_open``); TOML integers are accepted."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{name} = {value!r}: must be float")
    if not math.isfinite(value):  # NaN is neither below nor above a bound
        raise PolicyError(f"{name} = {value!r}: not a finite number; {_wanted(lo, hi, lo_open)}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise PolicyError(f"{name} = {value!r}: out of range; {_wanted(lo, hi, lo_open)}")
    return float(value)


def check_int(name: str, value: object, lo: float, hi: float = math.inf) -> int:
    """An integer in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{name} = {value!r}: must be int")
    if value < lo or value > hi:
        raise PolicyError(f"{name} = {value!r}: out of range; {_wanted(lo, hi)}")
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices`` (a TOML list or table is refused, not hashed)."""
    if not isinstance(value, str) or value not in choices:
        raise PolicyError(f"{name} = {value!r}: must be one of {', '.join(repr(c) for c in choices)}")
    return value


def check_str(name: str, value: object) -> str:
    """Any string."""
    if not isinstance(value, str):
        raise PolicyError(f"{name} = {value!r}: must be str")
    return value


def check_step(name: str, value: object) -> float:
    """The most a value may move at once: 0 (no limit), a fraction below 1 (of the value in force) or a
    whole number (absolute); 2.5 is neither."""
    step = check_float(name, value, 0.0)
    if step >= 1 and step != int(step):
        raise PolicyError(
            f"{name} = {value!r}: not a whole number; use a whole number, or a fraction below 1"
        )
    return step


def _wanted(lo: float, hi: float, lo_open: bool = False) -> str:
    """The fix of a value out of [lo, hi]: "use a value in [lo, hi]", or one side where the other is open."""
    if lo == -math.inf:
        return "use a finite value" if hi == math.inf else f"use a value <= {hi}"
    if hi == math.inf:
        return f"use a value {'>' if lo_open else '>='} {lo}"
    return f"use a value in {'(' if lo_open else '['}{lo}, {hi}]"


def is_stale(obs: Observation, stale_after_s: float) -> bool:
    """Requests are in flight but the engine has not reported a step for too long (or ever).

    An idle engine reports nothing, so old stats with nothing in flight are not stale."""
    if obs.in_flight == 0:
        return False
    return obs.stats_age_s is None or obs.stats_age_s > stale_after_s


def has_demand(obs: Observation, used: int, ceiling: int, fraction: float) -> bool:
    """Raising a knob helps only if requests wait in the gate or ``used`` is close to ``ceiling``."""
    return obs.queued > 0 or used >= fraction * ceiling


def limit_for_cap(cap: int, factor: float, headroom: int) -> int:
    """The admission limit that goes with a batch cap: ``ceil(cap * factor) + headroom``.

    The rounding to 9 places keeps ``ceil(10 * 1.1)`` at 11, not 12."""
    return max(1, math.ceil(round(cap * factor, 9)) + headroom)


def clamp(value: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, value))


class IdleTimer:
    """How long the system has been idle (nothing in flight, nothing queued): policy state, with
    time from ``now_mono``."""

    def __init__(self) -> None:
        self._since: float | None = None

    def update(self, obs: Observation, now_mono: float) -> float:
        if not obs.idle:
            self._since = None
            return 0.0
        if self._since is None:
            self._since = now_mono
        return now_mono - self._since


def kv_batch(running: int, kv_usage: float, target: float, min_running: int) -> int | None:
    """The batch whose KV reaches ``target`` of the cache at the running sequences' mean share of it,
    ``floor(target * running / kv_usage)`` (no cache size needed), or None where that share does not
    bound it: fewer than ``min_running`` running (one long prompt sways the share), or the cache less
    than half of ``target`` full.

    Why the second: requests that share a prompt prefix (a system prompt, a RAG document) hold its
    blocks once, however many read them (vLLM's ``kv_cache_usage`` counts a block once), so the mean
    share falls as the batch grows and the straight line from a nearly empty cache reads a fraction
    of what it holds: measured on the CPU box (four 480-token system prompts), 0.22 at 4 running
    read 16 where 15 running held 0.47 (a cap of 28), and the daemon's cap and limit flapped between
    16-23 and the knee's 58 every few seconds, queueing requests in the gate the engine had room for.
    From half of ``target`` on, the line reaches at most twice the batch running, and each tick reads
    the share again as the batch grows, so the bound closes on what the cache holds; below it vLLM's
    own block check (a prompt is admitted only with its blocks free) is the guard, as in ``vllm
    serve``."""
    if running < min_running or kv_usage < 0.5 * target:
        return None
    return math.floor(target * running / kv_usage)


def kv_signal(obs: Observation, source: str) -> float:
    """KV usage as ``source`` (one of KV_SOURCES) reads it."""
    if source == "latest":
        return obs.kv_usage
    return obs.kv_usage_max if source == "max" else obs.kv_usage_mean


@dataclass(kw_only=True)
class CapFollower:
    """The part every policy that moves the batch cap shares, its parameters defined once: the
    admission limit follows the cap, a raise needs demand, stale stats hold, and idleness gives the
    cap back to its ceiling. Built as ``CapFollower(max_num_seqs=..., **params)``; each parameter is
    checked, and an unknown one is a TypeError that names it.

    State: since when the system has been idle.
    """

    max_num_seqs: int
    """The engine's ceiling of the batch cap."""
    min_cap: int = 1
    """The lowest cap the policy asks for."""
    demand_fraction: float = 0.9
    """A raise needs requests queued in the gate or ``running >= demand_fraction * cap``."""
    limit_factor: float = 1.0
    """``limit = ceil(cap * limit_factor) + limit_headroom``: a few requests wait inside the engine,
    ready when a running one finishes."""
    limit_headroom: int = 2
    """See ``limit_factor``."""
    stale_after_s: float = 5.0
    """Requests in flight and no engine step for this long: hold."""
    idle_restore_s: float | None = 60.0
    """Idle (nothing in flight or queued) this long, the cap goes back to ``max_num_seqs``, ready for
    the next workload; None: never."""
    _idle: IdleTimer = field(default_factory=IdleTimer, init=False, repr=False)

    def __post_init__(self) -> None:
        self.min_cap = check_int("min_cap", self.min_cap, 1, self.max_num_seqs)
        self.demand_fraction = check_float("demand_fraction", self.demand_fraction, 0.0, 1.0, lo_open=True)
        self.limit_factor = check_float("limit_factor", self.limit_factor, 0.0, lo_open=True)
        self.limit_headroom = check_int("limit_headroom", self.limit_headroom, 0)
        self.stale_after_s = check_float("stale_after_s", self.stale_after_s, 0.0, lo_open=True)
        restore = self.idle_restore_s
        self.idle_restore_s = None if restore is None else check_float("idle_restore_s", restore, 0.0)

    def params(self) -> dict[str, Any]:
        return _params(self)

    def stale(self, obs: Observation) -> bool:
        return is_stale(obs, self.stale_after_s)

    def restore_due(self, obs: Observation, now_mono: float) -> bool:
        """Moves the idle clock; True once the system has been idle for ``idle_restore_s`` and the
        cap is below its ceiling: the load that made the policy cut is gone."""
        idle_for = self._idle.update(obs, now_mono)
        restore = self.idle_restore_s
        return restore is not None and idle_for >= restore and obs.batch_cap < self.max_num_seqs

    def has_demand(self, obs: Observation) -> bool:
        return has_demand(obs, obs.running, obs.batch_cap, self.demand_fraction)

    def decision(self, cap: int, reason: str) -> Decision:
        """Both knobs: the cap, and the admission limit that goes with it."""
        return Decision(limit_for_cap(cap, self.limit_factor, self.limit_headroom), cap, reason)


def _params(part: CapFollower) -> dict[str, Any]:
    """A shared part's parameters for /state (its ceiling and its state are not parameters)."""
    return {f.name: getattr(part, f.name) for f in fields(part) if f.init and f.name != "max_num_seqs"}
