"""The one percentile of the project, shared by the control loop's window, the bench and the twin.

Two rank rules, named by the caller: ``linear`` interpolates between ranks (numpy's default, what
benchmark reports compare against), ``nearest_rank`` returns a value that was observed (the control
loop's window: with a few dozen samples a tail estimate that really happened, stable under one more
sample). Both answer None for no values, so JSON stays valid and callers must handle "no samples".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Method = Literal["linear", "nearest_rank"]


def percentile(values: Sequence[float], q: float, method: Method = "linear") -> float | None:
    """The q-th percentile (0..100) of ``values`` by ``method``; None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q}: must be in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    if method == "nearest_rank":
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1]
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
