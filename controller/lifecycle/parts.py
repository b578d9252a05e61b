"""The daemon's parts, built in one place from the config.

Who calls whom, as wired here: the scheduler ticks the control loop; the loop observes through the
``Observer`` (gate, telemetry window, engine knobs, NVML, psutil), lets the policy decide, normalizes,
moves knobs only through the ``Actuator``, then calls its subscribers in order: the capacity meter
(``autopilot_saturation``), the diagnosis, the memory guard (which may start an engine restart) and
the decisions metric. The loop and the parts it ticks through are the control core, built by
``controller.control.build.ControlCore`` as the twin's is; the rest is the daemon's own. The admin
server reads ``Parts`` through ``controller.admin.status``; the reload handler
(``controller.lifecycle.reload``) swaps the live tables in: the core's through its one door
(``ControlCore.prepare`` then ``apply``, as at the first build), ``[guard]`` and the tick's interval here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from prometheus_client import CollectorRegistry

from controller.admin.metrics import GateMetrics, Metrics
from controller.admission.gate import AdmissionGate
from controller.config.load import Config
from controller.control.actuator import Actuator
from controller.control.build import ControlCore
from controller.control.capacity import CapacityMeter
from controller.control.diagnosis import Diagnoser, Diagnosis
from controller.control.fitcheck import FitCheck
from controller.control.loop import Change, ControlLoop, Subscriber
from controller.control.observe import Observer
from controller.control.outcomes import OutcomeLedger
from controller.control.samplers import GpuSource, HostReadingSource, HostSource, NvmlSource
from controller.control.stepcost import CostReader
from controller.control.steps import StepFeed
from controller.control.telemetry import TelemetryWindow
from controller.engine.runtime.args import serve_namespace
from controller.engine.runtime.host import EngineHost
from controller.engine.runtime.parallel import engine_devices
from controller.lifecycle.guard import Guard
from controller.lifecycle.notify import Notifier
from controller.lifecycle.tasks import BackgroundTasks
from policies.base import Observation

TICK_JOB = "control_tick"
"""The scheduler's job id for the loop's tick (a reload reschedules it)."""


@dataclass(eq=False)
class Parts:
    """Everything the daemon runs, and the little state its views read."""

    config: Config
    """The config in force: a reload replaces its live tables (the core's own parts read theirs from
    ``core.settings``, put in force in the same step)."""
    core: ControlCore[EngineHost]
    """The control core: its parts below, and the one door of the live tables into them (``apply``)."""
    registry: CollectorRegistry
    metrics: Metrics
    window: TelemetryWindow
    gate: AdmissionGate
    args: argparse.Namespace
    """vLLM's serve arguments, from [engine] and [server]."""
    host: EngineHost
    guard: Guard
    gpu_source: GpuSource
    host_source: HostReadingSource
    observer: Observer
    actuator: Actuator
    diagnoser: Diagnoser
    loop: ControlLoop
    scheduler: AsyncIOScheduler
    notifier: Notifier
    tasks: BackgroundTasks
    cost: CostReader
    """The online step-cost model, read by /state and the metrics (fed by ``loop.steps``)."""
    capacity: CapacityMeter
    """The SLO capacity and saturation, computed each tick (a loop subscriber), read by /state and
    the metrics."""
    outcomes: OutcomeLedger
    """How each request ended against ``[slo]`` (the core's ledger): /state and the observer read it."""
    fit_check: FitCheck
    """The step-cost model's starting fit against its live one over the steps served since (/state)."""
    file_engine: dict[str, Any] = field(default_factory=dict)
    """[engine] as the files asked for it, of the file whose values the engine runs (the first, then
    each reloaded file an engine built on): what a reload's [engine] is compared with, never the
    config in force, which holds the memory guard's shrink (``reload.py``)."""
    pending_changes: dict[str, list[str]] = field(default_factory=dict)
    """Changed keys per table that wait for a restart (set by the last reload)."""
    starting: bool = False
    """The daemon's startup runs (its first engine builds): reloads wait for it to end."""
    draining: bool = False
    server: Any = None
    """The data plane's uvicorn server, once it was started."""

    @property
    def data_plane_up(self) -> bool:
        """The OpenAI API listens (healthy only then: a load balancer may send traffic at once)."""
        return self.server is not None and bool(self.server.started) and not self.server.should_exit

    @property
    def diagnosis(self) -> Diagnosis | None:
        return self.diagnoser.last

    def adopt_engine(self, overrides: dict[str, Any]) -> None:
        """The guard's callback after a restart that built: the config in force says what the engine
        now runs (a memory shrink included); a reload compares [engine] with the file, not with this
        (``reload.py``), so a file that leaves the key alone keeps the shrink."""
        self.config = dataclasses.replace(self.config, engine={**self.config.engine, **overrides})


def watch_memory(guard: Guard, tasks: BackgroundTasks) -> Subscriber:
    """The guard as a loop subscriber: a confirmed memory risk starts a restart task that shutdown
    cancels with the others."""

    def on_tick(obs: Observation, _changes: list[Change]) -> None:
        task = guard.on_observation(obs)
        if task is not None:
            tasks.add(task)

    return on_tick


def build_parts(
    config: Config, gpu_source: GpuSource | None = None, host_source: HostReadingSource | None = None
) -> Parts:
    """The parts, wired; nothing starts (no engine, no listener, no task) until the daemon's startup.
    The control core is ``control/build.ControlCore``'s, as the twin's; the daemon adds its engine
    host, the NVML and host samplers, the metrics and the subscribers only it has."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    server = config.server
    args = serve_namespace(config.engine, {"host": server.host, "port": server.port, **server.vllm})
    # NVML reads the GPUs of the engine in force (``host``, built just below), not every GPU here
    gpu = gpu_source or NvmlSource(engine=lambda: engine_devices(host.args))
    hostsrc = host_source or HostSource()

    def engine_host(steps: StepFeed, outcomes: OutcomeLedger) -> EngineHost:
        built = EngineHost(args, steps, server.engine_poll_sleep_s)
        built.outcomes = outcomes  # each finished request judged against [slo] (control/outcomes.py)
        return built

    core = ControlCore(
        config,
        engine=engine_host,
        count_outcome=metrics.count_outcome,
        gpu=gpu,
        host=hostsrc,
        gate_events=GateMetrics(metrics),
    )
    host, gate, window, loop = core.engine, core.gate, core.window, core.loop
    guard = Guard(
        config.guard,
        gate,
        host,
        metrics.count_restart,
        last_step_age=window.last_step_age_s,
        gpu_free=lambda: (r.free_bytes, r.total_bytes) if (r := gpu.read()) is not None else None,
    )
    diagnoser, tasks = Diagnoser(), BackgroundTasks()
    for subscriber in (diagnoser.on_tick, watch_memory(guard, tasks), metrics.count_decisions):
        loop.subscribe(subscriber)
    fit_check = FitCheck()  # the start fit against the live one, over the steps served since
    core.steps.subscribe(fit_check.update)
    metrics.live.read_from(gate, host, loop)
    metrics.live.read_cost(core.cost)
    metrics.live.read_capacity(core.capacity)
    parts = Parts(
        config=config,
        core=core,
        registry=registry,
        metrics=metrics,
        window=window,
        gate=gate,
        args=args,
        host=host,
        guard=guard,
        gpu_source=gpu,
        host_source=hostsrc,
        observer=core.observer,
        actuator=core.actuator,
        diagnoser=diagnoser,
        loop=loop,
        scheduler=AsyncIOScheduler(),
        notifier=Notifier(),
        tasks=tasks,
        cost=core.cost,
        capacity=core.capacity,
        outcomes=core.outcomes,
        fit_check=fit_check,
        file_engine=dict(config.engine),
    )
    guard.on_engine_args = parts.adopt_engine
    return parts
