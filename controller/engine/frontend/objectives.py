"""A gateway's per-request objectives, read off the request's headers: its TTFT bound, its TPOT
objective and its class; and the reason a refusal names in the answer's headers.

A gateway in front of a fleet (llm-d's inference scheduler, the Gateway API inference extension's
endpoint picker, or any proxy) may give each request a TTFT bound and a TPOT objective in
milliseconds, and name its class. The daemon accepts llm-d's header names, their older ones (still
what the inference extension reads and its SLO-aware routing guide documents) and its own, in any
case:

| objective | ours | llm-d | llm-d, older |
| --- | --- | --- | --- |
| TTFT bound | ``x-autopilot-ttft-ms`` | ``x-llm-d-slo-ttft-ms`` | ``x-slo-ttft-ms`` |
| TPOT objective | ``x-autopilot-tpot-ms`` | ``x-llm-d-slo-tpot-ms`` | ``x-slo-tpot-ms`` |
| class | ``x-autopilot-class`` | ``x-llm-d-inference-objective`` | ``x-gateway-inference-objective`` |

A TTFT or TPOT value is a decimal number of milliseconds at least 0 (``500``, ``250.5``); 0 or an
empty value names no objective, as llm-d reads them. Where several of one objective's headers come,
the tightest holds. Anything else is the client's error: ``priority.py`` answers it 400 before the
gate.

The TTFT bound reaches the gate (``admission/ttft.py``), where it only tightens the class's own, and
the outcome ledger (``control/outcomes.py``), which judges the request's TTFT by that same tighter
bound. The gate has no use for a single request's TPOT (a slot's pace is the batch's, which the loop
steers for every request at once): it is checked and kept in the request's context, and the ledger
judges the TPOT by the class's bound alone (a miss of a tighter header TPOT is one nothing in the
daemon could have avoided, and counted as a miss it would cut the slo policy's margin, the limit of
every request, for an objective one request asked).

The class: llm-d's endpoint picker reads the name of the request's ``InferenceObjective`` resource
from its header and passes the header on to the model server. A value names one of the daemon's
classes (``[admission.classes.NAME]``, in any case); where ours comes it decides, else llm-d's
current name, else its older one (the order llm-d reads them in). A named class gives the request
its priority: the one it asked (``X-Vllm-Priority`` or the body's ``priority``, else
``[admission] default_priority``) moved to the nearest priority of the class's range, so the class's
queue, deadline and ``[slo]`` bound hold for it, and a TTFT header only tightens that bound. It never
loosens ``[admission]``: a class whose whole range is more urgent than ``most_urgent_priority`` is
answered 400 (as such a priority is), and any class a header names is one the client could reach by
naming a priority, behind the same API key.

A name that is no class of the daemon's: under our header it is the client's error, answered 400
naming the known classes (a client that sends our header means our table, and a typo served in
another class would go unseen). Under llm-d's headers it is ignored, as llm-d's endpoint picker
itself serves an objective it does not know at its default priority: those headers carry the names
of the gateway's ``InferenceObjective`` resources, which need not match our classes, and the picker
passes them on to every replica, so a 400 would refuse a whole fleet's traffic over a naming
difference. The daemon reads the objective's name only: its priority lives in the resource, which
the daemon does not see (and counts the other way: higher is more urgent there, lower in vLLM).

A refusal (429 or 503 from the gate) names its reason in two headers: ours, ``x-autopilot-refusal``,
with the gate's own reason (the metric label: ``queue_full``, ``expected_wait``, ``deadline``,
``shed``, ``restart_wait``, ``engine_unavailable``, ``shutting_down``), and llm-d's
``x-llm-d-request-dropped-reason`` with the nearest of llm-d's own values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from controller.admission.classes import PRIORITY_MAX, PRIORITY_MIN, PriorityClass, shown

TTFT_HEADERS = ("x-autopilot-ttft-ms", "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""Headers naming a request's TTFT bound in milliseconds: ours, llm-d's, llm-d's older name."""
TPOT_HEADERS = ("x-autopilot-tpot-ms", "x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
"""Headers naming a request's TPOT objective in milliseconds, likewise."""
CLASS_HEADER = "x-autopilot-class"
"""Our header naming a request's class: an unknown name is answered 400."""
LLMD_CLASS_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
"""llm-d's headers naming a request's ``InferenceObjective`` (current, then the inference extension's
older name): read as a class name where ours is absent; an unknown name is ignored."""

REFUSAL_HEADER = "x-autopilot-refusal"
"""The answer's header naming why the gate refused the request (the gate's reason)."""
LLMD_DROPPED_HEADER = "x-llm-d-request-dropped-reason"
"""llm-d's header for why a request was dropped, with llm-d's values (``LLMD_REASONS``)."""

LLMD_REASONS = {
    "queue_full": "rejected-saturated",
    "expected_wait": "rejected-saturated",
    "shed": "rejected-saturated",
    "deadline": "rejected-ttl-expired",
    "restart_wait": "rejected-no-endpoints",
    "engine_unavailable": "rejected-no-endpoints",
    "shutting_down": "rejected-shutting-down",
}
"""The gate's reasons in llm-d's words. A shed request was queued, never sent to the engine: llm-d's
``evicted-*`` values are for requests killed after dispatch, so it reads ``rejected-saturated``."""

_MILLISECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")


class ObjectiveRefused(ValueError):
    """A header's value this server does not accept (answered 400); ``header`` names it."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(f"{header}: {message}")
        self.header = header


def _not_milliseconds(header: str, value: str) -> ObjectiveRefused:
    return ObjectiveRefused(
        header,
        f"{shown(value)} is not a number of milliseconds; send a decimal number at least 0 (for example "
        "500), or 0 for no objective",
    )


@dataclass(frozen=True)
class Objectives:
    """What a request's headers ask of its latency, and the class they name (None: nothing asked)."""

    ttft_s: float | None = None
    """Its TTFT bound, seconds: the tightest of its TTFT headers."""
    tpot_s: float | None = None
    """Its TPOT objective, seconds: checked and kept, no rule reads it."""
    cls: PriorityClass | None = None
    """The class its headers name (``x-autopilot-class``, else llm-d's), None: none named (its
    priority alone chooses it)."""
    cls_header: str | None = None
    """The header that named ``cls``."""
    error: ObjectiveRefused | None = None
    """The first header this server does not accept (answered 400): a value that is not a number of
    milliseconds, or a class of ours that is not in the class table."""

    def within_class(self, priority: int, most_urgent: int = PRIORITY_MIN) -> int:
        """``priority`` moved to the nearest priority of ``cls``'s range (unchanged without a class),
        then kept no more urgent than ``most_urgent`` (``[admission] most_urgent_priority``): the bound wins
        over the class, so the result is outside the class only where the class's whole range is more
        urgent than the bound (``class_refusal`` says so)."""
        if self.cls is not None:
            lo = PRIORITY_MIN if self.cls.min_priority is None else self.cls.min_priority
            hi = PRIORITY_MAX if self.cls.max_priority is None else self.cls.max_priority
            priority = min(max(priority, lo), hi)
        return max(priority, most_urgent)

    def class_refusal(self, most_urgent: int) -> ObjectiveRefused | None:
        """Why the named class cannot be granted under ``most_urgent``: its range lies wholly more
        urgent than it; None where it can (or none is named)."""
        if self.cls is None or self.cls.max_priority is None or self.cls.max_priority >= most_urgent:
            return None
        return ObjectiveRefused(
            self.cls_header or CLASS_HEADER,
            f"class {self.cls.name!r} runs at priorities up to {self.cls.max_priority}, more urgent than "
            f"this server accepts ({most_urgent} is the most urgent: [admission] most_urgent_priority); "
            "name a less urgent class",
        )


def _seconds(header: str, value: str) -> float | None:
    text = value.strip()
    if not text:
        return None
    if not _MILLISECONDS.fullmatch(text):
        raise _not_milliseconds(header, value)
    ms = float(text)
    if not math.isfinite(ms):  # more digits than a float holds
        raise _not_milliseconds(header, value)
    return ms / 1000.0 if ms > 0 else None


def _tightest(headers: list[tuple[bytes, bytes]], names: tuple[str, ...]) -> float | None:
    found = [
        _seconds(name.decode("latin-1").lower(), value.decode("latin-1"))
        for name, value in headers
        if name.decode("latin-1").lower() in names
    ]
    named = [s for s in found if s is not None]
    return min(named) if named else None


def _first(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The first non-empty value of header ``name`` (lowercased, stripped); None without one."""
    for key, value in headers:
        if key.decode("latin-1").lower() == name and (text := value.decode("latin-1").strip()):
            return text.lower()
    return None


def _named_class(
    headers: list[tuple[bytes, bytes]], classes: Sequence[PriorityClass]
) -> tuple[PriorityClass | None, str | None]:
    """The class the headers name and the header that named it; ``ObjectiveRefused`` where ours
    names a class not in ``classes``."""
    by_name = {c.name: c for c in classes}
    if (name := _first(headers, CLASS_HEADER)) is not None:
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            raise ObjectiveRefused(
                CLASS_HEADER, f"{shown(name)} is not a class of this server; send one of: {known}"
            )
        return by_name[name], CLASS_HEADER
    for header in LLMD_CLASS_HEADERS:
        if (name := _first(headers, header)) is not None:
            return by_name.get(name), (header if name in by_name else None)
    return None, None


def from_headers(headers: list[tuple[bytes, bytes]], classes: Sequence[PriorityClass] = ()) -> Objectives:
    """A raw ASGI request's objectives, its class looked up in ``classes`` (the gate's, in force when
    it arrived); a value this server does not accept is kept as ``error``, not raised, so that
    vLLM's handler answers it with its own 400 (``priority.py``)."""
    try:
        cls, cls_header = _named_class(headers, classes)
        return Objectives(_tightest(headers, TTFT_HEADERS), _tightest(headers, TPOT_HEADERS), cls, cls_header)
    except ObjectiveRefused as exc:
        return Objectives(error=exc)


def refusal_headers(reason: str | None) -> list[tuple[bytes, bytes]]:
    """The headers naming why the gate refused a request; none without a reason."""
    if not reason:
        return []
    out = [(REFUSAL_HEADER.encode(), reason.encode("latin-1"))]
    if reason in LLMD_REASONS:
        out.append((LLMD_DROPPED_HEADER.encode(), LLMD_REASONS[reason].encode()))
    return out
