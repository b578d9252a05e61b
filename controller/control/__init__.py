"""The control loop: observe -> decide (a policy) -> normalize -> apply (the actuator), then subscribers.

The loop and what it reads. ``observe.py`` builds one tick's ``Observation`` from small Protocols (the
gate's readings, the telemetry window, the knobs in force, the samplers) and changes nothing. ``loop.py``
(``ControlLoop.tick``) runs observe -> decide -> normalize -> apply, tells the policy what was applied
(``Policy.applied``), then calls its subscribers with the observation and the changes; it keeps when its
ticks end (``ControlLoop.stalled``: none for longer than a tick can take, its waits on the engine each
bounded by the host's deadline), which ``/healthz`` and the systemd watchdog read. ``normalize.py`` clamps
to the knobs' bounds (``[control] limit_min``/``limit_max``, ``max_num_active_seqs_min``), applies the
tolerance band, the hold on quick reversals, the stabilisation window and the rate limit, for every knob
and every policy (a policy names its own anti-flap defaults, ``Policy.normalize_defaults``, which
``[control]`` overrides), and says why. ``actuator.py`` is the only code that moves knobs (the gate's
limit, the engine's batch cap and token budget); ``knobs.py`` names them, maps each to its setter for the
apply stage and re-exports ``policies/knobs.py``'s bounds, which the normalize stage, the engine and the
twin clamp with. ``steps.py`` is one engine
step's record (``EngineStep``: its end, its engine, and two parts named by where they are measured,
``cost``, the scheduler's figures from inside the EngineCore, and ``stats``, the stat logger's from the
API process; the real engine's records carry one part each, as no step id joins the two processes, the
twin's both) and the ``StepFeed``, the one route of those records to every consumer: the stat logger (the
twin's driver) publishes each step as it comes, the tick pulls the EngineCore's ring (``StepSource``, the
engine host) before it observes; the telemetry window watches the feed (each step at once: the liveness
check, the gate's prefix-cache share and ``/state`` read it between ticks; a new engine resets it through
the feed), the step-cost model and the fit check subscribe (each tick's steps, in time order).
``build.py`` builds the control core from ``[control]``, ``[admission]`` and ``[slo]`` (``ControlCore``), for
the daemon (``lifecycle/parts.py``) and the twin (``sim/run.py``) alike: the gate and its TTFT bounds under a
policy that steers to ``[slo]`` (``ttft_for``, with ``[admission] ttft_wait_share``), the telemetry window,
the outcome ledger, the step-cost model seeded from ``[control] cost_profile`` (``cost_prior_for``), the
policy (``ControlConfig.build_policy``), the normalize stage, the observer, the actuator, the capacity meter,
the step feed and the loop; the caller passes its clock, its engine (a ``CoreEngine``: the engine host, or the
twin's ``SimHost``, built on the core's step feed and ledger), its samplers, its outcome metric and the gate's
event sink, and subscribes its own consumers. The live tables enter through one door, at the first build and
at every reload alike: ``ControlCore.prepare`` builds what they need (``CoreSettings``) and changes nothing,
``ControlCore.apply`` assigns it; ``[slo]`` in force is ``ControlCore.settings.slo``, which the ledger and the
capacity meter read. ``outcomes.py`` is how each request ended against its class's ``[slo]`` (good, TTFT or
TPOT missed, refused, failed: ``autopilot_requests_by_outcome_total``, the
window's goodput in ``/state``), fed by the engine's finished-request stats and the gate's refusals
(``GateOutcomes``, the gate's event sink that ``ControlCore`` puts before the caller's, so the daemon and
the twin count them alike), and its served and missed totals go into each ``Observation`` (the slo
policy's mean margin learns from them; a request's own TTFT header decides its outcome, not those totals),
with the answer lengths (the budget's mean-TPOT rule) and the prefill mix the requests ask (the
concurrency's stand-in until the steps measure it); ``warmfit.py`` is the warm-up's plan and its fit, free
of vLLM, so the daemon (``engine/runtime/warmup.py``) and the twin (``sim/run.py``) run the same;
``fitcheck.py`` is how the fit the model started from predicts the steps served since, beside the live fit
(``/state`` ``cost_model.fit_check``); ``stepcost.py`` is the online step-cost model (recursive least
squares with forgetting over the engine's steps' ``cost`` parts, fed by the loop's step feed; its estimate
is ``Observation.cost``, with the engine's pace: the decoding steps' wall clock over the fit's
prediction); ``capacity.py`` is the SLO capacity and saturation (``autopilot_capacity_rps``,
``autopilot_saturation``: a loop subscriber, from the fit, ``[slo]``, the window's request mix and the
gate's arrivals); ``telemetry.py`` is the rolling window of engine steps' ``stats`` parts; ``samplers.py``
reads NVML (behind an interface with a fake; on a CPU host it reads nothing), only the engine's GPUs
(``EngineDevices``, which the daemon's wiring asks ``engine/runtime/parallel.engine_devices`` for), and
psutil; ``diagnosis.py`` says what saturates. May import ``policies/``, ``admission/``, ``config/`` and
``profiles/`` (a named cost profile), never ``engine/`` (the engine is reached through Protocols).
"""
