"""The step-cost model's state as a policy reads it (``Observation.cost``).

Pure data, no ``controller`` import, so a policy (``policies/*`` only) can predict a step's time. The
model that produces it is ``controller/control/stepcost.py`` (recursive least squares over the engine's
steps); its form is the twin's (``controller/sim/profile.py``, ``CostModel``)::

    step_s = a_s + b * prefill_tokens + c * decode_seqs + d * kv_tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

TERMS = ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token")
"""The coefficients' names, as a profile's ``[cost]`` table and the metric's ``term`` label spell them."""


@dataclass(frozen=True)
class CostEstimate:
    """The fitted step cost at one moment, and how far to trust it."""

    a_s: float
    """Fixed cost of a step (seconds)."""
    b_s_per_prefill_token: float
    """Seconds per prefill token."""
    c_s_per_decode_seq: float
    """Seconds per decoding sequence."""
    d_s_per_kv_token: float
    """Seconds per KV-cache token the step's attention reads."""
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

    def predict_step(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        """Predicted seconds of a step with these features."""
        return (
            self.a_s
            + self.b_s_per_prefill_token * prefill_tokens
            + self.c_s_per_decode_seq * decode_seqs
            + self.d_s_per_kv_token * kv_tokens
        )

    def coefficients(self) -> dict[str, float]:
        """The four coefficients by term name."""
        return {term: float(getattr(self, term)) for term in TERMS}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
