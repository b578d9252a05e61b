"""What SLO steering reads from the file: the ``[slo]`` table, the per-class overrides in
``[admission.classes.NAME]`` (``slo_ttft_s``, ``slo_tpot_s``) and the step-cost model's seed profile
(``[control] cost_profile``).

``[slo]`` is optional: without it there is no SLO to steer to (the ``slo`` policy requires one), and a
class may not override what is not there. With it, both ``ttft_s`` and ``tpot_s`` are required (a
request is good when both hold) and every class resolves to its own bound or the table's.

A class's ``queue_deadline_s`` above its TTFT bound is neither an error nor a warning: the bound is
derived. A request that waited past its TTFT bound can no longer be good, so under SLO steering its
longest useful wait is ``min(queue_deadline_s, TTFT bound)`` (``wait_bounds``, shown per class as
``wait_bound_s``); the deadline alone still governs under the other policies, which is why the default
file keeps its 5 s / 60 s deadlines beside its 5 s TTFT bound. A deadline below the bound refuses earlier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from controller.admission.classes import PriorityClass
from controller.config.fields import Key, suggest
from policies.slo_targets import SloBound, SloTargets

__all__ = ["SloTargets", "cost_profile_errors", "describe_slo", "parse_slo", "wait_bounds"]

KEYS: dict[str, Key] = {
    key.name: key
    for key in (
        Key(
            "ttft_s",
            float,
            0.001,
            86_400,
            "Longest time to first token of a good request, queueing included, in seconds.",
        ),
        Key("tpot_s", float, 0.0001, 60, "Longest mean time per output token of a good request, in seconds."),
    )
}
"""``[slo]`` keys, both required."""


def parse_slo(raw: Any, classes: Sequence[PriorityClass], errors: list[str]) -> SloTargets | None:
    """``[slo]`` resolved for ``classes`` (None when the file has no ``[slo]``); problems go to ``errors``
    (an ``slo`` that is not a table is reported by the loader)."""
    if raw is None:
        errors.extend(_orphan_overrides(classes))
        return None
    if not isinstance(raw, dict):
        return None
    values: dict[str, float] = {}
    for key, value in raw.items():
        if key not in KEYS:
            errors.append(f"[slo] unknown key '{key}': {suggest(key, list(KEYS))}")
            continue
        problems = KEYS[key].check("slo", value)
        errors.extend(problems)
        if not problems:
            values[key] = KEYS[key].typed(value)
    for key in KEYS.values():
        if key.name not in raw:
            errors.append(
                f"[slo] {key.name} is missing: a request is good when both ttft_s and tpot_s hold; "
                f"set it. {key.doc}"
            )
    if len(values) < len(KEYS):
        return None
    default = SloBound(values["ttft_s"], values["tpot_s"])
    return SloTargets(default, tuple((c.name, _resolve(c, default)) for c in classes))


def _resolve(cls: PriorityClass, default: SloBound) -> SloBound:
    ttft = default.ttft_s if cls.slo_ttft_s is None else cls.slo_ttft_s
    return SloBound(ttft, default.tpot_s if cls.slo_tpot_s is None else cls.slo_tpot_s)


def _orphan_overrides(classes: Sequence[PriorityClass]) -> list[str]:
    """A class override without ``[slo]``: the other classes would have no bound."""
    return [
        f"[admission.classes.{c.name}] {key} = {value}: a class SLO overrides the [slo] table, and there "
        "is none; add [slo] with ttft_s and tpot_s (the bound of the other classes), or drop the key"
        for c in classes
        for key, value in (("slo_ttft_s", c.slo_ttft_s), ("slo_tpot_s", c.slo_tpot_s))
        if value is not None
    ]


def wait_bounds(slo: SloTargets, classes: Sequence[PriorityClass]) -> dict[str, float]:
    """The longest a request of each class may usefully wait in the gate: its queue deadline, or its
    TTFT bound where that is shorter (past it the request can no longer be good)."""
    return {c.name: min(c.queue_deadline_s, slo.for_class(c.name).ttft_s) for c in classes}


def describe_slo(slo: SloTargets | None, classes: Sequence[PriorityClass]) -> dict[str, Any] | None:
    """``[slo]`` as check-config and /state show it: the table, every class resolved, and its wait
    bound; None without ``[slo]``."""
    if slo is None:
        return None
    shown = slo.as_dict()
    waits = wait_bounds(slo, classes)
    shown["classes"] = {name: {**b._asdict(), "wait_bound_s": waits[name]} for name, b in slo.by_class}
    return shown


def cost_profile_errors(name: str) -> list[str]:
    """``[control] cost_profile`` must name a profile that loads ('' = no seed)."""
    if not name:
        return []
    # Lazy: only a config that names a profile reads one (its tables load numpy).
    from controller.profiles.load import ProfileError, load_profile

    try:
        load_profile(name)
    except ProfileError as exc:
        return [f"[control] cost_profile = {name!r}: {exc}"]
    return []
