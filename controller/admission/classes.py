"""Priority classes of the admission gate, the priority a request may ask for, and the measured
completion rate.

A class owns a contiguous range of vLLM's ``priority`` values (lower is more urgent). Classes are
ranked by their range: the class with the lowest priorities is served first and shed last. No vLLM
import: ``controller/config/classes_table.py`` builds these from ``[admission.classes]`` (and checks
them), the gate uses them as they are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from controller.clock import Clock


@dataclass(frozen=True)
class PriorityClass:
    """One ``[admission.classes.NAME]`` table."""

    name: str
    """Label of the class in metrics, /state and logs."""
    min_priority: int | None = None
    """Lowest ``priority`` of the class (inclusive); None: no lower bound."""
    max_priority: int | None = None
    """Highest ``priority`` of the class (inclusive); None: no upper bound."""
    max_queue: int = 256
    """Requests of this class that may wait for a slot; more are refused with 429."""
    queue_deadline_s: float = 10.0
    """Longest wait for a slot. Refused at once when the expected wait is longer; 429 when it expires."""
    reserved_share: float = 0.0
    """Fraction of the admission limit only this class may use (the rest is shared)."""
    slo_ttft_s: float | None = None
    """This class's TTFT bound; None: ``[slo] ttft_s`` (``controller/config/slo_table.py`` resolves it)."""
    slo_tpot_s: float | None = None
    """This class's TPOT bound; None: ``[slo] tpot_s``."""
    order: str = "arrival"
    """Who of the class's waiters (of one priority) gets the next slot: ``arrival`` (first come,
    first served) or ``shortest`` (the fewest prompt tokens first). When more wait than can start
    within their deadline, ``shortest`` serves more of them in time (a short prompt's prefill
    delays those behind it less); a long prompt may then wait past its deadline and be refused
    (429) under sustained load. Opt-in: it trades fairness to long prompts for the count."""

    @property
    def shortest_first(self) -> bool:
        return self.order == "shortest"

    def contains(self, priority: int) -> bool:
        lo_ok = self.min_priority is None or priority >= self.min_priority
        return lo_ok and (self.max_priority is None or priority <= self.max_priority)

    def reserved_slots(self, limit: int) -> int:
        return int(self.reserved_share * limit)


PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
"""vLLM's ``priority`` is an int64 inside the engine: a value beyond it fails there, after the gate."""


class PriorityRefused(ValueError):
    """A request's priority is not one this server accepts (answered 400, before the gate)."""


SHOWN_CHARS = 40
"""The most of a client's value an error message shows (``shown``)."""


def shown(value: object) -> str:
    """A client's value as an answer names it (a string quoted): cut to ``SHOWN_CHARS`` with its
    length, so a 400 never echoes a header or a number whole, however long the client made it."""
    if isinstance(value, str):
        return (
            repr(value)
            if len(value) <= SHOWN_CHARS
            else f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
        )
    try:
        text = str(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number of more than 4300 digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} digits)"


@dataclass(frozen=True)
class PriorityBounds:
    """What a client may ask for: ``[admission] most_urgent_priority`` and ``default_priority``."""

    most_urgent: int = PRIORITY_MIN
    """The lowest (most urgent) priority a request may name; lower is refused."""
    default: int = 0
    """The priority of a request that names none."""

    def resolve(self, asked: int | str | None) -> int:
        """The request's priority: ``asked`` (the header's text or the body's value), else the default."""
        if asked is None:
            return self.default
        try:
            value = int(asked)  # the header's text as vLLM reads it; the body's value is an int already
        except ValueError:
            raise PriorityRefused(f"priority {shown(asked)} is not an integer") from None
        if not self.most_urgent <= value <= PRIORITY_MAX:
            raise PriorityRefused(
                f"priority {shown(value)} is out of range: this server accepts {self.most_urgent} "
                f"(most urgent) to {PRIORITY_MAX}"
            )
        return value

    def clamp(self, asked: int | None) -> int:
        """A priority where the client's own value cannot be told from vLLM's default (a
        ``generate()`` call, where vLLM passes 0 for a body that names none): kept within what this
        server accepts rather than refused, since a refusal would answer 400 to clients that named
        nothing. None: the default."""
        if asked is None:
            return self.default
        return min(max(int(asked), self.most_urgent), PRIORITY_MAX)


DEFAULT_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass("interactive", max_priority=0, max_queue=256, queue_deadline_s=5.0),
    PriorityClass("batch", min_priority=1, max_queue=1024, queue_deadline_s=60.0),
)


class GateEvents(Protocol):
    """What the gate reports per class (the daemon turns it into metrics)."""

    def admitted(self, cls: str, wait_s: float) -> None: ...

    def rejected(self, cls: str, reason: str) -> None: ...

    def timed_out(self, cls: str, wait_s: float) -> None: ...


class NoEvents:
    def admitted(self, cls: str, wait_s: float) -> None:
        pass

    def rejected(self, cls: str, reason: str) -> None:
        pass

    def timed_out(self, cls: str, wait_s: float) -> None:
        pass


class CompletionRate:
    """Completions per second over the last ``window_s``, and how long each held its slot, on an
    injected clock.

    None until two completions are in the window: without a measurement the gate does not refuse on
    expected wait (the queue bound and the deadline still hold).
    """

    def __init__(self, clock: Clock, window_s: float = 10.0, max_samples: int = 4096) -> None:
        self._clock = clock
        self.window_s = window_s
        self._times: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (completed, held s)
        self._held_sum = 0.0

    def record(self, held_s: float = 0.0) -> None:
        if len(self._times) == self._times.maxlen:
            self._held_sum -= self._times[0][1]
        self._times.append((self._clock(), held_s))
        self._held_sum += held_s

    def _trim(self) -> float:
        now = self._clock()
        while self._times and self._times[0][0] < now - self.window_s:
            self._held_sum -= self._times.popleft()[1]
        if not self._times:
            self._held_sum = 0.0  # no float drift survives an idle window
        return now

    def per_second(self) -> float | None:
        now = self._trim()
        if len(self._times) < 2 or now <= self._times[0][0]:
            return None
        return len(self._times) / (now - self._times[0][0])

    def mean_held_s(self) -> float | None:
        """How long the window's completions held their slot, on average (None below two)."""
        self._trim()
        if len(self._times) < 2:
            return None
        return self._held_sum / len(self._times)

    def service_per_second(self, in_flight: int) -> float | None:
        """The rate at which slots free up: the measured completions, or, when more is in flight than
        that rate can account for, ``in_flight`` over the mean hold (Little's law). At light load the
        completions follow the arrivals, not the engine's capacity, and a queue that forms behind
        ``in_flight`` running requests drains at their pace, not at the arrivals' of the last 10 s."""
        rate = self.per_second()
        held = self.mean_held_s()
        if rate is None or held is None or held <= 0 or in_flight <= 0:
            return rate
        return max(rate, in_flight / held)
