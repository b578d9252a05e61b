"""A gateway's per-request objectives, read off the request's headers, and the reason a refusal
names in the answer's headers.

A gateway in front of a fleet (llm-d's inference scheduler, the Gateway API inference extension's
endpoint picker, or any proxy) may give each request a TTFT bound and a TPOT objective in
milliseconds. The daemon accepts llm-d's names, its older ones (still what the inference extension's
SLO-aware routing guide documents) and its own, in any case:

| objective | ours | llm-d | llm-d, older |
| --- | --- | --- | --- |
| TTFT bound | ``x-autopilot-ttft-ms`` | ``x-llm-d-slo-ttft-ms`` | ``x-slo-ttft-ms`` |
| TPOT objective | ``x-autopilot-tpot-ms`` | ``x-llm-d-slo-tpot-ms`` | ``x-slo-tpot-ms`` |

A value is a decimal number of milliseconds at least 0 (``500``, ``250.5``); 0 or an empty value
names no objective, as llm-d reads them. Where several of one objective's headers come, the tightest
holds. Anything else is the client's error: ``priority.py`` answers it 400 before the gate.

The TTFT bound reaches the gate (``admission/ttft.py``), where it only tightens the class's own. The
gate has no use for a single request's TPOT (a slot's pace is the batch's, which the loop steers for
every request at once): it is checked and kept in the request's context, and changes nothing.

A refusal (429 or 503 from the gate) names its reason in two headers: ours, ``x-autopilot-refusal``,
with the gate's own reason (the metric label: ``queue_full``, ``expected_wait``, ``deadline``,
``shed``, ``restart_wait``, ``engine_unavailable``, ``shutting_down``), and llm-d's
``x-llm-d-request-dropped-reason`` with the nearest of llm-d's own values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TTFT_HEADERS = ("x-autopilot-ttft-ms", "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""Headers naming a request's TTFT bound in milliseconds: ours, llm-d's, llm-d's older name."""
TPOT_HEADERS = ("x-autopilot-tpot-ms", "x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
"""Headers naming a request's TPOT objective in milliseconds, likewise."""

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
    """A header's value is not a number of milliseconds; ``header`` names it."""

    def __init__(self, header: str, value: str) -> None:
        super().__init__(
            f"{header}: {value!r} is not a number of milliseconds; send a decimal number at least 0 "
            "(for example 500), or 0 for no objective"
        )
        self.header = header


@dataclass(frozen=True)
class Objectives:
    """What a request's headers ask of its latency (None: nothing asked)."""

    ttft_s: float | None = None
    """Its TTFT bound, seconds: the tightest of its TTFT headers."""
    tpot_s: float | None = None
    """Its TPOT objective, seconds: checked and kept, no rule reads it."""
    error: ObjectiveRefused | None = None
    """The first header whose value is not a number of milliseconds (answered 400)."""


def _seconds(header: str, value: str) -> float | None:
    text = value.strip()
    if not text:
        return None
    if not _MILLISECONDS.fullmatch(text):
        raise ObjectiveRefused(header, value)
    ms = float(text)
    if not math.isfinite(ms):  # more digits than a float holds
        raise ObjectiveRefused(header, value)
    return ms / 1000.0 if ms > 0 else None


def _tightest(headers: list[tuple[bytes, bytes]], names: tuple[str, ...]) -> float | None:
    found = [
        _seconds(name.decode("latin-1").lower(), value.decode("latin-1"))
        for name, value in headers
        if name.decode("latin-1").lower() in names
    ]
    named = [s for s in found if s is not None]
    return min(named) if named else None


def from_headers(headers: list[tuple[bytes, bytes]]) -> Objectives:
    """A raw ASGI request's objectives; a malformed value is kept as ``error``, not raised, so
    that vLLM's handler answers it with its own 400 (``priority.py``)."""
    try:
        return Objectives(_tightest(headers, TTFT_HEADERS), _tightest(headers, TPOT_HEADERS))
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
