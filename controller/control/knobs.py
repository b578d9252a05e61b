"""The knobs on the controller's side: ``policies/knobs.py``'s type, names and bounds, and the map from
each knob to the actuator's setter that moves it.

The type and the bounds live in ``policies/knobs.py`` (the policies clamp the batch cap and may import
nothing from ``controller/``); this module re-exports them for the rooms that may not import
``policies/`` (the engine's runtime) and for the normalize stage, so each knob's bounds are computed
by one function everywhere. A fourth knob is a ``Knob`` there, a setter on ``Knobs`` and a line in
``setters`` here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from controller.control.actuator import Knobs
from policies.knobs import (
    ADMISSION_LIMIT,
    BATCH_CAP,
    KNOBS,
    TOKEN_BUDGET,
    TOKEN_BUDGET_MIN,
    Bounds,
    Knob,
    budget_bounds,
    cap_bounds,
    token_budget_bounds,
)

__all__ = [
    "ADMISSION_LIMIT",
    "BATCH_CAP",
    "KNOBS",
    "TOKEN_BUDGET",
    "TOKEN_BUDGET_MIN",
    "Bounds",
    "Knob",
    "Setter",
    "budget_bounds",
    "cap_bounds",
    "setters",
    "token_budget_bounds",
]

Setter = Callable[[int], Awaitable[int]]
"""Moves one knob; returns the value that took effect (the engine clamps to its bounds)."""


def setters(actuator: Knobs) -> dict[str, Setter]:
    """Knob name -> the setter that moves it, for the loop's apply stage, in ``KNOBS``' order."""

    async def admission_limit(limit: int) -> int:
        actuator.set_admission_limit(limit)
        return limit

    return {
        ADMISSION_LIMIT.name: admission_limit,
        BATCH_CAP.name: actuator.set_batch_cap,
        TOKEN_BUDGET.name: actuator.set_token_budget,
    }
