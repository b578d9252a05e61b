"""The one adapter on vLLM's serving objects: the client's priority, resolved against the
``[admission]`` bounds as soon as vLLM has parsed the request, and its objectives' headers checked.

What it does: each generating serving object's ``_check_model(request)`` (the first thing every
generating handler does with its parsed request, before ``_preflight`` and before rendering) is
wrapped so that the request's priority is resolved as vLLM reads it (the ``X-Vllm-Priority`` header,
else the body's ``priority``): a request naming none gets ``[admission] default_priority``; one more
urgent than ``most_urgent_priority``, past int64 or not an integer is answered 400 there (vLLM's own error
answer for that handler, before the gate: it never counts, queues or sheds). The resolved value is
kept in the request's context (context.py): every ``generate()`` call of the request runs at it,
including the calls that name none (beam search's steps) or pass the body's raw value (the batch
route). A request whose headers (``objectives.py``) name a class moves to the nearest priority of
that class's range, within the bounds: a class whose whole range is more urgent than
``most_urgent_priority`` is answered 400 there, naming the header, as is a TTFT or TPOT header that is not a
number of milliseconds and a class of ours the table does not hold. ``_check_model`` itself runs
unchanged.

Why vLLM offers no other hook: ``generate()`` gets an int where a body that names no priority reads
0 like one that asks for 0; only the parsed request model (``model_fields_set``) tells them apart,
and ``generate()`` and ``check_admission`` never see it.

Routes it covers: every handler of a serving object with ``_preflight`` (vLLM's generating base)
that calls ``_check_model``, which in vLLM 0.32 is every generating one: chat, completions,
responses, the batch chat route, ``/inference``'s generate, scoring, structured decisions, speech
to text, and what converts into them (``/invocations``, Anthropic's messages and Cohere's chat over
the chat handler). A handler without it (a future route) still passes every rule in
``GovernedEngineClient.generate()``; only its priority is the call's own kept within the bounds
(``PriorityBounds.clamp``, then moved into the named class where that class is within the bounds:
clamped, not refused, and a body naming none runs at 0, not at the default).

It also drops the tracebacks vLLM logs for the gate's refusals ending a stream (``QuietRefusals``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from controller.admission.classes import PriorityRefused
from controller.engine.frontend import context


def asked_priority(request: Any, header: str | None) -> int | str | None:
    """The priority the client named, as vLLM resolves it (the header, else the body), or None."""
    if header is not None:
        return header
    fields = getattr(request, "model_fields_set", None)
    if fields is None:  # not one of vLLM's request models: its attribute, where it has one
        return getattr(request, "priority", None)
    return int(request.priority) if "priority" in fields else None


def _wrap(serving: Any, original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(original)
    async def check_model(request: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = context.current.get()
        if ctx is not None and not ctx.resolved:
            if (refused := ctx.objectives.error) is not None:
                return serving.create_error_response(str(refused), param=refused.header)
            try:
                asked = ctx.bounds.resolve(asked_priority(request, ctx.header))
            except PriorityRefused as exc:
                return serving.create_error_response(str(exc), param="priority")
            if (refused := ctx.objectives.class_refusal(ctx.bounds.most_urgent)) is not None:
                return serving.create_error_response(str(refused), param=refused.header)
            ctx.priority = ctx.objectives.within_class(asked, ctx.bounds.most_urgent)
            ctx.resolved = True
        return await original(request, *args, **kwargs)

    check_model.__autopilot_wrapped__ = True  # type: ignore[attr-defined]
    return check_model


class QuietRefusals(logging.Filter):
    """vLLM logs a traceback when a stream ends in an exception. A gate refusal there is expected,
    answered (the middleware's 429 before the first chunk, else an error event) and counted in the
    metrics: its record is dropped instead of printing a traceback per refused request."""

    def __init__(self, refusal: type[BaseException]) -> None:
        super().__init__()
        self.refusal = refusal

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.refusal))


def resolve_priorities(app_state: Any, refusal: type[BaseException] | None = None) -> int:
    """Wrap ``_check_model`` of every generating serving object in ``app_state``; returns how many
    (run again after ``init_app_state`` builds new ones). With ``refusal``, the serving modules'
    loggers drop that exception's tracebacks (``QuietRefusals``)."""
    wrapped = 0
    for serving in list(vars(app_state).get("_state", {}).values()):
        method = getattr(serving, "_check_model", None)
        if method is None or not hasattr(serving, "_preflight"):
            continue
        logger = logging.getLogger(type(serving).__module__)
        if refusal is not None and not any(isinstance(f, QuietRefusals) for f in logger.filters):
            logger.addFilter(QuietRefusals(refusal))
        if not getattr(method, "__autopilot_wrapped__", False):
            serving._check_model = _wrap(serving, method)
            wrapped += 1
    return wrapped
