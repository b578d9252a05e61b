"""The control core, built from the config's tables in one place for the daemon
(``controller/lifecycle/parts.py``) and the twin (``controller/sim/run.py``) alike: the admission gate
and its TTFT bounds, the telemetry window, the outcome ledger, the step-cost model (seeded from
``[control] cost_profile``), the policy, the normalize stage, the observer, the actuator, the capacity
meter, the step feed and the loop. The caller brings its world and nothing of the core: the clock, the
engine (the engine host, or the twin's engine behind the same interface), the NVML and host samplers
(the twin has none), the outcome metric, the gate's event sink, and then its own loop subscribers.

The live tables (``[control]``, ``[admission]``, ``[slo]``) go in through one door: ``prepare`` builds
what they need (the policy and the normalize stage when their inputs changed, the TTFT bounds, the
cost profile's seed) and changes nothing; ``apply`` assigns it. The first build and every reload
(``controller/lifecycle/reload.py``) run the same two steps, so a key reaches the core's parts the same
way both times; ``[slo]`` in force is read from ``ControlCore.settings`` by the parts that judge by it.
No vLLM here: the twin runs without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from controller.admission.classes import GateEvents
from controller.admission.gate import AdmissionGate
from controller.admission.ttft import NO_BOUNDS, PrefillEstimator, TtftBounds
from controller.clock import Clock, monotonic
from controller.config.load import AdmissionConfig, ControlConfig
from controller.control.actuator import Actuator, CappedEngine
from controller.control.capacity import CapacityMeter
from controller.control.loop import ControlLoop
from controller.control.normalize import Normalizer
from controller.control.observe import EngineKnobs, Observer
from controller.control.outcomes import GateOutcomes, OutcomeLedger
from controller.control.samplers import GpuSource, HostReadingSource
from controller.control.stepcost import CostPrior, CostReader, StepCostModel, prior_from
from controller.control.steps import StepFeed, StepSource
from controller.control.telemetry import TelemetryWindow
from controller.profiles.load import load_profile
from policies.base import Policy
from policies.slo_targets import SloTargets


class CoreEngine(EngineKnobs, CappedEngine, StepSource, Protocol):
    """The engine as the core reaches it: the knobs in force (the observer), the batch cap and the
    token budget it moves (the actuator), the steps waiting to be pulled (the step feed)."""


E = TypeVar("E", bound=CoreEngine)


class CoreTables(Protocol):
    """The tables the core runs under: a config file's (``Config``) or the twin's (``ControlSettings``)."""

    @property
    def control(self) -> ControlConfig: ...
    @property
    def admission(self) -> AdmissionConfig: ...
    @property
    def slo(self) -> SloTargets | None: ...


@dataclass(frozen=True)
class CoreSettings:
    """The core's live settings with every part built from them (``ControlCore.prepare``): what
    ``ControlCore.apply`` puts in force by assignments alone."""

    control: ControlConfig
    admission: AdmissionConfig
    slo: SloTargets | None
    """``[slo]`` in force: the one place the core's parts read it (the outcome ledger and the capacity
    meter, through ``ControlCore.slo``; the policy and the gate's TTFT bounds are built from it)."""
    policy: Policy
    """The policy in force after it: a new one when ``[control]``, ``[slo]`` or the limit changed."""
    normalizer: Normalizer
    ttft: TtftBounds
    """The gate's TTFT bounds under ``policy``, on this ``[slo]`` and ``[admission]``."""
    reseed: bool
    """The step-cost model starts over from ``cost_prior`` (the first build, a new cost profile)."""
    cost_prior: CostPrior | None


def _uncounted(_cls: str, _outcome: str) -> None:
    """No metric counts the outcomes (the twin)."""


class ControlCore(Generic[E]):
    """The loop and the parts it ticks through, wired, and the live settings they run under: built
    and put in force by ``prepare`` and ``apply``, at the first build and at every reload alike."""

    engine: E
    """The caller's engine, built around ``steps`` and ``outcomes`` (it publishes the steps it is told
    of on the one, each finished request's figures to the other)."""
    gate: AdmissionGate
    window: TelemetryWindow
    outcomes: OutcomeLedger
    """How each request ended against ``[slo]`` (``control/outcomes.py``): counted by the caller's
    ``count_outcome``, fed by the gate's refusals and the engine's finished requests."""
    cost: CostReader
    """The step-cost model (``cost.model``, fed by ``steps``) as the gate's prefill term, /state and
    the metrics read it."""
    capacity: CapacityMeter
    observer: Observer
    actuator: Actuator
    steps: StepFeed
    """The one route of the engine's steps: the window watches it, the step-cost model takes each
    tick's steps (pulled before observing); ``steps.subscribe`` adds a consumer."""
    loop: ControlLoop
    """Its subscribers: the capacity meter, then what the caller adds (``loop.subscribe``)."""

    def __init__(
        self,
        tables: CoreTables,
        *,
        engine: Callable[[StepFeed, OutcomeLedger], E],
        count_outcome: Callable[[str, str], None] = _uncounted,
        clock: Clock = monotonic,
        gpu: GpuSource | None = None,
        host: HostReadingSource | None = None,
        gate_events: GateEvents | None = None,
        capacity_history: int | None = 0,
    ) -> None:
        """The core ``tables`` describe, on ``clock``, around the engine that ``engine`` builds on the
        core's step feed and outcome ledger. The ledger counts each outcome with ``count_outcome``
        and the gate's refusals (``GateOutcomes``, before ``gate_events``), and each observation reads
        it; ``capacity_history`` ticks of capacity are kept (None: all)."""
        c, a = tables.control, tables.admission
        self.window = window = TelemetryWindow(c.window_s, clock)
        self.steps = steps = StepFeed(clock=clock)
        steps.watch(window.update, window.reset)  # at once: the liveness check and admission read it
        self.outcomes = OutcomeLedger(count_outcome, clock=clock, slo=lambda: self.slo)
        self.engine = built = engine(steps, self.outcomes)
        steps.source = built
        # the gate's refusals counted in the ledger, then the caller's
        events = GateOutcomes(self.outcomes, gate_events)
        self.gate = AdmissionGate(a.limit, a.max_queue, a.classes, a.aging_s, clock=clock, events=events)
        model = StepCostModel()  # seeded by ``apply``
        self.cost = CostReader(
            model,
            clock,
            lambda: built.token_budget,
            lambda: window.finished_mix().cached_share,
            self.outcomes.awaiting_first_token,
        )
        steps.watch(self.outcomes.on_steps)  # at once: the gate's backlog term reads it
        first = self._prepare(tables, None)
        self.capacity = CapacityMeter(window, self.gate, self, history=capacity_history)
        self.observer = Observer(window, self.gate, built, gpu, host, model, self.outcomes)
        self.actuator = Actuator(self.gate, built)
        steps.subscribe(model.update)
        observe, ticked = self.observer.observe, [self.capacity.on_tick]
        self.loop = ControlLoop(
            first.policy, first.normalizer, observe, self.actuator, ticked, c.history, steps
        )
        self._settings: CoreSettings | None = None
        self.apply(first)

    @property
    def settings(self) -> CoreSettings:
        """The live settings in force (``apply`` alone replaces them)."""
        assert self._settings is not None, "put in force when the core is built"
        return self._settings

    @property
    def slo(self) -> SloTargets | None:
        """``[slo]`` in force (None: the file has none)."""
        return self.settings.slo

    @property
    def policy(self) -> Policy:
        """The policy in force (the loop's)."""
        return self.loop.policy

    def prepare(self, tables: CoreTables) -> CoreSettings:
        """``tables`` with every part the core takes from them built (a policy that refuses its
        parameters, a cost profile gone since validation raise here), nothing in force changed: a
        reload builds everything before it assigns anything."""
        return self._prepare(tables, self.settings)

    def _prepare(self, tables: CoreTables, old: CoreSettings | None) -> CoreSettings:
        c, a, slo = tables.control, tables.admission, tables.slo
        if old is None or c != old.control or slo != old.slo or a.limit != old.admission.limit:
            policy = policy_for(tables, self.engine.max_num_seqs)
            normalizer = normalizer_for(c, policy)
        else:  # the policy keeps what it learnt
            policy, normalizer = self.loop.policy, self.loop.normalizer
        reseed = old is None or c.cost_profile != old.control.cost_profile
        return CoreSettings(
            control=c,
            admission=a,
            slo=slo,
            policy=policy,
            normalizer=normalizer,
            ttft=ttft_for(policy, slo, a, self.cost),
            reseed=reseed,
            cost_prior=cost_prior_for(c.cost_profile) if reseed else None,
        )

    def apply(self, settings: CoreSettings) -> None:
        """Put ``settings`` in force: assignments and the parts' own setters, nothing left to build."""
        old, a, c = self._settings, settings.admission, settings.control
        self._settings = settings
        self.gate.configure(a.classes, a.aging_s, a.max_queue, ttft=settings.ttft)
        if old is None or a.limit != old.admission.limit:
            self.actuator.set_admission_limit(a.limit)
        self.window.window_s = c.window_s
        self.loop.policy, self.loop.normalizer = settings.policy, settings.normalizer
        self.loop.resize_history(c.history)
        if settings.reseed:
            self.cost.model.reset(settings.cost_prior)


def policy_for(tables: CoreTables, max_num_seqs: int) -> Policy:
    """The policy ``tables`` describe under the engine's ``max_num_seqs`` (``ControlConfig.build_policy``)."""
    return tables.control.build_policy(tables.admission, tables.slo, max_num_seqs)


def normalizer_for(control: ControlConfig, policy: Policy) -> Normalizer:
    """The normalize stage ``[control]`` describes, with ``policy``'s own anti-flap settings
    (``Policy.normalize_defaults``) where ``[control]`` sets none."""
    own = policy.normalize_defaults
    tolerance, reverse_after_s = control.tolerance, control.reverse_after_s
    tolerance = own.get("tolerance", 0.0) if tolerance is None else tolerance
    reverse_after_s = own.get("reverse_after_s", 0.0) if reverse_after_s is None else reverse_after_s
    return Normalizer(
        limit_max=control.limit_max,
        limit_min=control.limit_min,
        cap_min=control.max_num_active_seqs_min,
        tolerance=tolerance,
        reverse_after_s=reverse_after_s,
        max_step_up=control.max_step_up,
        max_step_down=control.max_step_down,
        stabilization_s=control.stabilization_s,
    )


def cost_prior_for(profile: str) -> CostPrior | None:
    """``[control] cost_profile`` as the step-cost model's seed (the config loader checked it loads);
    None: no profile named, the warm-up fits the model."""
    if not profile:
        return None
    loaded = load_profile(profile)
    return prior_from(loaded.cost, loaded.name)


def ttft_for(
    policy: Policy, slo: SloTargets | None, admission: AdmissionConfig, prefill: PrefillEstimator | None
) -> TtftBounds:
    """The gate's TTFT bounds (``admission/ttft.py``) under a policy that steers to ``[slo]``: each
    class's bound, the step-cost model's prefill term and ``[admission] ttft_wait_share``; under any
    other policy (or without ``[slo]``) the queue deadlines alone govern, as configured."""
    if slo is None or not policy.takes_slo:
        return NO_BOUNDS
    bounds = {c.name: slo.for_class(c.name).ttft_s for c in admission.classes}
    return TtftBounds(bounds, prefill, admission.ttft_wait_share)
