"""The calibration's fit: step-cost rows measured from a server -> the step's coefficients
(``policies/cost.StepCoefficients``) and the front end's HTTP overhead.

``step_s = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read`` (plus an HTTP overhead that
only a TTFT row carries) by non-negative least squares over rows scaled to relative error; the method is
in ``controller/bench/calibrate/run.py``'s docstring.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from policies.cost import StepCoefficients

COLUMNS = ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token", "http_s")


@dataclass(frozen=True)
class Sample:
    """One measured row: step features (totals over ``steps`` steps) and the seconds they took."""

    kind: str
    """"decode" (one step between two streamed tokens) or "prefill" (a time to first token)."""
    steps: int
    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int
    seconds: float

    def row(self) -> list[float]:
        ttft = 1.0 if self.kind == "prefill" else 0.0
        return [float(self.steps), self.prefill_tokens, self.decode_seqs, self.kv_tokens_read, ttft]


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: fix the most negative at 0, refit)."""
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef


def fit(samples: Sequence[Sample]) -> tuple[StepCoefficients, float, float]:
    """The step's coefficients, the fitted HTTP overhead of a TTFT (a profile's ``frontend_s``), and R^2
    over the samples."""
    if len(samples) < len(COLUMNS):
        raise ValueError(f"{len(samples)} samples: need at least {len(COLUMNS)} to fit {len(COLUMNS)} terms")
    x = np.array([s.row() for s in samples])
    y = np.array([s.seconds for s in samples])
    # Rows are scaled to relative error: a 2 ms step and a 200 ms prefill weigh the same.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nnls(x * w[:, None], y * w)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    a, b, c, d = (float(v) for v in coef[:4])
    return StepCoefficients(a, b, c, d), float(coef[4]), 1.0 - ss_res / ss_tot


def median_sample(repeats: Sequence[Sample]) -> Sample:
    """One row per measured point: the median of its repeats (a shared machine gives outliers)."""
    return replace(repeats[0], seconds=statistics.median(s.seconds for s in repeats))
