"""Who gets the next slot: strict priority between the classes, aging, and slots with a weight
(a request's ``n`` sequences, a stream's prompts taken together: ``queues.Slot.weight``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.admission.queues import ClassQueue, Waiter


def next_queue(
    order: Sequence[ClassQueue],
    now: float,
    aging_s: float,
    free_for: Callable[[ClassQueue], int],
    need: Callable[[ClassQueue, int], int],
    own_free: Callable[[ClassQueue], int],
) -> ClassQueue | None:
    """The class (of ``order``, most urgent first) whose head gets the next slot, or None: an aged
    class first (a head that has waited ``aging_s``, in a class granted nothing for as long; the
    oldest such head), else the most urgent class that may take a slot (``free_for`` it > 0).

    A head whose weight (``need``: its weight as it would be granted) does not fit yet holds back
    the classes after it, except in their own unused reservations (``own_free``): lighter requests
    behind it would otherwise take each slot it frees and starve it."""
    ranked: list[tuple[tuple[int, int], ClassQueue, Waiter]] = []
    for rank, q in enumerate(order):
        w = q.head()
        if w is None or free_for(q) <= 0:
            continue
        aged = aging_s > 0 and now - w.enqueued_mono >= aging_s and now - q.last_grant_mono >= aging_s
        ranked.append(((0, w.seq) if aged else (1, rank), q, w))
    blocked = False
    for _, q, w in sorted(ranked, key=lambda entry: entry[0]):
        room = min(own_free(q), free_for(q)) if blocked else free_for(q)
        if need(q, w.weight) <= room:
            return q
        blocked = True
    return None


def capped(asked: int, q: ClassQueue, order: Sequence[ClassQueue], limit: int) -> int:
    """The weight a slot of class ``q`` is granted with: ``asked``, capped at what the class can ever
    hold (``limit`` less the other classes' reservations, read at each grant: the limit moves). A
    request asking more runs alone rather than waiting for room that never comes, and is not
    refused for a limit the control loop may raise a tick later."""
    most = limit - sum(o.spec.reserved_slots(limit) for o in order if o is not q)
    return max(1, min(asked, most))
