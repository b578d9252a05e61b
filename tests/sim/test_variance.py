"""The twin's measured spread: quantile tables, their place in a profile, and how the twin draws from them."""

from __future__ import annotations

import dataclasses

import pytest

from controller.bench.calibrate.measure import Measurements, step_ratios
from controller.bench.calibrate.run import variance
from controller.load.workload import RequestSpec
from controller.profiles.load import (
    Profile,
    ProfileError,
    Variance,
    dump_profile,
    load_profile,
    parse_profile,
)
from controller.profiles.quantiles import QuantileTable, parse_table
from policies.cost import StepCoefficients
from tests.sim.scenarios import PROFILE, simulate


def test_inverse_cdf_interpolates_between_the_quantiles() -> None:
    table = QuantileTable((1.0, 2.0, 4.0), samples=3)  # p0 = 1, p50 = 2, p100 = 4
    assert [table.sample(u) for u in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert table.sample(-0.1) == 1.0 and table.sample(1.5) == 4.0
    assert table.mean() == pytest.approx((1.5 + 3.0) / 2)  # two segments of half the mass each


def test_tables_from_samples_and_their_errors() -> None:
    assert QuantileTable.from_samples([5, 1, 3, 2, 4], points=5) == QuantileTable((1, 2, 3, 4, 5), 5)
    assert QuantileTable.from_samples([float(k) for k in range(101)]).values == tuple(range(101))
    with pytest.raises(ValueError, match="must not decrease"):
        QuantileTable((2.0, 1.0), 2)
    with pytest.raises(ValueError, match="at least 2 values"):
        QuantileTable((1.0,), 1)
    with pytest.raises(ValueError, match=r"\[variance.step\]: quantiles must be a list of numbers"):
        parse_table({"samples": 3, "quantiles": "1, 2"}, "[variance.step]")
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_table({"samples": 3, "quantiles": [-1.0, 1.0]}, "x")


FRONT = QuantileTable((0.004, 0.005, 0.030), samples=200)
STEP = QuantileTable((0.5, 1.0, 3.0), samples=5000)


def test_profile_round_trip_with_and_without_the_tables() -> None:
    plain = load_profile("h200-8b")
    assert plain.variance == Variance()  # derived profile: no measured spread
    again = parse_profile(dump_profile(plain), "x")
    assert "[variance" not in dump_profile(plain) and again.variance == Variance()
    spread = dataclasses.replace(plain, variance=Variance(frontend=FRONT, step=STEP))
    text = dump_profile(spread)
    assert "[variance.frontend]" in text and "[variance.step]" in text
    back = parse_profile(text, "x")
    assert (back.variance, back.cost, back.engine) == (spread.variance, plain.cost, plain.engine)
    only_step = parse_profile(dump_profile(dataclasses.replace(plain, variance=Variance(step=STEP))), "x")
    assert only_step.variance == Variance(step=STEP)
    with pytest.raises(ProfileError, match=r"\[variance\] may hold only"):
        parse_profile(text.replace("[variance.step]", "[variance.steps]"), "x")


def test_the_shipped_cpu_profile_carries_measured_tables() -> None:
    v = load_profile("cpu-tiny").variance
    assert v.frontend is not None and v.frontend.samples >= 100
    assert v.step is not None and v.step.samples >= 1000


def isolated(n: int, gap_s: float = 1.0) -> list[RequestSpec]:
    """Requests far apart: each one meets an idle engine, so its TTFT is its front end plus one step."""
    return [RequestSpec(k, k * gap_s, 100, 4) for k in range(n)]


def with_variance(frontend: QuantileTable | None = None, step: QuantileTable | None = None) -> Profile:
    return dataclasses.replace(PROFILE, frontend_s=0.004, variance=Variance(frontend=frontend, step=step))


def ttfts(
    profile: Profile, specs: list[RequestSpec], seed: int = 0, use_variance: bool = True
) -> list[float]:
    result = simulate(specs, "static", profile=profile, seed=seed, use_variance=use_variance)
    return [r.ttft_s or 0.0 for r in result.records]


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


def test_a_wide_front_end_table_raises_p99_ttft_over_the_constant() -> None:
    specs = isolated(200)
    constant = ttfts(with_variance(), specs)
    wide = ttfts(with_variance(frontend=QuantileTable((0.004, 0.010, 0.200), 200)), specs)
    # the table's minimum is the constant, and isolated requests do not interact: every TTFT is at least
    # the constant one's, and the tail is the table's
    assert min(w - c for w, c in zip(wide, constant, strict=True)) >= -1e-12
    assert p99(wide) > p99(constant) + 0.1
    degenerate = ttfts(with_variance(frontend=QuantileTable((0.004, 0.004), 1)), specs)
    assert degenerate == pytest.approx(constant, abs=1e-12)  # a one-point table is the constant


def test_a_flat_step_table_is_the_mean_model_and_use_variance_false_ignores_tables() -> None:
    specs = isolated(50, gap_s=0.05)
    mean_model = ttfts(with_variance(), specs)
    assert ttfts(with_variance(step=QuantileTable((1.0, 1.0), 1)), specs) == pytest.approx(mean_model)
    spread = with_variance(frontend=FRONT, step=STEP)
    assert ttfts(spread, specs, use_variance=False) == mean_model
    assert ttfts(spread, specs) != mean_model


def test_the_same_seed_gives_the_same_draws() -> None:
    specs = isolated(100, gap_s=0.01)  # overlapping requests: step draws matter too
    profile = with_variance(frontend=FRONT, step=STEP)
    one = simulate(specs, "hysteresis", profile=profile, seed=3)
    two = simulate(specs, "hysteresis", profile=profile, seed=3)
    other = simulate(specs, "hysteresis", profile=profile, seed=4)
    assert one.records == two.records and one.series == two.series
    assert one.records != other.records
    assert one.summary(None, None)["variance"] == ["frontend", "step"]


def test_step_ratios_use_lockstep_gaps_of_an_uncoalesced_stream() -> None:
    coalesced = (0.0, [0.10, 0.12, 0.16])  # 3 chunks for 4 tokens: skipped
    late = (0.0, [0.11 + 0.01 * k for k in range(4)])  # the batch's last first token: 0.11
    steady = (0.0, [0.10, 0.11, 0.12, 0.14])
    assert step_ratios([coalesced, steady, late], out=4, min_gaps=2) == pytest.approx([2 / 3, 4 / 3])
    assert step_ratios([coalesced], out=4, min_gaps=2) == []


def test_front_end_delays_are_ttft_minus_the_predicted_prefill_step() -> None:
    cost = StepCoefficients(a_s=0.002, b_s_per_prefill_token=1e-5, c_s_per_decode_seq=0, d_s_per_kv_token=0)
    step = cost.step_s(32, 0, 32)  # 2.32 ms
    m = Measurements([], [0.5, 1.5], frontend_ttfts=[step + 0.005, step - 0.001], frontend_prompt=32)
    v = variance(cost, m)
    assert v.frontend is not None and v.frontend.values[0] == 0.0  # below the step: kept at 0
    assert v.frontend.values[-1] == pytest.approx(0.005) and v.frontend.samples == 2
    assert v.step is not None and v.step.mean() == pytest.approx(1.0)
    assert variance(cost, Measurements([], [], [], 32)) == Variance()


def test_the_step_table_keeps_the_cost_models_mean_step() -> None:
    one_long = [RequestSpec(0, 0.0, 100, 2000)]  # 1999 decode steps of one request, alone
    skewed = QuantileTable((0.5, 0.6, 1.0, 5.0), 5000)  # mean 1.45: rescaled to 1 by the twin
    mean_model = simulate(one_long, "static", profile=with_variance()).records[0]
    spread = simulate(one_long, "static", profile=with_variance(step=skewed), seed=1).records[0]
    assert mean_model.tpot_s is not None and spread.tpot_s is not None
    assert spread.tpot_s == pytest.approx(mean_model.tpot_s, rel=0.05)
