"""Owns the AsyncLLM: builds it from [engine], moves its batch cap and token budget, drains its
per-step figures, swaps it for a new one, and shuts it down. Implements the guard's ``EngineControl``.

The knobs survive a restart: the new engine gets the batch cap and the token budget in force (each
clamped to the new engine's ceiling); a budget the loop never moved follows the new engine's own
initial value (``[engine] max_num_scheduled_tokens``, else ``max_num_batched_tokens``).

A restart never trades a working engine for settings that have not built: the settings in force
(``args``) change only when a build with the new ones succeeded. Where two engines fit at once (the
CPU: the KV cache is a fixed size in host memory) a config restart builds the new engine first and
swaps it in, so a bad value leaves the old engine serving untouched. Where they may not fit (a GPU:
the new engine would measure the old one's memory as taken) and for every memory restart (its whole
point is to free memory), the old engine goes first; a new build that fails is then followed by a
build with the last settings that worked, so an engine serves again.

Every utility call into the EngineCore has a deadline (calls.py): a tick that asked an engine that
hangs or died waits at most that long, and no longer than the engine serves: retiring it, or the
guard counting it failed, ends every wait on it.

A retired engine's renderer lives on for ``RENDERER_GRACE_S``; when it is let go, the heap it freed is
given back to the operating system (heap.py: else the daemon's RSS rises at each rebuild)."""

from __future__ import annotations

import argparse
import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from vllm.utils import func_utils
from vllm.v1.engine.async_llm import AsyncLLM

from controller.clock import Clock, monotonic
from controller.control.knobs import (
    TOKEN_BUDGET,
    TOKEN_BUDGET_MIN,
    Bounds,
    budget_bounds,
    cap_bounds,
    token_budget_bounds,
)
from controller.control.steps import EngineStep, StepCost, StepFeed
from controller.engine.runtime.args import SERVE_USAGE, engine_args
from controller.engine.runtime.builds import build_in_thread
from controller.engine.runtime.calls import CALL_DEADLINE_MIN_S, EngineCalls
from controller.engine.runtime.death import CUDA_OOM, DeathNotes
from controller.engine.runtime.dtype import dtype_settings
from controller.engine.runtime.heap import HeapTrim, trim_heap
from controller.engine.runtime.ipc import plugin_problem, set_poll_sleep
from controller.engine.runtime.procs import spawn_engine_processes
from controller.engine.runtime.scheduler import UTILITY_BUDGET, UTILITY_DRAIN, UTILITY_SET, scheduler_path
from controller.engine.runtime.stats import OutcomeSink, stat_logger_factory

log = structlog.get_logger(__name__)

RENDERER_GRACE_S = 30.0
"""A retired engine's renderer stays up this long after the swap finished (the app's serving objects
rebuilt over the new engine): requests that were tokenizing with it still finish their preprocessing
(else they would get a 500)."""


def engine_ranks(core: Any, engines: int) -> list[int]:
    """The data-parallel rank of each engine ``core.call_utility_all_async`` answered for, in its
    order: vLLM's engine client names each engine by its rank (``core_engines``, two bytes, little
    endian), the ``engine_idx`` its stat logger reports under; 0, 1, ... where it names none."""
    identities = getattr(core, "core_engines", None)
    if isinstance(identities, list) and len(identities) == engines:
        return [int.from_bytes(identity, "little") for identity in identities]
    return list(range(engines))


def forget_renderer_memos() -> None:
    """Empty vLLM's ``supports_kw`` memo, so a retired renderer's tokenizer can be freed.

    vLLM's renderer makes its tokenizer thread-safe with a class made for it (a pool of deep copies),
    and the app's warmup asks ``supports_kw`` about that class's ``apply_chat_template``: vLLM memoizes
    the answer per function in a module-level ``lru_cache`` (128 entries), so each rebuild left its
    tokenizer copies pinned there (~3 MiB of RSS per rebuild on the tiny model, more with a real
    vocabulary). The live renderer's entries are recomputed on their next use (a signature read)."""
    clear = getattr(getattr(func_utils, "_supports_kw", None), "cache_clear", None)
    if clear is not None:  # a vLLM without the memo has nothing to forget
        clear()


class EngineHost:
    """The current engine, its generation number, its batch cap and the requests inside it."""

    def __init__(
        self,
        args: argparse.Namespace,
        steps: StepFeed,
        poll_sleep_s: float = 0.0,
        builder: Callable[[argparse.Namespace], AsyncLLM] | None = None,
        two_engines_fit: bool | None = None,
        heap_trim: Callable[[], HeapTrim] = trim_heap,
        clock: Clock = monotonic,
        call_timer: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.args = args
        """The settings of the engine in force (the last that built)."""
        self._builder = builder or self._build
        self._two_fit = two_engines_fit
        """None: ask the platform (two fit on the CPU)."""
        self._heap_trim = heap_trim
        """Run when a retired engine is let go: its freed pages back to the OS (heap.py)."""
        self._steps = steps
        """Where the stat logger publishes each step, and which hears of each new engine."""
        self.poll_sleep_s = poll_sleep_s
        """[server] engine_poll_sleep_s, handed to the engine's processes (engine/runtime/ipc.py)."""
        self._llm: AsyncLLM | None = None
        self._calls: EngineCalls | None = None
        """The utility calls into ``_llm``, each with a deadline (calls.py)."""
        self._clock = clock
        self._call_timer = call_timer
        self._llm_retired = False
        """``_llm`` was retired and no new engine built yet (it stays readable, it serves nothing)."""
        self._restarting = False
        self._failed: str | None = None
        """Why the guard counts the live engine as failed (it stalled); cleared by a new engine."""
        self._deaths = DeathNotes()
        """What the engine in force's processes wrote at their death (death.py)."""
        self._stopped = False
        """``stop`` ran: a build that ends now shuts its engine down (builds.py)."""
        self._retired: list[AsyncLLM] = []
        self._grace_pending: list[AsyncLLM] = []
        """Retired engines whose renderer grace starts when the swap finishes (``_start_grace``)."""
        self.generation = 0
        self.max_num_seqs = int(args.max_num_seqs)
        self.batch_cap = self.max_num_seqs
        self.max_num_batched_tokens = int(getattr(args, "max_num_batched_tokens", None) or 0)
        """Ceiling of the token budget; known for sure once an engine is built (vLLM picks a default)."""
        self.token_budget_min = budget_bounds(self.max_num_batched_tokens, TOKEN_BUDGET_MIN).floor
        self.token_budget = self.max_num_batched_tokens
        """The per-step token budget in force (vLLM's ``max_num_scheduled_tokens``)."""
        self._budget_moved = False
        """The loop has set the budget: a new engine gets it, not its own initial value."""
        self.in_flight: dict[int, tuple[str, AsyncLLM]] = {}
        """Requests inside an engine, by the governed client's own key (one per attempt: clients may
        reuse a request id), with the engine's request id and the engine they run on."""
        self.aborted: dict[int, str] = {}
        """Keys of requests aborted by a restart, with the reason their client is told."""
        self.on_new_engine: Callable[[], Awaitable[None]] | None = None
        """Called after a swap, before requests resume (the app rebuilds its serving state)."""
        self.outcomes: OutcomeSink | None = None
        """Where each finished request's figures go (``control/outcomes.OutcomeLedger``), from the
        next engine built on."""

    @property
    def llm(self) -> AsyncLLM:
        """The engine in force; during a swap, the old one (its config and renderer stay usable)."""
        if self._llm is None:
            raise RuntimeError("the engine is not running")
        return self._llm

    @property
    def ready(self) -> bool:
        return not self.dead and not self._restarting

    @property
    def dead(self) -> bool:
        return self._llm is None or self._llm_retired or self._failed is not None or self._llm.errored

    def mark_failed(self, reason: str) -> None:
        """The guard saw the engine stall: count it dead, so recovery retires it and builds anew."""
        self._failed = reason
        if self._calls is not None:  # a tick waiting on it must not wait for the back-off and the retire
            self._calls.close("the engine was counted failed")
        log.error("engine_marked_failed", reason=reason, generation=self.generation)

    @property
    def died_out_of_memory(self) -> bool:
        """The engine in force is dead and one of its EngineCores wrote, at its death, that a CUDA
        out-of-memory error killed it (death.py); never on a CPU."""
        return self.dead and CUDA_OOM in self._deaths.causes()

    # -- build / stop ---------------------------------------------------------------------------
    def _build(self, args: argparse.Namespace) -> AsyncLLM:
        spawn_engine_processes()  # before vLLM reads it: a forked engine reaches the daemon's signals
        eargs = engine_args(args)
        vllm_config = eargs.create_engine_config(SERVE_USAGE)  # vllm serve's defaults for this platform
        # Match vLLM's own choice (async scheduling or not) with our capped subclass of it.
        got = bool(vllm_config.scheduler_config.async_scheduling)
        eargs.scheduler_cls = scheduler_path(got)
        if getattr(eargs, "async_scheduling", None) and not got:
            # vLLM's platform turns it off without a word (on a CPU, always): say so, once a build
            log.warning("async_scheduling_off", reason="asked for, but vLLM's platform turned it off")
        set_poll_sleep(self.poll_sleep_s)  # the EngineCore and its workers inherit the environment
        self._deaths.arm()
        if self.poll_sleep_s and (problem := plugin_problem()):
            log.warning("engine_poll_sleep_ignored", reason=problem)
        stat_logger = stat_logger_factory(self._steps, self.outcomes)
        return AsyncLLM.from_engine_args(eargs, usage_context=SERVE_USAGE, stat_loggers=[stat_logger])

    async def start(self) -> None:
        """Build the engine in a worker thread (~13 s on the CPU) so the event loop keeps serving."""
        await self._adopt(await self._build_in_thread(self.args), self.args)

    async def _build_in_thread(self, args: argparse.Namespace) -> AsyncLLM:
        """Never in the default executor: shutdown must not wait for a build (builds.py)."""
        llm: AsyncLLM = await build_in_thread(self._builder, args, lambda: self._stopped)
        return llm

    async def _adopt(self, llm: AsyncLLM, args: argparse.Namespace) -> None:
        """Make a freshly built engine the one in force, with the settings it was built with."""
        self._llm, self._llm_retired, self.args, self._failed = llm, False, args, None
        self._deaths.clear()
        self.max_num_seqs = int(args.max_num_seqs)
        self.batch_cap = cap_bounds(self.max_num_seqs).clamp(self.batch_cap)
        self.generation += 1
        if self._calls is not None:  # a tick still waiting on the engine before gets no answer now
            self._calls.close("a new engine serves")
        self._calls = EngineCalls(llm.engine_core, self.generation, self._clock, self._call_timer)
        self._steps.engine_started()
        # straight to the new engine: set_batch_cap only stores the cap while a restart runs
        self.batch_cap = await self._calls.put(UTILITY_SET, self.batch_cap)
        await self._adopt_budget(llm, self._calls)
        log.info("engine_started", generation=self.generation, **self.memory_settings())

    def _two_engines_fit(self) -> bool:
        if self._two_fit is not None:
            return self._two_fit
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        """A new engine with ``overrides`` on top of the settings in force; raises when it failed
        to build, after an engine on the old settings serves again where one can (module docstring)."""
        args = copy.copy(self.args)
        for key, value in overrides.items():
            setattr(args, key, value)
        self._restarting = True
        try:
            if build_first and not self.dead and self._two_engines_fit():
                await self._build_then_swap(args)
            else:
                await self._retire_then_build(args)
            if self.on_new_engine is not None:
                await self.on_new_engine()
            self._start_grace()
        finally:
            self._restarting = False

    async def _build_then_swap(self, args: argparse.Namespace) -> None:
        old = self.llm
        new = await self._build_in_thread(args)  # a failure leaves the old engine as it was
        await self._adopt(new, args)
        try:
            await self._retire(old)
        except Exception as exc:  # the new engine serves: the old one's stop is not the restart's failure
            log.error("engine_retire_failed", error=f"{type(exc).__name__}: {exc}")

    async def _retire_then_build(self, args: argparse.Namespace) -> None:
        if self._llm is not None and not self._llm_retired:
            await self._retire(self._llm)
            self._llm_retired = True
        try:
            llm = await self._build_in_thread(args)
        except Exception as exc:
            if args == self.args:
                raise  # nothing older to fall back to: the guard's recovery takes over
            log.error("engine_build_failed", error=f"{type(exc).__name__}: {exc}", fallback=True)
            await self._adopt(await self._build_in_thread(self.args), self.args)
            if self.on_new_engine is not None:
                await self.on_new_engine()
            self._start_grace()
            raise
        await self._adopt(llm, args)

    async def _retire(self, llm: AsyncLLM) -> None:
        """Stop an engine's core process now; keep its renderer until ``RENDERER_GRACE_S`` after
        the swap has finished (``_start_grace``)."""
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()  # first, so it does not report the shutdown as an engine failure
        if llm is self._llm and self._calls is not None:  # its core is going: no answer will come
            self._calls.close("the engine was retired")
        loop = asyncio.get_running_loop()
        timeout = llm.vllm_config.shutdown_timeout or 5.0
        await loop.run_in_executor(None, lambda: llm.engine_core.shutdown(timeout=timeout))
        self._end_held(llm, "engine restart")
        self._retired.append(llm)  # a reference: AsyncLLM.__del__ would shut the renderer down now
        self._grace_pending.append(llm)

    def _start_grace(self) -> None:
        """The app's serving objects were rebuilt over the new engine: from now, nothing new reaches
        a retired renderer, so the grace starts. Until then (a build of minutes on a GPU, or no
        engine at all) every request still preprocesses with the retired engine's renderer."""
        loop = asyncio.get_running_loop()
        for llm in self._grace_pending:
            loop.call_later(RENDERER_GRACE_S, self._release_retired, llm)
        self._grace_pending.clear()

    def _release_retired(self, llm: AsyncLLM) -> None:
        if llm in self._retired:  # stop() may have shut it down already
            llm.renderer.shutdown()
            self._retired.remove(llm)
            forget_renderer_memos()
            # on the next turn of the loop, when this callback's handle (its arguments hold the
            # engine) is gone and the collection can free the engine
            asyncio.get_running_loop().call_soon(self._trim_heap)

    def _trim_heap(self) -> None:
        trimmed = self._heap_trim()
        log.info(
            "heap_trimmed",
            reason=trimmed.reason,
            rss_before_mib=round(trimmed.rss_before / 2**20, 1),
            rss_after_mib=round(trimmed.rss_after / 2**20, 1),
            generation=self.generation,
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the engine down and reap its EngineCore process (a build still running shuts its
        engine down itself when it ends)."""
        self._stopped = True
        if self._calls is not None:
            self._calls.close("the daemon stops")
        for llm in [*self._retired, *([self._llm] if self._llm else [])]:
            llm.shutdown(timeout=timeout_s)
        self._retired.clear()
        self._grace_pending.clear()
        self._llm = None
        self._deaths.close()
        log.info("engine_stopped", generation=self.generation)

    # -- knobs and requests ---------------------------------------------------------------------
    async def set_batch_cap(self, cap: int) -> int:
        """Apply a batch cap inside the EngineCore process; returns the clamped value in force."""
        cap = cap_bounds(self.max_num_seqs).clamp(cap)
        if self.dead or self._restarting:
            self.batch_cap = cap  # applied to the next engine when it starts
            return cap
        self.batch_cap = await self.calls.put(UTILITY_SET, cap)
        return self.batch_cap

    async def set_token_budget(self, budget: int) -> int:
        """Apply a per-step token budget inside the EngineCore process (from its next step on);
        returns the clamped value in force."""
        self._budget_moved = True
        budget = self._budget_bounds().clamp(budget)
        if self.dead or self._restarting:
            self.token_budget = budget  # applied to the next engine when it starts
            return budget
        self.token_budget = await self.calls.put(UTILITY_BUDGET, budget)
        return self.token_budget

    def _budget_bounds(self) -> Bounds:
        return budget_bounds(self.max_num_batched_tokens, self.token_budget_min)

    async def _adopt_budget(self, llm: AsyncLLM, calls: EngineCalls) -> None:
        """A new engine's budget bounds, and the budget in force (module docstring)."""
        cfg = llm.vllm_config
        sched = getattr(cfg, "scheduler_config", None)
        if sched is None:  # an engine without a scheduler config to read (the unit tests' fakes)
            return
        self.max_num_batched_tokens = int(sched.max_num_batched_tokens)
        self.token_budget_min = token_budget_bounds(
            self.max_num_batched_tokens,
            bool(sched.enable_chunked_prefill),
            int(cfg.model_config.max_model_len),
            int(cfg.num_speculative_tokens),
        ).floor
        initial = int(sched.max_num_scheduled_tokens or self.max_num_batched_tokens)
        want = self.token_budget if self._budget_moved else initial
        self.token_budget = self._budget_bounds().clamp(want)
        self.token_budget = await calls.put(UTILITY_BUDGET, self.token_budget)

    async def drain_steps(self) -> list[EngineStep]:
        """The engine's steps since the last drain, measured inside the EngineCore (scheduler.py);
        none while no engine serves (a retired engine's last steps are lost with it)."""
        if self.dead or self._restarting:
            return []
        # Every engine's: with data parallelism each EngineCore meters its own steps, and
        # call_utility_async answers with the first engine's result alone (the others' drained rows
        # would be lost). Merged in time order, as the step feed hands them on. Past the deadline
        # EngineUnanswered is raised: the step feed logs the steps lost and the tick goes on.
        calls = self.calls
        per_engine = await calls.ask(UTILITY_DRAIN, every_engine=True)
        ranks = engine_ranks(calls.core, len(per_engine))
        rows = sorted(
            ((rank, row) for rank, engine_rows in zip(ranks, per_engine, strict=True) for row in engine_rows),
            key=lambda ranked: ranked[1][0],
        )
        calls.saw_step(max((float(row[4]) for _, row in rows), default=0.0))  # it sizes the deadline
        return [
            EngineStep(float(t), StepCost(int(p), int(d), int(kv), float(s), float(gap)), engine_idx=rank)
            for rank, (t, p, d, kv, s, gap) in rows
        ]

    async def abort_in_flight(self, reason: str) -> int:
        keys = list(self.in_flight)
        for key in keys:
            self.aborted[key] = reason
        if keys and not self.dead:
            ids = sorted({request_id for request_id, _ in self.in_flight.values()})
            try:  # a message to the EngineCore, no answer awaited; still bounded, like every call
                await asyncio.wait_for(self.llm.abort(ids), self.call_deadline_s)
            except TimeoutError:
                log.error("engine_abort_unsent", reason="engine_call_timeout", requests=len(ids))
        return len(keys)

    def _end_held(self, llm: AsyncLLM, reason: str) -> None:
        """End every request a retired engine still holds (its core is gone: their outputs would
        never come and their slots never return): each gets vLLM's own abort output, and its client
        a retryable 503."""
        for key, (_, engine) in list(self.in_flight.items()):
            if engine is llm:
                self.aborted.setdefault(key, reason)
        held = list(llm.output_processor.request_states)
        if held:
            llm.output_processor.abort_requests(held, internal=True)

    @property
    def calls(self) -> EngineCalls:
        """The utility calls into the engine in force."""
        if self._calls is None:
            raise RuntimeError("the engine is not running")
        return self._calls

    @property
    def call_deadline_s(self) -> float:
        """The longest a call into the engine waits for its answer (calls.py)."""
        return self._calls.deadline_s if self._calls is not None else CALL_DEADLINE_MIN_S

    # -- settings -------------------------------------------------------------------------------
    @property
    def memory_knob(self) -> str:
        return (
            "kv_cache_memory_bytes"
            if getattr(self.args, "kv_cache_memory_bytes", None)
            else ("gpu_memory_utilization")
        )

    def memory_settings(self) -> dict[str, Any]:
        cache = self._llm.vllm_config.cache_config if self._llm else None
        return {
            "gpu_memory_utilization": getattr(self.args, "gpu_memory_utilization", None),
            "kv_cache_memory_bytes": getattr(self.args, "kv_cache_memory_bytes", None),
            "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
            "block_size": getattr(cache, "block_size", None),
        }

    def settings(self) -> dict[str, Any]:
        """Engine settings for /state."""
        cfg = self._llm.vllm_config if self._llm else None
        sched = cfg.scheduler_config if cfg else None
        return {
            "model": self.args.model,
            "generation": self.generation,
            "restarting": self._restarting,
            "unanswered_call": self._calls.silence() if self._calls is not None else None,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            TOKEN_BUDGET.name: self.token_budget,
            "token_budget_min": self.token_budget_min,
            "scheduling_policy": str(getattr(sched, "policy", None)),
            **dtype_settings(getattr(self.args, "dtype", None), cfg.model_config.dtype if cfg else None),
            **self.memory_settings(),
        }
