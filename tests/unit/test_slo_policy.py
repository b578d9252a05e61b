"""The slo policy (policies/slo_policy.py) with a fake step-cost fit: every knob's size, exactly."""

from __future__ import annotations

from typing import Any

import pytest

from controller.admin.metrics import reason_label
from policies.base import BUILT_INS, PolicyError, build_policy
from policies.cost import CostEstimate
from policies.slo_policy import LOOKS_KEPT, SloPolicy, beyond_chance
from policies.slo_targets import SloBound, SloTargets
from tests.helpers import obs

SLO = SloTargets(SloBound(1.0, 0.05), (("interactive", SloBound(1.0, 0.05)),))


def cost(**overrides: Any) -> CostEstimate:
    """a = 5.1 ms, b = 30 us per prefill token, c = 100 us per sequence, d = 0.1 us per KV token;
    400 KV tokens per sequence, 2 prefill tokens per decoded token; ready."""
    fields: dict[str, Any] = {
        "a_s": 0.0051, "b_s_per_prefill_token": 3e-5, "c_s_per_decode_seq": 1e-4,
        "d_s_per_kv_token": 1e-7, "samples": 500, "rejected": 0, "rel_error": 0.02, "r2": 0.99,
        "age_s": 0.1, "ready": True, "reason": "ready", "kv_tokens_per_seq": 400.0,
        "prefill_per_decode": 2.0,
    }  # fmt: skip
    return CostEstimate(**{**fields, **overrides})


def policy(**params: Any) -> SloPolicy:
    """The policy with ``mean_margin`` 0.5 and ``margin`` 0.9 (the cap's step within 45 ms) unless
    given: the figures below are worked from them."""
    built = build_policy(
        "slo", {"mean_margin": 0.5, "margin": 0.9} | params, max_num_seqs=256, initial_limit=50, slo=SLO
    )
    assert isinstance(built, SloPolicy)
    return built


def loaded(**overrides: Any) -> Any:
    """20 running, 2 waiting inside the engine, KV at 0.1; knobs: limit 50, cap 256, budget 2048."""
    base: dict[str, Any] = {
        "admission_limit": 50, "batch_cap": 256, "max_num_seqs": 256, "in_flight": 22, "queued": 0,
        "running": 20, "kv_usage": 0.1, "token_budget": 2048, "max_num_batched_tokens": 8192,
        "token_budget_min": 16, "cost": cost(),
    }  # fmt: skip
    return obs(**{**base, **overrides})


def test_each_knob_is_sized_from_the_model_and_the_tpot_bound() -> None:
    d = policy().decide(loaded(), 100.0)
    # budget: tau = 0.9 * 50 ms = 45 ms; decodes 5.1 + 20 * (0.1 + 0.04) ms = 7.9 ms;
    #   chunk floor((45 - 7.9) ms / 30 us) = 1236 -> 20 + 1236
    assert d.token_budget == 1256
    # cap: decode step floor((45 - 5.1 - 64 * 0.03) ms / 0.14 ms) = 271, at most max_num_seqs; KV 0.1
    # is under half of kv_target 0.9: no KV bound (test_a_shared_prefix_...)
    assert d.batch_cap == 256
    # runs: mean step floor((25 - 5.1) ms / (0.14 + 2 * 0.03) ms) = 99; limit 99 + ceil(0.1 * 99)
    assert d.admission_limit == 109
    assert d.reason == (
        "slo[budget 1256: step 45 ms at 20 decodes, bound 45 ms; cap 271: decode step with 64 prefill "
        "tokens 45 ms <= 45 ms; "
        "runs 99: mean step 25 ms at 2.0 prefill/decode <= 25 ms; margin 0.50: 0 of 50 served to judge it; "
        "limit 109: 10 above]"
    )


def test_without_kv_pressure_the_decode_step_sizes_the_cap() -> None:
    no_mix = cost(prefill_per_decode=None)
    d = policy().decide(loaded(kv_usage=0.01, cost=no_mix), 100.0)
    # KV: floor(0.9 * 20 / 0.01) = 1800; decode step: 271, at most max_num_seqs
    assert d.batch_cap == 256
    # no prefill mix measured or asked (a start): one runs, two above it, until requests say
    assert d.admission_limit == 1 + 2 and "runs 1: no prefill mix asked or measured yet" in d.reason
    asked = policy().decide(loaded(kv_usage=0.01, cost=no_mix, asked_prefill_per_decode=50.0), 100.0)
    # what requests ask stands in: mean step floor((25 - 5.1) ms / (0.14 + 50 * 0.03) ms) = 12
    assert asked.admission_limit == 12 + 2
    assert "runs 12: mean step 25 ms at 50.0 prefill/decode asked <= 25 ms" in asked.reason
    wide = SloPolicy(max_num_seqs=512, initial_limit=50, slo=SLO).decide(
        loaded(kv_usage=0.01, batch_cap=128), 1.0
    )
    # by default the cap's step may take the whole TPOT bound (a decode step past it cannot make a
    # mean within it): floor((50 - 5.1 - 1.92) ms / 0.14 ms) = 307
    assert wide.batch_cap == 307
    assert "cap 307: decode step with 64 prefill tokens 50 ms <= 50 ms" in wide.reason


def test_where_prefill_costs_milliseconds_a_token_the_reserve_shrinks_to_fit_the_step() -> None:
    """SmolLM2 in float32 on a 2-core CPU (the first cpu-smollm2 fit): 64 prefill tokens would take
    513 ms, twice the whole 250 ms TPOT bound; the reserve is what fills half of tau - a."""
    cpu = cost(a_s=0.0738, b_s_per_prefill_token=0.008, c_s_per_decode_seq=0.0075,
               d_s_per_kv_token=1.2e-5, kv_tokens_per_seq=60.0, prefill_per_decode=None)  # fmt: skip
    slow = SloTargets(SloBound(5.0, 0.25), (("interactive", SloBound(5.0, 0.25)),))
    p = SloPolicy(max_num_seqs=64, initial_limit=8, slo=slow)
    d = p.decide(loaded(cost=cpu, running=2, in_flight=2, kv_usage=0.01, batch_cap=64,
                        max_num_seqs=64, admission_limit=8), 100.0)  # fmt: skip
    # the cap's tau = 250 ms (margin 1.0); reserve floor(0.5 * (250 - 73.8) / 8) = 11 tokens;
    # cap floor((250 - 73.8 - 88) ms / (7.5 + 0.72) ms) = 10
    assert d.batch_cap == 10
    assert "cap 10: decode step with 11 prefill tokens 244 ms <= 250 ms" in d.reason
    # budget (tau 225 ms, budget_margin 0.9): decodes 73.8 + 2 * 8.22 = 90.2 ms; chunk
    # floor((225 - 90.2) / 8) = 16 -> 2 + 16, at least the cap plus the reserve: 10 + 11
    assert d.token_budget == 21


def test_the_budget_never_falls_below_the_batch_it_serves() -> None:
    slow = cost(c_s_per_decode_seq=2e-3)  # 20 decodes: 5.1 + 20 * 2.04 ms = 45.9 ms > 45 ms alone
    d = policy().decide(loaded(cost=slow), 100.0)
    # cap floor((45 - 5.1 - 1.92) ms / 2.04 ms) = 18; the budget serves the 20 running + 64 prefill
    assert (d.batch_cap, d.token_budget) == (18, 84)


def test_an_engine_queue_pulls_the_limit_down_to_what_runs() -> None:
    d = policy().decide(loaded(in_flight=40, admission_limit=40), 100.0)
    assert d.admission_limit == 30  # 20 waiting inside the engine > 10: 20 running + 10
    assert "limit 30: 20 wait in the engine > 10" in d.reason


@pytest.mark.parametrize(
    ("estimate", "reason"),
    [
        (None, "cost_not_ready[no step-cost model]"),
        (
            cost(ready=False, reason="cost model: 12 samples < 50"),
            "cost_not_ready[cost model: 12 samples < 50]",
        ),
    ],
)
def test_it_holds_every_knob_until_the_model_is_ready(estimate: CostEstimate | None, reason: str) -> None:
    d = policy().decide(loaded(cost=estimate), 100.0)
    assert (d.admission_limit, d.batch_cap, d.token_budget, d.reason) == (None, None, None, reason)


def test_without_an_slo_it_runs_the_batch_at_the_throughput_knee() -> None:
    knee = SloPolicy(max_num_seqs=256, initial_limit=50, knee_share=0.2)
    d = knee.decide(loaded(kv_usage=0.01), 0.0)
    # per sequence 0.1 + 400 * 0.0001 + 2 * 0.03 = 0.2 ms; knee ceil(5.1 * 0.8 / (0.2 * 0.2)) = 102:
    # 80 % of the peak 1 / 0.2 ms, and past it a tenth more concurrency adds under 2 % throughput
    assert d.batch_cap == 102
    assert d.token_budget == 8192  # max_num_batched_tokens: no step bound to keep
    assert d.admission_limit == 102 + 11  # limit: ceil(0.1 * 102) above what runs
    assert d.reason == (
        "knee[cap 102: knee, 80% of peak at step 5 ms + 0.20 ms/seq; "
        "budget 8192: max_num_batched_tokens, no [slo]; limit 113: 11 above]"
    )
    assert knee.params()["slo"] is None
    assert knee.params()["objective"].startswith("knee: ")


def test_without_an_slo_requests_waiting_in_the_engine_do_not_cut_the_limit() -> None:
    knee = SloPolicy(max_num_seqs=256, initial_limit=50, knee_share=0.2)
    # 30 wait inside the engine beside 20 running: under [slo] the limit would fall to 20 + 11
    d = knee.decide(loaded(kv_usage=0.01, in_flight=50), 0.0)
    assert d.admission_limit == 102 + 11


def test_without_an_slo_the_kv_cache_bounds_the_knee() -> None:
    d = SloPolicy(max_num_seqs=256, initial_limit=50).decide(loaded(kv_usage=0.5), 0.0)
    # knee ceil(5.1 * 0.95 / (0.05 * 0.2)) = 485; KV floor(0.9 * 20 / 0.5) = 36
    assert d.batch_cap == 36
    assert "cap 36: KV 0.50 at 20 running > 0.9" in d.reason


def test_under_slo_the_kv_cache_bounds_the_cap() -> None:
    d = policy().decide(loaded(kv_usage=0.6), 100.0)
    # decode step 271 (test above); KV floor(0.9 * 20 / 0.6) = 30
    assert d.batch_cap == 30
    assert "cap 30: KV 0.60 at 20 running > 0.9" in d.reason


def test_a_shared_prefix_does_not_read_as_a_full_cache() -> None:
    """The load of the drop-in's flapping (CPU box, prefix_repetition: four 480-token system prompts):
    KV 0.22 at 4 running read a cap of floor(0.9 * 4 / 0.22) = 16 while the knee's was 58, and the
    cap and limit swung between the two every few seconds; 15 running held 0.47 of that cache. Under
    half of kv_target the mean share over-reads the shared blocks: the KV bounds nothing there."""
    knee = SloPolicy(max_num_seqs=256, initial_limit=50)
    shared = knee.decide(loaded(running=4, in_flight=4, kv_usage=0.22), 0.0)
    assert shared.batch_cap == 256  # the knee's 485, at most max_num_seqs: no KV bound
    assert "KV" not in shared.reason
    # at half of kv_target the straight line reaches twice the batch: it bounds from there
    half = knee.decide(loaded(running=4, in_flight=4, kv_usage=0.45), 0.0)
    assert half.batch_cap == 8
    assert "cap 8: KV 0.45 at 4 running > 0.9" in half.reason
    under_slo = policy().decide(loaded(running=4, in_flight=4, kv_usage=0.22), 100.0)
    assert "KV" not in under_slo.reason


def test_without_an_slo_it_holds_until_the_model_is_ready() -> None:
    d = SloPolicy(max_num_seqs=256, initial_limit=50).decide(loaded(cost=None), 0.0)
    assert (d.admission_limit, d.batch_cap, d.token_budget) == (None, None, None)
    assert d.reason == "cost_not_ready[no step-cost model]"


@pytest.mark.parametrize("share", [0, 0.6, float("nan"), float("inf")])
def test_the_knee_share_is_a_share_of_throughput(share: float) -> None:
    with pytest.raises(PolicyError, match="knee_share"):
        SloPolicy(max_num_seqs=8, initial_limit=8, knee_share=share)


def test_it_asks_the_normalize_stage_for_a_band_and_a_hold_on_quick_reversals() -> None:
    """Its steps jitter from tick to tick: the normalize stage drops what is within 10 % and holds a
    reversal for 30 s, unless ``[control]`` says otherwise (tests/unit/test_normalize.py)."""
    assert dict(policy().normalize_defaults) == {"tolerance": 0.1, "reverse_after_s": 30.0}


def test_it_is_built_in_and_takes_the_slo_from_the_builder_only() -> None:
    assert BUILT_INS["slo"] == "policies.slo_policy:SloPolicy"
    assert policy().slo is SLO
    with pytest.raises(PolicyError, match="'slo' comes from the \\[slo\\] table"):
        build_policy("slo", {"slo": 1}, max_num_seqs=8, initial_limit=8, slo=SLO)
    with pytest.raises(PolicyError, match="margin = 0"):
        policy(margin=0)


def test_the_figures_stay_out_of_the_metric_label() -> None:
    reason = policy().decide(loaded(), 100.0).reason + ":rate_limited"
    assert reason_label(reason) == "slo:rate_limited"
    assert reason_label("cost_not_ready[cost model: 12 samples < 50]:hold") == "cost_not_ready:hold"
    assert reason_label("kv_low:rate_limited") == "kv_low:rate_limited"


def test_the_mean_margin_rises_while_no_served_request_misses_and_it_bounds_what_runs() -> None:
    p = policy(margin_samples=20)
    # tick 1 marks the counts; runs 99 < cap 180: the margin bounds the concurrency
    assert "margin 0.50: 0 of 20 served to judge it" in p.decide(loaded(served_total=100), 1.0).reason
    d = p.decide(loaded(served_total=119, missed_total=0), 2.0)
    assert "margin 0.50: 19 of 20 served to judge it" in d.reason and p.margin_live == 0.5
    d = p.decide(loaded(served_total=120, missed_total=0), 3.0)
    assert "margin 0.50 -> 0.53: 0 of 20 served missed < 1%, it bounded runs" in d.reason
    # runs: floor((0.525 * 50 - 5.1) ms / 0.2 ms) = 105; limit 105 + ceil(10.5) = 116
    assert p.margin_live == pytest.approx(0.525) and d.admission_limit == 116
    assert p.terms()["mean_margin"] == pytest.approx(0.525) and p.mean_step_share == pytest.approx(0.525)
    # the 22 in flight at the move ran under the old margin: they end before the next count starts
    d = p.decide(loaded(served_total=141), 4.0)
    assert "margin 0.53: 1 admitted before its move to end" in d.reason
    for served in range(142, 161):
        p.decide(loaded(served_total=served), 5.0)
    assert p.margin_live == pytest.approx(0.525)  # 19 counted since 142
    p.decide(loaded(served_total=162), 6.0)
    assert p.margin_live == pytest.approx(0.525 * 1.05)


def test_the_mean_margin_falls_when_more_than_three_percent_of_those_served_miss() -> None:
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    d = p.decide(loaded(served_total=50, missed_total=4), 2.0)  # 8 % missed, beyond chance at 3 %
    assert "margin 0.50 -> 0.40: 4 of 50 served missed > 3% beyond chance" in d.reason
    # runs: floor((0.4 * 50 - 5.1) ms / 0.2 ms) = 74; limit 74 + ceil(7.4) = 82
    assert p.margin_live == pytest.approx(0.4) and d.admission_limit == 82
    for n in range(2, 12):  # every look with misses: down to mean_margin_min, never below
        p.decide(loaded(served_total=50 * n, missed_total=50 * n), 1.0 + n)
    assert p.margin_live == 0.2


def test_the_mean_margin_holds_between_the_shares_and_where_it_did_not_bound_runs() -> None:
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    d = p.decide(loaded(served_total=50, missed_total=1), 2.0)  # 2 %: between 1 % and 3 %
    assert "margin 0.50: 1 of 50 served missed within [1%, 3%]" in d.reason and p.margin_live == 0.5
    # no prefill mix: the engine runs its cap, so a larger margin would run nothing more
    no_mix = cost(prefill_per_decode=None)
    p = policy(margin_samples=50)
    p.decide(loaded(cost=no_mix), 3.0)
    d = p.decide(loaded(served_total=50, cost=no_mix), 4.0)
    assert "margin 0.50: 0 of 50 served missed < 1%, it did not bound runs" in d.reason
    assert p.margin_live == 0.5
    p = policy(mean_margin_max=0.52, margin_samples=1)
    p.decide(loaded(), 1.0)
    p.decide(loaded(served_total=1), 2.0)
    assert p.margin_live == 0.52  # capped at mean_margin_max


def test_the_mean_margin_rises_while_the_gate_refuses_more_than_it_lets_miss() -> None:
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    # 4 of 50 missed (8 %) with 30 refused: above miss_high beyond chance it falls, whatever the
    # refusals
    d = p.decide(loaded(served_total=50, missed_total=4, refused_total=30), 2.0)
    assert "margin 0.50 -> 0.40: 4 of 50 served missed > 3% beyond chance" in d.reason
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    # 1 of 50 missed (2 %, between the shares) with 3 refused: three requests lost at the door
    # against one late, so the margin rises as if none had missed
    d = p.decide(loaded(served_total=50, missed_total=1, refused_total=3), 2.0)
    said = "margin 0.50 -> 0.53: 1 of 50 served missed, fewer than the 3 refused or late in the queue"
    assert f"{said}, it bounded runs" in d.reason
    assert p.margin_live == pytest.approx(0.525)
    # the 20 in flight at the move end (to 70), then of 50 served 1 missed and 1 refused: it holds
    p.decide(loaded(served_total=69, missed_total=1, refused_total=3), 3.0)
    d = p.decide(loaded(served_total=119, missed_total=2, refused_total=4), 4.0)
    assert "margin 0.53: 1 of 50 served missed within [1%, 3%] but for chance, 1 refused" in d.reason
    assert p.margin_live == pytest.approx(0.525)
    # of the next 50, 2 missed (4 %, above miss_high, within chance) and 11 refused: more refused
    # than missed, but a raise from a share already past miss_high overshoots (the twin's
    # SmolLM2 shared prefix at 2.5 req/s: 1 of 22 missed at 0.85, raised, 18 TPOT misses in 20 s)
    d = p.decide(loaded(served_total=169, missed_total=4, refused_total=15), 5.0)
    assert "margin 0.53: 2 of 50 served missed within [1%, 3%] but for chance, 11 refused" in d.reason
    assert p.margin_live == pytest.approx(0.525)


def test_a_chance_cluster_of_misses_does_not_cut_the_mean_margin() -> None:
    # 3 of 50 missed (6 %): a true share of 3 % gives three or more in 19 % of the looks, so the
    # margin holds; 4 of 50 comes in 6 % of them, and cuts it
    assert not beyond_chance(3, 50, 0.03) and beyond_chance(4, 50, 0.03)
    assert not beyond_chance(5, 100, 0.03) and beyond_chance(6, 100, 0.03)
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    d = p.decide(loaded(served_total=50, missed_total=3, refused_total=2), 2.0)
    assert "margin 0.50: 3 of 50 served missed within [1%, 3%] but for chance, 2 refused" in d.reason
    assert p.margin_live == 0.5


def test_a_ttft_miss_spent_in_the_gates_queue_counts_as_a_refusal_not_a_miss() -> None:
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    # 4 of 50 missed (8 %), 3 of them waiting in the gate: 1 missed in the engine (2 %) against
    # 3 lost to the queue, so the margin rises (cutting it would lengthen the queue)
    d = p.decide(loaded(served_total=50, missed_total=4, queued_missed_total=3), 2.0)
    said = "margin 0.50 -> 0.53: 1 of 50 served missed, fewer than the 3 refused or late in the queue"
    assert f"{said}, it bounded runs" in d.reason


def test_misses_while_the_margin_did_not_bound_runs_leave_it_and_its_first_bind_restarts_the_count() -> None:
    no_mix = cost(prefill_per_decode=None)  # a start: no prefill mix yet, the engine runs the cap
    p = policy(margin_samples=50)
    p.decide(loaded(cost=no_mix), 1.0)
    d = p.decide(loaded(served_total=50, missed_total=10, cost=no_mix), 2.0)  # 20 % missed
    assert "margin 0.50: 10 of 50 served missed > 3% beyond chance, it did not bound runs" in d.reason
    assert p.margin_live == 0.5  # what ran was the cap's doing
    # the mix is measured and the margin binds (runs 99 < cap 180): the 22 in flight were admitted
    # under the cap alone, so they end (at 82 served) before its first count starts
    p.decide(loaded(served_total=60, missed_total=12), 3.0)
    d = p.decide(loaded(served_total=79, missed_total=15), 4.0)
    assert "margin 0.50: 3 admitted before its move to end" in d.reason and p.margin_live == 0.5
    d = p.decide(loaded(served_total=132, missed_total=15), 5.0)  # counted from the last tick before
    assert "margin 0.50 -> 0.53: 0 of 53 served missed < 1%, it bounded runs" in d.reason


def paced(first: int, shares: list[float]) -> tuple[tuple[int, float], ...]:
    """Served requests' TPOT over their bound, the first served as number ``first``."""
    return tuple((first + i, x) for i, x in enumerate(shares))


def test_the_served_requests_pace_holds_a_raise_and_trims_the_margin_past_tpot_target() -> None:
    """No miss counted says only that none passed the bound; the look's TPOT p90 says how near it
    ran. A raise (x1.05) that would carry it past ``tpot_target`` (0.9) holds; past it the margin
    trims by the share it overshot, at most x0.95."""
    p = policy(margin_samples=20)
    p.decide(loaded(served_total=100), 1.0)
    # 20 served from 101, none missed, at 0.805-0.90 of the bound: p90 (the 18th) 0.89, x1.05 > 0.9
    near = paced(101, [0.80 + 0.005 * i for i in range(1, 21)])
    d = p.decide(loaded(served_total=120, tpot_shares=near), 2.0)
    assert "margin 0.50: 0 of 20 served missed < 1%, TPOT p90 0.89 of its bound x 1.05 > 0.9;" in d.reason
    assert p.margin_live == 0.5
    # the next 20 at 0.99: a trim of max(0.95, 0.9 / 0.99)
    d = p.decide(loaded(served_total=140, tpot_shares=near + paced(121, [0.99] * 20)), 3.0)
    assert "margin 0.50 -> 0.47: 0 of 20 served missed < 1%, TPOT p90 0.99 of its bound > 0.9" in d.reason
    assert p.margin_live == pytest.approx(0.475)
    # the 22 in flight at the move end (at 162); of the next 20, at 0.93: x(0.9 / 0.93)
    p.decide(loaded(served_total=161), 4.0)
    d = p.decide(loaded(served_total=181, tpot_shares=paced(162, [0.93] * 20)), 5.0)
    assert p.margin_live == pytest.approx(0.475 * 0.9 / 0.93)
    # at 0.80 a raise stays within it (0.84): x1.05, as where no pace is known
    p.decide(loaded(served_total=202), 6.0)
    d = p.decide(loaded(served_total=222, tpot_shares=paced(203, [0.80] * 20)), 7.0)
    assert "TPOT p90 0.80 of its bound" not in d.reason
    assert p.margin_live == pytest.approx(0.475 * 0.9 / 0.93 * 1.05)
    # fewer than margin_min_samples (10) said a TPOT (one-token answers): the count alone decides
    p.decide(loaded(served_total=243), 8.0)
    p.decide(loaded(served_total=263, tpot_shares=paced(244, [0.99] * 9)), 9.0)
    assert p.margin_live == pytest.approx(0.475 * 0.9 / 0.93 * 1.05**2)


def test_a_miss_beyond_chance_cuts_the_margin_whatever_the_pace() -> None:
    p = policy(margin_samples=50)
    p.decide(loaded(), 1.0)
    d = p.decide(loaded(served_total=50, missed_total=4, tpot_shares=paced(1, [0.5] * 50)), 2.0)
    assert "margin 0.50 -> 0.40: 4 of 50 served missed > 3% beyond chance" in d.reason


def test_the_mean_margin_starts_at_0_7() -> None:
    p = build_policy("slo", {}, max_num_seqs=256, initial_limit=50, slo=SLO)
    assert isinstance(p, SloPolicy) and p.margin_live == 0.7


def test_the_mean_margin_parameters_are_checked() -> None:
    with pytest.raises(PolicyError, match=r"mean_margin = 0\.1: must lie within"):
        policy(mean_margin=0.1)
    with pytest.raises(PolicyError, match="miss_high"):
        policy(miss_low=0.05, miss_high=0.01)
    with pytest.raises(PolicyError, match="margin_down"):
        policy(margin_down=1.5)


def test_the_budget_shares_a_chunk_over_a_short_answer_as_vllms_mean_tpot_does() -> None:
    """vLLM's TPOT is a request's mean over its answer: a step carrying a chunk is paid once and
    shared over the answer's tokens; about one request joins per running one over an answer."""
    few = loaded(running=2, in_flight=2, answer_tokens=5.0)
    d = policy().decide(few, 100.0)
    # tau 45 ms, decodes 5.1 + 2 * 0.14 = 5.38 ms; 2 chunks in a 5-token answer:
    # floor((45 - 5.38) ms * 4 / (30 us * 2)) = 2641 -> 2 + 2641; the per-step bound gave 1322
    assert d.token_budget == 2643
    # mean (2 * (5.38 + 79.23) + 2 * 5.38) / 4 ms = 45 ms
    assert "budget 2643: step 85 ms at 2 decodes, 2 in a 5-token answer, mean 45 ms, bound 45 ms" in d.reason
    d = policy().decide(loaded(answer_tokens=11.0), 100.0)
    # 20 running: each of the answer's 10 steps may carry a chunk, so the per-step bound holds
    assert d.token_budget == 1256
    # 4 more wait inside the engine: each joins too, a chunk in each of the answer's 4 steps
    queued = policy().decide(loaded(running=2, in_flight=6, answer_tokens=5.0), 100.0)
    assert queued.token_budget == 2 + 1320  # floor(39.62 ms * 4 / (30 us * 4)): the per-step bound
    long = policy().decide(loaded(running=2, in_flight=2, answer_tokens=200.0), 100.0)
    assert long.token_budget == 8192  # past the engine's max_num_batched_tokens: that


def test_before_any_answer_is_known_the_budget_holds_the_step_alone_within_the_bound() -> None:
    assert policy().decide(loaded(answer_tokens=None), 100.0).token_budget == 1256
    assert policy().decide(loaded(answer_tokens=1.0), 100.0).token_budget == 1256  # one token: no TPOT


def test_on_a_slow_engine_the_margin_is_judged_every_margin_look_s_from_ten_served() -> None:
    """A CPU serves a request or two a second: 50 served took most of a one-minute run, and the
    margin never moved in it. The binomial test judges ten as fairly, so a look comes every 10 s."""
    p = policy(margin_samples=50)
    p.decide(loaded(now_mono=0.0), 0.0)
    d = p.decide(loaded(now_mono=9.0, served_total=12), 9.0)
    assert "margin 0.50: 12 of 50 served to judge it" in d.reason  # 9 s: not yet
    d = p.decide(loaded(now_mono=10.0, served_total=12), 10.0)
    assert "margin 0.50 -> 0.53: 0 of 12 served missed < 1%, it bounded runs" in d.reason
    p = policy(margin_samples=50)
    p.decide(loaded(now_mono=0.0), 0.0)
    d = p.decide(loaded(now_mono=30.0, served_total=9), 30.0)
    assert "9 of 50 served to judge it" in d.reason  # fewer than margin_min_samples: no look


def test_the_first_look_cuts_the_margin_only_on_a_full_count() -> None:
    """The first requests meet a cold prefix cache and a cost model still fitting: 2 of 15 missed
    at a timely first look is counted on to ``margin_samples``, not a cut; a later look's is."""
    p = policy(margin_samples=50)
    p.decide(loaded(now_mono=0.0), 0.0)
    d = p.decide(loaded(now_mono=10.0, served_total=15, missed_total=2), 10.0)
    assert "margin 0.50: 2 of 15 served missed at the start, counted on to 50" in d.reason
    assert p.margin_live == 0.5 and p.learned() == []
    d = p.decide(loaded(now_mono=20.0, served_total=50, missed_total=2, refused_total=9), 20.0)
    # 2 of 50 (4 %) is within chance at 3 %: the margin holds
    assert "margin 0.50: 2 of 50 served missed within [1%, 3%] but for chance, 9 refused" in d.reason
    assert p.margin_live == 0.5 and len(p.learned()) == 1
    p = policy(margin_samples=50)
    p.decide(loaded(now_mono=0.0), 0.0)
    d = p.decide(loaded(now_mono=10.0, served_total=50, missed_total=4), 10.0)
    assert "margin 0.50 -> 0.40: 4 of 50 served missed > 3% beyond chance" in d.reason  # a full count
    p = policy(margin_samples=50)
    p.decide(loaded(now_mono=0.0), 0.0)
    p.decide(loaded(now_mono=10.0, served_total=12), 10.0)  # the first look: a raise
    p.decide(loaded(now_mono=10.0, served_total=33), 10.0)  # those in flight at the move end (34)
    d = p.decide(loaded(now_mono=20.0, served_total=48, missed_total=2), 20.0)
    assert "margin 0.53 -> 0.42: 2 of 15 served missed > 3% beyond chance" in d.reason


def test_every_look_of_the_margin_is_kept_with_its_counts_and_reason_moved_or_not() -> None:
    """A look that holds moves no knob, so only ``learned`` says why the margin stayed: the last
    ``LOOKS_KEPT`` looks, newest last, with the counts since the look before."""
    p = policy(margin_samples=20)
    p.decide(loaded(served_total=100), 1.0)
    assert p.learned() == []  # counting, no look yet
    near = paced(101, [0.80 + 0.005 * i for i in range(1, 21)])
    p.decide(loaded(served_total=120, refused_total=3, tpot_shares=near, now_mono=2.0), 2.0)
    hold = "margin 0.50: 0 of 20 served missed < 1%, TPOT p90 0.89 of its bound x 1.05 > 0.9"
    assert p.learned() == [
        {"t_mono": 2.0, "margin": 0.5, "new": 0.5, "served": 20, "missed": 0, "refused": 3,
         "tpot_p90_share": pytest.approx(0.89), "reason": hold},
    ]  # fmt: skip
    p.decide(loaded(served_total=145, missed_total=4), 3.0)  # 4 of 25: a cut
    look = p.learned()[-1]
    assert (look["margin"], look["new"], look["served"], look["missed"]) == (0.5, pytest.approx(0.4), 25, 4)
    assert look["tpot_p90_share"] is None and look["reason"].startswith("margin 0.50 -> 0.40: 4 of 25")
    served, missed = 145 + 22, 4
    p.decide(loaded(served_total=served - 1, missed_total=missed), 4.0)  # the 22 in flight at the cut end
    for n in range(LOOKS_KEPT + 3):  # 1 of 20 each (5 %, within chance of 3 %): holds, look after look
        served, missed = served + 20, missed + 1
        p.decide(loaded(served_total=served, missed_total=missed, now_mono=5.0 + n), 5.0 + n)
    assert len(p.learned()) == LOOKS_KEPT  # the oldest dropped
    assert [x["t_mono"] for x in p.learned()[-2:]] == [5.0 + LOOKS_KEPT + 1, 5.0 + LOOKS_KEPT + 2]
    assert all(x["new"] == x["margin"] == pytest.approx(0.4) for x in p.learned())
