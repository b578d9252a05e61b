"""Open connections per client address, for a server's per-peer cap: the data plane's
(``engine/frontend/wire.py``) and the control plane's (``admin/server.py``). One host must not fill a
server's connections for everyone else."""

from __future__ import annotations

import ipaddress
from collections import Counter

import structlog

from controller.clock import Clock, monotonic

log = structlog.get_logger(__name__)

REFUSAL_LOG_EVERY_S = 10.0
"""A peer refused over and over is logged once per this long, with the count since: a flood of
connections must not become a flood of log lines."""


def peer_key(host: str) -> str:
    """The address a connection is counted under: IPv4 as it is (an IPv4-mapped IPv6 address too),
    IPv6 by its /64, which one host holds whole."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Peers:
    """Open connections per peer (``peer_key``), at most ``cap`` each, of one server (``name``)."""

    def __init__(self, cap: int, name: str, clock: Clock = monotonic) -> None:
        self.cap, self.name, self.clock = cap, name, clock
        self.open: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        """When each refused peer was last logged (``clock``)."""

    def admit(self, peer: str) -> bool:
        """Counts a new connection of ``peer``; False, and not counted, when it has ``cap`` open."""
        if self.open[peer] >= self.cap:
            self._note_refusal(peer, "per_peer")
            return False
        self.open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        """A connection ``admit`` counted has closed."""
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    def note_full(self) -> None:
        """A connection refused because the server holds its cap in all (logged as ``peer`` "*")."""
        self._note_refusal("*", "max_connections")

    def _note_refusal(self, peer: str, reason: str) -> None:
        self._refused[peer] += 1
        now = self.clock()
        if now - self._logged.get(peer, now - REFUSAL_LOG_EVERY_S) < REFUSAL_LOG_EVERY_S:
            return
        self._logged = {p: t for p, t in self._logged.items() if now - t < REFUSAL_LOG_EVERY_S}
        self._logged[peer] = now
        refused = self._refused.pop(peer)
        log.warning("connections_refused", server=self.name, reason=reason, peer=peer, refused=refused)
