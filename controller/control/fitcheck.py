"""Does the warm-up's fit predict the load that came after it? A step consumer that keeps the fit the
step-cost model started from (the warm-up's, a state file's or a profile's) and the last steps served
since, and measures both that fit and the live one over those same steps.

The live fit has learnt from these steps, so it is expected to be closer; the question the check
answers is how far the start was: a warm-up that fits this box and model well predicts the served
steps within a few tens of percent, and a term it measured wrongly (a prefill cost from chunk sizes
the load never sends, a KV term from lengths it never reaches) shows as a gap between the two.

The error is the median of ``|predicted - measured| / measured`` per step (the median, because a step
that waited on a GC pause or the event loop is no fault of the fit, and the model weighs each step by
its relative error too). Beside the two, the best fit of the same form over the same steps (relative
least squares) gives the floor the steps' own noise sets, and each error is also taken over the steps
that prefilled and those that only decoded, so a gap points at a term (``b``, or ``a``/``c``/``d``).
The steps are kept in a fixed ring (``capacity``), so a /state read costs one 4-column least-squares
solve and a few medians over at most that many steps, however long the daemon runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from controller.control.stepcost import fittable
from controller.control.steps import EngineStep, costs
from policies.cost import StepCoefficients

CAPACITY = 5000
"""Steps kept: about five minutes of a 2-core CPU serving SmolLM2 (15 steps a second), a few
seconds of a GPU; a median over this many is steady to a fraction of a percent."""
KINDS = ("all", "prefill", "decode_only")
"""The steps an error is taken over: all, those that prefilled (``b`` at work), those that only
decoded (``a``, ``c``, ``d``)."""


class FitCheck:
    """The start fit against the live one, over the steps served since the start (a ``StepConsumer``:
    ``update``)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._x = np.zeros((capacity, 4))
        """Each kept step's features: 1, prefill tokens, decode sequences, KV tokens."""
        self._y = np.zeros(capacity)
        """Each kept step's measured seconds."""
        self.start_fit: StepCoefficients | None = None
        """The coefficients the model started from (None: it started empty, nothing to check)."""
        self.seen = 0
        """Steps taken in since ``start`` (the ring holds the last ``capacity`` of them)."""

    @property
    def capacity(self) -> int:
        return len(self._y)

    def start(self, coefficients: StepCoefficients | None) -> None:
        """The model's starting fit, once the warm-up (or the seed) set it: what was seen before is
        the warm-up's own steps, or none, and is dropped."""
        self.start_fit = coefficients
        self.seen = 0

    def update(self, steps: Sequence[EngineStep]) -> None:
        """Keep each step the model would take in (a positive, finite time, some work scheduled)."""
        for _, s in costs(steps):
            if not fittable(s):
                continue
            i = self.seen % self.capacity
            self._x[i] = (1.0, s.prefill_tokens, s.decode_seqs, s.kv_tokens)
            self._y[i] = s.step_s
            self.seen += 1

    def median_error(self, coefficients: StepCoefficients, kind: str = "all") -> float | None:
        """Median ``|x . coefficients - measured| / measured`` over the kept steps of ``kind``
        (``KINDS``); None without one."""
        x, y = self._kept(kind)
        if len(y) == 0:
            return None
        pred = x @ np.array(coefficients.vector())
        return float(np.median(np.abs(pred - y) / y))

    def best_fit(self) -> StepCoefficients | None:
        """The coefficients of this form closest to the kept steps in relative least squares (the
        loss the model minimises, unconstrained and unforgetting): the floor a fit of this form
        reaches on them, which tells the start fit's bias from the steps' own noise."""
        x, y = self._kept("all")
        if len(y) < 4:
            return None
        coefficients, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
        return StepCoefficients.of(coefficients)

    def report(self, live: StepCoefficients) -> dict[str, Any]:
        """For /state: the steps seen since the start, and the start, live and best fits' median
        errors over the kept ones, in all and per kind of step (which term is off)."""
        best = self.best_fit()
        fits = {"start_fit": self.start_fit, "live_fit": live, "best_fit": best}
        return {
            "steps_since_start": self.seen,
            "steps_measured": min(self.seen, self.capacity),
            **{
                f"{name}_median_rel_error": None if c is None else self.median_error(c)
                for name, c in fits.items()
            },
            "best_fit": None if best is None else best.coefficients(),
            "by_kind": {
                kind: {
                    "steps": len(self._kept(kind)[1]),
                    **{name: None if c is None else self.median_error(c, kind) for name, c in fits.items()},
                }
                for kind in KINDS[1:]
            },
        }

    def _kept(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        n = min(self.seen, self.capacity)
        x, y = self._x[:n], self._y[:n]
        if kind == "all":
            return x, y
        prefill = x[:, 1] > 0
        rows = prefill if kind == "prefill" else ~prefill
        return x[rows], y[rows]
