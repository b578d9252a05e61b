"""What the front end knows of one HTTP request while vLLM handles it: its ``RequestContext`` (the
HTTP facts: priority, bounds, arrival, objectives, ``X-Request-Id``, the refusal to answer) and its
``Admission`` handle (``admission/handle.py``: admitted, served, its calls' pending places and
slots), in context variables that the middleware (app.py) sets once per request (``entered``) and
vLLM's handler tasks inherit.

vLLM calls ``generate()`` without the HTTP request, and some routes make several calls for one
request (a completion's prompts, a batch's conversations, a beam search's steps): the context is how
those calls share the request's arrival time and resolved priority, and the handle how they share
its admission.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from controller.admission.classes import PriorityBounds, PriorityClass
from controller.admission.gate import Admission, AdmissionGate, GateRejected
from controller.clock import monotonic
from controller.engine.frontend.objectives import Objectives, from_headers

PRIORITY_HEADER = "x-vllm-priority"
REQUEST_ID_HEADER = "x-request-id"
"""The client's id for a request, which vLLM also takes as its own; a router's retries carry it."""


@dataclass
class RequestContext:
    priority: int = 0
    """The header's priority until ``priority.py`` resolves the body's (then ``resolved``)."""
    header: str | None = None
    """The ``X-Vllm-Priority`` header's text: it wins over the body's priority, as in vLLM."""
    resolved: bool = False
    """Resolved from the client's header or body: every call runs at it (beam search's steps name none)."""
    bounds: PriorityBounds = field(default_factory=PriorityBounds)
    """[admission] most_urgent_priority and default_priority in force when the request arrived."""
    arrived_mono: float = field(default_factory=monotonic)
    """When the request reached the server: a TTFT bound counts from here."""
    objectives: Objectives = field(default_factory=Objectives)
    """What its headers ask of its latency (a gateway's TTFT bound and TPOT objective,
    ``objectives.py``): the TTFT bound goes to the gate with each call, a malformed value is
    answered 400 by ``priority.py``."""
    request_id: str | None = None
    """The client's ``X-Request-Id``, the same on each try of the request (docs/fleet.md): the gate
    counts a try of an id it refused lately as a retry, not new demand; None without the header."""
    refusal: GateRejected | None = None
    """The gate's last refusal of the request (its status, message, Retry-After and reason): the
    middleware answers it as the request's status when the response has not really started (a
    stream before its first chunk), with its reason in the answer's headers
    (``objectives.refusal_headers``)."""


current: ContextVar[RequestContext | None] = ContextVar("autopilot_request", default=None)
admission: ContextVar[Admission | None] = ContextVar("autopilot_admission", default=None)
"""The request's ``Admission`` handle (``admission/handle.py``), set with ``current`` by ``entered``."""


@contextlib.contextmanager
def entered(request: RequestContext, gate: AdmissionGate) -> Iterator[Admission]:
    """The request enters the gate once: its ``Admission`` and its context, set for vLLM's handler
    tasks (which inherit them) while it runs; at its end, whatever way it ends, the handle closes
    (the pending places of calls that never queued go back)."""
    handle = gate.enter(request.arrived_mono, request.objectives.ttft_s, request.request_id)
    tokens = current.set(request), admission.set(handle)
    try:
        yield handle
    finally:
        current.reset(tokens[0])
        admission.reset(tokens[1])
        handle.close()


def header_text(headers: list[tuple[bytes, bytes]], wanted: str) -> str | None:
    """The text of a raw ASGI request's header ``wanted`` (in lower case); None without one."""
    for name, value in headers:
        if name.lower() == wanted.encode():
            return value.decode("latin-1")
    return None


def priority_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The text of a raw ASGI request's ``X-Vllm-Priority`` header; None without one."""
    return header_text(headers, PRIORITY_HEADER)


def for_request(
    headers: list[tuple[bytes, bytes]], bounds: PriorityBounds, classes: Sequence[PriorityClass] = ()
) -> RequestContext:
    """A new request's context: its priority the header's until ``priority.py`` resolves it (a
    header that is not an integer reads 0, as vLLM reads it), kept within ``bounds``, the
    objectives its headers name (a class looked up in ``classes``, the gate's in force), and its
    ``X-Request-Id``."""
    header = priority_header(headers)
    try:
        asked = None if header is None else int(header)
    except ValueError:
        asked = 0
    return RequestContext(
        bounds.clamp(asked),
        bounds=bounds,
        header=header,
        objectives=from_headers(headers, classes),
        request_id=header_text(headers, REQUEST_ID_HEADER),
    )
