"""The latency a request must meet (``[slo]``, per class), as the policies and the gate read it.

A request is good when its time to first token is within ``ttft_s`` and its time per output token
within ``tpot_s``. Pure data, no ``controller`` import: a policy (pure, ``policies/*`` only) and the
config loader (``controller/config/slo_table.py``, which builds it) share this one type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class SloBound(NamedTuple):
    """One class's bounds; unpacks as ``ttft_s, tpot_s``."""

    ttft_s: float
    """Longest time to first token of a good request (seconds, queueing in the gate included)."""
    tpot_s: float
    """Longest mean time per output token after the first of a good request (seconds)."""


@dataclass(frozen=True)
class SloTargets:
    """``[slo]`` resolved for every priority class: a class's own ``slo_ttft_s`` / ``slo_tpot_s``
    where it sets one, else the table's."""

    default: SloBound
    """``[slo] ttft_s`` and ``tpot_s``: the bound of a class that overrides neither."""
    by_class: tuple[tuple[str, SloBound], ...] = ()
    """Every class of ``[admission.classes]`` with its resolved bound, most urgent first."""

    def for_class(self, name: str) -> SloBound:
        """The bound of class ``name``; the table's for a class not configured (a reload removed it)."""
        for cls, bound in self.by_class:
            if cls == name:
                return bound
        return self.default

    @property
    def tightest(self) -> SloBound:
        """The smallest TTFT and the smallest TPOT over every class: what a knob shared by all classes
        (the batch cap, the token budget) must meet so that every class can be good."""
        bounds = [b for _, b in self.by_class] or [self.default]
        return SloBound(min(b.ttft_s for b in bounds), min(b.tpot_s for b in bounds))

    def as_dict(self) -> dict[str, object]:
        """Plain data for check-config and /state."""
        return {
            "ttft_s": self.default.ttft_s,
            "tpot_s": self.default.tpot_s,
            "classes": {name: b._asdict() for name, b in self.by_class},
        }
