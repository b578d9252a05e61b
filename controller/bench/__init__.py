"""`vllm-autopilot bench`: servers under test, one run against each, and the experiments built on them.

``vllm-autopilot bench`` (run, sweep, compare, frontend, soak, chaos, overload, fleet, report, calibrate,
validate) against any OpenAI-compatible server. The orchestration: ``servers.py`` (the one server launcher
and TOML writer: our daemon or plain ``vllm serve`` on free ports), ``gpucheck.py`` (the top-level
``gpu-check`` command: the daemon on the operator's config, its engine's start method, a restart it
survives, a co-tenant's memory restart, the guard at util 0.97, parity with ``vllm serve`` through the
runner's load, TP 2 and DP 2 restarts, a clean stop; a table and JSON), ``router.py`` (``vllm-router`` in
front of servers it started), ``runner.py`` (one run against one live server: warm up, send, scrape, write
the run directory; the run options), ``scrape.py`` (the server's ``/metrics`` and ``/state`` once a
period), ``targets.py`` (one base config, many server specs, and the one loop that starts each in turn and
runs the workload against it),
``memory.py`` and ``pyspy.py`` (what a server's processes use), ``cli.py`` (parsing and dispatch).
``experiments/``: one module a command (``compare.py``, ``sweep.py``, ``soak.py``, ``overload.py`` with
``mix.py``, its two-class overload mix; ``frontend.py``: interleaved pairs of bursts against ``vllm
serve``, ``frontend_layers.py``: the CPU each of our layers adds a request over a fake engine;
``fleet.py``: two daemons behind ``vllm-router``, their summed saturation against the offered load).
``chaos/``: the chaos soak (``run.py``: the run, its samples of the daemon's memory, files, threads and
ticks, and what it finds left behind; ``load.py``: the rude clients and the ordinary probe; ``faults.py``:
the faults and what each must cause, engine-killing requests and a hung EngineCore among them;
``hostile.py``: the connections that attack the data plane below HTTP, each from a loopback address of its
own; ``verdict.py``: the invariants, pure, one table row each). ``calibrate/``: the twin measured against
a real server (``run.py``: ``bench calibrate``, its method and the profile it writes, ``measure.py``: the
loads sent, ``fit.py``: the least squares; ``validate.py``: `bench validate``, a trace window through the
real engine and the twin); it imports ``sim/` for the profile and the twin, never the other way. Imports
run one way: ``experiments/``, ``chaos/`` and ``calibrate/`` -> the orchestration -> ``load/`` ->
``results/``; only ``cli.py`` imports the experiments. Never imported by the daemon. Invariant: a figure
is printed with a baseline measured in the same run.
"""
