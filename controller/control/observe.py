"""One tick's ``Observation``, built the same way by the daemon and by the engine twin.

A pure builder over small source interfaces: it reads the gate, the telemetry window, the knobs in
force and the NVML / host samplers, and changes none of them. What a tick sets off (the diagnosis,
the memory guard) is the loop's subscribers' business, not the observer's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from controller.admission.queues import GateStats
from controller.control.samplers import GpuReading, GpuSource, HostReading, HostReadingSource
from controller.control.telemetry import EngineStats
from policies.base import Observation
from policies.cost import CostEstimate


class GateReadings(Protocol):
    """What an observation reads from the admission gate."""

    def stats(self) -> GateStats: ...

    def queued_by_class(self) -> dict[str, int]: ...


class CostSource(Protocol):
    """The step-cost model (``controller/control/stepcost.py``), read at the observation's time."""

    def estimate(self, now_mono: float) -> CostEstimate: ...


class OutcomeTotals(Protocol):
    """The outcome ledger's running counts (``controller/control/outcomes.py``)."""

    served_total: int
    missed_total: int
    queued_missed_total: int
    refused_total: int

    def answer_tokens(self) -> float | None: ...

    def asked_prefill_per_decode(self) -> float | None: ...

    def tpot_shares(self) -> tuple[tuple[int, float], ...]: ...


class StatsWindow(Protocol):
    def snapshot(self) -> EngineStats: ...


class EngineKnobs(Protocol):
    """The engine host's knobs in force (a Protocol: the host itself imports vLLM)."""

    @property
    def batch_cap(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def token_budget(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def token_budget_min(self) -> int: ...


@dataclass(frozen=True)
class BudgetReading:
    """The token budget in force and its bounds, as the engine (or the twin) reports them."""

    token_budget: int
    max_num_batched_tokens: int
    token_budget_min: int

    @classmethod
    def of(cls, engine: EngineKnobs) -> BudgetReading:
        return cls(engine.token_budget, engine.max_num_batched_tokens, engine.token_budget_min)


def build_observation(
    eng: EngineStats,
    gate: GateReadings,
    batch_cap: int,
    max_num_seqs: int,
    gpu: GpuReading | None = None,
    host: HostReading | None = None,
    budget: BudgetReading | None = None,
    cost: CostEstimate | None = None,
    outcomes: OutcomeTotals | None = None,
) -> Observation:
    """The engine-stats window, the gate and the knobs in force; NVML and host readings where the
    caller has them (the twin has neither: those fields stay None); the served requests and their
    misses where an outcome ledger counts them."""
    g = gate.stats()
    return Observation(
        now_mono=eng.now_mono,
        admission_limit=g.limit,
        batch_cap=batch_cap,
        max_num_seqs=max_num_seqs,
        in_flight=g.in_flight,
        queued=g.queued,
        running=eng.running,
        kv_usage=eng.kv_usage,
        kv_usage_mean=eng.kv_usage_mean,
        kv_usage_max=eng.kv_usage_max,
        preemptions_per_s=eng.preemptions_per_s,
        generated_tokens_per_s=eng.generated_tokens_per_s,
        ttft_p99_s=eng.ttft_p99_s,
        itl_p99_s=eng.itl_p99_s,
        stats_age_s=eng.last_step_age_s,
        gpu_memory_total_bytes=gpu.total_bytes if gpu else None,
        gpu_memory_free_bytes=gpu.free_bytes if gpu else None,
        gpu_utilization=gpu.utilization if gpu else None,
        host_memory_available_bytes=host.memory_available_bytes if host else None,
        daemon_cpu_percent=host.daemon_cpu_percent if host else None,
        window_s=eng.window_s,
        **(asdict(budget) if budget else {}),  # without one, Observation's defaults (tests)
        cost=cost,
        served_total=outcomes.served_total if outcomes else 0,
        missed_total=outcomes.missed_total if outcomes else 0,
        queued_missed_total=outcomes.queued_missed_total if outcomes else 0,
        refused_total=outcomes.refused_total if outcomes else 0,
        answer_tokens=outcomes.answer_tokens() if outcomes else None,
        asked_prefill_per_decode=outcomes.asked_prefill_per_decode() if outcomes else None,
        tpot_shares=outcomes.tpot_shares() if outcomes else (),
    )


class Observer:
    """The observe stage: ``build_observation`` over its live sources (the twin has no NVML and no
    host sampler: ``gpu`` and ``host`` None)."""

    def __init__(
        self,
        window: StatsWindow,
        gate: GateReadings,
        engine: EngineKnobs,
        gpu: GpuSource | None,
        host: HostReadingSource | None,
        cost: CostSource | None = None,
        outcomes: OutcomeTotals | None = None,
    ) -> None:
        self.window, self.gate, self.engine, self.gpu, self.host = window, gate, engine, gpu, host
        self.cost, self.outcomes = cost, outcomes

    def observe(self) -> Observation:
        e, eng = self.engine, self.window.snapshot()
        return build_observation(
            eng,
            self.gate,
            e.batch_cap,
            e.max_num_seqs,
            self.gpu.read() if self.gpu is not None else None,
            self.host.read() if self.host is not None else None,
            BudgetReading.of(e),
            self.cost.estimate(eng.now_mono) if self.cost is not None else None,
            self.outcomes,
        )
