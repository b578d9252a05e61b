"""The twin: a virtual-time vLLM engine behind the interfaces the control loop and the gate use.

The engine twin: ``engine.py`` (vLLM V1's scheduler in virtual time; each step one ``EngineStep`` with
both its parts), ``kvcache.py`` (the paged KV cache with vLLM's automatic prefix caching: chained block
hashes, LRU eviction of freed cached blocks), ``llm.py`` (the virtual vLLM: ``SimLLM`` in place of the
``AsyncLLM`` over the engine, its renderer's 400 for a prompt past ``max_model_len``, one final output a
request with vLLM's request stats, and after each step its output handler and stat logger: the step to the
core's step feed, each finished request to the outcome ledger through
``engine/runtime/stats.report_finished``; ``SimHost``, the engine host around it as the control core and
the engine client reach it), ``run.py`` (the daemon's control core from ``control/build.ControlCore``
around ``SimHost``, an outcome ledger, one clock, and the driver: each request a task that does what
vLLM's OpenAI handler does with the daemon's ``engine/frontend/client.GovernedEngineClient``, its context,
the preflight ``check_admission``, then ``generate()``, with no admission code of its own; the daemon's
warm-up runs on the engine before the workload when no ``cost_profile`` is named), ``twin.py`` (the one
place that builds a simulation from a profile, ``controller/profiles/``, and the ``[control]`` /
``[admission]`` / ``[slo]`` tables), ``compare.py`` (``simulate --compare``), ``grid.py`` (``simulate
--grid``: a policy against vLLM's defaults and a grid of static settings, ratios from one run),
``cli.py`` (``simulate``). May import ``control/``, ``admission/``, ``config/``, ``profiles/``,
``load/`` and ``results/``, and of ``engine/`` only the request path the daemon runs
(``engine/frontend/client`` and ``context``, ``engine/runtime/stats.report_finished``), never vLLM
itself nor ``bench/``. Importing
``sim/run.py`` loads vLLM (through the client): ``bench calibrate`` imports the twin where it builds one,
so the CLI starts without it.
"""
