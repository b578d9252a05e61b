"""Prometheus definitions. The registry is passed in (each test has a fresh one); vLLM's own
``vllm:*`` metrics live in prometheus_client's default registry and are exposed beside ours."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.admission_limit = Gauge(
            "autopilot_admission_limit", "Requests allowed inside the engine at once.", registry=registry
        )
        self.batch_cap = Gauge(
            "autopilot_batch_cap", "Active-request cap of the engine's scheduler.", registry=registry
        )
        self.max_num_seqs = Gauge(
            "autopilot_max_num_seqs",
            "Hard ceiling of the batch cap (engine max_num_seqs).",
            registry=registry,
        )
        self.in_flight = Gauge(
            "autopilot_in_flight_requests", "Requests holding an admission slot.", registry=registry
        )
        self.queue_depth = Gauge(
            "autopilot_queue_depth",
            "Requests waiting in the admission gate, by priority class.",
            ["priority_class"],
            registry=registry,
        )
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
        self.engine_generation = Gauge(
            "autopilot_engine_generation", "How many engines this daemon has started.", registry=registry
        )
        self.policy_term = Gauge(
            "autopilot_policy_term",
            "Internal terms of the active policy (error, integral, gradient, baseline, ...).",
            ["policy", "term"],
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
            "Engine restarts by reason: gpu_memory_low, host_memory_low, oom_killed, engine_died, "
            "config_reload.",
            ["reason"],
            registry=registry,
        )
        self.restart_duration = Histogram(
            "autopilot_engine_restart_duration_seconds",
            "Drain start to the new engine serving.",
            buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300),
            registry=registry,
        )
        self.engine_up = Gauge("autopilot_engine_up", "1 when the engine serves, else 0.", registry=registry)


class GateMetrics:
    """The gate's per-class events as metrics (a ``controller.admission.classes.GateEvents``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def admitted(self, cls: str, wait_s: float) -> None:
        self.m.admitted.labels(cls).inc()
        self.m.queue_wait.labels(cls).observe(wait_s)

    def rejected(self, cls: str, reason: str) -> None:
        self.m.rejected.labels(reason, cls).inc()

    def timed_out(self, cls: str, wait_s: float) -> None:
        self.m.queue_timeouts.labels(cls).inc()
