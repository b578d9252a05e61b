"""What admission knows of one HTTP request while vLLM handles it: its ``RequestContext``, in a
context variable that the middleware (app.py) sets and vLLM's handler tasks inherit, and its
``Call`` list, one per ``generate()`` call the handler makes (client.py).

vLLM calls ``generate()`` without the HTTP request, and some routes make several calls for one
request (a completion's prompts, a batch's conversations, a beam search's steps): the context is how
those calls share the request's arrival time, its resolved priority and whether it has been served.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from controller.admission.classes import PriorityBounds, PriorityClass
from controller.clock import monotonic
from controller.engine.frontend.objectives import Objectives, from_headers

PRIORITY_HEADER = "x-vllm-priority"
REQUEST_ID_HEADER = "x-request-id"
"""The client's id for a request, which vLLM also takes as its own; a router's retries carry it."""


@dataclass
class Call:
    """One ``generate()`` call: admitted by the gate, holding a pending place until it queues."""

    priority: int
    weight: int = 1
    """The sequences it runs in the engine (its sampling's ``n``): its slot's weight."""
    prompt_tokens: int | None = None
    """Tokens its prompt prefills, as vLLM rendered it (where the gate uses it:
    ``AdmissionGate.uses_prompt_length``; else None)."""
    holds_place: bool = False
    """It holds pending places in its class, one per sequence (counted at admission, taken when it
    queues); the middleware gives them back when the request ends without the call ever running."""
    predicted_ttft_s: float | None = None
    """The TTFT the gate predicted for it, from ``arrived_mono``, where a TTFT bound held it: its
    first token is measured against it (``admission/ttft.TtftCheck``)."""
    arrived_mono: float | None = None
    """When its request reached the server (with ``predicted_ttft_s``)."""


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
    admitted: bool = False
    """A call has passed admission: later calls are not new arrivals."""
    retry: bool = False
    """Its arrival took a try that a recent refusal of its ``request_id`` excuses
    (``AdmissionGate.take_retry``): refused before it holds a slot, it is a retry, not new demand."""
    served: bool = False
    """A call has held a slot: its TTFT has happened, later calls are not refused by it."""
    calls: list[Call] = field(default_factory=list)
    refusal: tuple[int, str] | None = None
    """The gate's last refusal of a call (status, message): the middleware answers it as the
    request's status when the response has not really started (a stream before its first chunk)."""
    retry_after_s: int | None = None
    """The Retry-After of the gate's refusal."""
    refusal_reason: str | None = None
    """The gate's reason for its refusal, named in the answer's headers (``objectives.refusal_headers``)."""


current: ContextVar[RequestContext | None] = ContextVar("autopilot_request", default=None)


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
