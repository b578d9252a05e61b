"""The map cannot drift: ``tools/house.py --check`` (in ``make lint``) fails on an import between
rooms that ARCHITECTURE.md's table "Who may import whom" does not allow, and on an import circle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "house.py"), "--check"],
        cwd=root,
        capture_output=True,
        text=True,
    )


def house_copy(tmp_path: Path) -> Path:
    for pkg in ("controller", "policies"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "ARCHITECTURE.md", tmp_path / "ARCHITECTURE.md")
    return tmp_path


def plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # planted\n")


def test_the_house_follows_its_map() -> None:
    run = check(ROOT)
    assert run.returncode == 0, run.stderr


def test_an_import_the_table_does_not_allow_fails_the_check(tmp_path: Path) -> None:
    root = house_copy(tmp_path)
    plant(root / "controller" / "admission" / "gate.py", "from controller.engine.runtime import host")
    run = check(root)
    assert run.returncode == 1
    assert "controller/admission may not import controller/engine/runtime" in run.stderr, run.stderr


def test_an_import_circle_fails_the_check_even_where_the_table_allows_both_ways(tmp_path: Path) -> None:
    root = house_copy(tmp_path)
    plant(root / "controller" / "clock.py", "import controller.percentile")
    plant(root / "controller" / "percentile.py", "import controller.clock")
    table = (root / "ARCHITECTURE.md").read_text()
    table = table.replace(
        "| `controller/clock` | nothing |", "| `controller/clock` | `controller/percentile` |"
    )
    table = table.replace(
        "| `controller/percentile` | nothing |", "| `controller/percentile` | `controller/clock` |"
    )
    (root / "ARCHITECTURE.md").write_text(table)
    run = check(root)
    assert run.returncode == 1 and "import circle: controller.clock <-> controller.percentile" in run.stderr


def test_a_room_the_table_does_not_name_fails_the_check(tmp_path: Path) -> None:
    root = house_copy(tmp_path)
    (root / "controller" / "newroom").mkdir()
    (root / "controller" / "newroom" / "__init__.py").write_text("")
    run = check(root)
    assert run.returncode == 1 and "room controller/newroom is not in the table" in run.stderr
