"""TTFT bounds in the gate: under SLO steering a request that cannot reach its first token within its
class's TTFT bound is refused at once (429 + Retry-After) rather than served late, and a queued one
whose bound passes gets 429 (``[slo]``, resolved per class; refusals count as misses in goodput).

A request's predicted TTFT is its expected wait (its place in the queue over the rate at which slots
free up) plus its own prefill, which a ``PrefillEstimator`` predicts (the step-cost model,
``controller/control/stepcost.py``, through ``controller/control`` wiring: admission imports nothing
of it). It must stay within the class's queue deadline, which becomes ``min(queue_deadline_s,
wait_share * TTFT bound)``: the rest of the bound is a margin for what the prediction misses (held to
the whole bound, the twin's H200 conversation run lost 2.6 % of its goodput), and a queued request
granted a slot just at its bound would miss it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controller.admission.classes import PriorityClass


class PrefillEstimator(Protocol):
    """Seconds the engine takes to prefill a prompt of ``prompt_tokens`` (0 when it cannot tell)."""

    def prefill_s(self, prompt_tokens: int) -> float: ...


@dataclass(frozen=True)
class TtftBounds:
    """Each class's TTFT bound (seconds), and what predicts a request's own prefill."""

    bounds: Mapping[str, float] = field(default_factory=dict)
    prefill: PrefillEstimator | None = None
    wait_share: float = 1.0
    """The share of the TTFT bound a request may spend queued: the rest is for its prefill and first
    step once it has a slot (a request granted a slot at its bound misses it)."""

    def bounded(self, classes: Sequence[PriorityClass]) -> list[PriorityClass]:
        """``classes`` with each queue deadline cut to ``wait_share`` of its class's TTFT bound where
        that is shorter."""
        out = []
        for c in classes:
            bound = self.bounds.get(c.name)
            if bound is not None and bound * self.wait_share < c.queue_deadline_s:
                c = dataclasses.replace(c, queue_deadline_s=bound * self.wait_share)
            out.append(c)
        return out

    @property
    def uses_prompt_length(self) -> bool:
        """Whether a request's prompt length changes its check (only with a prefill estimator)."""
        return self.prefill is not None

    def prefill_s(self, prompt_tokens: int | None) -> float:
        """The request's own prefill; 0 without an estimator or a known prompt length (the daemon
        counts it from the raw request before vLLM tokenizes: ``engine/frontend/prompts.py``)."""
        if self.prefill is None or not prompt_tokens:
            return 0.0
        return max(0.0, self.prefill.prefill_s(prompt_tokens))


NO_BOUNDS = TtftBounds()
"""The gate without SLO steering: queue deadlines as configured, no prefill term."""
