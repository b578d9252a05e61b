"""Per-step cost figures measured inside the EngineCore.

Why here, in the scheduler subclass, rather than from vLLM's stat logger: the stat logger runs in the
API process, once per batch of outputs that reaches it over IPC, so its times include the IPC hop and
the output handler's own scheduling, and one call may cover several engine steps (or none). Its
``SchedulerStats`` has no count of the prefill tokens a step issued. The scheduler sees each step's
``SchedulerOutput`` (the exact tokens given to each request) and runs on the EngineCore's own
clock, right around the forward pass, so the figures are the step's own.

This module has no vLLM import: the scheduler subclass (``scheduler.py``) hands it the objects it
reads, and the unit tests hand it stand-ins.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

StepTuple = tuple[float, int, int, int, float, float]
"""An ``EngineStep``'s time and cost figures as plain values (t_mono, prefill_tokens, decode_seqs,
kv_tokens, step_s, gap_s): what the utility call returns through msgpack."""

RING = 4096
"""Steps kept between two drains: the daemon drains every tick (about a second), and even a fast
GPU runs well under 4096 steps a second; past it the oldest are dropped."""


class ScheduledRequest(Protocol):
    """What the meter reads of vLLM's ``Request`` (after ``schedule()`` advanced it)."""

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class Scheduled(Protocol):
    """What the meter reads of vLLM's ``SchedulerOutput``."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def total_num_scheduled_tokens(self) -> int: ...


class StepMeter:
    """One step's figures, from ``schedule()`` to ``update_from_output()`` of the same output.

    ``scheduled`` runs at the end of ``schedule()`` (``num_computed_tokens`` already counts the step's
    tokens, so the computed count before the step is that minus the scheduled tokens):

    * prefill tokens: the tokens given to requests whose computed count was below their prompt
      (a chunk of a new prompt, or a preempted request's recompute of prompt and output);
    * decode sequences: the other scheduled requests (one token, plus draft tokens with spec decode);
    * KV tokens: each scheduled request's computed tokens plus its new ones (the twin's
      ``kv_tokens_read``: what the step's attention reads).

    ``finished`` runs after ``update_from_output()`` of that output (outputs are matched by identity).
    ``step_s`` is the step's end minus the later of its schedule start and the previous step's end: in
    the synchronous engine that is schedule + forward pass + update; with async scheduling (vLLM's
    batch queue) the next step is scheduled while this one runs, and measuring from the previous
    step's end gives each step the time the engine spent on it, not its wait behind the one before.
    ``gap_s`` is the time from the previous step's end to this one's schedule start, for a step that
    decodes (a sequence ran on from the step before, so the engine was not idle): the engine loop's
    own work between steps, and on a shared CPU the time the process waited for a core. 0 for a step
    of prefills alone (the engine may have idled before it) and under async scheduling (no gap).
    Steps that scheduled no tokens (no forward pass) are not recorded.
    """

    def __init__(self, maxlen: int = RING, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._maxlen = maxlen
        self.steps: deque[StepTuple] = deque(maxlen=maxlen)
        self._pending: dict[int, tuple[float, int, int, int, float]] = {}
        self._last_end = float("-inf")

    def scheduled(self, output: Scheduled, requests: Mapping[str, ScheduledRequest], t_start: float) -> None:
        if output.total_num_scheduled_tokens <= 0:
            return
        prefill = decode = kv = 0
        for req_id, n in output.num_scheduled_tokens.items():
            req = requests[req_id]
            before = req.num_computed_tokens - n
            kv += before + n
            if before < req.num_prompt_tokens:
                prefill += n
            else:
                decode += 1
        if len(self._pending) >= self._maxlen:  # outputs never updated: not in vLLM's loop, but bounded
            self._pending.clear()
        ran_on = decode > 0 and self._last_end > float("-inf")  # a sequence ran on from a step before
        gap = max(0.0, t_start - self._last_end) if ran_on else 0.0
        self._pending[id(output)] = (t_start, prefill, decode, kv, gap)

    def finished(self, output: Scheduled) -> None:
        pending = self._pending.pop(id(output), None)
        if pending is None:
            return
        t_end = self.clock()
        t_start, prefill, decode, kv, gap = pending
        self.steps.append((t_end, prefill, decode, kv, t_end - max(t_start, self._last_end), gap))
        self._last_end = t_end

    def drain(self) -> list[StepTuple]:
        """The steps since the last drain, oldest first; the ring is empty afterwards."""
        out = list(self.steps)
        self.steps.clear()
        return out
