"""vLLM stat logger -> our TelemetryWindow.

vLLM calls ``record`` on the event loop once per engine step that produced output. The
``SchedulerStats``/``IterationStats`` classes are not a stable vLLM interface, so they are read here
and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase

from controller.control.telemetry import StepSample, TelemetryWindow


class _WindowLogger(StatLoggerBase):
    def __init__(self, window: TelemetryWindow) -> None:
        self.window = window

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None and iteration_stats is None:
            return
        it = iteration_stats
        done = it.finished_requests if it else []  # FinishedRequestStats: each request's token counts
        self.window.record(
            StepSample(
                t_mono=self.window.now(),
                running=scheduler_stats.num_running_reqs if scheduler_stats else 0,
                waiting=scheduler_stats.num_waiting_reqs if scheduler_stats else 0,
                kv_usage=float(scheduler_stats.kv_cache_usage) if scheduler_stats else 0.0,
                preempted=it.num_preempted_reqs if it else 0,
                generated_tokens=it.num_generation_tokens if it else 0,
                ttft_s=tuple(it.time_to_first_tokens_iter) if it else (),
                itl_s=tuple(it.inter_token_latencies_iter) if it else (),
                finished=len(done),
                finished_prefill_tokens=sum(r.num_prompt_tokens - r.num_cached_tokens for r in done),
                finished_output_tokens=sum(r.num_generation_tokens for r in done),
            )
        )

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(window: TelemetryWindow) -> Callable[[VllmConfig, int], StatLoggerBase]:
    """A per-engine stat-logger factory, as ``AsyncLLM(stat_loggers=[...])`` takes."""

    def factory(vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _WindowLogger(window)

    return factory
