"""The twin's engine: vLLM V1's scheduler and paged KV cache, stepped in virtual time.

What is modelled, with the vLLM 0.32 source it follows (``vllm/v1/core/sched/scheduler.py``,
``Scheduler.schedule``, and ``vllm/v1/core/kv_cache_manager.py``, ``KVCacheManager.allocate_slots``):

* Continuous batching: every step first schedules the RUNNING requests in order, each for all the
  tokens it has not computed yet (one for a decode, the rest of its prompt for a prefill), capped by
  the step's token budget (``max_num_scheduled_tokens``: ``max_num_batched_tokens`` until the loop
  moves it, as our scheduler subclass does live); then, only when the step preempted nobody, it
  admits WAITING requests while the budget lasts and ``len(running) < max_num_active_reqs`` (the
  batch cap; vLLM's ``max_num_active_seqs``, our ``controller/engine/runtime/scheduler.py`` moves it live).
* Chunked prefill: a prompt longer than the budget left is split over steps; without
  ``enable_chunked_prefill`` a waiting prompt that does not fit stops admission (vLLM's ``break``).
* Paged KV: a request holds ``ceil(computed_tokens / block_size)`` blocks; ``allocate_slots`` gives the
  blocks a step's new tokens need or fails when the pool is short (watermark 0, vLLM's default).
* Automatic prefix caching (``enable_prefix_caching``, on unless the profile or the config's ``[engine]``
  turns it off, as in vLLM): full blocks are hashed and kept after their request frees them until
  evicted LRU; a request entering RUNNING with nothing computed starts from the longest cached chain
  of its blocks and prefills only the rest (``controller/sim/kvcache.py`` has the rules). The step's
  ``prefill_tokens``, what the cost model prices, are the computed tokens only; the cached ones are
  read by attention (``kv_tokens_read``).
* Preemption by recompute (``Scheduler._preempt_request``): when a running request cannot get its
  blocks, the victim is ``running[-1]`` (the newest) under FCFS, ``max(running, key=(priority,
  arrival_time))`` under priority; it frees its blocks, restarts from zero computed tokens (its prompt
  and the output so far are prefilled again) and goes back to the front of the waiting queue (FCFS)
  or into the priority heap. A request that would preempt itself waits for the next step.
* A token is emitted when a step leaves a request with all its known tokens computed; the request
  finishes at ``max_tokens`` output tokens (the trace's output length; no EOS).

Not modelled: speculative decoding, async scheduling's overlap (it is inside the cost
model's fixed term), ``long_prefill_token_threshold`` (0 by default), the watermark.

Each step's duration is the profile's ``StepCoefficients.step_s`` (``policies/cost.py``); the engine
reports every step as one ``EngineStep`` with both its parts: the ``stats`` that our real stat logger
(``controller/engine/runtime/stats.py``) builds from vLLM's ``SchedulerStats`` / ``IterationStats``,
so the real ``TelemetryWindow`` and policies see the same signals, and the ``cost`` that our
scheduler subclass measures inside the real EngineCore (``controller/engine/runtime/stepmeter.py``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.control.knobs import budget_bounds, cap_bounds, token_budget_bounds
from controller.control.steps import EngineStep, StepCost, StepStats
from controller.load.sessions import within
from controller.load.workload import RequestSpec
from controller.profiles.load import EngineLimits
from controller.sim.kvcache import BlockTable, KVCache
from policies.cost import StepCoefficients

OWN_KEY = 1 << 62
"""A request's own content is keyed ``OWN_KEY + request_id``, apart from the workload's segment ids."""


@dataclass(eq=False)
class SimRequest:
    """One request inside the twin (vLLM's ``Request``, reduced to what scheduling needs)."""

    request_id: int
    prompt_tokens: int
    max_tokens: int
    priority: int
    arrival_t: float
    """When the engine received it (virtual seconds): vLLM's ``arrival_time``."""
    on_finish: Callable[[SimRequest], None] | None = None
    on_first_token: Callable[[SimRequest], None] | None = None
    """Called at the end of the step that gave its first token (the twin's streaming output)."""
    segments: tuple[tuple[int, int], ...] = ()
    """The prompt's shared pieces (segment id, tokens), for the prefix cache (``RequestSpec.segments``)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prefix-cache hit at its first scheduling, in tokens (vLLM's; -1 until scheduled)."""
    output_tokens: int = 0
    num_preemptions: int = 0
    scheduled_t: float | None = None
    """When its first step began (vLLM's ``scheduled_ts``: a preemption does not move it)."""
    first_token_t: float | None = None
    last_token_t: float | None = None
    finish_t: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each output token was emitted (kept only when the engine records them)."""
    kv: BlockTable = field(init=False)
    """Its KV blocks and its content's block hashes."""

    @classmethod
    def of(cls, spec: RequestSpec, arrival_t: float) -> SimRequest:
        """The engine's request for a workload's ``spec``, received at ``arrival_t``."""
        return cls(
            spec.index,
            spec.prompt_tokens,
            spec.output_tokens,
            spec.priority,
            arrival_t,
            segments=spec.segments,
        )

    def __post_init__(self) -> None:
        self.kv = BlockTable(OWN_KEY + self.request_id, within(self.segments, self.prompt_tokens))

    @property
    def blocks(self) -> int:
        """KV blocks held."""
        return len(self.kv.blocks)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output so far: what a (re)prefill has to compute."""
        return self.prompt_tokens + self.output_tokens

    @property
    def finished(self) -> bool:
        return self.output_tokens >= self.max_tokens


@dataclass(frozen=True)
class StepPlan:
    """What one step scheduled (``SchedulerOutput`` in vLLM)."""

    scheduled: tuple[tuple[SimRequest, int], ...]
    """(request, new tokens) pairs."""
    preempted: int
    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int


class WaitingQueue:
    """vLLM's ``FCFSRequestQueue`` (deque, preempted requests prepended) or ``PriorityRequestQueue``
    (heap on ``(priority, arrival_time)``)."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._fifo)

    def add(self, req: SimRequest) -> None:
        if self.priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_t, next(self._seq), req))
        else:
            self._fifo.append(req)

    def prepend(self, req: SimRequest) -> None:
        """A preempted request goes back first (FCFS) or to its place by priority."""
        if self.priority:
            self.add(req)
        else:
            self._fifo.appendleft(req)

    def peek(self) -> SimRequest:
        return self._heap[0][3] if self.priority else self._fifo[0]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[3] if self.priority else self._fifo.popleft()

    def drain(self) -> list[SimRequest]:
        out = [item[3] for item in sorted(self._heap)] if self.priority else list(self._fifo)
        self._heap.clear()
        self._fifo.clear()
        return out


class SimEngine:
    """The engine core: ``add`` requests, ``plan`` a step, ``finish_step`` when its time has passed."""

    def __init__(
        self, limits: EngineLimits, cost: StepCoefficients, record_token_times: bool = False
    ) -> None:
        self.limits = limits
        self.cost = cost
        self.kv = KVCache(limits.num_blocks, limits.block_size, limits.enable_prefix_caching)
        self.running: list[SimRequest] = []
        self.waiting = WaitingQueue(limits.scheduling_policy)
        self.max_num_seqs = limits.max_num_seqs
        self.batch_cap = limits.max_num_seqs
        """``max_num_active_reqs``: admission into RUNNING stops at this many."""
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.token_budget_min = token_budget_bounds(
            limits.max_num_batched_tokens, limits.enable_chunked_prefill, limits.max_model_len
        ).floor
        self.token_budget = limits.max_num_batched_tokens
        """``max_num_scheduled_tokens``: the most tokens one step issues."""
        self.record_token_times = record_token_times
        self.total_preemptions = 0
        self.steps = 0

    # -- the batch cap, as controller/engine/runtime/scheduler.py sets it ------------------------------------
    def set_batch_cap(self, cap: int) -> int:
        """Clamp to [1, max_num_seqs], apply, return the value in force; never preempts."""
        self.batch_cap = cap_bounds(self.max_num_seqs).clamp(cap)
        return self.batch_cap

    def set_token_budget(self, budget: int) -> int:
        """Clamp to [token_budget_min, max_num_batched_tokens], apply from the next plan, return the
        value in force; never preempts (a running prefill gets smaller chunks)."""
        self.token_budget = budget_bounds(self.max_num_batched_tokens, self.token_budget_min).clamp(budget)
        return self.token_budget

    # -- requests ---------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        self.waiting.add(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def abort_all(self) -> list[SimRequest]:
        """Drop every request (an engine restart): blocks freed, nothing finishes."""
        dropped = self.running + self.waiting.drain()
        for req in self.running:
            self.kv.release(req.kv)
        self.running = []
        self.kv = KVCache(self.limits.num_blocks, self.limits.block_size, self.limits.enable_prefix_caching)
        return dropped

    # -- one step ---------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """``Scheduler.schedule``: running requests first, preempting on KV shortage, then admissions.
        The token budget bounds a step that carries a decode; one of prefill alone stalls no stream and
        takes up to ``max_num_batched_tokens`` (``engine/runtime/scheduler.py``)."""
        decoding = any(r.num_computed_tokens >= r.prompt_tokens for r in self.running)
        budget = self.token_budget if decoding else self.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.prompt_tokens + req.output_tokens - req.num_computed_tokens, budget)
            ok = self.kv.allocate(req.kv, req.num_computed_tokens, n, req.num_tokens)
            while not ok:
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:
                    i -= 1
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
                ok = self.kv.allocate(req.kv, req.num_computed_tokens, n, req.num_tokens)
            if not ok:
                break
            scheduled[req] = n
            budget -= n
            i += 1
        if preempted == 0:
            budget = self._admit(budget, scheduled)
        return self._summarize(scheduled, preempted)

    def _victim(self) -> SimRequest:
        if self.waiting.priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_t))
        return self.running[-1]

    def _preempt(self, req: SimRequest) -> None:
        self.kv.release(req.kv)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.prepend(req)

    def _admit(self, budget: int, scheduled: dict[SimRequest, int]) -> int:
        while budget > 0 and len(self.waiting) > 0 and len(self.running) < self.batch_cap:
            req = self.waiting.peek()
            hit = self.kv.lookup(req.kv, req.num_tokens) if req.num_computed_tokens == 0 else []
            computed = req.num_computed_tokens + len(hit) * self.kv.block_size
            n = req.num_tokens - computed
            if not self.limits.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate(req.kv, computed, n, req.num_tokens, hit):
                break
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            self.waiting.pop()
            self.running.append(req)
            scheduled[req] = n
            budget -= n
        return budget

    def _summarize(self, scheduled: dict[SimRequest, int], preempted: int) -> StepPlan:
        prefill = decode = kv_read = 0
        for req, n in scheduled.items():
            computed = req.num_computed_tokens
            kv_read += computed + n
            # A decode: one new token that follows the output so far (not the last token of a prompt).
            if n == 1 and req.output_tokens > 0 and computed == req.prompt_tokens + req.output_tokens - 1:
                decode += 1
            else:
                prefill += n
        return StepPlan(tuple(scheduled.items()), preempted, prefill, decode, kv_read)

    def step_s(self, plan: StepPlan) -> float:
        return self.cost.step_s(plan.prefill_tokens, plan.decode_seqs, plan.kv_tokens_read)

    def finish_step(
        self, plan: StepPlan, t_end: float, step_s: float | None = None
    ) -> tuple[EngineStep, list[SimRequest]]:
        """Apply a planned step at its end time: tokens out, finished requests leave and free blocks.
        ``step_s``: how long it took (the driver's draw; the cost model's mean without one)."""
        self.steps += 1
        took = 0.0
        cost = None
        if plan.scheduled:  # as in the engine: a step that scheduled nothing ran no forward pass
            took = self.step_s(plan) if step_s is None else step_s
            cost = StepCost(plan.prefill_tokens, plan.decode_seqs, plan.kv_tokens_read, took)
        ttft: list[float] = []
        itl: list[float] = []
        generated = 0
        done: list[SimRequest] = []
        for req, n in plan.scheduled:
            if req.scheduled_t is None:
                req.scheduled_t = t_end - took
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.prompt_tokens + req.output_tokens:
                continue  # a prefill chunk: no token yet
            req.output_tokens += 1
            generated += 1
            if req.first_token_t is None:
                req.first_token_t = t_end
                ttft.append(t_end - req.arrival_t)
                if req.on_first_token is not None:
                    req.on_first_token(req)
            elif req.last_token_t is not None:
                itl.append(t_end - req.last_token_t)
            req.last_token_t = t_end
            if self.record_token_times:
                req.token_times.append(t_end)
            if req.finished:
                req.finish_t = t_end
                done.append(req)
        for req in done:
            self.running.remove(req)
            self.kv.release(req.kv, final=True)
        stats = StepStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            preempted=plan.preempted,
            generated_tokens=generated,
            ttft_s=tuple(ttft),
            itl_s=tuple(itl),
            finished=len(done),
            finished_prefill_tokens=sum(r.prompt_tokens - max(0, r.num_cached_tokens) for r in done),
            finished_output_tokens=sum(r.output_tokens for r in done),
            finished_prompt_tokens=sum(r.prompt_tokens for r in done),
        )
        return EngineStep(t_end, cost=cost, stats=stats), done
