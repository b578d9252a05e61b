"""Owns the AsyncLLM: builds it from [engine], moves its batch cap, shuts it down."""

from __future__ import annotations

import argparse
import asyncio
import gc
from typing import Any

import structlog
from vllm.v1.engine.async_llm import AsyncLLM

from controller.engine.args import engine_args
from controller.engine.scheduler import UTILITY_SET, scheduler_path
from controller.engine.stats import stat_logger_factory
from controller.telemetry import TelemetryWindow

log = structlog.get_logger(__name__)


class EngineHost:
    """The current engine, its generation number and its batch cap."""

    def __init__(self, args: argparse.Namespace, window: TelemetryWindow) -> None:
        self._args = args
        self._window = window
        self._llm: AsyncLLM | None = None
        self.generation = 0
        self.max_num_seqs = int(args.max_num_seqs)
        self.batch_cap = self.max_num_seqs

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("the engine is not running")
        return self._llm

    @property
    def ready(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def _build(self) -> AsyncLLM:
        eargs = engine_args(self._args)
        vllm_config = eargs.create_engine_config()
        # Match vLLM's own choice (async scheduling or not) with our capped subclass of it.
        eargs.scheduler_cls = scheduler_path(bool(vllm_config.scheduler_config.async_scheduling))
        return AsyncLLM.from_engine_args(eargs, stat_loggers=[stat_logger_factory(self._window)])

    async def start(self) -> None:
        """Build the engine in a worker thread (~13 s on the CPU) so the event loop keeps serving."""
        loop = asyncio.get_running_loop()
        self._llm = await loop.run_in_executor(None, self._build)
        self.generation += 1
        self._window.reset()
        await self.set_batch_cap(self.batch_cap)
        log.info("engine_started", generation=self.generation, **self.memory_settings())

    async def set_batch_cap(self, cap: int) -> int:
        """Apply a batch cap inside the EngineCore process; returns the clamped value in force."""
        cap = max(1, min(int(cap), self.max_num_seqs))
        self.batch_cap = int(await self.llm.engine_core.call_utility_async(UTILITY_SET, cap))
        return self.batch_cap

    def memory_settings(self) -> dict[str, Any]:
        cache = self._llm.vllm_config.cache_config if self._llm else None
        return {
            "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
            "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None),
            "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
            "block_size": getattr(cache, "block_size", None),
        }

    def settings(self) -> dict[str, Any]:
        """Engine settings for /state."""
        cfg = self._llm.vllm_config if self._llm else None
        sched = cfg.scheduler_config if cfg else None
        return {
            "model": self._args.model,
            "generation": self.generation,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "scheduling_policy": str(getattr(sched, "policy", None)),
            **self.memory_settings(),
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the engine down and reap its EngineCore process."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        llm.shutdown(timeout=timeout_s)
        del llm
        gc.collect()
        log.info("engine_stopped", generation=self.generation)
