"""``tools/knee_matrix.py``'s seeds table: the operator's fixed point is the grid point with the best
worst case over a profile's loads, and ``slo`` is set against it and against each seed's best."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def km() -> ModuleType:
    spec = importlib.util.spec_from_file_location("knee_matrix", ROOT / "tools" / "knee_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["knee_matrix"] = module
    spec.loader.exec_module(module)
    return module


def grid(slo: float, **points: float) -> dict[str, Any]:
    """A grid.json as ``simulate --grid`` writes it: ``slo``, the defaults and static points (``A``:
    ``static A``), the best being the static point with the most good requests a second."""
    runs = [{"config": "slo", "goodput_rps": slo}, {"config": "defaults", "goodput_rps": 0.1}]
    runs += [{"config": f"static {k}", "goodput_rps": v} for k, v in points.items()]
    best = max(points, key=lambda k: points[k])
    return {"runs": runs, "best": f"static {best}"}


def test_the_fixed_point_has_the_best_worst_case_not_the_best_mean(km: ModuleType) -> None:
    # A is best on the first load and poor on the second (worst 0.5); B is second-best on both
    # (worst 0.9): an operator who sets one point for both loads sets B
    grids = {"cpu-x": grid(1.0, A=2.0, B=1.8), "cpu-y": grid(1.0, A=1.0, B=1.8, C=2.0)}
    assert km.fixed_point(grids) == "static B"
    assert km.ratio_to_best(grids["cpu-y"], "static A") == pytest.approx(0.5)


def test_a_point_missing_from_one_grid_is_not_a_fixed_point(km: ModuleType) -> None:
    assert km.fixed_point({"cpu-x": grid(1.0, A=2.0, B=1.0), "cpu-y": grid(1.0, B=1.0)}) == "static B"
    with pytest.raises(ValueError, match="share no static point"):
        km.fixed_point({"cpu-x": grid(1.0, A=2.0), "cpu-y": grid(1.0, B=1.0)})


def test_the_seeds_table_keeps_the_first_seeds_fixed_point_per_profile(km: ModuleType) -> None:
    grids = {
        ("cpu-x", 0): grid(1.9, A=2.0, B=1.8),
        ("cpu-x", 1): grid(1.7, A=1.6, B=2.0),  # seed 1's best moves to B; the fixed point stays A
        ("h200-x", 0): grid(30.0, C=20.0),
        ("h200-x", 1): grid(33.0, C=22.0),
    }
    lines = km.seeds_table(grids)
    assert lines[2] == "| cpu-x | 0 | 1.90 | A: 2.00 | 0.950x | A: 2.00 | 0.950x |"
    assert lines[3] == "| cpu-x | 1 | 1.70 | B: 2.00 | 0.850x | A: 1.60 | 1.062x |"
    assert lines[4] == "| h200-x | 0 | 30.00 | C: 20.00 | 1.500x | C: 20.00 | 1.500x |"
    assert len(lines) == 6
