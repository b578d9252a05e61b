"""What the daemon shows: /state and /healthz, read from its parts (the gauges are read at scrape
time by ``controller.admin.metrics.LiveGauges``).

A typed view: ``StatusParts`` names what is read, so this module needs neither the daemon nor the
parts builder (``controller.lifecycle.parts.Parts`` is one).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from controller.admin.metrics import Metrics
from controller.admission.gate import AdmissionGate
from controller.config.load import Config, describe
from controller.config.slo_table import describe_slo
from controller.control.capacity import CapacityMeter
from controller.control.diagnosis import Diagnosis
from controller.control.fitcheck import FitCheck
from controller.control.knobs import ADMISSION_LIMIT, BATCH_CAP, TOKEN_BUDGET
from controller.control.loop import ControlLoop
from controller.control.outcomes import OutcomeLedger
from controller.control.stepcost import CostReader
from controller.control.telemetry import TelemetryWindow
from controller.lifecycle.guard import Guard

if TYPE_CHECKING:  # the host imports vLLM; only its type is needed here
    from controller.engine.runtime.host import EngineHost


class StatusParts(Protocol):
    @property
    def config(self) -> Config: ...
    @property
    def gate(self) -> AdmissionGate: ...
    @property
    def host(self) -> EngineHost: ...
    @property
    def guard(self) -> Guard: ...
    @property
    def loop(self) -> ControlLoop: ...
    @property
    def window(self) -> TelemetryWindow: ...
    @property
    def diagnosis(self) -> Diagnosis | None: ...
    @property
    def pending_changes(self) -> dict[str, list[str]]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def data_plane_up(self) -> bool: ...
    @property
    def cost(self) -> CostReader: ...
    @property
    def capacity(self) -> CapacityMeter: ...
    @property
    def fit_check(self) -> FitCheck: ...
    @property
    def outcomes(self) -> OutcomeLedger: ...
    @property
    def metrics(self) -> Metrics: ...


def loop_stall(d: StatusParts) -> str | None:
    """Why the control loop counts as stalled, or None (``ControlLoop.stalled``: its ticks wait on
    the engine host's calls, each within the host's deadline)."""
    return d.loop.stalled(d.loop.clock(), d.config.control.tick_s, d.host.call_deadline_s)


def health(d: StatusParts) -> tuple[bool, str]:
    if d.draining:
        return False, "draining"
    if d.guard.unavailable_reason is not None:
        return False, d.guard.unavailable_reason
    if loop_stall(d) is not None:  # the knobs, the memory guard and the saturation no longer move
        return False, "control_loop_stalled"
    if d.guard.restarting:
        return False, "engine_restarting"
    if not d.host.ready:
        return False, "engine_not_ready" if d.host.generation == 0 else "engine_dead"
    if not d.data_plane_up:
        return False, "data_plane_starting"
    return True, "serving"


def cost_model(d: StatusParts) -> dict[str, Any]:
    """The step-cost model's estimate, how it started, and how that start fits the steps served since."""
    check = d.fit_check.report(d.cost.model.coefficients)
    return {**d.cost.current().as_dict(), "warm_start": d.cost.warm_start, "fit_check": check}


def loop_progress(d: StatusParts) -> dict[str, Any]:
    """How the control loop's ticks go, for /state."""
    loop, now = d.loop, d.loop.clock()
    last, started = loop.last_tick_mono, loop.tick_started_mono
    return {
        "ticks_total": loop.ticks_total,
        "skipped_total": loop.skipped_total,
        "last_tick_age_s": None if last is None else round(now - last, 3),
        "running_s": None if started is None else round(now - started, 3),
        "stalled": loop_stall(d),
    }


def state(d: StatusParts) -> dict[str, Any]:
    g = d.gate.stats()
    ok, reason = health(d)
    return {
        "healthy": ok,
        "health_reason": reason,
        ADMISSION_LIMIT.name: g.limit,
        BATCH_CAP.name: d.host.batch_cap,
        TOKEN_BUDGET.name: d.host.token_budget,
        "policy": {
            "name": d.config.control.policy,
            "params": d.loop.policy.params(),
            "terms": d.loop.policy.terms(),
            "learned": d.loop.policy.learned(),
            "last_reason": d.loop.last_reason,
            "normalize": d.loop.normalizer.params(),
            "last_outcome": d.loop.normalizer.last_outcome,
        },
        "engine": d.host.settings(),
        "guard": {
            "restarting": d.guard.restarting,
            "unavailable_reason": d.guard.unavailable_reason,
            "last_restart": d.guard.last_restart,
        },
        "gate": {
            "in_flight": g.in_flight,
            "queue_depth": g.queued,
            "queue_depth_by_class": d.gate.queued_by_class(),
            "in_flight_by_class": d.gate.in_flight_by_class(),
            "timed_out_total": g.timed_out_total,
            "pending": g.pending,
            "paused": d.gate.paused,
            "arrivals_total": g.arrivals_total,
            "retries_total": g.retries_total,
            "admitted_total": g.admitted_total,
            "rejected_total": g.rejected_total,
            "completed_total": g.completed_total,
            "completion_rate_per_s": d.gate.completion_rate(),
            "service_rate_per_s": d.gate.service_rate(),
            "after_slot_s": d.gate.after_slot.seconds(),
            "backlog_s": d.gate.ttft.backlog_s(),
            "ttft_check": d.gate.ttft_check.state(),
        },
        "engine_stats": dataclasses.asdict(d.window.snapshot()),
        "decisions": d.loop.recent(),
        "loop": loop_progress(d),
        "diagnosis": dataclasses.asdict(d.diagnosis) if d.diagnosis else None,
        "slo": describe_slo(d.config.slo, d.config.admission.classes),
        "cost_model": cost_model(d),
        "capacity": d.capacity.last.as_dict(),
        "outcomes": d.outcomes.state(),
        "config": describe(d.config),
        "pending_config_changes": d.pending_changes,
    }
