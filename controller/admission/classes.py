"""Priority classes of the admission gate, their validation, and the measured completion rate.

A class owns a contiguous range of vLLM's ``priority`` values (lower is more urgent). Classes are
ranked by their range: the class with the lowest priorities is served first and shed last. No vLLM
import: config.py builds these from ``[admission.classes]``, the gate uses them as they are.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

_KEYS: dict[str, tuple[type, float, float, str]] = {
    "min_priority": (int, -(2**31), 2**31 - 1, "lowest priority of the class (inclusive)"),
    "max_priority": (int, -(2**31), 2**31 - 1, "highest priority of the class (inclusive)"),
    "max_queue": (int, 0, 1_000_000, "requests of the class that may wait for a slot"),
    "queue_deadline_s": (float, 0.001, 86_400, "longest wait for a slot, in seconds"),
    "reserved_share": (float, 0.0, 1.0, "fraction of the admission limit only this class may use"),
    "slo_ttft_s": (float, 0.001, 86_400, "this class's time-to-first-token bound, overriding [slo] ttft_s"),
    "slo_tpot_s": (float, 0.0001, 60, "this class's time-per-output-token bound, overriding [slo] tpot_s"),
}
CHOICE_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "order": (
        ("arrival", "shortest"),
        "who of the class's waiters goes first: arrival, or the shortest prompt",
    ),
}
"""Keys whose value is one of a few names: (the names, the doc)."""
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def parse_classes(raw: Any, errors: list[str]) -> tuple[PriorityClass, ...]:
    """``[admission.classes]`` -> classes ordered by priority range; problems go to ``errors``."""
    import difflib

    if not isinstance(raw, dict) or not raw:
        errors.append("[admission] classes must be tables: write [admission.classes.NAME] per class")
        return DEFAULT_CLASSES
    classes = []
    for name, table in raw.items():
        where = f"[admission.classes.{name}]"
        if not _NAME.match(name):
            errors.append(f"{where}: class names are metric labels; use lowercase letters, digits, '_'")
        if not isinstance(table, dict):
            errors.append(f"{where}: must be a table of {', '.join([*_KEYS, *CHOICE_KEYS])}")
            continue
        kwargs: dict[str, Any] = {}
        for key, value in table.items():
            if key in CHOICE_KEYS:
                names, doc = CHOICE_KEYS[key]
                if value in names:
                    kwargs[key] = value
                else:
                    choices = ", ".join(map(repr, names))
                    errors.append(f"{where} {key} = {value!r}: must be one of {choices} ({doc})")
                continue
            if key not in _KEYS:
                known = [*_KEYS, *CHOICE_KEYS]
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
                errors.append(f"{where} unknown key '{key}': {hint}")
                continue
            want, lo, hi, doc = _KEYS[key]
            ok = isinstance(value, want) or (want is float and isinstance(value, int))
            if not ok or isinstance(value, bool):
                errors.append(f"{where} {key} = {value!r}: must be {want.__name__} ({doc})")
            elif not lo <= value <= hi:
                errors.append(f"{where} {key} = {value!r}: out of range; use a value in [{lo}, {hi}] ({doc})")
            else:
                kwargs[key] = float(value) if want is float else value
        classes.append(PriorityClass(name, **kwargs))
    if not classes:
        return DEFAULT_CLASSES  # every table was unusable: reported above
    errors.extend(_range_errors(classes))
    return tuple(sorted(classes, key=_lower_bound))


def _lower_bound(c: PriorityClass) -> float:
    return float("-inf") if c.min_priority is None else c.min_priority


def _range_errors(classes: Sequence[PriorityClass]) -> list[str]:
    """The ranges must cover every priority exactly once, so each request has one class."""
    errors = []
    for c in classes:
        if c.min_priority is not None and c.max_priority is not None and c.min_priority > c.max_priority:
            errors.append(
                f"[admission.classes.{c.name}] min_priority = {c.min_priority} > max_priority = "
                f"{c.max_priority}: swap them"
            )
    if errors:
        return errors
    ordered = sorted(classes, key=_lower_bound)
    if ordered[0].min_priority is not None:
        errors.append(
            f"[admission.classes.{ordered[0].name}] min_priority = {ordered[0].min_priority}: lower "
            "priorities would have no class; drop min_priority from the most urgent class"
        )
    if ordered[-1].max_priority is not None:
        errors.append(
            f"[admission.classes.{ordered[-1].name}] max_priority = {ordered[-1].max_priority}: higher "
            "priorities would have no class; drop max_priority from the least urgent class"
        )
    for a, b in itertools.pairwise(ordered):
        if a.max_priority is None or b.min_priority is None or b.min_priority != a.max_priority + 1:
            errors.append(
                f"[admission.classes.{a.name}] and [admission.classes.{b.name}]: their priority ranges "
                f"must meet without gap or overlap; set {b.name}.min_priority = {a.name}.max_priority + 1"
            )
    share = sum(c.reserved_share for c in classes)
    if share > 1.0:
        errors.append(
            f"[admission.classes] reserved_share adds up to {share:g}: the shares must total at most 1"
        )
    return errors


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
