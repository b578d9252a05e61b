"""The three knobs the control loop moves: one type, one name each, and their bounds computed once.

A ``Knob`` carries its one public name (``name``: the ``Decision`` and ``Observation`` field, the key in
``/state``, ``decisions.jsonl`` and the twin's time series, the ``knob`` label of
``autopilot_decisions_total``), the setting vLLM gives it (``vllm``) and its gauge (``gauge``).

The bounds live here, in ``policies/``, because the policies clamp the batch cap too and may import
nothing from ``controller/``; ``controller/control/knobs.py`` re-exports them to the engine's scheduler
subclass, its host, the twin's engine and the normalize stage, which all clamp with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Knob:
    """One knob the control loop moves."""

    name: str
    """Its one name in code, ``/state``, the decisions log and the metric label."""
    vllm: str | None
    """vLLM's name for the setting (its engine argument and ``SchedulerConfig`` field); None for a
    knob of the daemon's own."""
    gauge: str
    """The ``autopilot_*`` gauge of the value in force (named after vLLM's setting where it has one)."""


ADMISSION_LIMIT = Knob("admission_limit", None, "autopilot_admission_limit")
"""Requests the admission gate lets into the engine at once; the gate's, not vLLM's."""
BATCH_CAP = Knob("batch_cap", "max_num_active_seqs", "autopilot_max_num_active_seqs")
"""Requests RUNNING in the engine at once (vLLM's scheduler holds it as ``max_num_active_reqs``)."""
TOKEN_BUDGET = Knob("token_budget", "max_num_scheduled_tokens", "autopilot_max_num_scheduled_tokens")
"""The most tokens the engine's scheduler issues in one step."""
KNOBS = (ADMISSION_LIMIT, BATCH_CAP, TOKEN_BUDGET)
"""In the order a tick applies them."""


class Bounds(NamedTuple):
    """[floor, ceiling] of a knob."""

    floor: int
    ceiling: int

    def clamp(self, value: int) -> int:
        """``value`` moved into the bounds (the floor wins should it be above the ceiling)."""
        return max(self.floor, min(int(value), self.ceiling))


def cap_bounds(max_num_seqs: int, floor: int = 1) -> Bounds:
    """[floor, max_num_seqs] of the batch cap: ``max_num_seqs`` sizes the engine's batch (vLLM
    refuses ``max_num_active_seqs`` above it), 1 is the least that serves anything; a higher floor
    (``[control] max_num_active_seqs_min``, a policy's ``min_cap``) yields to the ceiling."""
    return Bounds(min(floor, max_num_seqs), max_num_seqs)


def budget_bounds(max_num_batched_tokens: int, floor: int) -> Bounds:
    """[floor, max_num_batched_tokens] of the token budget, ``floor`` as ``token_budget_bounds``
    computes it for the engine in force (the floor yields to the ceiling)."""
    return Bounds(min(floor, max_num_batched_tokens), max_num_batched_tokens)


TOKEN_BUDGET_MIN = 16
"""The lowest per-step token budget the engine (and the twin) takes while chunked prefill is on. vLLM
progresses with any budget >= 1 (a prompt is chunked, a decode needs one token), but a step that
issues a handful of tokens costs its whole fixed overhead for almost no work; 16 also leaves room for
a speculative decode's draft tokens."""


def token_budget_bounds(
    max_num_batched_tokens: int, chunked_prefill: bool, max_model_len: int, spec_tokens: int = 0
) -> Bounds:
    """[floor, ceiling] of the per-step token budget of an engine so configured, in the engine and in
    the twin alike.

    The ceiling is ``max_num_batched_tokens``: it sizes the model runner's input buffers, and vLLM's
    scheduler checks every step against its ``input_budget`` (that same number) apart from the budget.
    The floor is ``TOKEN_BUDGET_MIN`` (and at least one decode with its draft tokens). Without chunked
    prefill vLLM stops admitting when the next waiting prompt is longer than the budget (its
    ``break`` in ``schedule()``), so a budget under ``max_model_len`` could hold the waiting queue
    forever: the floor is then ``max_model_len``, which vLLM's own config check keeps within the
    ceiling (``max_num_batched_tokens >= max_model_len`` without chunked prefill)."""
    floor = max(TOKEN_BUDGET_MIN, 1 + spec_tokens) if chunked_prefill else max_model_len
    return budget_bounds(max_num_batched_tokens, floor)
