"""``[admission.classes.NAME]``: the priority classes a file declares, checked and ordered for the gate
(``controller/admission/classes.py``, which uses them as they are).

Each class table's keys are ``Key``s (``fields.py``); a class name is a metric label. Together the
classes' ranges must cover every priority exactly once, so each request has one class, and their
reserved shares may total at most the whole admission limit.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from controller.admission.classes import DEFAULT_CLASSES, PriorityClass
from controller.config.fields import Key, suggest

KEYS: dict[str, Key] = {
    key.name: key
    for key in (
        Key("min_priority", int, -(2**31), 2**31 - 1, "Lowest priority of the class (inclusive)."),
        Key("max_priority", int, -(2**31), 2**31 - 1, "Highest priority of the class (inclusive)."),
        Key("max_queue", int, 0, 1_000_000, "Requests of the class that may wait for a slot."),
        Key("queue_deadline_s", float, 0.001, 86_400, "Longest wait for a slot, in seconds."),
        Key("reserved_share", float, 0.0, 1.0, "Fraction of the admission limit only this class may use."),
        Key(
            "slo_ttft_s",
            float,
            0.001,
            86_400,
            "This class's time-to-first-token bound, overriding [slo] ttft_s.",
        ),
        Key(
            "slo_tpot_s",
            float,
            0.0001,
            60,
            "This class's time-per-output-token bound, overriding [slo] tpot_s.",
        ),
        Key(
            "order",
            str,
            doc="Who of the class's waiters goes first: arrival, or the shortest prompt.",
            choices=("arrival", "shortest"),
        ),
    )
}
"""A class table's keys, in the reference's order (``reference.py``)."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
"""A class name: it labels the class's metrics."""


def parse_classes(raw: Any, errors: list[str]) -> tuple[PriorityClass, ...]:
    """``[admission.classes]`` -> classes ordered by priority range; problems go to ``errors``."""
    if not isinstance(raw, dict) or not raw:
        errors.append("[admission] classes must be tables: write [admission.classes.NAME] per class")
        return DEFAULT_CLASSES
    classes = []
    for name, table in raw.items():
        where = f"admission.classes.{name}"
        if not _NAME.match(name):
            errors.append(f"[{where}]: class names are metric labels; use lowercase letters, digits, '_'")
        if not isinstance(table, dict):
            errors.append(f"[{where}]: must be a table of {', '.join(KEYS)}")
            continue
        kwargs: dict[str, Any] = {}
        for key, value in table.items():
            if key not in KEYS:
                errors.append(f"[{where}] unknown key '{key}': {suggest(key, list(KEYS))}")
                continue
            problems = KEYS[key].check(where, value)
            errors.extend(problems)
            if not problems:
                kwargs[key] = KEYS[key].typed(value)
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
