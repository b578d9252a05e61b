"""The gate's refusals: who is turned away before a slot, and why (HTTP 503).

Three states, each a stored ``GateRejected`` raised afresh per request (``GateRejected.fresh``):
shutdown (new requests refused, queued ones go on; ``close`` refuses those too), the restart budget
spent (``refuse_all``: everyone without a slot, until ``reopen``), and no engine able to serve while
the guard rebuilds one (``refuse_new``: new requests get 503 with Retry-After instead of queueing
without bound; those already queued keep their place).
"""

from __future__ import annotations

from controller.admission.queues import GateRejected, Waiter, shutting_down


class Refusals:
    """Mixed into ``AdmissionGate``, which provides the waiters and how one is dropped."""

    def __init__(self) -> None:
        self._refuse_new: GateRejected | None = None
        self._refuse_queued: GateRejected | None = None
        self._unavailable: GateRejected | None = None
        """The refusal ``refuse_new`` set (lifted only by ``refuse_new(None)``)."""

    def _live_waiters(self) -> list[Waiter]:
        raise NotImplementedError

    def _drop(self, w: Waiter, error: GateRejected) -> None:
        raise NotImplementedError

    def stop_admitting(self) -> None:
        """Refuse new requests (503); queued and in-flight ones go on (graceful drain)."""
        self._refuse_new = shutting_down()

    def close(self) -> None:
        """Refuse new requests; those already queued are refused too (503), in-flight ones finish."""
        self.refuse_all(shutting_down())

    def refuse_all(self, error: GateRejected) -> None:
        """Refuse every request that has no slot yet with ``error``, until ``reopen``."""
        self._refuse_new = self._refuse_queued = error
        for w in self._live_waiters():
            self._drop(w, error.fresh())

    def reopen(self) -> None:
        """Admit again after ``refuse_all`` (the engine is back)."""
        self._refuse_new = None
        self._refuse_queued = None

    def refuse_new(self, error: GateRejected | None) -> None:
        """Refuse new requests with ``error`` while no engine can serve (queued ones keep waiting);
        None admits again. Never replaces or lifts a refusal it did not set (shutdown's)."""
        if error is not None and self._refuse_new is None:
            self._refuse_new = self._unavailable = error
        elif error is None and self._refuse_new is not None and self._refuse_new is self._unavailable:
            self._refuse_new = self._unavailable = None
