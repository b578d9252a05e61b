"""Which arrivals are retries of a request the gate refused: the ids of recent refusals, bounded in
time and in number, so that the offered load counts a client's request once per replica, not once
per try (``control/capacity.py``).

A router in front of the fleet retries a 429 or 503 on the next replica (vllm-router: up to 5
attempts in about half a second), and a client may retry after ``Retry-After``; each try carries the
client's ``X-Request-Id`` when it sent one (docs/fleet.md). An arrival whose id was refused here
within the last ``window_s`` is not new demand. A request without an id is new demand on every try.
"""

from __future__ import annotations

from collections import OrderedDict

from controller.clock import Clock

WINDOW_S = 60.0
"""How long a refused id is remembered: the longest ``Retry-After`` the gate gives
(``AdmissionGate._retry_after``), so a client that honours it and comes back with the same id is
still a retry."""
MAX_IDS = 10_000
"""How many refused ids are remembered at most (the oldest refusal is forgotten first): about 60 s
of refusals at 170 a second; beyond it a retry counts as new demand again, as without an id."""


class RefusedIds:
    """The ids refused within the last ``window_s``, at most ``max_ids`` of them, each kept by its
    ``hash`` (a fixed size whatever the header's length) with the time of its latest refusal."""

    def __init__(self, clock: Clock, window_s: float = WINDOW_S, max_ids: int = MAX_IDS) -> None:
        if window_s <= 0 or max_ids < 1:
            raise ValueError(f"window_s must be > 0 and max_ids >= 1, got {window_s} and {max_ids}")
        self._clock = clock
        self.window_s, self.max_ids = window_s, max_ids
        self._refused: OrderedDict[int, float] = OrderedDict()
        """hash(id) -> when it was last refused, oldest refusal first."""

    def __len__(self) -> int:
        return len(self._refused)

    def refused(self, request_id: str) -> None:
        """The gate refused ``request_id`` now: its arrivals within ``window_s`` are retries."""
        key = hash(request_id)
        self._refused.pop(key, None)
        self._refused[key] = self._clock()
        while len(self._refused) > self.max_ids:
            self._refused.popitem(last=False)

    def is_retry(self, request_id: str) -> bool:
        """``request_id`` was refused within the last ``window_s`` (a refusal exactly ``window_s``
        ago has expired)."""
        self._forget_expired()
        return hash(request_id) in self._refused

    def _forget_expired(self) -> None:
        horizon = self._clock() - self.window_s
        while self._refused and next(iter(self._refused.values())) <= horizon:
            self._refused.popitem(last=False)
