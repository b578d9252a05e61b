"""controller/control/stepcost.py: the online step-cost fit, with exact numbers.

Steps are synthetic: features drawn like a serving engine's (decode batches with some prefill chunks),
times from known coefficients, fed in ticks of 100 steps as the control loop's ``StepFeed`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest

from controller.control.stepcost import (
    SCALES,
    CostPrior,
    CostReader,
    FitSettings,
    StepCostModel,
    prior_from,
)
from controller.control.steps import EngineStep
from policies.cost import StepCoefficients

TRUE = (0.003, 8e-6, 5e-5, 1e-7)
"""a_s, b per prefill token, c per decode sequence, d per KV token (cpu-tiny's order of magnitude)."""
TICK = 100


def make_steps(
    n: int,
    coef: Sequence[float] = TRUE,
    *,
    seed: int = 1,
    t0: float = 0.0,
    noise: float = 0.0,
    prefill: bool = True,
) -> list[EngineStep]:
    """``n`` steps 10 ms apart; one in four carries a prefill chunk unless ``prefill`` is False;
    ``noise``: the sd of a log-normal multiplier."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(16, 2048)) if prefill and rng.random() < 0.25 else 0
        d = int(rng.integers(0 if p else 1, 64))
        k = p + d * int(rng.integers(50, 1500))
        y = coef[0] + coef[1] * p + coef[2] * d + coef[3] * k
        if noise:
            y *= math.exp(float(rng.normal(0.0, noise)))
        out.append(EngineStep.measured(t0 + 0.01 * i, p, d, k, y))
    return out


def feed(model: StepCostModel, steps: Sequence[EngineStep]) -> None:
    for i in range(0, len(steps), TICK):
        model.update(steps[i : i + TICK])


def rel_errors(model: StepCostModel, coef: Sequence[float] = TRUE) -> list[float]:
    return [abs(got / want - 1) for got, want in zip(model.coefficients.vector(), coef, strict=True)]


def test_noiseless_steps_recover_the_coefficients() -> None:
    model = StepCostModel()
    feed(model, make_steps(3000))
    assert max(rel_errors(model)) < 1e-7
    est = model.estimate(now_mono=30.0)
    assert est.samples == 3000 and est.rejected == 0
    assert est.ready and est.reason == "ready"
    assert est.rel_error is not None and est.rel_error < 1e-6
    assert est.r2 is not None and est.r2 > 1 - 1e-9
    assert est.step_s(512, 32, 20_000) == pytest.approx(0.003 + 8e-6 * 512 + 5e-5 * 32 + 1e-7 * 20_000)
    assert model.predict_step(512, 32, 20_000) == est.step_s(512, 32, 20_000)


def test_noisy_steps_recover_the_coefficients_within_their_spread() -> None:
    model = StepCostModel()
    feed(model, make_steps(20_000, noise=0.1))
    assert max(rel_errors(model)) < 0.05
    est = model.estimate(now_mono=200.0)
    assert est.rel_error == pytest.approx(0.1, rel=0.15)  # the spread itself: the fit explains the rest


def test_forgetting_tracks_a_change_of_coefficients() -> None:
    model = StepCostModel()
    feed(model, make_steps(3000))
    doubled = tuple(2 * c for c in TRUE)  # a neighbour took half the machine
    feed(model, make_steps(3000, doubled, seed=2, t0=30.0))
    assert 1e-3 < max(rel_errors(model, doubled)) < 0.1  # the old steps weigh forgetting^3000 = 5 %
    feed(model, make_steps(7000, doubled, seed=3, t0=60.0))
    assert max(rel_errors(model, doubled)) < 1e-3
    assert model.rejected == 0  # twice as slow is not an outlier


def test_too_few_samples_is_not_ready_and_says_why() -> None:
    model = StepCostModel()
    est = model.estimate(now_mono=0.0)
    assert (est.ready, est.reason, est.samples, est.age_s, est.rel_error) == (
        False, "cost model: 0 samples < 50", 0, None, None
    )  # fmt: skip
    model.update(make_steps(12))
    est = model.estimate(now_mono=0.2)
    assert (est.ready, est.reason) == (False, "cost model: 12 samples < 50")


def test_stale_samples_are_not_ready_and_say_how_old() -> None:
    model = StepCostModel(FitSettings(max_age_s=60.0))
    feed(model, make_steps(100))  # last step at t = 0.99
    assert model.estimate(now_mono=60.0).ready
    est = model.estimate(now_mono=75.99)
    assert est.age_s == pytest.approx(75.0)
    assert (est.ready, est.reason) == (False, "cost model: last sample 75 s ago > 60 s")


def test_steps_that_did_nothing_or_have_no_time_are_skipped() -> None:
    model = StepCostModel()
    model.update([
        EngineStep.measured(0.0, 0, 0, 0, 0.003),  # nothing scheduled
        EngineStep.measured(0.1, 0, 4, 400, 0.0),
        EngineStep.measured(0.2, 0, 4, 400, float("nan")),
    ])  # fmt: skip
    assert model.samples == 0


def test_a_seed_is_a_prior_that_data_overrides() -> None:
    wrong = tuple(1.5 * c for c in TRUE)
    model = StepCostModel(prior=CostPrior(StepCoefficients(*wrong), name="cpu-tiny"))
    est = model.estimate(now_mono=0.0)
    # a seed is trusted before any step (the knobs are sized before the first request)
    assert est.seed == "cpu-tiny" and est.samples == 0 and est.ready
    assert est.coefficients() == pytest.approx(dict(zip(est.coefficients(), wrong, strict=True)))
    model.update(make_steps(1))
    assert 0 < max(rel_errors(model)) < 0.5  # one step moves the seed, does not replace it
    feed(model, make_steps(3000, seed=3))
    assert max(rel_errors(model)) < 0.01  # the seed weighs forgetting^3000 of its 20 steps now
    feed(model, make_steps(7000, seed=4, t0=30.0))
    assert max(rel_errors(model)) < 1e-4


def test_a_seed_holds_a_term_the_load_does_not_excite() -> None:
    """Decode-only load: nothing measures the prefill cost, so the seed's stays, exactly."""
    seeded = StepCostModel(prior=CostPrior(StepCoefficients(*TRUE)))
    feed(seeded, make_steps(5000, prefill=False))
    assert seeded.coefficients.vector()[1] == pytest.approx(TRUE[1], rel=1e-9)
    assert max(rel_errors(seeded)) < 1e-6


def test_prior_from_a_profile_cost_table() -> None:
    cost = StepCoefficients(
        a_s=0.003, b_s_per_prefill_token=8e-6, c_s_per_decode_seq=5e-5, d_s_per_kv_token=1e-7
    )
    assert prior_from(cost, "cpu-tiny") == CostPrior(StepCoefficients(*TRUE), name="cpu-tiny")


def test_outliers_are_rejected_and_counted() -> None:
    steps = make_steps(3000)
    paused = [
        EngineStep(s.t_mono, dataclasses.replace(s.cost, step_s=s.cost.step_s * 10))
        if i % 50 == 49 and s.cost is not None
        else s
        for i, s in enumerate(steps)
    ]  # a GC pause every 50 steps
    model = StepCostModel()
    feed(model, paused)
    # All but the first tick's two: the fit predicts nothing before it has taken in a tick.
    assert model.rejected == 60 - 2
    assert max(rel_errors(model)) < 1e-4  # those two weigh forgetting^2900 now


def test_a_lasting_change_is_learnt_after_max_rejects() -> None:
    model = StepCostModel(FitSettings(max_rejects=20))
    feed(model, make_steps(2000))
    slower = tuple(5 * c for c in TRUE)  # five times slower is an outlier, for a while
    feed(model, make_steps(3000, slower, seed=4, t0=20.0))
    assert model.rejected == 20
    assert max(rel_errors(model, slower)) < 1e-4


def test_slow_prefills_after_a_start_without_them_are_learnt_not_rejected() -> None:
    """SmolLM2 in float32 on a 2-core CPU: a prefill token costs 8 ms, so a 500-token chunk takes 4 s
    where the decode steps the load started with take 0.1 s. Those steps recur, one in four: they are
    the cost of prefill the fit has not learnt yet, not pauses to skip."""
    cpu = (0.074, 0.008, 0.0075, 1.2e-5)
    model = StepCostModel()
    feed(model, make_steps(300, cpu, seed=10, prefill=False))
    feed(model, make_steps(1000, cpu, seed=11, t0=3.0, noise=0.05))
    assert model.coefficients.vector()[1] == pytest.approx(cpu[1], rel=0.05)
    assert model.rejected <= model.settings.max_rejects


def test_coefficients_never_go_negative() -> None:
    no_kv = (0.003, 8e-6, 5e-5, 0.0)  # the KV term is 0: noise alone would fit it below 0
    model = StepCostModel()
    steps = make_steps(5000, no_kv, noise=0.3, seed=5)
    for i in range(0, len(steps), TICK):
        model.update(steps[i : i + TICK])
        assert min(model.coefficients.vector()) >= 0.0
    assert model.coefficients.vector()[3] < 1e-8


def test_stable_over_100k_updates_with_a_long_stretch_without_prefill() -> None:
    """Forgetting over poor excitation winds the covariance up; the cap keeps it bounded, so the
    first prefill steps after 50k decode-only steps move the prefill cost a little, not wildly."""
    model = StepCostModel()
    feed(model, make_steps(30_000, noise=0.2, seed=6))
    feed(model, make_steps(50_000, noise=0.2, seed=7, t0=300.0, prefill=False))
    vals = np.linalg.eigvalsh(model._p)
    cap = model._cap()
    assert np.isfinite(vals).all() and vals.min() > 0 and vals.max() <= cap * (1 + 1e-9)
    b_before = model.coefficients.vector()[1]
    model.update(make_steps(20, noise=0.2, seed=8, t0=800.0))
    assert model.coefficients.vector()[1] == pytest.approx(b_before, rel=0.5)
    feed(model, make_steps(20_000, noise=0.2, seed=9, t0=801.0))
    assert max(rel_errors(model)) < 0.25  # the noise's own spread (c and d are correlated)
    assert all(math.isfinite(c) and c >= 0 for c in model.coefficients.vector())
    assert model.samples + model.rejected == 100_020


def test_features_are_scaled_so_every_term_is_near_one() -> None:
    assert (SCALES == [1.0, 1024.0, 64.0, 65536.0]).all()


def test_reader_reads_at_its_clock() -> None:
    model = StepCostModel()
    model.update(make_steps(10))
    now = [5.09]
    assert CostReader(model, lambda: now[0]).current().age_s == pytest.approx(5.0)


def test_kv_per_decoding_sequence_is_a_ratio_of_sums_not_a_mean_of_each_steps_ratio() -> None:
    """Decodes of 300 KV tokens each, in steps of 40, alternating with steps that decode one beside
    three 288-token prompts: the load reads (12,000 + 1,164) / 41 = 321 a decode. A mean of each
    step's ratio would read (300 + 1,164) / 2 = 732, and plan half the batch the KV allows."""
    model = StepCostModel()
    steps = []
    for i in range(200):
        steps.append(EngineStep.measured(0.02 * i, 0, 40, 40 * 300, 0.05))
        steps.append(EngineStep.measured(0.02 * i + 0.01, 3 * 288, 1, 300 + 3 * 288, 0.05))
    model.update(steps)
    k = model.estimate(now_mono=4.0).kv_tokens_per_seq
    assert k == pytest.approx(13_164 / 41, rel=0.01)


def test_the_pace_is_the_wall_clock_of_the_decoding_steps_over_the_fit() -> None:
    """Steps measured as the seed predicts, each after a 1 ms gap: the pace is the wall clock (the
    step and its gap) over the prediction, summed over the decoding steps; prefills alone count not."""
    model = StepCostModel(prior=CostPrior(StepCoefficients(*TRUE), name="true"))
    steps = make_steps(1000, prefill=False)
    assert model.estimate(0.0).pace is None
    feed(model, steps[:50])
    assert model.estimate(0.5).pace is None  # 50 steps: under a tenth of the fit's 1000-step memory
    costs = [c for c in (s.cost for s in steps) if c is not None]
    gapped = [
        EngineStep.measured(s.t_mono, c.prefill_tokens, c.decode_seqs, c.kv_tokens, c.step_s, 0.001)
        for s, c in zip(steps, costs, strict=True)
    ]
    model = StepCostModel(prior=CostPrior(StepCoefficients(*TRUE), name="true"))
    feed(model, gapped)
    lam = model.settings.forgetting
    weights = [lam ** (len(gapped) - 1 - i) for i in range(len(gapped))]
    wall = sum(w * (c.step_s + 0.001) for w, c in zip(weights, costs, strict=True))
    predicted = sum(w * c.step_s for w, c in zip(weights, costs, strict=True))
    assert model.estimate(10.0).pace == pytest.approx(wall / predicted, rel=0.01)
    assert model.estimate(10.0).pace > 1.0


def test_the_prefill_mix_is_read_after_twenty_steps_not_a_tenth_of_the_memory() -> None:
    """Until the mix is read the slo policy plans with what requests ask or, with nothing asked,
    one running: at 100 steps (7 s on a CPU) the twin's start admitted a burst that then missed."""
    model = StepCostModel()
    model.update([EngineStep.measured(0.01 * i, 32, 4, 400, 0.01) for i in range(21)])
    assert model.estimate(now_mono=0.2).prefill_per_decode is None  # 19.99 steps with mix_forgetting
    model.update([EngineStep.measured(0.2, 32, 4, 400, 0.01)])
    assert model.estimate(now_mono=0.2).prefill_per_decode == pytest.approx(8.0)  # 32 tokens / 4 decodes


def test_the_mix_forgets_a_cold_start_within_a_few_hundred_steps() -> None:
    """A shared-prefix load's first steps prefill whole prompts; once its prefixes are cached it
    asks a fraction of that. Over the fit's memory (1,000 steps) the cold start still read 17.9
    prefill per decode 400 steps later; over the mix's 200, 7.7."""
    model = StepCostModel()
    model.update([EngineStep.measured(0.01 * i, 400, 4, 400, 0.05) for i in range(100)])
    model.update([EngineStep.measured(1 + 0.01 * i, 8, 4, 400, 0.02) for i in range(400)])
    mix = model.estimate(now_mono=5.0).prefill_per_decode
    assert mix is not None and mix == pytest.approx(7.7, abs=0.1)
