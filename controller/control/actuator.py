"""The only code that moves knobs (STYLE.md 13): the admission limit on the gate, the batch cap and
the token budget through the engine host. The loop's apply stage and a reload's new ``[admission]
limit`` both come here, so a knob never moves behind the loop's back."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

TOKEN_BUDGET_MIN = 16
"""The lowest per-step token budget the engine (and the twin) takes while chunked prefill is on. vLLM
progresses with any budget >= 1 (a prompt is chunked, a decode needs one token), but a step that
issues a handful of tokens costs its whole fixed overhead for almost no work; 16 also leaves room for
a speculative decode's draft tokens. Defined here, once, for the engine's scheduler subclass and the
twin alike."""


def token_budget_bounds(
    max_num_batched_tokens: int, chunked_prefill: bool, max_model_len: int, spec_tokens: int = 0
) -> tuple[int, int]:
    """[floor, ceiling] of the per-step token budget, in the engine and in the twin alike.

    The ceiling is ``max_num_batched_tokens``: it sizes the model runner's input buffers, and vLLM's
    scheduler checks every step against its ``input_budget`` (that same number) apart from the budget.
    The floor is ``TOKEN_BUDGET_MIN`` (and at least one decode with its draft tokens). Without chunked
    prefill vLLM stops admitting when the next waiting prompt is longer than the budget (its
    ``break`` in ``schedule()``), so a budget under ``max_model_len`` could hold the waiting queue
    forever: the floor is then ``max_model_len``, which vLLM's own config check keeps within the
    ceiling (``max_num_batched_tokens >= max_model_len`` without chunked prefill)."""
    floor = max(TOKEN_BUDGET_MIN, 1 + spec_tokens) if chunked_prefill else max_model_len
    return min(floor, max_num_batched_tokens), max_num_batched_tokens


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
