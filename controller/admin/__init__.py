"""The control plane: the aiohttp server (/metrics, /state, /healthz, /reload), the typed status view,
the Prometheus metrics.

The control plane (aiohttp): ``server.py`` (routes, bearer token, the ``Host`` check against DNS
rebinding, the content type a ``POST /reload`` needs against cross-site forms; the runner's idle deadline
and header limits, and its connection cap in all and per peer), ``page.py`` (the status page at ``/``:
``static/status.html``, self-contained, polling ``/state``; ``/favicon.ico`` a 204, so a browser's console
stays clean), ``status.py`` (``/state`` and ``/healthz`` as a typed view over the ``StatusParts`` it
reads; it imports no daemon), ``metrics.py`` (every ``autopilot_*`` metric on a registry passed in; a
Collector reads the live gauges at scrape time). vLLM's ``vllm:*`` metrics are served from the same
endpoint. Of ``lifecycle/`` it reads the guard's types; the engine host's type only under
``TYPE_CHECKING``.
"""
