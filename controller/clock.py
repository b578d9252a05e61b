"""Clocks, injected wherever time matters (STYLE.md practice 5)."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]
"""Returns seconds on a monotonic clock."""

monotonic: Clock = time.monotonic


class FakeClock:
    """A monotonic clock for tests: it moves only when told."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.now += seconds
