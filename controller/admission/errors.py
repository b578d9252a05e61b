"""The gate's refusals: what a request that does not get a slot is answered (429 or 503), raised by
the gate, its shedding and deadlines, and by the guard and liveness watch when no engine can serve."""

from __future__ import annotations

OWN_BOUND = "own_ttft_bound"
"""The reason of a refusal that only the request's own TTFT bound (a gateway's header) made: a 429
for that request, which the outcome ledger does not set against the loop's margins."""


class GateRejected(Exception):
    """The request is refused before it starts (HTTP 429 or 503); ``reason`` is the metric label."""

    def __init__(self, message: str, status: int, retry_after_s: int, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s
        self.reason = reason

    def fresh(self) -> GateRejected:
        """A new refusal with the same answer. A stored refusal (the gate refusing everyone during
        shutdown or while no engine can serve) is never raised itself: each raise would append its
        frames to the one shared traceback, which then grows with every refused request."""
        return GateRejected(self.message, self.status, self.retry_after_s, self.reason)


def shutting_down() -> GateRejected:
    """The answer to every request once the daemon drains."""
    return GateRejected("the server is shutting down; retry on another instance", 503, 1, "shutting_down")
