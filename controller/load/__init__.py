"""What a benchmark sends and the one client that sends it: workloads, prompts, the streaming SSE client.

What a benchmark sends and the one client that sends it, for the bench, the twin, the tests and the
locustfile alike. ``workload.py`` (``RequestSpec``; Poisson, Azure trace windows and windows of several
traces in turn, ShareGPT, priority mixes), ``sessions.py`` (the shared-prefix workload: system prompts and
multi-turn sessions as ``RequestSpec.segments``), ``prompts.py`` (prompts of an exact token count from the
served model's tokenizer, the same text for the same segments), ``phases.py`` (the phase-changing load and
its per-phase figures), ``options.py`` (the workload options of the bench commands and ``simulate``,
turned into a workload), ``client.py`` (the one streaming SSE client and connection pool: ``post`` sends a
request and reads its stream into an ``Answer`` for every caller, the bench, the overload mix, the chaos
load, calibration and the tests alike; the open loop, one ``RequestRecord`` a request). Of ``controller/`` it
imports only ``results/``.
"""
