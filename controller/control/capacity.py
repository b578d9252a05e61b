"""How many SLO-good requests per second this replica can serve at the current request mix, and how
much of that is asked of it: ``autopilot_capacity_rps`` and ``autopilot_saturation``, the signal an
autoscaler adds replicas by (``deploy/k8s/``). Computed each tick by a loop subscriber
(``CapacityMeter.on_tick``) from the observation's step-cost fit, the telemetry window's mix and the
gate's arrivals; read by the metrics and ``/state``.

The model. The step cost is the online fit (``controller/control/stepcost.py``)::

    step_s = a + b*P + c*D + d*K      (P prefill tokens, D decoding sequences, K KV tokens read)

A request of the current mix prefills ``p`` tokens once and decodes ``o`` tokens, one per step of the
batch it runs in (``p``, ``o``: the means over the requests that finished in the telemetry window,
``p`` without prefix-cache hits; its first token, made by its last prefill step, counted as a decode
step too, an error of one step per request on the safe side). In steady state with ``D`` sequences
running, each reading ``k`` KV tokens (``CostEstimate.kv_tokens_per_seq``), a step decodes ``D``
tokens, so requests finish at ``D / o`` per step and the prefill the arrivals bring is ``D * p / o``
tokens per step. The mean step, which is what a request waits per output token (its TPOT), is::

    s(D) = a + x * D,          x = c + d*k + b*p/o

and the requests served per second, with the engine busy all the time (each request takes
``o*a/D + o*(c + d*k) + b*p`` seconds of engine time, and those sum to one second a second)::

    lambda(D) = D / (o * s(D))

Both ``a`` and ``x`` are counted at the engine's pace (``CostEstimate.pace``, 1 until measured): the
wall clock of the recent decoding steps, the time between steps included, over the fit's prediction
of them. The fit follows the typical step (it weighs relative error and skips outliers), where
throughput and a stream's TPOT go by the mean step on the wall clock: equal on an engine with cores of
its own, 20 % apart on a 2-core CPU shared by two engines (docs/fleet.md).

``lambda`` rises with ``D`` (towards ``1 / (o*x)``), so the capacity is ``lambda`` at the largest
batch that the SLO and the memory allow::

    D* = min(floor((share * tpot_s - a) / x), D_kv, max_num_seqs)
    capacity_rps = D* / (o * s(D*))
    saturation   = offered_rps / capacity_rps

* ``tpot_s``: the tightest class's bound (the batch is shared by every class). ``share``: of it, what
  the mean step may take: the policy's own plan where it has one (the ``slo`` policy's
  ``mean_margin``, learned from 0.7: the requests whose steps run longer than the mean must meet the
  bound too, and it is the batch that policy lets run), else 1.0 (the bound itself).
* ``D_kv = floor(running / kv_usage)``: the batch whose KV fills the cache at the current sequences'
  mean share of it (no cache size needed); with fewer than ``kv_min_running`` sequences running, or
  the cache under half full (a shared prefix's blocks over-read: ``policies.common.kv_batch``), only
  the TPOT bound and ``max_num_seqs`` apply.
* ``offered_rps``: requests arriving at the gate per second over the telemetry window: admitted,
  refused, timed out in the queue, and still queued (``GateStats`` totals, differenced between ticks).
  Not the admitted rate: that cannot pass what the engine takes, so it would read about 1 under any
  overload; demand the gate refused is demand a further replica would serve. A request counts once
  per replica, not once per try: a refused try whose ``X-Request-Id`` this gate refused within the
  last minute is a retry (``GateStats.retries_total``, ``admission/retries.py``: at most 4 per
  refusal, never an admitted try), not new demand. A try
  without the header counts each time (vllm-router passes the client's id on every attempt and
  makes up none: docs/fleet.md).
* Across replicas, a request a replica refused and the router tried on another counts on each replica
  it reached: up to ``min(attempts, N)`` times in the fleet's sum (vllm-router: 5 attempts). That
  overstates the demand by the refused share, never by more than the attempts: what a replica
  refused is demand a new replica would serve once, but no replica sees what another refused.
* Without ``[slo]``, under a policy that steers to the throughput knee (the ``slo`` policy's
  ``knee_share`` ``g``), the batch is the knee instead of the TPOT bound:
  ``D_knee = ceil(a * (1 - g) / (g * x))``, the smallest batch that reaches ``1 - g`` of the peak
  ``1 / (o*x)``; capacity is then requests a second at the knee, not good requests (there is no bound).
* TTFT is not a term: below saturation 1 the queue in front of the engine stays short, and the gate
  refuses a request whose predicted TTFT misses its bound; the autoscaler's target below 1 (0.8,
  ``deploy/k8s/README.md``) is the headroom that keeps TTFT.

Never a made-up number: without ``[slo]`` (and no knee), a ready fit, ``min_finished`` requests
finished in the window or two ticks of arrivals, the figure is None (the gauge has no sample) and
``reason`` says why.
Nothing offered reads saturation 0 (exact, capacity or not), from the first tick when no request has
reached the gate since the meter started; a capacity of 0 (not one sequence's mean step fits the
bound) leaves saturation None, as any load over it would be infinite.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from controller.admission.queues import GateStats
from controller.control.telemetry import FinishedMix
from policies.base import Observation, Policy
from policies.common import kv_batch
from policies.cost import CostEstimate, knee_batch
from policies.slo_targets import SloTargets


@dataclass(frozen=True)
class CapacityFit:
    """The largest batch within the bound and what it serves."""

    batch: int
    """``D*``: running sequences at capacity."""
    bound: str
    """What set ``D*``: "tpot", "knee", "kv" or "max_num_seqs"."""
    mean_step_s: float
    """``s(D*)``: the mean step at capacity (seconds)."""
    capacity_rps: float
    """``lambda(D*)``: good requests per second at capacity."""
    pace: float = 1.0
    """What the fit's step times were counted at (``CostEstimate.pace``; 1 before it is measured)."""


def fit_capacity(
    cost: CostEstimate,
    step_bound_s: float | None,
    mix: FinishedMix,
    kv_batch: int | None,
    max_num_seqs: int,
    knee_share: float | None = None,
) -> CapacityFit | str:
    """``D*`` and ``capacity_rps`` of the module's formula, with ``step_bound_s = share * tpot_s`` and
    ``kv_batch = D_kv`` (None: no KV bound); with ``knee_share`` (and no step bound) the knee's batch
    bounds instead; a reason string when the mix or the fit lacks a figure."""
    p, o, k = mix.prefill_tokens, mix.output_tokens, cost.kv_tokens_per_seq
    if p is None or o is None or o <= 0:
        return "mix: no finished request with output"
    if k is None:
        return "cost model: no decoding step yet (KV per sequence unknown)"
    pace = cost.pace or 1.0
    a = cost.a_s * pace
    x = (cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k + cost.b_s_per_prefill_token * p / o) * pace
    candidates = [(max_num_seqs, "max_num_seqs")]
    if x > 0 and step_bound_s is not None:
        candidates.append((math.floor((step_bound_s - a) / x), "tpot"))
    if x > 0 and knee_share is not None:
        candidates.append((knee_batch(a, x, knee_share), "knee"))
    if kv_batch is not None:
        candidates.append((kv_batch, "kv"))
    batch, bound = min(candidates)
    if batch < 1:
        return CapacityFit(0, bound, a + x, 0.0, pace)
    step = a + x * batch
    if step <= 0:
        return "cost model: predicts steps of 0 s"
    return CapacityFit(batch, bound, step, batch / (o * step), pace)


@dataclass(frozen=True)
class Capacity:
    """One tick's figures (``/state``'s ``capacity`` block; the two gauges)."""

    saturation: float | None
    """``offered_rps / capacity_rps``: 0 idle, 1 at capacity, above 1 over it; None: see reason."""
    capacity_rps: float | None
    """Good requests per second this replica can serve at the current mix; None: see reason."""
    offered_rps: float | None
    """Requests arriving at the gate per second over the window; 0 while none has arrived since the
    meter started; else None before two ticks."""
    reason: str
    """"ok", or why a figure is None ("cost model: 12 samples < 50", "no [slo] table", ...)."""
    batch: int | None = None
    bound: str | None = None
    mean_step_s: float | None = None
    """``s(D*)`` on the wall clock (the fit's mean step at ``pace``)."""
    pace: float | None = None
    """The wall clock of a decoding step over the fit's prediction (``CostEstimate.pace``)."""
    step_bound_s: float | None = None
    """``share * tpot_s``: what the mean step may take."""
    kv_tokens_per_seq: float | None = None
    prefill_tokens: float | None = None
    output_tokens: float | None = None
    finished: int = 0
    """Requests finished in the window (the mix's sample)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MixSource(Protocol):
    """The telemetry window (``controller/control/telemetry.py``)."""

    window_s: float

    def finished_mix(self) -> FinishedMix: ...


class GateTotals(Protocol):
    def stats(self) -> GateStats: ...


def new_arrivals(stats: GateStats) -> int:
    """The gate's arrivals less the retries of requests it refused: new demand, counted once."""
    return stats.arrivals_total - stats.retries_total


class Steering(Protocol):
    """What the capacity is counted against, in force (``control/build.ControlCore``)."""

    @property
    def slo(self) -> SloTargets | None: ...
    @property
    def policy(self) -> Policy: ...


class CapacityMeter:
    """The loop subscriber that computes a ``Capacity`` each tick (``last``), against ``steering``'s
    ``[slo]`` and policy, read each tick (None: no SLO, no policy)."""

    def __init__(
        self,
        window: MixSource,
        gate: GateTotals,
        steering: Steering | None = None,
        min_finished: int = 3,
        kv_min_running: int = 4,
        history: int | None = 0,
    ) -> None:
        self.window, self.gate, self.steering = window, gate, steering
        self.history: deque[tuple[float, Capacity]] = deque(maxlen=history)
        """The last ``history`` ticks' figures, (tick time, figures); None keeps every tick (the twin)."""
        self.min_finished, self.kv_min_running = min_finished, kv_min_running
        self._arrivals: deque[tuple[float, int]] = deque()
        """(tick time, arrivals so far) over the window."""
        self._arrivals_at_start = new_arrivals(gate.stats())
        """The gate's arrivals when the meter started: none since reads offered 0 from the first tick."""
        self.last = Capacity(None, None, None, "not started")

    @property
    def slo(self) -> SloTargets | None:
        return None if self.steering is None else self.steering.slo

    @property
    def policy(self) -> Policy | None:
        return None if self.steering is None else self.steering.policy

    @property
    def knee_share(self) -> float | None:
        """Without ``[slo]``: the policy's throughput knee, the batch the capacity is counted at."""
        policy = self.policy
        return policy.knee_share if policy is not None and self.slo is None else None

    def on_tick(self, obs: Observation, _changes: object) -> None:
        self.last = self.measure(obs)
        self.history.append((obs.now_mono, self.last))

    def _offered_rps(self, now: float) -> float | None:
        """Requests per second that reached admission over the window: the gate counts each once
        when it arrives (``new_arrivals``), whatever its ``n``, its prompts or what became of it, so
        requests leaving the queue or refused together move nothing, and retries of a refused one
        add nothing."""
        total = new_arrivals(self.gate.stats())
        self._arrivals.append((now, total))
        while len(self._arrivals) > 2 and self._arrivals[1][0] <= now - self.window.window_s:
            self._arrivals.popleft()  # keep one sample at or before the window's start
        (t0, n0), (t1, n1) = self._arrivals[0], self._arrivals[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def measure(self, obs: Observation) -> Capacity:
        offered = self._offered_rps(obs.now_mono)
        if offered is None and new_arrivals(self.gate.stats()) == self._arrivals_at_start:
            offered = 0.0  # no rate yet (one tick), but nothing has arrived since the start: idle
        mix = self.window.finished_mix()
        cost, slo = obs.cost, self.slo
        figures: dict[str, Any] = {"offered_rps": offered, "finished": mix.finished}
        figures.update(prefill_tokens=mix.prefill_tokens, output_tokens=mix.output_tokens)
        idle = 0.0 if offered == 0 else None  # nothing offered: 0 whatever the capacity
        if offered is None:
            return Capacity(None, None, reason="offered rate: one tick so far", **figures)
        if slo is None and self.knee_share is None:
            return Capacity(idle, None, reason="no [slo] table: no SLO capacity", **figures)
        if cost is None or not cost.ready:
            why = "no step-cost model" if cost is None else cost.reason
            return Capacity(idle, None, reason=why, **figures)
        figures["kv_tokens_per_seq"] = cost.kv_tokens_per_seq
        if mix.finished < self.min_finished:
            why = f"mix: {mix.finished} requests finished in {self.window.window_s:g} s < {self.min_finished}"
            return Capacity(idle, None, reason=why, **figures)
        share = 1.0 if self.policy is None else self.policy.mean_step_share  # learned: read each tick
        bound_s = None if slo is None else share * slo.tightest.tpot_s
        kv = kv_batch(obs.running, obs.kv_usage, 1.0, self.kv_min_running)
        fit = fit_capacity(cost, bound_s, mix, kv, obs.max_num_seqs, self.knee_share)
        if isinstance(fit, str):
            return Capacity(idle, None, reason=fit, step_bound_s=bound_s, **figures)
        figures.update(asdict(fit), step_bound_s=bound_s)
        if fit.capacity_rps <= 0:
            why = f"capacity 0: one sequence's mean step {_ms(fit.mean_step_s)} > {_ms(bound_s or 0.0)}"
            return Capacity(idle, reason=why, **figures)
        return Capacity(offered / fit.capacity_rps, reason="ok", **figures)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"
