"""The only code that moves knobs (STYLE.md 13): the admission limit on the gate, the batch cap and
the token budget through the engine host. The loop's apply stage (through ``knobs.setters``) and a
reload's new ``[admission] limit`` both come here, so a knob never moves behind the loop's back; the
knobs' names and bounds are ``knobs.py``'s."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol


class Knobs(Protocol):
    """What the loop's apply stage moves; ``Actuator`` in the daemon, the twin's engine in the sim."""

    def set_admission_limit(self, limit: int) -> None: ...

    def set_batch_cap(self, cap: int) -> Awaitable[int]:
        """Move the batch cap; the value that took effect (the engine clamps to max_num_seqs)."""

    def set_token_budget(self, budget: int) -> Awaitable[int]:
        """Move the per-step token budget; the value that took effect (the engine clamps to its
        [floor, max_num_batched_tokens])."""


class LimitedGate(Protocol):
    def set_limit(self, limit: int) -> None: ...


class CappedEngine(Protocol):
    """The engine host, without importing it (it imports vLLM)."""

    async def set_batch_cap(self, cap: int) -> int: ...

    async def set_token_budget(self, budget: int) -> int: ...


class Actuator:
    """Moves the admission limit on the gate, the batch cap and the token budget in the running engine."""

    def __init__(self, gate: LimitedGate, engine: CappedEngine) -> None:
        self._gate = gate
        self._engine = engine

    def set_admission_limit(self, limit: int) -> None:
        self._gate.set_limit(limit)

    async def set_batch_cap(self, cap: int) -> int:
        return await self._engine.set_batch_cap(cap)

    async def set_token_budget(self, budget: int) -> int:
        return await self._engine.set_token_budget(budget)
