"""Does the warm-up's fit predict the load that came after it? A step consumer that keeps the fit the
step-cost model started from (the warm-up's, a state file's or a profile's) and the last steps served
since, and measures both that fit and the live one over those same steps.

The live fit has learnt from these steps, so it is expected to be closer; the question the check
answers is how far the start was: a warm-up that fits this box and model well predicts the served
steps within a few tens of percent, and a term it measured wrongly (a prefill cost from chunk sizes
the load never sends, a KV term from lengths it never reaches) shows as a gap between the two.

The error is the median of ``|predicted - measured| / measured`` per step (the median, because a step
that waited on a GC pause or the event loop is no fault of the fit, and the model weighs each step by
its relative error too). The steps are kept in a fixed ring (``capacity``), so a /state read costs two
small matrix products and two medians over at most that many steps, however long the daemon runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from controller.control.steps import EngineStep

CAPACITY = 5000
"""Steps kept: about five minutes of a 2-core CPU serving SmolLM2 (15 steps a second), a few
seconds of a GPU; a median over this many is steady to a fraction of a percent."""


class FitCheck:
    """The start fit against the live one, over the steps served since the start (a ``StepConsumer``:
    ``update``)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._x = np.zeros((capacity, 4))
        """Each kept step's features: 1, prefill tokens, decode sequences, KV tokens."""
        self._y = np.zeros(capacity)
        """Each kept step's measured seconds."""
        self.start_fit: tuple[float, float, float, float] | None = None
        """The coefficients the model started from (None: it started empty, nothing to check)."""
        self.seen = 0
        """Steps taken in since ``start`` (the ring holds the last ``capacity`` of them)."""

    @property
    def capacity(self) -> int:
        return len(self._y)

    def start(self, coefficients: Sequence[float] | None) -> None:
        """The model's starting fit, once the warm-up (or the seed) set it: what was seen before is
        the warm-up's own steps, or none, and is dropped."""
        self.start_fit = None if coefficients is None else _four(coefficients)
        self.seen = 0

    def update(self, steps: Sequence[EngineStep]) -> None:
        """Keep each step the model would take in (a positive, finite time, some work scheduled)."""
        for s in steps:
            if not (math.isfinite(s.step_s) and s.step_s > 0 and s.prefill_tokens + s.decode_seqs > 0):
                continue
            i = self.seen % self.capacity
            self._x[i] = (1.0, s.prefill_tokens, s.decode_seqs, s.kv_tokens)
            self._y[i] = s.step_s
            self.seen += 1

    def median_error(self, coefficients: Sequence[float]) -> float | None:
        """Median ``|x . coefficients - measured| / measured`` over the kept steps (None without one)."""
        n = min(self.seen, self.capacity)
        if n == 0:
            return None
        y = self._y[:n]
        pred = self._x[:n] @ np.array(_four(coefficients))
        return float(np.median(np.abs(pred - y) / y))

    def report(self, live: Sequence[float]) -> dict[str, Any]:
        """For /state: the steps seen since the start and both fits' median errors over the kept ones."""
        return {
            "steps_since_start": self.seen,
            "steps_measured": min(self.seen, self.capacity),
            "start_fit_median_rel_error": None
            if self.start_fit is None
            else self.median_error(self.start_fit),
            "live_fit_median_rel_error": self.median_error(live),
        }


def _four(coefficients: Sequence[float]) -> tuple[float, float, float, float]:
    a, b, c, d = (float(v) for v in coefficients)
    return a, b, c, d
