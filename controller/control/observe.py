"""One tick's ``Observation``, built the same way by the daemon and by the engine twin."""

from __future__ import annotations

from controller.admission.gate import AdmissionGate
from controller.control.samplers import GpuReading, HostReading
from controller.control.telemetry import EngineStats
from policies.base import Observation


def build_observation(
    eng: EngineStats,
    gate: AdmissionGate,
    batch_cap: int,
    max_num_seqs: int,
    gpu: GpuReading | None = None,
    host: HostReading | None = None,
) -> Observation:
    """The engine-stats window, the gate and the knobs in force; NVML and host readings where the
    caller has them (the twin has neither: those fields stay None)."""
    g = gate.stats()
    return Observation(
        now_mono=eng.now_mono,
        admission_limit=g.limit,
        batch_cap=batch_cap,
        max_num_seqs=max_num_seqs,
        in_flight=g.in_flight,
        queued=g.queued,
        running=eng.running,
        waiting=eng.waiting,
        kv_usage=eng.kv_usage,
        kv_usage_mean=eng.kv_usage_mean,
        kv_usage_max=eng.kv_usage_max,
        preemptions_per_s=eng.preemptions_per_s,
        generated_tokens_per_s=eng.generated_tokens_per_s,
        ttft_p99_s=eng.ttft_p99_s,
        itl_p99_s=eng.itl_p99_s,
        stats_age_s=eng.last_step_age_s,
        ttft_p50_s=eng.ttft_p50_s,
        itl_p50_s=eng.itl_p50_s,
        finished_per_s=eng.finished_per_s,
        queued_by_class=gate.queued_by_class(),
        gpu_memory_used_bytes=gpu.used_bytes if gpu else None,
        gpu_memory_total_bytes=gpu.total_bytes if gpu else None,
        gpu_memory_free_bytes=gpu.free_bytes if gpu else None,
        gpu_utilization=gpu.utilization if gpu else None,
        host_memory_available_bytes=host.memory_available_bytes if host else None,
        daemon_cpu_percent=host.daemon_cpu_percent if host else None,
        window_s=eng.window_s,
    )
