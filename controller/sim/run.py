"""A simulation: the real gate, telemetry window, policy, normalize stage and control loop around the
twin's engine, all on one virtual clock: the daemon's control core, built by the daemon's builder
(``control/build.ControlCore``) around the engine behind the engine host's interface (``SimHost``).

Only the engine is simulated: vLLM itself is the twin's ``SimLLM`` (``sim/llm.py``) over its
``SimEngine``, and each request is an asyncio task that does what vLLM's OpenAI handler does with our
engine client (``engine/frontend/client.GovernedEngineClient``) in front of it: the request's context
(its priority resolved against ``[admission]``, its arrival on the virtual clock), the client's
``check_admission`` (vLLM's preflight), the renderer's length check, then ``generate()`` read to its
one, final output (the twin's requests do not stream). A refusal is the client's (``GateRefusal``) and
the gate counts it in the outcome ledger, as in the daemon. The driver advances the virtual clock
from event to event (an engine step ends, a request arrives, a control tick is due, a time-series
sample is due) and lets the tasks run after each event, so a slot released by a finished request goes
to the next waiter before the next step is planned, as it does between two steps of the real engine.
Time never comes from the wall clock: two runs with the same workload, settings and seed give the same
records.

Noise. With the mean model (a profile without ``[variance]``, or ``use_variance=False``) request ``i``
reaches the gate at ``arrival_i + frontend_s`` and a step lasts ``step_s(plan)``. With a profile's
measured tables (``controller/profiles/quantiles.py``), one seeded ``random.Random(seed)`` draws, first the
front-end delays of all requests in arrival order, then one multiplier per step::

    entry_i = arrival_i + F^-1(u_i)                    F: the [variance.frontend] table, u_i ~ U[0,1)
    step    = step_s(plan) * S^-1(u) / mean(S)         S: the [variance.step] table
            * max(0, N(1, jitter))                     only with jitter > 0

so the step table changes a step's spread, not the cost model's mean step. With a
``[variance.frontend_loaded]`` table, a request that finds ``n >= 1`` requests in flight when it
arrives (arrived and not finished, those in their own front end included, those waiting in the
gate's queues not: an awaited future streams nothing) draws ``F_n^-1(u_i)`` from the table of that
load instead: the front end's queueing and CPU share, measured by ``bench calibrate`` with every
request in the engine. TTFT is counted from ``arrival_i``, as a client counts it; a request whose
front end is slow may enter the engine after one that arrived later, as on a real server.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.admission.classes import PriorityRefused
from controller.clock import FakeClock
from controller.config.load import AdmissionConfig, ControlConfig
from controller.control.build import ControlCore
from controller.control.loop import Change
from controller.control.steps import KEPT, EngineStep
from controller.control.warmfit import plan, seed_from_warm_up
from controller.engine.frontend import context
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from controller.load.workload import RequestSpec, describe
from controller.profiles.load import Profile
from controller.profiles.quantiles import LoadTables, QuantileTable
from controller.results.records import (
    RequestRecord,
    SeriesPoint,
    client_series,
    merge_series,
    summarize,
    tpot,
)
from controller.sim.engine import SimEngine, SimRequest, StepPlan
from controller.sim.llm import PromptTooLong, SimHost, SimLLM, SimOutput, SimParams
from policies.base import Observation
from policies.slo_targets import SloTargets

SETTLE_ROUNDS = 4
"""Event-loop rounds after each event. The longest chain: a step ends and the virtual vLLM resolves a
finished request's future -> (1) its ``generate`` resumes and yields the output through the engine
client, which releases the slot (the gate grants it to a waiter) and starts its stream's pump task ->
(2) the waiter's call adds its request to the engine, the pump ends the finished stream -> (3) the
finished request's handler returns, and the request leaves ``_in_flight``. Three rounds; one more for
safety (the twin's runs measure at most three before the event loop has nothing ready)."""

MIN_STEP_S = 1e-6
"""A step takes at least this long, so virtual time always moves."""


@dataclass(frozen=True)
class ControlSettings:
    """What a simulation runs under besides the profile: the daemon's own ``[control]`` and
    ``[admission]`` tables (the gate's limit, queue, aging and classes; the loop's tick and window), so
    the twin reads the same settings as ``serve``, and two settings only a simulation has."""

    control: ControlConfig = field(default_factory=ControlConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    sample_period_s: float = 1.0
    """Period of the time series written to timeseries.jsonl."""
    drain_s: float = 600.0
    """After the last arrival, how long unfinished requests may run before the run stops (they are
    then recorded as failed)."""
    slo: SloTargets | None = None
    """``[slo]``: what a policy that steers to it (and the gate's TTFT bounds under it) read."""


@dataclass
class SimResult:
    records: list[RequestRecord]
    series: list[SeriesPoint]
    changes: list[Change]
    duration_s: float
    """Virtual seconds from the start to the last request's end."""
    steps: int
    preemptions: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> dict[str, Any]:
        extra = {
            "target": "twin",
            "engine_steps": self.steps,
            "engine_preemptions": self.preemptions,
            "limit_changes": len(self.changes),
            "sim_wall_s": round(self.wall_s, 3),
            **self.extra,
        }
        return summarize(self.records, self.duration_s, slo_ttft_s, slo_tpot_s, self.series, extra)


class Simulation:
    """One run of a workload through the twin under the tables of ``control``. Use ``run`` once."""

    def __init__(
        self,
        profile: Profile,
        control: ControlSettings | None = None,
        seed: int = 0,
        jitter: float = 0.0,
        use_variance: bool = True,
    ) -> None:
        if jitter < 0:
            raise ValueError(f"jitter = {jitter}: must be >= 0 (0.05 = 5 % step-time noise)")
        self.profile = profile
        self.control = c = control or ControlSettings()
        self.clock = FakeClock(0.0)
        self.engine = SimEngine(profile.engine, profile.cost)
        core = ControlCore(
            c,
            engine=lambda steps, outcomes: SimHost(SimLLM(self.engine, steps, outcomes)),
            clock=self.clock,
            capacity_history=None,  # every tick's saturation
        )
        self.outcomes = core.outcomes
        self.llm = core.engine.llm
        # the engine never dies; vLLM's timestamps are on the virtual clock
        self.client = GovernedEngineClient(core.engine, core.gate, lambda: None, wall=self.clock)
        self.window, self.gate, self.capacity, self.loop = core.window, core.gate, core.capacity, core.loop
        self.steps = core.steps
        self.cost = core.cost.model
        self.observe = core.observer.observe
        self.changes: list[Change] = []
        self.loop.subscribe(self._record_changes)
        self._rng = random.Random(seed)
        self.jitter = jitter
        variance = profile.variance if use_variance else None
        self._front_table = variance.frontend if variance else None
        self._front_loaded = variance.frontend_loaded if variance else None
        self._step_table = variance.step if variance else None
        self._step_mean = self._step_table.mean() if self._step_table else 1.0
        self._records: dict[int, RequestRecord] = {}
        self._series: list[SeriesPoint] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._open = 0
        """Client tasks started and not finished."""
        self._in_flight = 0
        """Requests arrived and not finished (in the front end, queued or in the engine)."""

    def _record_changes(self, _obs: Observation, changes: list[Change]) -> None:
        self.changes.extend(changes)

    # -- one request, as vLLM's OpenAI handler passes it to our engine client -------------------------
    async def _client(self, spec: RequestSpec) -> None:
        try:
            await self._request(spec)
        finally:
            self._open -= 1
            self._in_flight -= 1

    async def _request(self, spec: RequestSpec) -> None:
        t0 = spec.arrival_s  # then the front-end delay: TTFT's share the gate counts
        bounds = self.control.admission.priority_bounds
        try:  # the middleware's context, the priority resolved as priority.py resolves it
            priority = bounds.resolve(spec.priority)
        except PriorityRefused as exc:
            self._fail(spec, t0, "failed", 400, str(exc))
            return
        request = context.RequestContext(priority, resolved=True, bounds=bounds, arrived_mono=t0)
        final: SimOutput | None = None
        try:
            with context.entered(request, self.gate):  # as the middleware enters the gate
                self.client.check_admission()  # vLLM's preflight, before it renders the prompt
                prompt, params = self.llm.render(spec), SimParams(spec.output_tokens)
                async for output in self.client.generate(prompt, params, str(spec.index), priority=priority):
                    final = output  # as vLLM's handler keeps the last (the twin's one, final output)
        except GateRefusal as exc:
            self._fail(spec, t0, "refused", exc.http_status.value, exc.message)
            return
        except PromptTooLong as exc:
            self._fail(spec, t0, "failed", exc.status, str(exc))
            return
        assert final is not None and final.finished
        m = final.metrics
        ttft, e2e = m.first_token_ts - t0, m.last_token_ts - t0
        self._records[spec.index] = RequestRecord(
            index=spec.index,
            priority=spec.priority,
            prompt_tokens=spec.prompt_tokens,
            output_tokens_requested=spec.output_tokens,
            output_tokens=m.num_generation_tokens,
            arrival_s=t0,
            status="ok",
            http_status=200,
            ttft_s=ttft,
            tpot_s=tpot(ttft, e2e, m.num_generation_tokens),
            e2e_s=e2e,
        )

    def _fail(self, spec: RequestSpec, t0: float, status: str, http: int | None, error: str) -> None:
        self._records[spec.index] = RequestRecord(
            index=spec.index,
            priority=spec.priority,
            prompt_tokens=spec.prompt_tokens,
            output_tokens_requested=spec.output_tokens,
            output_tokens=0,
            arrival_s=t0,
            status=status,  # type: ignore[arg-type]
            http_status=http,
            e2e_s=self.clock() - t0,
            error=error,
        )

    # -- the driver ---------------------------------------------------------------------------------
    async def _settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    def _step_s(self, plan: StepPlan) -> float:
        step = self.engine.step_s(plan)
        if self._step_table is not None:
            step *= self._step_table.sample(self._rng.random()) / self._step_mean
        if self.jitter:
            step *= max(0.0, self._rng.gauss(1.0, self.jitter))
        return max(MIN_STEP_S, step)

    def _sample(self, t: float) -> None:
        g = self.gate.stats()
        self._series.append(
            SeriesPoint(
                t_s=round(t, 6),
                admission_limit=g.limit,
                batch_cap=self.engine.batch_cap,
                token_budget=self.engine.token_budget,
                kv_usage=round(self.engine.kv.usage, 6),
                running=len(self.engine.running),
                waiting=len(self.engine.waiting),
                queue_depth=g.queued,
                preemptions=self.engine.total_preemptions,
            )
        )

    def _tables(self) -> tuple[tuple[str, QuantileTable | LoadTables | None], ...]:
        return (
            ("frontend", self._front_table),
            ("step", self._step_table),
            ("frontend_loaded", self._front_loaded),
        )

    def _draws(self, arrivals: Sequence[RequestSpec]) -> list[float]:
        """One uniform per request, in arrival order, for its front-end delay (none for the mean model)."""
        if self._front_table is None and self._front_loaded is None:
            return []
        return [self._rng.random() for _ in arrivals]

    def _front_end_s(self, u: float | None) -> float:
        """A front-end delay for a request arriving now, with ``self._in_flight`` others in flight
        less those parked in the gate's queues (module docstring)."""
        if u is None:
            return self.profile.frontend_s
        busy = self._in_flight - sum(self.gate.queued_by_class().values())
        if self._front_loaded is not None and busy >= 1:
            return self._front_loaded.table_for(busy).sample(u)
        if self._front_table is not None:
            return self._front_table.sample(u)
        return self.profile.frontend_s

    async def run(self, specs: Sequence[RequestSpec]) -> SimResult:
        wall0 = time.perf_counter()
        arrivals = sorted(specs, key=lambda s: (s.arrival_s, s.index))
        warm_up = self._warm_up()  # before the loop starts, as the daemon's startup runs it
        await self.loop.tick()  # the policy's initial values apply before the first request (Daemon.startup)
        await self._drive(arrivals, self._draws(arrivals))
        duration = await self._finish(arrivals)
        records = [self._records[s.index] for s in sorted(specs, key=lambda s: s.index)]
        series = merge_series(self._series, client_series(records, duration, self.control.sample_period_s))
        return SimResult(
            records=records,
            series=series,
            changes=self.changes,
            duration_s=duration,
            steps=self.engine.steps,
            preemptions=self.engine.total_preemptions,
            wall_s=time.perf_counter() - wall0,
            extra={
                "profile": self.profile.name,
                "workload": describe(specs),
                "variance": [k for k, t in self._tables() if t],
                "warm_up": warm_up,
            },
        )

    def _warm_up(self) -> dict[str, Any] | None:
        """The daemon's warm-up (``lifecycle/warm.py``) on the twin's engine, out of the workload's
        time: the same phases while ``[control] warmup_s`` lasts, each run to its end, and the
        step-cost model seeded with the fit of their steps. None where the daemon runs none (a named
        ``cost_profile`` seeds it, or ``warmup_s`` is 0)."""
        c = self.control.control
        if c.cost_profile or c.warmup_s <= 0:
            return None
        limits, t, ran, ids = self.profile.engine, 0.0, [], -1
        steps0, preemptions0 = self.engine.steps, self.engine.total_preemptions
        steps: deque[EngineStep] = deque(maxlen=KEPT)  # as many as the EngineCore's ring keeps
        for phase in plan(limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len):
            if t >= c.warmup_s:
                break
            for _ in range(phase.streams):  # negative ids: never a workload's, own content only
                self.engine.add(SimRequest(ids, phase.prompt_tokens, phase.output_tokens, 0, t))
                ids -= 1
            while self.engine.has_work:
                step = self.engine.plan()
                took = self._step_s(step)
                t += took
                record, _ = self.engine.finish_step(step, t, took)
                if record.cost is not None:
                    steps.append(record)
            ran.append(phase.describe())
        self.engine.steps, self.engine.total_preemptions = steps0, preemptions0  # the workload's alone
        _, error = seed_from_warm_up(self.cost, list(steps), t)
        return {"phases": ran, "steps": len(steps), "seconds": round(t, 3), "median_rel_error": error}

    async def _drive(self, arrivals: Sequence[RequestSpec], draws: Sequence[float]) -> None:
        """Advance virtual time from event to event until every request is done (or ``drain_s`` after
        the last arrival). ``arrivals`` in arrival order; ``draws[i]`` the uniform of request ``i``'s
        front-end delay. At one instant: the step that ends, then arrivals (each draws its front-end
        delay from the load it finds), then entries into the gate, then the control tick, then the
        time-series sample; then the next step is planned from what the tasks did."""
        c = self.control
        next_tick, next_sample = c.control.tick_s, c.sample_period_s
        end_by = (arrivals[-1].arrival_s if arrivals else 0.0) + c.drain_s
        entries: list[tuple[float, int, RequestSpec]] = []
        i, plan, step_end, step_s = 0, None, 0.0, 0.0
        while i < len(arrivals) or entries or plan is not None or self.engine.has_work or self._open > 0:
            next_arrival = arrivals[i].arrival_s if i < len(arrivals) else math.inf
            next_entry = entries[0][0] if entries else math.inf
            t = min(step_end if plan is not None else math.inf, next_arrival, next_entry, next_tick)
            t = min(t, next_sample)
            if t > end_by:
                break
            self.clock.now = t
            # queue deadlines on virtual time, before any await: the gate's own loop timers (real
            # time) then find these waiters already refused, so the run stays deterministic
            woken = self.gate.expire_overdue() > 0  # did anything happen that tasks must react to?
            if plan is not None and step_end <= t:
                woken = self._end_step(plan, t, step_s) or woken
                plan = None
            while i < len(arrivals) and arrivals[i].arrival_s <= t:
                spec = arrivals[i]
                delay = self._front_end_s(draws[i] if draws else None)
                heapq.heappush(entries, (spec.arrival_s + delay, spec.index, spec))
                self._in_flight += 1
                i += 1
            while entries and entries[0][0] <= t:
                self._tasks.append(asyncio.create_task(self._client(heapq.heappop(entries)[2])))
                self._open += 1
                woken = True
            if woken:
                await self._settle()
            if next_tick <= t:
                await self.loop.tick()
                next_tick += c.control.tick_s
                await self._settle()
            if next_sample <= t:
                self._sample(t)
                next_sample += c.sample_period_s
            if plan is None and self.engine.has_work:
                plan = self.engine.plan()
                step_s = self._step_s(plan)
                step_end = t + step_s

    def _end_step(self, plan: StepPlan, t: float, step_s: float) -> bool:
        """Apply a step at its end and hand it to the virtual vLLM's output handler (its finished
        requests' outputs, the step feed, the outcome ledger)."""
        step, done = self.engine.finish_step(plan, t, step_s)
        self.llm.step_ended(step, done)
        return bool(done)

    async def _finish(self, arrivals: Sequence[RequestSpec]) -> float:
        """Cancel what is still running at the end (recorded as failed); the run's duration."""
        now = self.clock()
        unfinished = [t for t in self._tasks if not t.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        for spec in arrivals:
            if spec.index not in self._records:
                self._fail(spec, spec.arrival_s, "failed", None, "unfinished when the simulation ended")
        ends = [r.arrival_s + (r.e2e_s or 0.0) for r in self._records.values()]
        return max([now if unfinished else 0.0, *ends, 1e-9])
