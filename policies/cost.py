"""The step cost in one vocabulary: its coefficients, the one formula, the knee, and the fit's estimate.

Pure data, no ``controller`` import, so every room that speaks of a step's cost may import it: a
policy (``policies/*`` only), the profile format (``controller/profiles/``), the twin
(``controller/sim/``), the online fit (``controller/control/stepcost.py``) and the calibration
(``controller/bench/calibrate/``). ``StepCoefficients`` is the cost of one engine step (one forward
pass)::

    step_s = a_s + b * prefill_tokens + c * decode_seqs + d * kv_tokens

A profile's ``[cost]`` table holds one (``controller/profiles/load.py``), the twin steps by it, the
online fit learns one (recursive least squares over the engine's steps) and hands it to the policies as
``CostEstimate`` (``Observation.cost``): the coefficients and how far to trust them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

TERMS = ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token")
"""The coefficients' names, as a profile's ``[cost]`` table and the metric's ``term`` label spell them."""


@dataclass(frozen=True)
class StepCoefficients:
    """Duration of one engine step (one forward pass) in seconds: ``step_s(P, D, K)``.

    ``prefill_tokens`` (``P``): prompt (or recomputed) tokens scheduled in the step; ``decode_seqs``
    (``D``): requests that decode one token; ``kv_tokens`` (``K``): the context the step's attention
    reads (each scheduled request's computed tokens plus its new ones). ``a`` is the fixed cost of a
    step (scheduling, launch, sampling), ``b`` the matmul cost of a prompt token, ``c`` the
    per-sequence cost of a decode (its matmul row, sampling, detokenising), ``d`` the attention cost
    per KV token read."""

    a_s: float
    """Fixed cost of a step (seconds)."""
    b_s_per_prefill_token: float
    """Seconds per prefill token."""
    c_s_per_decode_seq: float
    """Seconds per decoding sequence."""
    d_s_per_kv_token: float
    """Seconds per KV-cache token the step's attention reads."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        """Predicted seconds of a step with these features (summed in this order, term by term)."""
        return (
            self.a_s
            + self.b_s_per_prefill_token * prefill_tokens
            + self.c_s_per_decode_seq * decode_seqs
            + self.d_s_per_kv_token * kv_tokens
        )

    def coefficients(self) -> dict[str, float]:
        """The four coefficients by term name."""
        return {term: float(getattr(self, term)) for term in TERMS}

    def vector(self) -> tuple[float, float, float, float]:
        """The four coefficients in ``TERMS`` order: a fit's parameter vector (``StepCostModel``)."""
        return self.a_s, self.b_s_per_prefill_token, self.c_s_per_decode_seq, self.d_s_per_kv_token

    @classmethod
    def of(cls, values: Iterable[Any]) -> StepCoefficients:
        """``vector``'s inverse: the four in ``TERMS`` order, each as a float (a fit's numpy values)."""
        a, b, c, d = (float(v) for v in values)
        return cls(a, b, c, d)

    @classmethod
    def from_terms(cls, terms: Mapping[str, Any]) -> StepCoefficients:
        """``coefficients``' inverse: the four by term name (a profile's ``[cost]``, a state file's)."""
        return cls.of(terms[term] for term in TERMS)


def knee_batch(a_s: float, per_seq_s: float, share: float) -> int:
    """The smallest batch whose throughput ``N / (a + s*N)`` reaches ``1 - share`` of its peak
    ``1 / s``: ``ceil(a * (1 - share) / (share * s))`` (``a``, ``s`` > 0; 102.00000000001 is 102)."""
    return math.ceil(round(a_s * (1 - share) / (share * per_seq_s), 6))


@dataclass(frozen=True)
class CostEstimate(StepCoefficients):
    """The fitted step cost at one moment, and how far to trust it."""

    samples: int
    """Engine steps the fit took in (a seed counts none; rejected outliers are not counted)."""
    rejected: int
    """Steps rejected as outliers (a GC pause, a step that waited on something else)."""
    rel_error: float | None
    """RMS of (measured - predicted) / measured over the recent window, each step predicted before the
    fit took it in; None before the first step."""
    r2: float | None
    """R^2 of those predictions over the window; None when the window's steps all took one time."""
    age_s: float | None
    """Seconds since the last step taken in; None before the first."""
    ready: bool
    """Enough recent steps to steer by; when False a policy holds its knobs and says ``reason``."""
    reason: str
    """"ready", or why not: "cost model: 12 samples < 50", "cost model: last sample 75 s ago > 60 s"."""
    seed: str = ""
    """The profile the fit started from ('' = none)."""
    kv_tokens_per_seq: float | None = None
    """Recent KV tokens a scheduled sequence attends over (moving mean of ``kv_tokens / decode_seqs``
    over the steps that decode): what the ``d`` term of a larger batch costs per sequence. None before
    the first decoding step."""
    prefill_per_decode: float | None = None
    """Recent prefill tokens per decoded token (moving means of the steps' prefill tokens over their
    decoding sequences): in steady state the load's prompt tokens per output token, so
    ``b * prefill_per_decode`` is what each sequence of the batch costs a mean step in prefill. None
    before the first decoding step."""
    pace: float | None = None
    """Recent wall-clock time of a decoding step (the step and the time before it since the previous
    one's end) over the fit's prediction of it (moving sums): about 1 on an engine with cores of its
    own; above 1 where the steps' times are long-tailed (a CPU the engine shares) or time passes
    between steps, which the fit, following the typical step, leaves out. What the capacity counts a
    step at (``controller/control/capacity.py``). None until enough such steps."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
