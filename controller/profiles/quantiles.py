"""Empirical distributions of a profile: quantile tables, sampled by inverse CDF.

A ``QuantileTable`` keeps ``n`` values at the evenly spaced probabilities ``p_k = k / (n - 1)``,
``k = 0 .. n-1`` (so the first is the measured minimum and the last the maximum). Its CDF is the
piecewise-linear curve through those points, and a draw is its inverse at a uniform ``u`` in
``[0, 1)``::

    x = u * (n - 1),  k = min(floor(x), n - 2),  value = q[k] + (x - k) * (q[k+1] - q[k])

``bench calibrate`` builds the tables from measured samples (``numpy.quantile``, linear method);
``controller/sim/run.py`` draws from them with its seeded RNG.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_POINTS = 101
"""Quantiles a calibration stores: p0, p1, ..., p100."""


@dataclass(frozen=True)
class QuantileTable:
    """Values at probabilities 0, 1/(n-1), ..., 1 (non-decreasing, n >= 2)."""

    values: tuple[float, ...]
    """The quantiles, lowest (p0, the measured minimum) first."""
    samples: int
    """How many measurements the table was built from."""

    def __post_init__(self) -> None:
        if len(self.values) < 2:
            raise ValueError(f"a quantile table needs at least 2 values, got {len(self.values)}")
        if any(not math.isfinite(v) for v in self.values):
            raise ValueError("quantile values must be finite numbers")
        if any(b < a for a, b in itertools.pairwise(self.values)):
            raise ValueError("quantile values must not decrease (p0 first, p100 last)")
        if self.samples < 1:
            raise ValueError(f"samples = {self.samples}: must be >= 1")

    @classmethod
    def from_samples(cls, xs: Sequence[float], points: int = DEFAULT_POINTS) -> QuantileTable:
        if not xs:
            raise ValueError("no samples to build a quantile table from")
        qs = np.quantile(np.asarray(xs, dtype=float), np.linspace(0.0, 1.0, points))
        # 6 significant digits: measurement noise is far above that, and the TOML stays short
        return cls(tuple(float(f"{q:.6g}") for q in qs), len(xs))

    def sample(self, u: float) -> float:
        """The inverse CDF at ``u`` in [0, 1] (linear between neighbouring quantiles)."""
        n = len(self.values)
        x = min(max(u, 0.0), 1.0) * (n - 1)
        k = min(int(x), n - 2)
        lo, hi = self.values[k], self.values[k + 1]
        return lo + (x - k) * (hi - lo)

    def mean(self) -> float:
        """The mean of the piecewise-linear distribution (each segment holds 1/(n-1) of the mass)."""
        v = self.values
        return sum(a + b for a, b in itertools.pairwise(v)) / (2 * (len(v) - 1))

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "quantiles": list(self.values)}


def parse_table(raw: Any, where: str, low: float = 0.0) -> QuantileTable:
    """A table from its TOML form ``{samples = N, quantiles = [...]}``; errors name the problem."""
    if not isinstance(raw, dict) or set(raw) - {"samples", "quantiles"}:
        raise ValueError(f"{where}: write it as a table with samples = N and quantiles = [p0, ..., p100]")
    values = raw.get("quantiles")
    samples = raw.get("samples")
    if not isinstance(values, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"{where}: quantiles must be a list of numbers (p0 first, p100 last)")
    if isinstance(samples, bool) or not isinstance(samples, int):
        raise ValueError(f"{where}: samples = {samples!r}: must be the number of measurements (>= 1)")
    if values and min(values) < low:
        raise ValueError(f"{where}: quantiles must be >= {low}, got {min(values)}")
    try:
        return QuantileTable(tuple(float(v) for v in values), samples)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class LoadTables:
    """One quantity's quantile tables by load: ``tables[i]`` holds what was measured while the server
    had ``levels[i]`` up to ``levels[i + 1] - 1`` requests in flight (the last: ``levels[-1]`` or more).

    ``bench calibrate`` fills it with the front-end delay under open-loop load (see
    ``controller/bench/calibrate/run.py``); the twin picks the table of the in-flight count a request finds
    when it arrives."""

    levels: tuple[int, ...]
    """Lowest in-flight count of each table, ascending, the first >= 1."""
    tables: tuple[QuantileTable, ...]

    def __post_init__(self) -> None:
        if not self.levels or len(self.levels) != len(self.tables):
            raise ValueError("give one quantile table per level (levels and quantiles of equal length)")
        if self.levels[0] < 1 or any(b <= a for a, b in itertools.pairwise(self.levels)):
            raise ValueError(f"levels = {list(self.levels)}: must be in-flight counts >= 1, ascending")

    def table_for(self, in_flight: int) -> QuantileTable:
        """The table of the level ``in_flight`` falls in (below the first level: the first)."""
        return self.tables[max(0, bisect.bisect_right(self.levels, in_flight) - 1)]

    @classmethod
    def from_samples(
        cls, samples: Sequence[tuple[int, float]], edges: Sequence[int], min_samples: int
    ) -> LoadTables | None:
        """Tables from (in-flight count, value) pairs binned at ``edges`` (ascending, >= 1). Going up,
        a bin still short of ``min_samples`` values takes in the next one; a short last bin joins the
        one below. None when fewer than ``min_samples`` values have in-flight >= ``edges[0]``."""
        bins: list[tuple[int, list[float]]] = [(e, []) for e in edges]
        for n, v in samples:
            if n >= edges[0]:
                bins[bisect.bisect_right(edges, n) - 1][1].append(v)
        merged: list[tuple[int, list[float]]] = []
        for level, values in bins:
            if merged and len(merged[-1][1]) < min_samples:
                merged[-1] = (merged[-1][0], merged[-1][1] + values)
            else:
                merged.append((level, list(values)))
        if len(merged) > 1 and len(merged[-1][1]) < min_samples:
            level, values = merged.pop()
            merged[-1] = (merged[-1][0], merged[-1][1] + values)
        merged = [(level, values) for level, values in merged if values]
        if not merged or len(merged[0][1]) < min_samples:
            return None
        return cls(
            tuple(level for level, _ in merged),
            tuple(QuantileTable.from_samples(values) for _, values in merged),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "levels": list(self.levels),
            "samples": [t.samples for t in self.tables],
            "quantiles": [list(t.values) for t in self.tables],
        }


def parse_load_tables(raw: Any, where: str) -> LoadTables:
    """``LoadTables`` from ``{levels = [...], samples = [...], quantiles = [[...], ...]}``."""
    if not isinstance(raw, dict) or set(raw) != {"levels", "samples", "quantiles"}:
        raise ValueError(
            f"{where}: write it as levels = [in-flight counts], samples = [one count per level] and "
            "quantiles = [[p0, ..., p100] per level]"
        )
    levels, samples, quantiles = raw["levels"], raw["samples"], raw["quantiles"]
    if not all(isinstance(x, list) for x in (levels, samples, quantiles)) or not (
        len(levels) == len(samples) == len(quantiles)
    ):
        raise ValueError(f"{where}: levels, samples and quantiles must be lists of the same length")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in levels):
        raise ValueError(f"{where}: levels must be integers (requests in flight)")
    tables = tuple(
        parse_table({"samples": s, "quantiles": q}, f"{where} level {n}")
        for n, s, q in zip(levels, samples, quantiles, strict=True)
    )
    try:
        return LoadTables(tuple(levels), tables)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
