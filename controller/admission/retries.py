"""Which arrivals are retries of a request the gate refused: the ids of recent refusals, bounded in
time, in number and in the tries each excuses, so that the offered load counts a client's request
once per replica, not once per try (``control/capacity.py``).

A router in front of the fleet retries a 429 or 503 on the next replica (vllm-router: up to 5
attempts in about half a second), and a client may retry after ``Retry-After``; each try carries the
client's ``X-Request-Id`` when it sent one (docs/fleet.md). A refusal of a new request excuses the
next ``tries`` arrivals of its id within ``window_s`` (``take``): each of them that is refused in
turn is a retry, not new demand. What an id cannot tell apart is a retry from another request
that reuses the id (a fixed id in an SDK's config, a gateway's shared one), so the excuse is
bounded on both sides: an excused arrival that is admitted is demand (work this replica serves is
never hidden), and the refusal of an excused try excuses nothing more (the window is not renewed),
so an id reused for every request hides at most ``tries`` of each ``tries + 1`` of its refused
requests, never the rest. A request without an id is new demand on every try.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from controller.clock import Clock

WINDOW_S = 60.0
"""How long a refusal excuses tries: the longest ``Retry-After`` the gate gives
(``AdmissionGate._retry_after``), so a client that honours it and comes back with the same id is
still a retry."""
TRIES = 4
"""How many later arrivals of its id one refusal excuses: vllm-router's retries after its first
attempt (5 attempts in all, which a prefix-aware policy may send to this one replica:
docs/fleet.md), so a router's request counts once here however its attempts fall."""
MAX_IDS = 10_000
"""How many refused ids are remembered at most (the oldest refusal is forgotten first): about 60 s
of refusals at 170 a second; beyond it a retry counts as new demand again, as without an id."""


@dataclass(slots=True)
class _Refusal:
    refused_mono: float
    """When the refusal of a new request with this id was answered (the gate's clock)."""
    tries_left: int
    """Later arrivals of the id it still excuses."""


class RefusedIds:
    """The ids of new requests refused within the last ``window_s``, at most ``max_ids`` of them,
    each kept by its ``hash`` (a fixed size whatever the header's length) with the time of that
    refusal and the tries it still excuses (at most ``tries``)."""

    def __init__(
        self, clock: Clock, window_s: float = WINDOW_S, max_ids: int = MAX_IDS, tries: int = TRIES
    ) -> None:
        if window_s <= 0 or max_ids < 1 or tries < 1:
            raise ValueError(
                f"window_s must be > 0, max_ids and tries >= 1, got {window_s}, {max_ids} and {tries}"
            )
        self._clock = clock
        self.window_s, self.max_ids, self.tries = window_s, max_ids, tries
        self._refused: OrderedDict[int, _Refusal] = OrderedDict()
        """hash(id) -> its refusal, oldest refusal first."""

    def __len__(self) -> int:
        return len(self._refused)

    def take(self, request_id: str) -> bool:
        """An arrival of ``request_id``: True when a refusal of its id within the last ``window_s``
        (one exactly ``window_s`` ago has expired) still excuses a try, which this arrival takes,
        admitted or not; the caller tells ``refused`` which its refusal, if any, was."""
        self._forget_expired()
        refusal = self._refused.get(hash(request_id))
        if refusal is None or refusal.tries_left == 0:
            return False
        refusal.tries_left -= 1
        return True

    def refused(self, request_id: str) -> None:
        """The gate refused a new request ``request_id`` (one whose arrival ``take`` did not
        excuse): the next ``tries`` arrivals of its id within ``window_s`` are excused. The refusal
        of an excused try is not reported here: it renews nothing."""
        key = hash(request_id)
        self._refused.pop(key, None)
        self._refused[key] = _Refusal(self._clock(), self.tries)
        while len(self._refused) > self.max_ids:
            self._refused.popitem(last=False)

    def _forget_expired(self) -> None:
        horizon = self._clock() - self.window_s
        while self._refused and next(iter(self._refused.values())).refused_mono <= horizon:
            self._refused.popitem(last=False)
