"""Per-request admission tickets: the request's priority class is known when vLLM calls
``check_admission`` (which it does without the priority), and a refusal carries its own Retry-After.

The data-plane middleware gives every HTTP request a ``Ticket`` in a context variable (vLLM's
handler tasks inherit it). The serving objects' entry points are wrapped to fill in the priority with
vLLM's own resolution (the ``X-Vllm-Priority`` header, else the body's ``priority``) before their
``_preflight`` runs; a request that names none gets ``[admission] default_priority``, and one that
asks for more urgent than ``min_priority``, past int64 or not an integer is answered 400 there.
The wrapping only resolves the priority and counts the prompts before vLLM's own admission check:
the rules live in the governed client's ``generate()`` (client.py), which every route passes. Each
``generate()`` call is a ``Claim`` on the ticket: it takes one of the pending places admission
counted, or, past them (a route whose entry point is not wrapped, a beam search's steps), passes the
gate's admission check itself. A place never claimed (vLLM answered 4xx after admission: bad input,
prompt too long) or claimed by a generator never iterated goes back when the request ends.

A streamed request waits for its gate slot in the entry point, after vLLM's handler has made its
generators and before it returns the stream: its 200 goes out only once the request runs, so a
queue deadline that passes is a 429 with Retry-After, as for a request that does not stream, not an
error event in a stream that already said 200. Its calls take one slot of all their weights at
once (a stream of more prompts than the limit never holds some while it waits for the rest), split
into one ``Slot`` per ``Claim``; one the stream never took (the client left first) goes back when
the request ends.

A request's path: ``AdmissionMiddleware`` (app.py: the ``Ticket``) -> a wrapped entry point (the
priority, the prompts) -> ``GovernedEngineClient.check_admission`` (pending places) -> ``generate()``
(a ``Claim``) -> ``AdmissionGate.acquire`` (a ``Waiter`` until its ``Slot``) -> the engine
(``pump.EngineStream``) -> ``AdmissionGate.release``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

from controller.admission.classes import PriorityBounds, PriorityRefused
from controller.clock import monotonic
from controller.engine.frontend.prompts import generate_calls, prompt_tokens

ENTRY_POINTS = ("create_chat_completion", "create_completion", "create_responses")
"""Serving methods that take (request, raw_request) and call ``_preflight`` before generating."""
PRIORITY_HEADER = "x-vllm-priority"
_UNSET = object()


@dataclass
class Claim:
    """One ``generate()`` call of a request, as its stream has yet to run it."""

    priority: int
    """What it runs at: the ticket's resolved priority, else the call's own within the bounds."""
    from_pending: bool
    """It holds one of the pending places admission counted for the request."""
    admitted_as: int | None = None
    """The priority its pending place was counted under (None: ``priority``)."""
    weight: int = 1
    """The sequences it runs in the engine (its sampling's ``n``): its slot's weight."""
    slot: Any = None
    """A gate slot acquired for it ahead of its stream (a streamed request), until the stream takes it."""
    started: bool = False
    """Its stream has begun: the slot is the stream's to release."""


@dataclass
class Ticket:
    priority: int = 0
    resolved: bool = False
    """The priority was resolved from the client's header or body by a wrapped entry point: every
    call of the request runs at it (beam search calls ``generate()`` without one)."""
    served: bool = False
    """A call of the request has held a slot: its TTFT has happened, a later call (a beam search
    step) is not refused by it nor counts its deadline from the request's arrival."""
    admitted: bool = False
    """Passed check_admission: counted as pending in its class."""
    calls: int = 1
    """generate() calls the request will make (a completion's prompts: ``prompts.generate_calls``)."""
    prompt_tokens: int | None = None
    """Tokens its prompts prefill, where the raw request tells (``prompts.prompt_tokens``)."""
    pending: int = 0
    """Pending places it holds in the gate that no generate() call has taken yet."""
    retry_after_s: int | None = None
    """Set when the gate refused the request: the Retry-After of its answer."""
    bounds: PriorityBounds = field(default_factory=PriorityBounds)
    """[admission] min_priority and default_priority in force when the request arrived."""
    claims: list[Claim] = field(default_factory=list)
    """Its ``generate()`` calls so far."""
    arrived_mono: float = field(default_factory=monotonic)
    """When the request reached the server (the middleware made its ticket): a TTFT bound counts
    from here, the front end's work before the gate included."""


current: ContextVar[Ticket | None] = ContextVar("autopilot_ticket", default=None)


def header_priority(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The priority header of a raw ASGI request, as vLLM reads it (bad values read 0); None
    without one."""
    for name, value in headers:
        if name.lower() == PRIORITY_HEADER.encode():
            try:
                return int(value)
            except ValueError:
                return 0
    return None


def asked_priority(serving: Any, request: Any, raw_request: Any) -> int | str | None:
    """The priority the client named, as vLLM resolves it (the header, else the body), or None."""
    header = raw_request.headers.get(PRIORITY_HEADER) if raw_request is not None else None
    if header is not None:
        return str(header)
    if not hasattr(request, "model_fields_set"):  # not one of vLLM's request models: its own reading
        return int(serving._get_priority(request, raw_request))
    return int(request.priority) if "priority" in request.model_fields_set else None


def tokenizer_of(serving: Any) -> Any:
    """The served model's tokenizer for counting prompts, once per serving object; None without one
    (``skip_tokenizer_init``) or on a serving object without a renderer. vLLM's renderer encodes in
    its own worker thread, and a fast tokenizer used from two threads at once can fail ("Already
    borrowed"): vLLM's thread-safe wrapper (a pool of copies) is used as it is, any other is copied."""
    own = getattr(serving, "_autopilot_tokenizer", _UNSET)
    if own is _UNSET:
        try:
            source = serving.renderer.tokenizer
            safe = source is None or isinstance(source, ThreadSafeHFTokenizerMixin)
            own = source if safe else copy.deepcopy(source)
        except Exception:  # no renderer, or a tokenizer that cannot be copied: no prefill term
            own = None
        with contextlib.suppress(AttributeError):
            serving._autopilot_tokenizer = own
    return own


def _wrap(serving: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def entry(request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        ticket = current.get()
        if ticket is not None:
            try:
                priority = ticket.bounds.resolve(asked_priority(serving, request, raw_request))
            except PriorityRefused as exc:  # before the gate: it never counts, queues or sheds
                return serving.create_error_response(str(exc), param="priority")
            ticket.priority, ticket.resolved = priority, True
            if hasattr(request, "priority"):
                request.priority = priority  # what vLLM reads when no header names it
            ticket.calls = generate_calls(request)
            if getattr(getattr(serving, "engine_client", None), "counts_prompts", True):
                ticket.prompt_tokens = await prompt_tokens(request, tokenizer_of(serving))
        result = await method(request, raw_request, *args, **kwargs)
        # A stream, not sent yet, over our client (another streams as vLLM does)
        ahead = getattr(getattr(serving, "engine_client", None), "acquire_ahead", None)
        if ticket is not None and ticket.claims and inspect.isasyncgen(result) and ahead is not None:
            refusal = await ahead(ticket)
            if refusal is not None:  # nothing was sent: the stream is dropped before its first step
                return serving.create_error_response(refusal)
        return result

    entry.__autopilot_wrapped__ = True  # type: ignore[attr-defined]
    return entry


class QuietRefusals(logging.Filter):
    """vLLM logs a traceback when a stream ends in an exception. A gate refusal there (a request
    retried after an engine failure whose deadline then passed) is expected, answered with an error
    event and counted in the metrics: its record is dropped instead of printing a traceback per
    refused request."""

    def __init__(self, refusal: type[BaseException]) -> None:
        super().__init__()
        self.refusal = refusal

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.refusal))


def capture_priorities(app_state: Any, refusal: type[BaseException] | None = None) -> int:
    """Wrap the entry points of every generating serving object in ``app_state``; returns how many
    (run again after ``init_app_state`` builds new ones). With ``refusal``, the serving modules'
    loggers drop that exception's tracebacks (``QuietRefusals``)."""
    wrapped = 0
    for serving in list(vars(app_state).get("_state", {}).values()):
        if not hasattr(serving, "_get_priority") or not hasattr(serving, "_preflight"):
            continue
        logger = logging.getLogger(type(serving).__module__)
        if refusal is not None and not any(isinstance(f, QuietRefusals) for f in logger.filters):
            logger.addFilter(QuietRefusals(refusal))
        for name in ENTRY_POINTS:
            method = getattr(serving, name, None)
            if method is not None and not getattr(method, "__autopilot_wrapped__", False):
                setattr(serving, name, _wrap(serving, method))
                wrapped += 1
    return wrapped
