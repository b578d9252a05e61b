"""vLLM stat logger -> the step feed (the telemetry window watches it), and each finished request's
figures -> its outcome.

vLLM calls ``record`` on the event loop once per engine step that produced output. The
``SchedulerStats``/``IterationStats`` classes are not a stable vLLM interface, so they are read here
and nowhere else.

A finished request's figures (``IterationStats.finished_requests``) go to an ``OutcomeSink``
(``controller/control/outcomes.OutcomeLedger``): the engine's TTFT, ``e2e_latency - decode_time``
(from vLLM's ``arrival_time`` to its first token: vLLM 0.32 stamps it when its handler renders the
prompt, before the gate's queue, so the ledger reads this only where the client told it no first
token, ``OutcomeLedger.first_token``, and then counts the gate's wait twice: the careful side), its
mean time per output token (None below two tokens), and whether it ended in an error or an abort. The
ledger adds the time before the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from vllm.config import VllmConfig
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import StatLoggerBase

from controller.control.steps import EngineStep, StepFeed, StepStats
from controller.engine.runtime.warmup import REQUEST_PREFIX


class OutcomeSink(Protocol):
    """``controller/control/outcomes.OutcomeLedger``: the governed client tells it each request that
    enters the engine (``started``) and its first token (``first_token``), this logger each one that
    finished (``served``)."""

    def started(
        self,
        request_id: str,
        cls: str,
        before_engine_s: float,
        n: int = 1,
        ttft_s: float | None = None,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None: ...

    def first_token(self, request_id: str, engine_ttft_s: float) -> None: ...

    def served(
        self,
        request_id: str,
        engine_ttft_s: float,
        tpot_s: float | None,
        error: bool = False,
        output_tokens: int | None = None,
    ) -> str | None: ...


def report_finished(sink: OutcomeSink, done: list[Any]) -> None:
    """Each of vLLM's ``FinishedRequestStats`` in ``done`` to ``sink`` (module docstring); the
    warm-up's synthetic requests (``warmup.REQUEST_PREFIX``) are no client's and are left out."""
    for r in done:
        if str(r.request_id).startswith(REQUEST_PREFIX):
            continue
        tpot = r.mean_time_per_output_token if r.num_generation_tokens >= 2 else None
        error = r.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
        ttft = max(0.0, r.e2e_latency - r.decode_time)
        sink.served(str(r.request_id), ttft, tpot, error, output_tokens=int(r.num_generation_tokens))


class _FeedLogger(StatLoggerBase):
    def __init__(self, feed: StepFeed, outcomes: OutcomeSink | None = None) -> None:
        self.feed = feed
        self.outcomes = outcomes

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
        stats = StepStats(
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
            finished_prompt_tokens=sum(r.num_prompt_tokens for r in done),
        )
        self.feed.publish([EngineStep(self.feed.now(), stats=stats, engine_idx=engine_idx)])
        if self.outcomes is not None:
            report_finished(self.outcomes, done)

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(
    feed: StepFeed, outcomes: OutcomeSink | None = None
) -> Callable[[VllmConfig, int], StatLoggerBase]:
    """A per-engine stat-logger factory, as ``AsyncLLM(stat_loggers=[...])`` takes."""

    def factory(vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _FeedLogger(feed, outcomes)

    return factory
