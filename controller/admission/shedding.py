"""Shedding: when the whole gate is full, a more urgent request takes the place of the newest
waiters of the least urgent classes, which are refused with 429 (reason ``shed``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.admission.errors import GateRejected
from controller.admission.queues import ClassQueue, Waiter


def shed_order(
    lower: Sequence[ClassQueue], count: int, retry_after: Callable[[float], int]
) -> list[tuple[Waiter, GateRejected]]:
    """The ``count`` waiters to refuse for a more urgent request, with their refusals: the least
    urgent class first, in it the least urgent priority, then the newest arrival. None when fewer
    than ``count`` wait: shedding some and refusing the request anyway would help nobody."""
    victims: list[Waiter] = []
    for q in reversed(lower):
        live = sorted(q.live(), key=lambda w: (w.priority, w.seq), reverse=True)
        victims.extend(live[: count - len(victims)])
        if len(victims) >= count:
            break
    if len(victims) < count:
        return []
    refused = []
    for w in victims:
        why = f"shed: the gate is full and more urgent requests arrived ({w.queue.spec.name} sheds first)"
        refused.append((w, GateRejected(f"{why}; retry later", 429, retry_after(1 + w.queue.queued), "shed")))
    return refused
