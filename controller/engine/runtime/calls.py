"""Every utility call into one engine's EngineCore, each with a deadline.

vLLM's engine client answers a utility call (``call_utility_async``: the batch cap, the token budget,
the step drain) with a future that only the EngineCore's answer resolves: an EngineCore that hangs
(stopped by a signal, a deadlocked worker) or dies never answers, and neither its shutdown nor vLLM's
engine monitor fails the future (``core_client.py``: ``_process_utility_output`` is its one writer).
Awaited plainly, such a call waits for ever, and the control loop's tick with it. So here:

* Each call waits at most ``deadline_s``; past it the caller gets ``EngineUnanswered`` and the
  engine counts as *silent*. The late call is kept waiting: its answer says the engine is back.
* While the engine is silent, a question (the step drain) fails at once instead of waiting again,
  so a tick waits on a hung engine once, not at every tick; a setting is sent without waiting (the
  EngineCore runs utility calls in the order sent, so the latest value wins if it ever steps again).
* ``close`` (the engine retired, or counted failed) ends every wait on it at once.

Whether a silent engine is hung is the liveness check's call (``lifecycle/liveness.py``, with its own
``[guard] stall_timeout_s``): a deadline here only keeps callers from waiting on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from controller.clock import Clock, monotonic

log = structlog.get_logger(__name__)

CALL_DEADLINE_MIN_S = 10.0
"""The least a utility call waits for its answer. The EngineCore answers between two steps, so a call
waits for the step running when it arrives: well under a second on a GPU, a few seconds for a long
prefill chunk on a small CPU. Ten seconds leaves room for that, and a late answer costs little (one
tick's steps lost, a setting sent without its answer)."""

STEPS_PER_DEADLINE = 3.0
"""The deadline is at least this many of the engine's longest step seen (a call may arrive just after
a step starts, and an async scheduler runs one step ahead), for engines whose steps are long."""


class EngineUnanswered(Exception):
    """A utility call that got no answer: past its deadline, the engine silent, or its engine
    retired. ``reason`` is a stable string for logs and metrics."""

    def __init__(self, method: str, reason: str, detail: str) -> None:
        super().__init__(f"{method}: {detail} ({reason})")
        self.method = method
        self.reason = reason


class EngineCalls:
    """The utility calls into one engine (all its EngineCores, under data parallelism)."""

    def __init__(
        self,
        core: Any,
        generation: int,
        clock: Clock = monotonic,
        timer: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.core = core
        """vLLM's engine client (``AsyncLLM.engine_core``)."""
        self.generation = generation
        self._clock = clock
        self._timer = timer
        """Waits out a deadline (a test's fake resolves it when told)."""
        self.longest_step_s = 0.0
        """The longest step this engine took, as drained: it sizes the deadline."""
        self._waits: set[asyncio.Future[Any]] = set()
        self._late: tuple[str, float] | None = None
        """The call past its deadline still awaited, and when it was sent (``_clock``)."""
        self._sent: dict[str, asyncio.Future[Any]] = {}
        """The setting of each kind sent without waiting while the engine is silent."""
        self.closed: str | None = None
        """Why the calls were closed; every call then fails at once."""

    @property
    def deadline_s(self) -> float:
        return max(CALL_DEADLINE_MIN_S, STEPS_PER_DEADLINE * self.longest_step_s)

    def saw_step(self, step_s: float) -> None:
        self.longest_step_s = max(self.longest_step_s, step_s)

    def silence(self) -> dict[str, Any] | None:
        """For /state: the call the engine has not answered past its deadline, and for how long."""
        if self._late is None:
            return None
        method, sent_mono = self._late
        return {"method": method, "waiting_s": round(self._clock() - sent_mono, 1)}

    async def ask(self, method: str, *args: Any, every_engine: bool = False) -> Any:
        """The engine's answer (every engine's, in a list, with ``every_engine``), within the
        deadline; raises ``EngineUnanswered`` otherwise (module docstring)."""
        if self.closed is not None:
            raise EngineUnanswered(method, "engine_retired", self.closed)
        if self._late is not None:
            late, sent_mono = self._late
            detail = f"the engine has not answered {late} for {self._clock() - sent_mono:.1f}s"
            raise EngineUnanswered(method, "engine_silent", detail)
        sent_mono, deadline = self._clock(), self.deadline_s
        call = self._send(method, args, every_engine)
        timer = asyncio.ensure_future(self._timer(deadline))
        try:
            await asyncio.wait({call, timer}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller gave up (shutdown): nobody waits on the call
            call.cancel()
            raise
        finally:
            timer.cancel()
        if not call.done():
            self._late = (method, sent_mono)
            call.add_done_callback(self._answered_late)
            log.error(
                "engine_call_unanswered",
                reason="engine_call_timeout",
                method=method,
                deadline_s=deadline,
                generation=self.generation,
            )
            raise EngineUnanswered(method, "engine_call_timeout", f"no answer within {deadline:g}s")
        if call.cancelled():
            raise EngineUnanswered(method, "engine_retired", self.closed or "the call was cancelled")
        return call.result()

    async def put(self, method: str, value: int) -> int:
        """Set ``value`` (the batch cap, the token budget); the value in force as the engine answers,
        else ``value`` itself: sent, it applies when the engine steps again, and where the engine is
        retired the host hands it to the next one."""
        if self.closed is None and self._late is not None:
            if (previous := self._sent.pop(method, None)) is not None:
                previous.cancel()  # a newer value of the same setting follows it
            self._sent[method] = self._send(method, (value,), False)
            return value
        try:
            return int(await self.ask(method, value))
        except EngineUnanswered:
            return value

    def close(self, why: str) -> None:
        """No one waits on this engine any more: every call in flight ends now."""
        if self.closed is not None:
            return
        self.closed = why
        self._late = None
        for waiting in list(self._waits):
            waiting.cancel()
        self._sent.clear()

    def _send(self, method: str, args: tuple[Any, ...], every_engine: bool) -> asyncio.Future[Any]:
        ask = self.core.call_utility_all_async if every_engine else self.core.call_utility_async
        call = asyncio.ensure_future(ask(method, *args))
        self._waits.add(call)
        call.add_done_callback(self._forget)
        return call

    def _forget(self, call: asyncio.Future[Any]) -> None:
        self._waits.discard(call)
        if not call.cancelled():
            call.exception()  # retrieved: a late call's error is not "never retrieved" noise

    def _answered_late(self, call: asyncio.Future[Any]) -> None:
        if call.cancelled() or self._late is None:
            return  # closed: the engine is gone, not back
        method, sent_mono = self._late
        self._late = None
        log.warning(
            "engine_answered_late",
            reason="engine_call_answered",
            method=method,
            after_s=round(self._clock() - sent_mono, 1),
            generation=self.generation,
        )
