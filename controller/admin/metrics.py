"""Prometheus definitions. The registry is passed in (each test has a fresh one); vLLM's own
``vllm:*`` metrics live in prometheus_client's default registry and are exposed beside ours.

Counters and histograms count events as they happen. The gauges are read from the live parts at
scrape time by ``LiveGauges``, a Collector, so a scrape never shows a value older than itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from controller.admission.ttft import TtftCheck
from controller.control.capacity import Capacity
from controller.control.knobs import ADMISSION_LIMIT, BATCH_CAP, TOKEN_BUDGET
from controller.control.loop import Change
from controller.control.observe import EngineKnobs, GateReadings
from policies.base import Observation, Policy
from policies.cost import CostEstimate

GAUGES = {
    ADMISSION_LIMIT.gauge: "Requests allowed inside the engine at once.",
    BATCH_CAP.gauge: "Active-request cap of the engine's scheduler (the batch cap).",
    "autopilot_max_num_seqs": "Hard ceiling of the batch cap (engine max_num_seqs).",
    TOKEN_BUDGET.gauge: "Most tokens the engine's scheduler issues in one step (the token budget).",
    "autopilot_in_flight_requests": "Requests holding an admission slot.",
    "autopilot_engine_generation": "How many engines this daemon has started.",
    "autopilot_engine_up": "1 when the engine serves, else 0.",
}
QUEUE_DEPTH = "Requests waiting in the admission gate, by priority class."
POLICY_TERM = "Internal terms of the active policy (error, integral, tau_s, ...)."
COST_GAUGES = {
    "autopilot_cost_model_samples": "Engine steps the online step-cost model has taken in.",
    "autopilot_cost_model_rel_error": "RMS relative error of the step-cost model's recent predictions.",
    "autopilot_cost_model_ready": "1 when the step-cost model has enough recent steps to steer by.",
}
CAPACITY_GAUGES = {
    "autopilot_saturation": "Offered requests/s over autopilot_capacity_rps: 0 idle, 1 at the SLO capacity "
    "the step-cost model predicts for the current mix, above 1 over it (no sample: /state capacity.reason).",
    "autopilot_capacity_rps": "Good requests per second this replica can serve at the current request mix "
    "within [slo] (no sample: /state capacity.reason).",
}
COST_TERM = "Step-cost model coefficient: step_s = a_s + b*prefill + c*decode_seqs + d*kv_tokens."


class LiveEngine(EngineKnobs, Protocol):
    """The engine host as the gauges read it: its knobs, and which engine serves."""

    @property
    def generation(self) -> int: ...

    @property
    def ready(self) -> bool: ...


class LiveCost(Protocol):
    """The step-cost model's reader (``controller/control/stepcost.py``, ``CostReader``)."""

    def current(self) -> CostEstimate: ...


class LiveCapacity(Protocol):
    """The capacity meter (``controller/control/capacity.py``): its latest tick's figures."""

    @property
    def last(self) -> Capacity: ...


class LivePolicy(Protocol):
    """Whatever holds the policy in force (the control loop: a reload swaps its policy)."""

    @property
    def policy(self) -> Policy: ...


class GateGauges(GateReadings, Protocol):
    """What the gauges read from the gate: an observation's readings and the TTFT check."""

    ttft_check: TtftCheck


class LiveGauges:
    """A Collector: the gauges, read from the gate, the engine host and the policy at each scrape.
    Until ``read_from`` the families have no samples (their names are still exposed)."""

    def __init__(self) -> None:
        self._parts: tuple[GateGauges, LiveEngine, LivePolicy] | None = None
        self._cost: LiveCost | None = None
        self._capacity: LiveCapacity | None = None

    def read_from(self, gate: GateGauges, engine: LiveEngine, policy: LivePolicy) -> None:
        self._parts = (gate, engine, policy)

    def read_cost(self, cost: LiveCost) -> None:
        self._cost = cost

    def read_capacity(self, capacity: LiveCapacity) -> None:
        self._capacity = capacity

    def _capacity_families(self) -> Iterator[Metric]:
        last = self._capacity.last if self._capacity is not None else None
        values = (last.saturation, last.capacity_rps) if last else (None, None)
        for (name, doc), value in zip(CAPACITY_GAUGES.items(), values, strict=True):
            yield GaugeMetricFamily(name, doc, value=value)  # None: no sample, never a made-up one

    def _cost_families(self) -> Iterator[Metric]:
        est = self._cost.current() if self._cost is not None else None
        terms = GaugeMetricFamily("autopilot_cost_model_coefficient", COST_TERM, labels=["term"])
        for term, coefficient in (est.coefficients() if est else {}).items():
            terms.add_metric([term], coefficient)
        yield terms
        values: tuple[float | None, ...] = (
            (est.samples, est.rel_error, int(est.ready)) if est else (None,) * 3
        )
        for (name, doc), value in zip(COST_GAUGES.items(), values, strict=True):
            yield GaugeMetricFamily(name, doc, value=value)  # no sample until there is a value

    def describe(self) -> Iterator[Metric]:
        yield from (GaugeMetricFamily(name, doc) for name, doc in GAUGES.items())
        yield GaugeMetricFamily("autopilot_queue_depth", QUEUE_DEPTH, labels=["priority_class"])
        yield from _ttft_check_families({})
        yield GaugeMetricFamily("autopilot_policy_term", POLICY_TERM, labels=["policy", "term"])
        yield GaugeMetricFamily("autopilot_cost_model_coefficient", COST_TERM, labels=["term"])
        yield from (GaugeMetricFamily(name, doc) for name, doc in COST_GAUGES.items())
        yield from (GaugeMetricFamily(name, doc) for name, doc in CAPACITY_GAUGES.items())

    def collect(self) -> Iterator[Metric]:
        if self._parts is None:
            yield from self.describe()
            return
        gate, engine, holder = self._parts
        g = gate.stats()
        values = (
            g.limit,
            engine.batch_cap,
            engine.max_num_seqs,
            engine.token_budget,
            g.in_flight,
            engine.generation,
        )
        read = dict(zip(GAUGES, (*values, 1 if engine.ready else 0), strict=True))
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=read[name])
        depth = GaugeMetricFamily("autopilot_queue_depth", QUEUE_DEPTH, labels=["priority_class"])
        for cls, n in gate.queued_by_class().items():  # a class removed by a reload disappears
            depth.add_metric([cls], n)
        yield depth
        yield from _ttft_check_families(gate.ttft_check.state())
        policy = holder.policy
        terms = GaugeMetricFamily("autopilot_policy_term", POLICY_TERM, labels=["policy", "term"])
        for term, term_value in policy.terms().items():
            terms.add_metric([policy.name, term], term_value)
        yield terms
        yield from self._cost_families()
        yield from self._capacity_families()


TTFT_CHECK = {
    "autopilot_ttft_predicted_seconds": (
        "predicted_p50_s",
        "Median TTFT the gate predicted for the last admitted requests of a class (ttft.TtftCheck).",
    ),
    "autopilot_ttft_measured_seconds": (
        "measured_p50_s",
        "Median TTFT the same requests measured, from their arrival at the server to their first token.",
    ),
    "autopilot_ttft_correction_seconds": (
        "correction_s",
        "What the gate adds to a class's predicted TTFT: the p90 of measured minus predicted.",
    ),
}


def _ttft_check_families(state: dict[str, dict[str, float | int | None]]) -> Iterator[Metric]:
    """Predicted against measured TTFT per class (``/state``'s ``gate.ttft_check``)."""
    for name, (key, doc) in TTFT_CHECK.items():
        family = GaugeMetricFamily(name, doc, labels=["priority_class"])
        for cls, figures in state.items():
            value = figures.get(key)
            if value is not None:
                family.add_metric([cls], float(value))
        yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.live = LiveGauges()
        registry.register(self.live)
        self.rejected = Counter(
            "autopilot_rejected_requests",
            "Requests refused before they started, by reason (queue_full, expected_wait, shed, "
            "shutting_down, engine_unavailable) and priority class. Queue-deadline expiries are "
            "autopilot_queue_timeouts_total.",
            ["reason", "priority_class"],
            registry=registry,
        )
        self.admitted = Counter(
            "autopilot_admitted_requests",
            "Requests that got an admission slot, by priority class.",
            ["priority_class"],
            registry=registry,
        )
        self.queue_timeouts = Counter(
            "autopilot_queue_timeouts",
            "Requests refused (429) because their class's queue deadline passed while they waited.",
            ["priority_class"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "autopilot_queue_wait_seconds",
            "Time from reaching the gate to getting a slot, by priority class (never above the class's "
            "queue deadline; expiries are autopilot_queue_timeouts_total).",
            ["priority_class"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self.decisions = Counter(
            "autopilot_decisions",
            "Knob changes applied by the control loop, by knob and reason.",
            ["knob", "reason"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "autopilot_config_reloads",
            "Config reloads (SIGHUP or POST /reload), by result: ok, error, pending_engine_restart.",
            ["result"],
            registry=registry,
        )
        self.engine_restarts = Counter(
            "autopilot_engine_restarts",
            "Engine restarts by reason: gpu_memory_low, host_memory_low, oom_killed, cuda_oom, engine_died, "
            "config_reload.",
            ["reason"],
            registry=registry,
        )
        self.requests_by_outcome = Counter(
            "autopilot_requests_by_outcome",
            "Requests ended, by priority class and outcome: good (within the class's [slo] TTFT and "
            "TPOT; without [slo] every served request), ttft_missed, tpot_missed, refused (429) and "
            "failed (503, or an engine error). TTFT counts the time before the engine (front end and "
            "queue wait) too.",
            ["priority_class", "outcome"],
            registry=registry,
        )
        self.restart_duration = Histogram(
            "autopilot_engine_restart_duration_seconds",
            "Drain start to the new engine serving.",
            buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300),
            registry=registry,
        )

    def count_restart(self, reason: str, duration_s: float) -> None:
        """The guard's callback after each engine restart."""
        self.engine_restarts.labels(reason).inc()
        self.restart_duration.observe(duration_s)

    def count_outcome(self, cls: str, outcome: str) -> None:
        """The outcome ledger's count (``control/outcomes.OutcomeLedger``, the control core's: fed by
        the gate's refusals and vLLM's finished requests)."""
        self.requests_by_outcome.labels(cls, outcome).inc()

    def count_decisions(self, _obs: Observation, changes: list[Change]) -> None:
        """A loop subscriber: one count per knob change, by knob and reason."""
        for change in changes:
            self.decisions.labels(change.knob, reason_label(change.reason)).inc()


def reason_label(reason: str) -> str:
    """A reason as a metric label: without its bracketed figures ("slo[budget 1256: ...]:rate_limited"
    -> "slo:rate_limited"), which the log and /state keep, so a label's values stay few."""
    return re.sub(r"\[[^\]]*\]", "", reason)


class GateMetrics:
    """The gate's per-class events as metrics (a ``controller.admission.classes.GateEvents``; the
    outcome ledger counts the refusals before them: ``control/outcomes.GateOutcomes``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def admitted(self, cls: str, wait_s: float) -> None:
        self.m.admitted.labels(cls).inc()
        self.m.queue_wait.labels(cls).observe(wait_s)

    def rejected(self, cls: str, reason: str) -> None:
        self.m.rejected.labels(reason, cls).inc()

    def timed_out(self, cls: str, wait_s: float) -> None:
        self.m.queue_timeouts.labels(cls).inc()
