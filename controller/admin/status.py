"""What the daemon shows: /state, /healthz and the gauges refreshed at each scrape."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from controller.config.load import describe

if TYPE_CHECKING:
    from controller.lifecycle.daemon import Daemon


def health(d: Daemon) -> tuple[bool, str]:
    if d.draining:
        return False, "draining"
    if d.guard.unavailable_reason is not None:
        return False, d.guard.unavailable_reason
    if d.guard.restarting:
        return False, "engine_restarting"
    if not d.host.ready:
        return False, "engine_not_ready" if d.host.generation == 0 else "engine_dead"
    if not d.data_plane_up:
        return False, "data_plane_starting"
    return True, "serving"


def refresh_metrics(d: Daemon) -> None:
    m, g = d.metrics, d.gate.stats()
    m.admission_limit.set(g.limit)
    m.batch_cap.set(d.host.batch_cap)
    m.max_num_seqs.set(d.host.max_num_seqs)
    m.in_flight.set(g.in_flight)
    m.queue_depth.clear()  # a class removed by a reload disappears
    for cls, n in d.gate.queued_by_class().items():
        m.queue_depth.labels(cls).set(n)
    m.engine_generation.set(d.host.generation)
    m.engine_up.set(1 if d.host.ready else 0)
    for term, value in d.loop.policy.terms().items():
        m.policy_term.labels(d.loop.policy.name, term).set(value)


def state(d: Daemon) -> dict[str, Any]:
    g = d.gate.stats()
    ok, reason = health(d)
    return {
        "healthy": ok,
        "health_reason": reason,
        "admission_limit": g.limit,
        "batch_cap": d.host.batch_cap,
        "policy": {
            "name": d.config.control.policy,
            "params": d.loop.policy.params(),
            "terms": d.loop.policy.terms(),
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
            "admitted_total": g.admitted_total,
            "rejected_total": g.rejected_total,
            "completed_total": g.completed_total,
            "completion_rate_per_s": d.gate.completion_rate(),
        },
        "engine_stats": dataclasses.asdict(d.window.snapshot()),
        "decisions": d.loop.recent(),
        "diagnosis": dataclasses.asdict(d.diagnosis) if d.diagnosis else None,
        "config": describe(d.config),
        "pending_config_changes": d.pending_changes,
    }
