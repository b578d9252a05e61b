"""controller/control/diagnosis.py: what saturates when more concurrency stops paying."""

from __future__ import annotations

from controller.control.diagnosis import Diagnoser
from tests.helpers import obs


def feed(d: Diagnoser, running: int, tps: float, cpu: float = 20.0) -> None:
    d.observe(obs(running=running, generated_tokens_per_s=tps, daemon_cpu_percent=cpu))


def test_not_enough_levels_then_gains_then_engine_saturated() -> None:
    d = Diagnoser(min_gain=0.05, alpha=1.0)
    feed(d, 4, 1000.0)
    assert d.observe(obs(running=4, generated_tokens_per_s=1000.0)).reason == "not_enough_levels"
    feed(d, 8, 1800.0)
    verdict = d.observe(obs(running=8, generated_tokens_per_s=1800.0, daemon_cpu_percent=20.0))
    assert (verdict.saturated, verdict.reason) == (False, "concurrency_4_to_8_gains_80%")
    verdict = d.observe(obs(running=16, generated_tokens_per_s=1850.0, daemon_cpu_percent=20.0))
    assert (verdict.saturated, verdict.bottleneck) == (True, "engine")
    assert verdict.reason == "engine_saturated_gain_3%_from_8_to_16"
    assert verdict.throughput_by_concurrency == {4: 1000.0, 8: 1800.0, 16: 1850.0}


def test_front_end_cpu_is_named_when_the_daemon_is_busy() -> None:
    d = Diagnoser(min_gain=0.05, alpha=1.0, cpu_busy_percent=90.0)
    feed(d, 8, 1800.0)
    verdict = d.observe(obs(running=16, generated_tokens_per_s=1810.0, daemon_cpu_percent=97.0))
    assert (verdict.saturated, verdict.bottleneck) == (True, "front_end_cpu")
    assert verdict.reason == "front_end_cpu_97pct_gain_1%"


def test_idle_observations_do_not_move_the_table() -> None:
    d = Diagnoser(alpha=0.5)
    feed(d, 4, 1000.0)
    feed(d, 0, 0.0)
    feed(d, 4, 2000.0)  # EWMA: 1000 + 0.5 * (2000 - 1000)
    assert d.observe(obs(running=0, generated_tokens_per_s=0.0)).throughput_by_concurrency == {4: 1500.0}
