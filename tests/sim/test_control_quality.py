"""Control quality on the twin: deterministic, virtual time, no engine.

The scenario profile (tests/sim/scenarios.py) is KV-bound: 8192 KV tokens (512 blocks) hold about
20 requests of 200 + 200 tokens, while 128 could run. Loads are evenly spaced arrivals, so every
figure below is exact and repeatable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controller.sim.run import SimResult
from tests.sim.quality import changes_per_minute, settling
from tests.sim.scenarios import LIMITS, PROFILE, simulate, step_load, uniform, uniform_step

KV_BOUND = dataclasses.replace(PROFILE, engine=dataclasses.replace(LIMITS, kv_cache_tokens=8192))
STEP_AT, END = 60.0, 180.0


@pytest.mark.parametrize("policy", ["hysteresis", "pid", "static"])
def test_a_2x_load_step_settles_within_10s_without_overshoot(policy: str) -> None:
    result = simulate(uniform_step(6.0, STEP_AT, END - STEP_AT), policy, profile=KV_BOUND)
    for signal in ("kv_usage", "output_tok_s", "running"):
        settle_s, overshoot = settling(result.series, signal, STEP_AT, END, band=0.05)
        print(f"{policy} {signal}: settles in {settle_s:.0f} s, overshoot {overshoot:.1%}")
        assert settle_s <= 10.0, (
            f"{signal} still outside 5 % of its final value {settle_s:.0f} s after the step"
        )
        assert overshoot < 0.10, f"{signal} overshoots its final value by {overshoot:.1%}"
    assert result.preemptions == 0
    assert all(r.status == "ok" for r in result.records)


@pytest.mark.xfail(
    strict=True, reason="finding: pid (defaults) keeps moving the cap when a step puts KV at its setpoint"
)
def test_pid_settles_when_a_2x_step_puts_kv_at_its_setpoint() -> None:
    # 7 -> 14 requests/s: the KV max after the step is 0.91, just above pid's default setpoint 0.9.
    # Measured: KV settles (5 s, 0.1 % overshoot) but the integral walks the cap down one request a
    # tick through caps far above the running count (33 moves in the minute after settling should be
    # over). A band above the setpoint, a dwell and cuts from the running count pass here but make the
    # cap cycle on the real engine (tests/integration/test_control.py: 8 <-> 11-12, 7 direction changes
    # a minute), so pid keeps its form and this stays an expected failure (docs/benchmarks.md, section 5).
    result = simulate(uniform_step(7.0, STEP_AT, END - STEP_AT), "pid", profile=KV_BOUND)
    settle_s, overshoot = settling(result.series, "kv_usage", STEP_AT, END, band=0.05)
    per_minute = changes_per_minute(result.changes, STEP_AT + 60, END, "batch_cap")
    print(f"pid kv_usage: settles in {settle_s:.0f} s, overshoot {overshoot:.1%}, cap moves/min {per_minute}")
    assert settle_s <= 10.0 and overshoot < 0.10 and max(per_minute) <= 2


DITHERS = "finding: at a steady load that keeps KV near its setpoint, pid's integral walks the cap"


@pytest.mark.parametrize(
    ("policy", "rate"),
    [
        *((p, 10.0) for p in ("hysteresis", "pid", "static")),
        # pid still moves 21 and 1 times a minute at 14 requests/s (docs/benchmarks.md, section 5).
        *((p, 14.0) for p in ("hysteresis", "static")),
        pytest.param("pid", 14.0, marks=pytest.mark.xfail(strict=True, reason=DITHERS)),
    ],
)
def test_at_most_2_limit_changes_per_minute_at_steady_load(policy: str, rate: float) -> None:
    # 10 requests/s keeps KV at ~0.5, 14 requests/s at ~0.9 (near pid's setpoint, under hysteresis' high).
    result = simulate(uniform(rate, 180.0), policy, profile=KV_BOUND)
    for knob in ("admission_limit", "batch_cap"):
        per_minute = changes_per_minute(result.changes, 60.0, 180.0, knob)
        print(f"{policy} at {rate:g}/s {knob}: changes per minute after the first {per_minute}")
        assert max(per_minute) <= 2


def _preempted(result: SimResult, t0: float, t1: float) -> int:
    at = {round(p.t_s): p.preemptions or 0 for p in result.series}
    return at[round(t1)] - at[round(t0)]


@pytest.mark.parametrize(
    ("policy", "params"),
    [("hysteresis", {"low": 0.6}), ("pid", {"setpoint": 0.75})],
    ids=["hysteresis", "pid"],
)
def test_kv_overflow_preemptions_clear(policy: str, params: dict[str, Any]) -> None:
    # 7.5 -> 15 requests/s: after the step the running set outgrows the KV cache and vLLM preempts
    # (static: about 600 preemptions a minute, for good). The policy cuts the batch cap until they stop.
    specs = uniform_step(7.5, STEP_AT, END - STEP_AT)
    static = simulate(specs, "static", profile=KV_BOUND)
    controlled = simulate(specs, policy, params, profile=KV_BOUND)
    first, first_static = (
        _preempted(controlled, STEP_AT, STEP_AT + 60),
        _preempted(static, STEP_AT, STEP_AT + 60),
    )
    last, last_static = _preempted(controlled, END - 60, END), _preempted(static, END - 60, END)
    print(
        f"{policy}: {first} preemptions in the first minute after the step, {last} in the last; "
        f"static {first_static}, {last_static}"
    )
    assert first_static > 100  # the step overflows the cache
    assert last_static > 100  # and without control it goes on
    assert first < first_static
    assert last == 0


def test_kv_overflow_preemptions_clear_under_hysteresis_defaults() -> None:
    # With kv_source = "mean" (the old default) 27 preemptions remained in the last minute (static: 610):
    # the mean sat under kv_low and raised the cap back into overflow. The window max (now the default)
    # sees the peaks.
    result = simulate(uniform_step(7.5, STEP_AT, END - STEP_AT), "hysteresis", profile=KV_BOUND)
    assert _preempted(result, END - 60, END) == 0


def test_same_seed_same_result_and_jitter_seeds_differ() -> None:
    specs = step_load(6.0, 60.0, 60.0, seed=3)
    one = simulate(specs, "hysteresis", seed=7, jitter=0.1)
    two = simulate(specs, "hysteresis", seed=7, jitter=0.1)
    other = simulate(specs, "hysteresis", seed=8, jitter=0.1)
    assert one.records == two.records
    assert one.series == two.series
    assert [(c.knob, c.old, c.new, c.reason, c.t_mono) for c in one.changes] == [
        (c.knob, c.old, c.new, c.reason, c.t_mono) for c in two.changes
    ]
    assert one.records != other.records
