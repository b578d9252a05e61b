"""The slo policy: steer the token budget, the batch cap and the admission limit to the SLO, from the
online step-cost model (``Observation.cost``) and ``[slo]`` (``policies/slo_targets.SloTargets``).

Every knob is sized from a predicted step, ``step(P, D, K) = a + b*P + c*D + d*K`` (P prefill tokens,
D decoding sequences, K KV tokens they read), planned to ``margin * tpot`` with ``tpot`` the tightest
class's TPOT bound (the cap and the budget are shared by every class).

Without ``[slo]`` the objective is throughput at the knee: the smallest batch past which more
concurrency adds less than ``knee_share`` of the engine's throughput (the seed's rule, "more
concurrency, no more throughput"), with KV preemption avoided and the whole per-step token budget.
"""

from __future__ import annotations

import math
from collections import deque
from types import MappingProxyType
from typing import Any

from policies.base import Decision, Observation, Policy, PolicyError
from policies.common import check_float, check_int, is_stale, kv_batch
from policies.cost import CostEstimate, knee_batch
from policies.knobs import cap_bounds
from policies.slo_targets import SloTargets

MISS_TEST_P = 0.1
"""The margin is cut only where its look's misses would come at most this often from a true share of
``miss_high``: a cut (x0.8) undoes four raises (x1.05), so one on a chance cluster of misses costs
requests for minutes."""


LOOKS_KEPT = 16
"""The margin's looks ``learned`` keeps: at a look every 10-15 s, the last three to four minutes."""


TRIM_FLOOR = 0.95
"""The most a look's pace trims the margin by: a TPOT p90 is a noisy figure of 10-50 requests, and a
miss (``margin_down``) is the evidence for a larger cut."""


def beyond_chance(missed: int, seen: int, share: float) -> bool:
    """Whether ``missed`` of ``seen`` is more than a true ``share`` gives with probability
    ``MISS_TEST_P`` (the binomial upper tail)."""
    if missed <= share * seen:
        return False
    below = sum(math.comb(seen, k) * share**k * (1 - share) ** (seen - k) for k in range(missed))
    return 1.0 - below <= MISS_TEST_P


class SloPolicy(Policy):
    """Sizes the three knobs to the TPOT bound and keeps the queue in the gate, where the TTFT bound
    is enforced (the gate refuses a request whose predicted TTFT misses its class's bound).

    Each tick, with ``tau = margin * tpot_s``, the model's ``a, b, c, d``, ``D`` the running requests
    (the decoding batch the next step serves) and ``k`` the KV tokens one of them reads
    (``cost.kv_tokens_per_seq``):

    1. stale stats, or ``cost`` None / not ready -> hold every knob, and say why (``cost.reason``).
       No ``[slo]``: the knee objective below.
    2. token budget ``T = D + floor((tau - a - c*D - d*k*D) / b)``: the largest whose step, a full
       prefill chunk with the decoding batch it joins, is predicted within ``tau``; never below
       ``D + R`` (vLLM serves the running requests first, in order: a budget below the batch starves
       the later decodes), nor below the new cap plus ``R``. The prefill reserve ``R`` is
       ``min_prefill_tokens``, or fewer where they would take more than half of ``tau - a``
       (``floor((tau - a) / 2b)``, at least 1: a CPU, where a token of prefill costs milliseconds).
    3. batch cap ``min(N_tpot, N_kv)``: ``N_tpot = floor((tau - a - b*R) / (c + d*k))``,
       the largest batch whose decode step (with the prefill reserve) is within ``tau`` (``margin``
       1.0: a decode step past the TPOT bound cannot give a mean within it; below that, what runs
       is the mean margin's to bound, step 4);
       ``N_kv = floor(kv_target * D / kv_usage)``, what the cache holds without preemption. The KV of
       one sequence is estimated from the observation as its mean share of the cache,
       ``kv_usage / D`` (the latest step's usage over the latest running count), so no cache size is
       needed; with fewer than ``kv_min_running`` requests running the share is too noisy, and with
       the cache under half of ``kv_target`` it over-reads a shared prefix's blocks
       (``policies.common.kv_batch``): there only ``N_tpot`` applies.
    4. admission limit: just above what the engine runs, so that the queue forms in the gate, where it
       is ordered by class and shed against the TTFT bound, not in the engine's waiting queue.
       ``waiting = in_flight - D`` (requests inside the engine not yet running), ``h = max(min_headroom,
       ceil(headroom * D))``: more than ``h`` waiting -> ``D + h`` ("engine_full"); requests queued in
       the gate with the limit reached and at most ``h / 2`` waiting -> ``limit + h`` ("gate_queue");
       otherwise the limit holds. At most ``cap + h``.

    The knee objective (no ``[slo]``): a batch of ``N`` decodes ``N / step(N)`` tokens a step-second,
    ``step(N) = a + s*N`` with ``s = c + d*k + b*r`` (``r = cost.prefill_per_decode``: the prefill each
    decoded token brings, 0 before it is measured). That rises towards ``1 / s`` and reaches the share
    ``1 - g`` of it (``g = knee_share``) at ``N_knee = ceil(a * (1 - g) / (g * s))``; past it a tenth
    more concurrency adds less than ``g`` / 10 throughput while every stream's TPOT grows. Cap
    ``min(N_knee, N_kv)`` (``N_kv`` as in 3), budget ``max_num_batched_tokens`` (throughput: no step
    bound to keep), limit the cap plus ``h`` as in 4, never cut to what runs (no TTFT bound to
    shed against: a queue is no better in the gate than in the engine). The gate refuses by queue
    bounds and deadlines alone.

    The mean margin learns (under ``[slo]``): ``mean_margin`` is where it starts, and every
    ``margin_samples`` requests served since its last look (``Observation.served_total``), or every
    ``margin_look_s`` once ``margin_min_samples`` were (a slow engine's look), the share
    of them that missed a bound of their class in the engine (``missed_total`` less
    ``queued_missed_total``: a TTFT miss spent mostly in the gate's queue counts as a refusal) steers
    it: where the misses show a share above ``miss_high`` beyond chance (``MISS_TEST_P``, a one-sided
    binomial test: 4 of 50, not 2, since at 3 % two misses in fifty come in 45 % of the looks and a
    cut at each ratchets the margin down on noise) it is multiplied by ``margin_down``; below
    ``miss_low``, or with more
    requests refused since that look (``refused_total``, and the queued misses) than missed and a
    share within ``miss_high`` (past it a raise overshoots, whatever the door lost), where it
    bounded the concurrency at some tick since that look (``runs`` below the cap: a larger margin
    would run more), by ``margin_up``; always within ``[mean_margin_min, mean_margin_max]``. Between
    the two it holds, and a look where the margin never bound what ran holds it either way (the cap
    or the KV did). After a move, and at its first bind, the requests then in flight (``in_flight``)
    end before the next count starts: they ran under the old margin (or the cap alone), and judging
    the new one by them moves it twice for one cause. The first look cuts only on a full count
    (``margin_samples``): before it, misses beyond chance are counted on (a raise or a hold still
    comes at a timely look). A too careful margin shows as refusals and queued misses (the limit
    holds the queue in the gate); a bold one as misses in the engine, which good requests then pay
    for in TPOT. A count of misses says only that none passed the bound, not
    how near it they ran: at a look where ``margin_min_samples`` or more of those served said a TPOT
    (``Observation.tpot_shares``, as a share of their class's bound) and no cut is due, a p90 above
    ``tpot_target`` trims the margin by ``max(TRIM_FLOOR, tpot_target / p90)``, and a raise that
    would carry it past (``p90 * margin_up > tpot_target``) holds.

    The policy asks for targets; the normalize stage (``controller/control/normalize.py``) clamps them
    (``[control] max_num_active_seqs_min``, ``limit_min``), drops moves within ``tolerance`` of the
    value in force, holds a quick reversal (``reverse_after_s``) and rate-limits the budget. The steps
    here are noisy, so the policy names its own defaults for the first two (``normalize_defaults``:
    tolerance 0.1, a reversal held 30 s), which ``[control]`` overrides.

    Parameters (defaults): ``margin`` 1.0; ``budget_margin`` 0.9 (``margin`` of the token budget's
    step); ``kv_target`` 0.9; ``kv_min_running`` 4; ``min_prefill_tokens`` 64; ``headroom`` 0.1;
    ``min_headroom`` 2; ``stale_after_s`` 5.0; ``knee_share`` 0.05; ``mean_margin`` 0.7,
    ``mean_margin_min`` 0.2, ``mean_margin_max`` 1.0, ``margin_samples`` 50, ``margin_look_s`` 10.0,
    ``margin_min_samples`` 10, ``miss_low`` 0.01, ``miss_high`` 0.03, ``margin_up`` 1.05,
    ``margin_down`` 0.8, ``tpot_target`` 0.9. ``slo`` is passed by the builder from ``[slo]`` (not a
    ``[control.params]`` key).

    States: the learned mean margin, the served and missed counts at its last look, and whether it
    bounded the concurrency since.
    """

    name = "slo"
    takes_slo = True
    normalize_defaults = MappingProxyType({"tolerance": 0.1, "reverse_after_s": 30.0})
    param_names = tuple(
        "margin mean_margin budget_margin kv_target kv_min_running min_prefill_tokens "
        "headroom min_headroom stale_after_s knee_share "
        "mean_margin_min mean_margin_max margin_samples margin_look_s margin_min_samples "
        "miss_low miss_high margin_up margin_down tpot_target".split()
    )

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        slo: SloTargets | None = None,
        margin: float = 1.0,
        mean_margin: float = 0.7,
        budget_margin: float = 0.9,
        kv_target: float = 0.9,
        kv_min_running: int = 4,
        min_prefill_tokens: int = 64,
        headroom: float = 0.1,
        min_headroom: int = 2,
        stale_after_s: float = 5.0,
        knee_share: float = 0.05,
        mean_margin_min: float = 0.2,
        mean_margin_max: float = 1.0,
        margin_samples: int = 50,
        margin_look_s: float = 10.0,
        margin_min_samples: int = 10,
        miss_low: float = 0.01,
        miss_high: float = 0.03,
        margin_up: float = 1.05,
        margin_down: float = 0.8,
        tpot_target: float = 0.9,
    ) -> None:
        self.max_num_seqs, self.slo = max_num_seqs, slo
        self.margin = check_float("margin", margin, 0.0, 10.0, lo_open=True)
        self.mean_margin = check_float("mean_margin", mean_margin, 0.0, 10.0, lo_open=True)
        self.budget_margin = check_float("budget_margin", budget_margin, 0.0, 100.0, lo_open=True)
        self.kv_target = check_float("kv_target", kv_target, 0.0, 1.0, lo_open=True)
        self.kv_min_running = check_int("kv_min_running", kv_min_running, 1)
        self.min_prefill_tokens = check_int("min_prefill_tokens", min_prefill_tokens, 1)
        self.headroom = check_float("headroom", headroom, 0.0, 10.0)
        self.min_headroom = check_int("min_headroom", min_headroom, 0)
        self.stale_after_s = check_float("stale_after_s", stale_after_s, 0.0, lo_open=True)
        self.knee_share: float = check_float("knee_share", knee_share, 0.0, 0.5, lo_open=True)
        self.mean_margin_min = check_float("mean_margin_min", mean_margin_min, 0.0, 10.0, lo_open=True)
        self.mean_margin_max = check_float("mean_margin_max", mean_margin_max, self.mean_margin_min, 10.0)
        if not self.mean_margin_min <= self.mean_margin <= self.mean_margin_max:
            raise PolicyError(
                f"mean_margin = {mean_margin}: must lie within [mean_margin_min, mean_margin_max] = "
                f"[{self.mean_margin_min:g}, {self.mean_margin_max:g}] (where it starts learning)"
            )
        self.margin_samples = check_int("margin_samples", margin_samples, 1)
        self.margin_look_s = check_float("margin_look_s", margin_look_s, 0.0)
        self.margin_min_samples = check_int("margin_min_samples", margin_min_samples, 1)
        self.miss_low = check_float("miss_low", miss_low, 0.0, 1.0)
        self.miss_high = check_float("miss_high", miss_high, self.miss_low, 1.0)
        self.margin_up = check_float("margin_up", margin_up, 1.0, 10.0)
        self.margin_down = check_float("margin_down", margin_down, 0.0, 1.0, lo_open=True)
        self.tpot_target = check_float("tpot_target", tpot_target, 0.0, 1.0, lo_open=True)
        self.margin_live = self.mean_margin
        """The learned mean margin, what ``_concurrency`` plans with."""
        self._mark: tuple[int, int, int] | None = None
        self._mark_t = 0.0
        """When the margin's count last started (a look, a move's settling, the first tick)."""
        """(served, missed, refused) totals at the margin's last look; None before the first tick."""
        self._margin_bound = False
        """The margin bounded the concurrency (runs below the cap) at a tick since its last look."""
        self._ever_bound: bool | None = None
        """The margin has bounded the concurrency at some tick; None before the first."""
        self._settle_until = 0
        """After a move, the served total at which the requests then in flight have ended: the
        next look counts only requests admitted under the new margin."""
        self._looks: deque[dict[str, Any]] = deque(maxlen=LOOKS_KEPT)
        """The margin's last looks, newest last (``learned``)."""
        self._terms: dict[str, float] = {}
        self._shared: tuple[float, int] = (2.0, 1)
        """The last budget's short answer (tokens) and the chunks it shares (``_budget``)."""

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        hold = self._hold_reason(obs)
        if hold is not None:
            return Decision(None, None, hold)
        cost = obs.cost
        assert cost is not None
        if self.slo is None:
            return self._knee(obs, cost)
        tau = self.margin * self.slo.tightest.tpot_s
        k = cost.kv_tokens_per_seq or 0.0
        reserve = self._reserve(cost, tau)
        cap, cap_why = self._cap(obs, cost, tau, k, reserve)
        budget_tau = self.budget_margin * self.slo.tightest.tpot_s
        budget, budget_why = self._budget(obs, cost, budget_tau, k, cap, reserve)
        margin_why = self._learn_margin(obs)
        runs, runs_why = self._concurrency(cost, k, cap, obs.asked_prefill_per_decode)
        # with no prefill mix known (a start) one runs: the margin bounds nothing yet
        known = cost.prefill_per_decode is not None or obs.asked_prefill_per_decode is not None
        binds = runs < cap and known
        if binds and self._ever_bound is False:
            # the margin binds for the first time: those admitted before ran under the cap alone (at
            # a start, before the load's prefill mix is measured), so they do not judge the margin
            self._settle_until = obs.served_total + obs.in_flight
        self._ever_bound = bool(self._ever_bound) or binds
        self._margin_bound = self._margin_bound or binds
        limit, limit_why = self._limit(obs, runs)
        self._terms = {"tau_s": tau, "kv_tokens_per_seq": k, "cap": cap, "budget": budget, "limit": limit}
        self._terms["answer_tokens"], self._terms["chunks_per_answer"] = self._shared
        self._terms["mean_margin"] = self.margin_live
        why = f"slo[{budget_why}; {cap_why}; {runs_why}; {margin_why}; {limit_why}]"
        return Decision(limit, cap, why, token_budget=budget)

    def _hold_reason(self, obs: Observation) -> str | None:
        if is_stale(obs, self.stale_after_s):
            return "stale_stats"
        if obs.cost is None:
            return "cost_not_ready[no step-cost model]"
        if not obs.cost.ready:
            return f"cost_not_ready[{obs.cost.reason}]"
        return None

    @property
    def objective(self) -> str:
        """What the policy steers to: the ``[slo]`` bounds, or without them the throughput knee."""
        if self.slo is None:
            return f"knee: the batch past which more concurrency adds < {self.knee_share:g} of throughput"
        return "slo: the most requests a second within [slo]"

    def _knee(self, obs: Observation, cost: CostEstimate) -> Decision:
        """No ``[slo]``: the throughput knee's cap (within the KV), the whole budget, the limit above."""
        k = cost.kv_tokens_per_seq or 0.0
        r = cost.prefill_per_decode or 0.0
        per_seq = cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k + cost.b_s_per_prefill_token * r
        g = self.knee_share
        if per_seq <= 0 or cost.a_s <= 0:
            n, why = self.max_num_seqs, f"cap {self.max_num_seqs}: knee, no per-sequence cost measured"
        else:
            n = knee_batch(cost.a_s, per_seq, g)
            why = f"cap {n}: knee, {1 - g:.0%} of peak at step {_ms(cost.a_s)} + {per_seq * 1e3:.2f} ms/seq"
        n, why = self._kv_cap(obs, n, why)
        cap = cap_bounds(self.max_num_seqs).clamp(n)
        budget = obs.max_num_batched_tokens
        limit, limit_why = self._limit(obs, cap, cut=False)
        self._terms = {"kv_tokens_per_seq": k, "cap": cap, "budget": budget, "limit": limit}
        why = f"knee[{why}; budget {budget}: max_num_batched_tokens, no [slo]; {limit_why}]"
        return Decision(limit, cap, why, token_budget=budget)

    def _cap(
        self, obs: Observation, cost: CostEstimate, tau: float, k: float, reserve: int
    ) -> tuple[int, str]:
        """The largest batch whose decode step, with ``reserve`` prefill tokens, is within ``tau``
        and that KV holds."""
        per_seq = cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k
        room = tau - cost.a_s - cost.b_s_per_prefill_token * reserve
        n = self.max_num_seqs if per_seq <= 0 else max(0, math.floor(room / per_seq))
        step = _ms(cost.a_s + per_seq * n + cost.b_s_per_prefill_token * reserve)
        cap, why = n, f"cap {n}: decode step with {reserve} prefill tokens {step} <= {_ms(tau)}"
        cap, why = self._kv_cap(obs, cap, why)
        return cap_bounds(self.max_num_seqs).clamp(cap), why

    def _kv_cap(self, obs: Observation, cap: int, why: str) -> tuple[int, str]:
        """``cap``, or what the KV cache holds where that is less (``policies.common.kv_batch``)."""
        n = kv_batch(obs.running, obs.kv_usage, self.kv_target, self.kv_min_running)
        if n is None or n >= cap:
            return cap, why
        return n, f"cap {n}: KV {obs.kv_usage:.2f} at {obs.running} running > {self.kv_target:g}"

    def _learn_margin(self, obs: Observation) -> str:
        """Steer ``margin_live`` by the share of the requests served since its last look that missed
        a bound; a look needs ``margin_samples`` of them, or ``margin_min_samples`` and
        ``margin_look_s`` since the last (each look starts a fresh count)."""
        # a TTFT miss spent waiting in the gate is a request the limit had no room for, as a refusal
        # is: it asks for a bolder margin, not a more careful one (cutting it lengthens the queue)
        queued = obs.queued_missed_total
        served, missed, refused = obs.served_total, obs.missed_total - queued, obs.refused_total + queued
        if self._mark is None or served < self._mark[0]:  # first tick, or another ledger's counts
            self._mark, self._margin_bound, self._settle_until = (served, missed, refused), False, served
            self._mark_t = obs.now_mono
        m = self.margin_live
        if served < self._settle_until:  # those in flight at the last move ran under the old margin
            self._mark, self._margin_bound = (served, missed, refused), False
            self._mark_t = obs.now_mono
            return f"margin {m:.2f}: {self._settle_until - served} admitted before its move to end"
        seen, miss, shed = served - self._mark[0], missed - self._mark[1], refused - self._mark[2]
        # a slow engine (a CPU: a request a second) serves margin_samples in a minute; the binomial
        # test below judges a smaller count as fairly, so a look comes at least every margin_look_s
        timely = seen >= self.margin_min_samples and obs.now_mono - self._mark_t >= self.margin_look_s
        if seen < self.margin_samples and not timely:
            return f"margin {m:.2f}: {seen} of {self.margin_samples} served to judge it"
        share, said = miss / seen, f"{miss} of {seen} served missed"
        too_many = beyond_chance(miss, seen, self.miss_high)
        if too_many and not self._looks and seen < self.margin_samples:
            # the first requests meet a cold prefix cache and a cost model still fitting: a cut on
            # a short count of them is a cut on the start (the twin's SmolLM2 shared prefix at 6
            # req/s, seed 0: 2 of 15 missed, 0.70 -> 0.56, and a minute at +5 % a look to climb
            # back: 0.90x the best static point, 0.95x with the start counted on to a full look;
            # the engine's load B cut the same way on 2 of 13)
            return f"margin {m:.2f}: {said} at the start, counted on to {self.margin_samples}"
        new, move = m, 0
        if too_many:
            move, said = -1, f"{said} > {self.miss_high:.0%} beyond chance"
        elif share < self.miss_low or (shed > miss and share <= self.miss_high):
            # a refusal loses a request as surely as a miss does: while the gate refuses more than
            # the margin lets miss, a bolder margin (more running, a shorter queue) gains requests
            lost = f", fewer than the {shed} refused or late in the queue"
            move, said = 1, said + (f" < {self.miss_low:.0%}" if share < self.miss_low else lost)
        else:
            said += f" within [{self.miss_low:.0%}, {self.miss_high:.0%}] but for chance, {shed} refused"
        paced, trim = self._paced(obs.tpot_shares, self._mark[0]), None
        if move >= 0 and paced is not None and paced * self.margin_up > self.tpot_target:
            # the served requests' pace says what the count of misses does not: how near the bound
            # they ran. A raise that would carry the look's p90 past tpot_target holds; past it the
            # margin trims by the share it overshot (SmolLM2 at 12 req/s: 18 running took the p90 to
            # 0.97 of 80 ms and served fewer than 16 at 0.88, with no miss counted)
            said += f", TPOT p90 {paced:.2f} of its bound"
            if paced <= self.tpot_target:
                move, said = 0, f"{said} x {self.margin_up:g} > {self.tpot_target:g}"
            else:
                move, trim = -1, max(TRIM_FLOOR, self.tpot_target / paced)
                said = f"{said} > {self.tpot_target:g}"
        if move and not self._margin_bound:  # the cap or the KV bound what ran: not the margin's doing
            said += ", it did not bound runs"
        elif move > 0:
            new, said = min(self.mean_margin_max, m * self.margin_up), f"{said}, it bounded runs"
        elif move < 0:
            new = max(self.mean_margin_min, m * (trim or self.margin_down))
        self.margin_live = new
        self._mark, self._margin_bound, self._mark_t = (served, missed, refused), False, obs.now_mono
        if new != m:
            self._settle_until = served + obs.in_flight
        said = f"margin {m:.2f} -> {new:.2f}: {said}" if new != m else f"margin {m:.2f}: {said}"
        self._looks.append(
            {
                "t_mono": obs.now_mono,
                "margin": m,
                "new": new,
                "served": seen,
                "missed": miss,
                "refused": shed,
                "tpot_p90_share": paced,
                "reason": said,
            }
        )
        return said

    def _paced(self, shares: tuple[tuple[int, float], ...], since: int) -> float | None:
        """The 90th percentile of the TPOT, as a share of its bound, of the requests served after
        ``since`` (a look's); None where fewer than ``margin_min_samples`` said one."""
        look = sorted(x for i, x in shares if i > since)
        if len(look) < self.margin_min_samples:
            return None
        return look[math.ceil(0.9 * len(look)) - 1]

    def _reserve(self, cost: CostEstimate, tau: float) -> int:
        """Prefill tokens every step keeps room for: ``min_prefill_tokens``, or on hardware where they
        would take most of the step (a CPU: 8 ms a token) as many as fill half of what ``tau`` leaves
        above the step's base, at least one, so that prompts progress and the step stays within ``tau``."""
        b = cost.b_s_per_prefill_token
        if b <= 0:
            return self.min_prefill_tokens
        return max(1, min(self.min_prefill_tokens, math.floor(0.5 * (tau - cost.a_s) / b)))

    def _concurrency(
        self, cost: CostEstimate, k: float, cap: int, asked_mix: float | None = None
    ) -> tuple[int, str]:
        """What the engine runs within the SLO: the cap, or fewer where the mean step (its decodes
        and their share of the load's prefill) would pass ``mean_margin`` of the TPOT bound. Until
        the steps measure the load's prefill mix, ``asked_mix`` stands in (what the requests ask,
        every prompt token counted: the careful side; at a start the cap alone let a first burst in
        that then missed its TTFT)."""
        r, asked = cost.prefill_per_decode, ""
        if r is None and asked_mix is not None:  # before the steps measure it: what requests ask
            r, asked = asked_mix, " asked"
        assert self.slo is not None
        bound = self.margin_live * self.slo.tightest.tpot_s
        decode = cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k
        per_seq = decode + cost.b_s_per_prefill_token * (r or 0.0)
        if r is None:  # no request has asked yet (a start): one runs until the first ones say
            return 1, "runs 1: no prefill mix asked or measured yet"
        if per_seq <= 0:
            return cap, f"runs {cap}: the cap (no per-sequence cost measured)"
        n = max(1, math.floor((bound - cost.a_s) / per_seq))
        if n >= cap:
            return cap, f"runs {cap}: the cap"
        mean = _ms(cost.a_s + per_seq * n)
        return n, f"runs {n}: mean step {mean} at {r:.1f} prefill/decode{asked} <= {_ms(bound)}"

    def _budget(
        self, obs: Observation, cost: CostEstimate, tau: float, k: float, cap: int, reserve: int
    ) -> tuple[int, str]:
        """The largest budget whose prefill chunks, shared over the tokens of a short answer, keep
        that answer's mean time per output token within ``tau``; at least the batch (or the cap)
        plus the cap's prefill ``reserve``.

        vLLM's TPOT (the one ``--goodput`` judges) is a request's mean, ``(e2e - TTFT) / (tokens -
        1)``: a step that carries a chunk of ``C`` prefill tokens is paid once and shared over the
        answer. Over an answer of ``L`` tokens (``obs.answer_tokens``: a short one) about one request
        joins per running one, and every one waiting in the engine (``W``) joins too, ``J = min(D + W,
        L - 1)`` chunks, so each may take ``(tau - decode step) * (L - 1) / J``: several times the
        per-step chunk where answers are long and the batch small (a CPU, where a per-step budget of
        30 tokens prefilled a 500-token prompt over 17 steps and its TTFT missed), the per-step bound
        where every step of the answer carries one. Before answers are
        known ``L`` is 2: the per-step bound. How much prefill the engine runs over a request's life,
        its mean step, is the concurrency's to bound (``_concurrency``)."""
        d = obs.running
        decode_s = cost.a_s + (cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k) * d
        b = cost.b_s_per_prefill_token
        answer = max(2.0, obs.answer_tokens or 2.0)
        # over an answer one request joins per running one (steady state) and each waiting in the
        # engine joins too: its steps carry that many chunks, at most one each (a queue of long
        # prompts, the code trace's, puts one in every step: the per-step bound)
        waiting = max(0, obs.in_flight - d)
        joins = max(1, min(d + waiting, math.floor(answer - 1)))
        self._shared = (answer, joins)
        slack = (tau - decode_s) * (answer - 1)  # what the chunks of an answer's life may add to it
        chunk = obs.max_num_batched_tokens if b <= 0 else math.floor(slack / (b * joins))
        floor = max(d, min(cap, self.max_num_seqs)) + reserve
        budget = min(max(floor, d + chunk), max(floor, obs.max_num_batched_tokens))
        step = decode_s + b * (budget - d)
        if answer <= 2:
            return budget, f"budget {budget}: step {_ms(step)} at {d} decodes, bound {_ms(tau)}"
        mean = (joins * step + (answer - 1 - joins) * decode_s) / (answer - 1)
        return budget, (
            f"budget {budget}: step {_ms(step)} at {d} decodes, {joins} in a {answer:.0f}-token "
            f"answer, mean {_ms(mean)}, bound {_ms(tau)}"
        )

    def _limit(self, obs: Observation, runs: int, cut: bool = True) -> tuple[int, str]:
        """Just above what the engine runs: the queue forms in the gate. ``cut``: requests waiting
        inside the engine pull it down to what runs (under ``[slo]``, where the gate sheds by the TTFT
        bound; without one a queue is no better in the gate, and a cut holds back requests the
        engine would batch as soon as a sequence ends)."""
        d = obs.running
        h = max(self.min_headroom, math.ceil(self.headroom * runs))
        waiting = max(0, obs.in_flight - d)
        want, why = runs + h, f"limit {runs + h}: {h} above"
        if cut and waiting > h and d + h < want:
            want, why = d + h, f"limit {d + h}: {waiting} wait in the engine > {h}"
        return max(1, want), why

    def params(self) -> dict[str, Any]:
        slo = None if self.slo is None else self.slo.as_dict()
        return {**super().params(), "slo": slo, "objective": self.objective}

    @property
    def mean_step_share(self) -> float:
        """Of the TPOT bound, what a mean step may take now: the learned mean margin."""
        return self.margin_live

    def learned(self) -> list[dict[str, Any]]:
        """The mean margin's last looks, newest last: when, the margin before and after, the
        requests served, missed and refused (or late in the gate's queue) since the look before,
        their TPOT p90 as a share of the bound (None: too few said one) and the reason. A look that
        holds leaves no knob change, so without these the decision log would not say why."""
        return list(self._looks)

    def terms(self) -> dict[str, float]:
        """The step bound, the KV per sequence, the three sizes and the learned mean margin of the
        last tick."""
        return dict(self._terms)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"
