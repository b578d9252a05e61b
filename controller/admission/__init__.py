"""The data plane's admission gate: priority classes, per-class queues, slots, early refusal with
Retry-After.

The data plane's gate: ``classes.py`` (priority classes, the measured completion and service rates),
``queues.py`` (one class's queue, in arrival order or, with ``order = "shortest"``, by prompt length;
slots, stats), ``errors.py`` (``GateRejected``, the 429 or 503 a refused request gets, with its reason and
``Retry-After``), ``deadlines.py`` (queue deadlines and the pause of an engine restart, which does not
count against them up to ``[guard] max_restart_wait_s``), ``shedding.py`` (who is refused when a more
urgent request needs the place), ``ttft.py`` (under SLO steering: queue deadlines cut to a share of each
class's TTFT bound, and early refusal by predicted TTFT, its prefill from a ``PrefillEstimator`` the
wiring passes in (the step-cost model's reader: it asks per request, between ticks, and reads the fit as
the last tick left it, since the fit takes steps only in the tick; the prefix cache's share at most once a
second, the budget as the actuator set it); a request's own TTFT bound, a gateway's header, only tightens
its class's (never below 0.1 s), and one its own prefill passes is refused even with a free slot (reason
``own_ttft_bound``, which steers no margin); ``TtftCheck``, each admitted request's predicted TTFT (what
``check_admission`` returns) against its measured one, per class, whose p90 residual joins the
expected-wait check; ``AfterSlot``, the measured time from a slot to the first token beyond the prefill
(the engine's own queue at its median, the rest at p90, over 10 s), which the engine client reports per
request and which joins every prediction and shortens the queue deadline; the time a request has spent in
the server since the middleware's ``RequestContext``, ``engine/frontend/context.py``, counts too),
``handle.py`` (``Admission``, one request's handle from ``AdmissionGate.enter``: its preflight, each
call's admission, slot and release, its close; the only place a request's slot or pending place goes
back), ``order.py`` (who gets the next slot: strict priority with aging, a heavy request at the head
holding back the classes after it; a slot's weight capped at what its class can ever hold), ``gate.py``
(``AdmissionGate``: the limit in sequences, weighted slots granted all at once or none, pending places
counted per sequence, reserved shares, early refusal with ``Retry-After`` (400 for an ``n`` that overflows
the queue limits on an idle gate), shedding, the 503 states (shutdown, restart budget spent, no engine
able to serve), the pause of a restart and the drain; ``GateStats.arrivals_total`` counts each try once,
``retries_total`` the refused tries of a request it refused lately, known by its ``X-Request-Id``
(``retries.py``: a refusal excuses a few tries, never an admitted one): the offered load is the
difference). Imports ``clock`` and ``percentile`` only. Invariant: every request that enters ends with a
slot, a refusal or a timeout, and a slot is always returned.
"""
