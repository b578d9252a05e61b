"""The control core, built from the config's tables in one place for the daemon
(``controller/lifecycle/parts.py``) and the twin (``controller/sim/run.py``) alike: the admission gate
and its TTFT bounds, the telemetry window, the step-cost model (seeded from ``[control] cost_profile``),
the policy, the normalize stage, the observer, the actuator, the capacity meter, the step feed and
the loop. The caller brings its world and nothing of the core: the clock, the engine (the engine host,
or the twin's engine behind the same interface), the NVML and host samplers (the twin has none), the
outcome ledger, the gate's event sink, and then its own loop subscribers. A reload
(``controller/lifecycle/reload.py``) rebuilds the policy, the normalize stage and the TTFT bounds with
the same functions. No vLLM here: the twin runs without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from controller.admission.classes import GateEvents
from controller.admission.gate import AdmissionGate
from controller.admission.ttft import NO_BOUNDS, PrefillEstimator, TtftBounds
from controller.clock import Clock, monotonic
from controller.config.load import AdmissionConfig, Config, ControlConfig
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


@dataclass(eq=False)
class ControlCore(Generic[E]):
    """The loop and the parts it ticks through, wired."""

    engine: E
    """The caller's engine, built around ``steps`` (it publishes the steps it is told of there)."""
    gate: AdmissionGate
    window: TelemetryWindow
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


def build_core(
    control: ControlConfig,
    admission: AdmissionConfig,
    slo: SloTargets | None,
    outcomes: OutcomeLedger,
    *,
    engine: Callable[[StepFeed], E],
    clock: Clock = monotonic,
    gpu: GpuSource | None = None,
    host: HostReadingSource | None = None,
    gate_events: GateEvents | None = None,
    capacity_history: int | None = 0,
) -> ControlCore[E]:
    """The core ``[control]``, ``[admission]`` and ``[slo]`` describe, on ``clock``, around the engine
    that ``engine`` builds on the core's step feed. ``outcomes`` is configured to ``slo``, counts the
    gate's refusals (``GateOutcomes``, before ``gate_events``) and is read by each observation;
    ``capacity_history`` ticks of capacity are kept (None: all)."""
    window = TelemetryWindow(control.window_s, clock)
    steps = StepFeed(clock=clock)
    steps.watch(window.update, window.reset)  # at once: the liveness check and admission read it
    built = engine(steps)
    steps.source = built
    a = admission
    events = GateOutcomes(outcomes, gate_events)  # its refusals counted in the ledger, then the caller's
    gate = AdmissionGate(a.limit, a.max_queue, a.classes, a.aging_s, clock=clock, events=events)
    model = StepCostModel(prior=cost_prior_for(control.cost_profile))
    outcomes.configure(slo)
    policy = control.build_policy(admission, slo, built.max_num_seqs)
    capacity = CapacityMeter(window, gate, history=capacity_history)
    capacity.configure(slo, policy)
    observer = Observer(window, gate, built, gpu, host, model, outcomes)
    actuator = Actuator(gate, built)
    steps.subscribe(model.update)
    normalizer, ticked = normalizer_for(control, policy), [capacity.on_tick]
    loop = ControlLoop(policy, normalizer, observer.observe, actuator, ticked, control.history, steps)
    cost = CostReader(model, clock, lambda: built.token_budget, lambda: window.finished_mix().cached_share)
    gate.set_ttft(ttft_for(policy, slo, a, cost))
    return ControlCore(
        engine=built,
        gate=gate,
        window=window,
        cost=cost,
        capacity=capacity,
        observer=observer,
        actuator=actuator,
        steps=steps,
        loop=loop,
    )


def policy_for(config: Config) -> Policy:
    """The policy a whole config file describes (a reload's; ``ControlConfig.build_policy``)."""
    return config.control.build_policy(config.admission, config.slo, config.max_num_seqs)


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
